"""The cuBLAS workspace as the allocator sees it, under the allocator's model: one per cuBLAS handle (the
test's thread, and the autograd engine's device thread that runs backward on CUDA), allocated on the
handle's first matmul, of the size torch gives the card's compute capability, kept until the test ends;
never the test's leak. Figures derived by hand from the allocator's rules (tests/allocator_model/)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from builders import Reported

from cuda_allocator_model import CachingAllocatorModel
from cuda_allocator_model.cards import cublas_workspace_bytes
from pytest_gpumem.backends.base import Settings
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.backends.tracker.ledger import StorageLedger
from pytest_gpumem.backends.tracker.storages import Workspace
from pytest_gpumem.explain.text import describe
from pytest_gpumem.measure.measurement import Measurement

MIB = 2**20
WORKSPACE = 8 * MIB + 128 * 1024  # torch's default, ':4096:2:16:8': 8,519,680 B


@pytest.fixture
def meta() -> Iterator[TrackerBackend]:
    backend = TrackerBackend(device="meta")  # the allocator's model, by default on meta
    backend.start()
    yield backend
    backend.stop()


def workspaces(backend: TrackerBackend) -> list[int]:
    """The counted bytes of the workspaces live in the ledger (storages no tensor holds, keys below 0)."""
    return [size for key, (size, _) in backend.live_storages().items() if key < 0]


@pytest.mark.parametrize(
    ("capability", "environ", "size"),
    [
        pytest.param(None, {}, WORKSPACE, id="no card: torch's default"),
        pytest.param((8, 0), {}, WORKSPACE, id="A100: torch's default"),
        pytest.param((9, 0), {}, 32 * MIB, id="H100: 32 MiB"),
        pytest.param((12, 0), {}, 32 * MIB, id="12.x: 32 MiB"),
        pytest.param((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, 128 * 1024, id="config: 8 x 16 KiB"),
        pytest.param((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}, WORKSPACE, id="config: pairs summed"),
        pytest.param((9, 0), {"CUBLAS_WORKSPACE_CONFIG": "bad"}, 32 * MIB, id="unreadable config: the default"),
    ],
)
def test_the_workspace_size_follows_the_card_and_cublas_workspace_config(
    capability: tuple[int, int] | None, environ: dict[str, str], size: int
) -> None:
    assert cublas_workspace_bytes(capability, environ) == size


def test_a_matmul_makes_its_threads_workspace_once(meta: TrackerBackend) -> None:
    a = torch.empty(1024, 1024, device="meta")  # 4 MiB: a block of a new 20 MiB segment
    c = torch.mm(a, a)  # its 4 MiB output, then the workspace, both from that segment's free 16 MiB
    assert meta.current().allocated == 4 * MIB + 4 * MIB + WORKSPACE == 16_908_288
    assert meta.current().reserved == 20 * MIB
    d = torch.mm(a, a)  # the same handle: no second workspace; 3.9 MiB are left, so a new segment
    assert meta.current().allocated == 12 * MIB + WORKSPACE
    assert meta.current().reserved == 40 * MIB
    assert workspaces(meta) == [WORKSPACE]
    del c, d


def test_forward_and_backward_hold_two_workspaces(meta: TrackerBackend) -> None:
    w = torch.empty(256, 256, device="meta", requires_grad=True)
    x = torch.empty(64, 256, device="meta", requires_grad=True)
    loss = (x @ w).sum()  # forward: the test thread's handle
    assert workspaces(meta) == [WORKSPACE]
    loss.backward()  # type: ignore[no-untyped-call]  # mm's backward (two mms) on the autograd thread's handle: one more
    assert workspaces(meta) == [WORKSPACE, WORKSPACE]
    (x @ w).sum().backward()  # type: ignore[no-untyped-call]  # a second step finds both
    assert workspaces(meta) == [WORKSPACE, WORKSPACE]


@pytest.mark.parametrize(
    "op",
    [
        lambda m, v: torch.mv(m, v),
        lambda m, v: torch.addmm(m, m, m),
        lambda m, v: torch.bmm(m[None], m[None]),
        lambda m, v: torch.baddbmm(m[None], m[None], m[None]),
        lambda m, v: torch.dot(v, v),
        lambda m, v: torch.nn.functional.linear(m, m),
        lambda m, v: torch.einsum("ij,jk->ik", m, m),
        lambda m, v: m.addmm_(m, m),
    ],
    ids=["mv", "addmm", "bmm", "baddbmm", "dot", "linear", "einsum", "in place"],
)
def test_the_ops_cuda_runs_on_cublas_make_it(op: Callable[..., Any], meta: TrackerBackend) -> None:
    m, v = torch.empty(64, 64, device="meta"), torch.empty(64, device="meta")
    op(m, v)
    assert workspaces(meta) == [WORKSPACE]


def test_other_ops_and_empty_operands_make_none(meta: TrackerBackend) -> None:
    m = torch.empty(64, 64, device="meta")
    (m + m).relu().sum()
    torch.nn.functional.scaled_dot_product_attention(m[None, None], m[None, None], m[None, None])  # fused
    torch.mm(torch.empty(64, 0, device="meta"), torch.empty(0, 64, device="meta"))  # returns before cuBLAS
    assert workspaces(meta) == []


def test_a_matmul_counted_first_without_the_model_still_makes_its_workspace_with_it() -> None:
    exact = TrackerBackend(rounding="none")  # no GPU predicted: the matmul takes the fast path, as any op
    exact.start()
    try:
        a = torch.ones(64, 64)
        before = exact.current().allocated
        b = torch.mm(a, a)  # its 16 KiB output and nothing else
        assert exact.current().allocated - before == 64 * 64 * 4
    finally:
        exact.stop()
    on_meta = TrackerBackend(device="meta")
    on_meta.start()
    try:
        m = torch.empty(1024, 1024, device="meta")
        c = torch.mm(m, m)  # as in test_a_matmul_makes_its_threads_workspace_once
        assert on_meta.current().allocated == 4 * MIB + 4 * MIB + WORKSPACE
        assert workspaces(on_meta) == [WORKSPACE]
    finally:
        on_meta.stop()
    del b, c


def test_a_card_of_compute_capability_9_has_32_mib_workspaces(meta: TrackerBackend) -> None:
    meta.predict_card("H100-80GB")
    a = torch.empty(1024, 1024, device="meta")
    torch.mm(a, a)  # 32 MiB: at least 10 MiB, so a segment of its own
    assert workspaces(meta) == [32 * MIB]
    assert meta.current().reserved == 20 * MIB + 32 * MIB
    assert "cuBLAS workspace 32.0 MiB" in meta.identity().backend  # other figures: another identity


def test_a_larger_size_replaces_the_workspace_as_torch_does(meta: TrackerBackend) -> None:
    a = torch.empty(64, 64, device="meta")
    torch.mm(a, a)
    with meta.predicting("H200"):
        torch.mm(a, a)  # the new one is made, then the smaller one freed
        assert workspaces(meta) == [32 * MIB]
    torch.mm(a, a)  # back to the default size: the larger one serves it
    assert workspaces(meta) == [32 * MIB]


def test_cublas_workspace_config_sets_the_size_as_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # torch's deterministic setting: 32 MiB
    backend = TrackerBackend(device="meta")
    backend.predict_card("T4")  # the variable wins over the card's default, as in torch
    assert backend.ledger.workspace_bytes == 32 * MIB


@pytest.mark.parametrize("number", ["9" * 5000, "2147483648"])
def test_a_cublas_workspace_config_torch_cannot_read_stops_the_run_in_one_line(
    tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, number: str
) -> None:
    """torch reads each number with std::stoi: past a C int the first matmul fails on a card (and Python
    refuses to convert 5,000 digits); 2,147,483,647 is still read."""
    assert cublas_workspace_bytes(None, {"CUBLAS_WORKSPACE_CONFIG": ":1:2147483647"}) == 1024 * (2**31 - 1)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", f":{number}:2")
    tracker.makepyfile("def test_nothing(gpumem):\n    pass\n")
    result = tracker.runpytest("--gpumem-device=meta")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"ERROR: CUBLAS_WORKSPACE_CONFIG=':{number[:5]}*:2'*: '{number[:5]}* is past what torch reads there (a C "
         "int, at most 2,147,483,647): on a card the first matmul fails"]
    )  # fmt: skip
    result.stdout.no_fnmatch_line("*INTERNALERROR*")


def test_without_the_allocators_model_there_is_none() -> None:
    backend = TrackerBackend("none")
    backend.start()
    try:
        a = torch.ones(64, 64)
        c = torch.mm(a, a)
        assert workspaces(backend) == [] and backend.current().allocated == 2 * 64 * 64 * 4
        del c
    finally:
        backend.stop()


def test_clearing_frees_them_and_keeps_their_segments(meta: TrackerBackend) -> None:
    a = torch.empty(64, 64, device="meta")  # 16 KiB: a 2 MiB small segment
    torch.mm(a, a)  # the workspace: a 20 MiB large one
    meta.clear_workspaces()
    assert (meta.current().allocated, meta.current().reserved) == (64 * 64 * 4, 22 * MIB)


def test_the_ledger_keeps_one_per_handle() -> None:
    ledger = StorageLedger("cuda")
    for handle in ("test thread", "test thread", "autograd"):
        ledger.workspace(handle)
    assert (len(ledger.workspaces), ledger.allocated, ledger.reserved) == (2, 2 * WORKSPACE, 20 * MIB)
    assert all(isinstance(w, Workspace) and w.nbytes() == WORKSPACE for w in ledger.workspaces.values())
    ledger.forget()  # a new measurement starts with none
    assert ledger.workspaces == {} and ledger.allocated == 0


def test_the_handles_ready_and_what_the_ledger_wants_follow_every_change_of_terms() -> None:
    """The mode skips a matmul's workspace check on a handle in `workspaces_ready` and reads `wants_*` as
    plain attributes: after any sequence of changes they say what the ledger's state does."""
    rng = random.Random(50)
    ledger = StorageLedger("cuda")
    for _ in range(2_000):
        action = rng.randrange(6)
        if action == 0 and ledger.wants_workspaces:  # as the mode calls it
            ledger.workspace(rng.choice(("test thread", "autograd", "another thread")))
        elif action == 1:
            ledger.workspace_bytes = rng.choice((0, 512, WORKSPACE, 32 * MIB))
        elif action == 2:
            ledger.clear_workspaces()
        elif action == 3:
            ledger.forget()
        elif action == 4:
            ledger.model = rng.choice((None, CachingAllocatorModel(ledger.settings)))
        elif action == 5:
            ledger.device_type = rng.choice((None, "meta", "cpu"))
        size, modelled = ledger.workspace_bytes, ledger.model is not None
        assert ledger.workspaces_ready == {h for h, w in ledger.workspaces.items() if w.size >= size}
        assert ledger.wants_workspaces == (modelled and size > 0)
        assert ledger.wants_temporaries == (modelled or ledger.device_type == "meta")


def test_the_cuda_backend_clears_torchs_workspaces(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_gpumem.backends.cuda import CudaBackend

    cleared: list[bool] = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: cleared.append(True), raising=False)
    backend = object.__new__(CudaBackend)  # no GPU here: only the method is exercised
    backend.clear_workspaces()
    assert cleared == [True]
    monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces")
    backend.clear_workspaces()  # a torch without it: nothing to clear
    assert cleared == [True]


MATMULS = """
import torch

def step(gpumem):
    w = torch.empty(256, 256, device=gpumem.device, requires_grad=True)
    (torch.empty(64, 256, device=gpumem.device) @ w).sum().backward()

def test_first(gpumem):
    step(gpumem)

def test_second(gpumem):
    step(gpumem)
"""


def test_each_test_pays_for_its_workspaces_and_none_is_a_leak(tracker: pytest.Pytester, reported: Reported) -> None:
    tracker.makepyfile(MATMULS)
    result = tracker.runpytest("-p", "no:randomly", "--gpumem-device=meta", "--gpumem-leak=0", "--gpumem-json=out.json")
    result.assert_outcomes(passed=2)  # the workspaces kept at the end are not the tests' leak
    calls = [test["call"] for test in reported().values()]
    # at the peak: w and its gradient (256 KiB each), x (64 KiB), the sum and backward's seed (512 B each; mm's
    # output is freed by the sum) and two workspaces, the test thread's and backward's, in one 20 MiB segment
    # beside a 2 MiB one; whatever ran before: the second test pays as the first did
    peak = 2 * 256 * 256 * 4 + 64 * 256 * 4 + 2 * 512 + 2 * WORKSPACE
    assert [(c["peak_bytes"], c["reserved_peak_bytes"], c["net_bytes"]) for c in calls] == 2 * [(peak, 22 * MIB, 0)]


def test_the_explanation_names_a_workspace_as_one() -> None:
    backend = TrackerBackend("cuda", device="meta")
    backend.configure(Settings(None, origins=False, events=False, explain=True))
    measured = Measurement(backend, "t.py::t")
    measured.explain = True
    measured.begin()
    a = torch.ones(64, 64, device="meta")
    kept = a @ a
    measured.end()
    assert measured.explanation is not None and kept.shape == (64, 64)
    lines = describe(measured.explanation)
    alive = next(at for at, line in enumerate(lines) if "cuBLAS" in line)
    assert lines[alive : alive + 2] == [  # 137 columns in one line
        "    alive at the peak: 8.1 MiB cuBLAS workspace (temporaries, (outside modules)),",
        f"      made by aten.mm.default at tests/test_workspaces.py:{_line_of('kept = a @ a')}",
    ]


def _line_of(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.strip() == text)
