"""Where the tracker used to give a confidently wrong figure: compiled code, sparse tensors, storage
resizes, views without alias annotations, CPU-only defaults, tracing and threads. Exact bytes by hand."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.optim.optimizer as optimizer
from builders import UNPLUGGED, Reported

from pytest_gpumem.backends.tracker.backend import TrackerBackend

SPARSE_AND_STORAGES = """
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

N = 1000


def test_coo_counts_indices_and_values(gpumem):
    dense = torch.zeros(N, N)
    dense[torch.arange(500), torch.arange(500)] = 1.0
    with gpumem.phase("to_sparse"):
        sparse = dense.to_sparse()
    # 500 non-zeros: indices 2 x 500 int64 (8,000 B) and values 500 float32 (2,000 B)
    assert gpumem.peak("to_sparse") == 2 * 500 * 8 + 500 * 4
    assert gpumem.result("to_sparse").net_bytes == 10_000
    del sparse


def test_compressed_layouts_count_their_parts(gpumem):
    dense = torch.zeros(100, 100)
    dense[torch.arange(50), torch.arange(50)] = 1.0
    with gpumem.phase("csr"):
        csr = dense.to_sparse_csr()
    with gpumem.phase("bsr"):
        bsr = dense.to_sparse_bsr((2, 2))
    # CSR: crow_indices 101 int64 (808); col_indices is a view of the 2 x 50 int64 COO indices the
    # conversion goes through (800 B held); values 50 float32 (200)
    assert gpumem.peak("csr") == 808 + 800 + 200
    # BSR 2x2: 25 diagonal blocks; crow 51 int64 (408), COO indices 2 x 25 int64 (400), values 25x2x2 (400)
    assert gpumem.peak("bsr") == 408 + 400 + 400
    del csr, bsr


def test_sparse_parts_given_by_the_caller_are_not_new(gpumem):
    indices = torch.tensor([[0, 1, 2], [2, 1, 0]])
    values = torch.ones(3)
    with gpumem.phase("wrap"):
        coo = torch.sparse_coo_tensor(indices, values, (3, 3))
        csr = torch.sparse_csr_tensor(torch.tensor([0, 1, 2, 3]), indices[1], values, (3, 3))
    # coo keeps the caller's tensors; csr's only new memory is its crow_indices (4 int64)
    assert gpumem.peak("wrap") == 4 * 8
    del coo, csr


def test_sparse_gradient_counts(gpumem):
    embedding = torch.nn.Embedding(100, 8, sparse=True)
    loss = embedding(torch.tensor([1, 5, 7])).sum()
    with gpumem.phase("backward"):
        loss.backward()
    # the seed (4) and the sparse gradient AccumulateGrad keeps, a clone: indices 1 x 3 int64 (24),
    # values 3 x 8 float32 (96); the graph releases the index tensor it saved (24, made before)
    assert gpumem.peak("backward") == 4 + 24 + 96
    assert gpumem.result("backward").net_bytes == 24 + 96 - 24


def test_storage_resize_grows_and_frees(gpumem):
    made_inside = torch.empty(N)
    made_before = torch.empty(0)
    with gpumem.phase("resize"):
        made_before.untyped_storage().resize_(8 * N)  # grown from nothing: 8N new bytes
        made_inside.untyped_storage().resize_(0)  # frees 4N (how FSDP2 frees unsharded parameters)
        made_inside.untyped_storage().resize_(4 * N)  # and re-allocates them
    # 8N after the growth; the free and the re-allocation come back to that level
    assert gpumem.peak("resize") == 8 * N
    assert gpumem.result("resize").net_bytes == 8 * N
    made_before.untyped_storage().resize_(0)
    assert gpumem.peak() == 4 * N + 8 * N
    assert gpumem.result().net_bytes == 4 * N


@pytest.fixture
def made_before_the_call():
    return torch.randn(N)


def test_unannotated_views_count_zero(gpumem, made_before_the_call):
    x = made_before_the_call
    with gpumem.phase("views"):
        a = torch.ops.aten._unsafe_view(x, [10, 100])
        b = torch.unsafe_chunk(x, 4)
        c = torch.unsafe_split(x, 250)
    assert gpumem.peak("views") == 0
    del a, b, c


def test_traced_module_runs_measured(gpumem):
    conv = torch.nn.Conv2d(3, 4, 3)
    x = torch.randn(1, 3, 8, 8)
    traced = torch.jit.trace(conv, x)
    with gpumem.phase("run"):
        y = traced(x)
    assert gpumem.peak("run") == 1 * 4 * 6 * 6 * 4  # the output only
    assert torch.equal(y, conv(x))


def test_traced_shape_arithmetic(gpumem):
    x = torch.randn(4, 3)
    traced = torch.jit.trace(lambda t: t.view(t.shape[0] * t.shape[1]) * 2, x)
    with gpumem.phase("run"):
        y = traced(x)
    # the product only (12 float32); the script's size arithmetic passes numbers, which a dispatch
    # mode receives as Python ints: once failing ("Expected a value of type 'Tensor'"), now re-wrapped
    assert gpumem.peak("run") == 48
    assert torch.equal(y, x.view(12) * 2)


def test_thread_that_allocates(gpumem):
    made = []
    worker = threading.Thread(target=lambda: made.append(torch.ones(N)), name="loader")
    worker.start()
    worker.join()
    assert len(made) == 1


def test_failing_thread(gpumem):
    threading.Thread(target=lambda: None, name="side").start()
    assert False


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no")


class Open(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_unprintable_error(gpumem):
    raise Unprintable()


def test_leaves_its_mode_open(gpumem):
    Open().__enter__()


def test_after_runs_unmeasured():
    assert _get_current_dispatch_mode_stack() == []
"""


def test_sparse_resize_views_trace_threads_and_hostile_tests(tracker: pytest.Pytester, reported: Reported) -> None:
    tracker.makepyfile(SPARSE_AND_STORAGES)
    result = tracker.runpytest("-p", "no:cacheprovider", "-p", "no:randomly", "-rA", "--gpumem-json=out.json")
    result.assert_outcomes(passed=11, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*GpuMemWarning: *test_thread_that_allocates: threads started inside the call (loader)*",
            "*GpuMemWarning: *::test_failing_thread: threads started inside the call (side)*",
            "*note: torch.jit.trace ran unmeasured: the tracer cannot run under a dispatch mode*",
            "*note: threads started inside the call (loader) run without the tracker*",
        ]
    )
    tests = reported()
    # the notes reach the JSON, the failing test's too
    note = (
        "threads started inside the call ({}) run without the tracker: tensors they made are not counted "
        "(the cuda backend sees every thread)"
    )
    assert tests["test_thread_that_allocates"]["notes"] == [note.format("loader")]
    assert tests["test_failing_thread"]["notes"] == [note.format("side")]
    # the tracker ends after tests that raise an unprintable error or leave a mode of their own open
    error = tests["test_unprintable_error"]
    assert (error["status"], error["message"]) == ("error", "Unprintable: <Unprintable.__str__ raised>")


def test_measurement_leaves_nothing_patched() -> None:
    def patched() -> tuple[object, ...]:
        return (
            torch.jit.trace,
            torch.UntypedStorage.resize_,
            optimizer._get_foreach_kernels_supported_devices,  # type: ignore[attr-defined]
            threading.getprofile(),
        )

    before = patched()
    backend = TrackerBackend("cuda")
    backend.start()
    try:
        during = patched()
        devices = optimizer._get_foreach_kernels_supported_devices()  # type: ignore[attr-defined]
    finally:
        backend.stop()
    assert [now is then for now, then in zip(during, before, strict=True)] == [False] * 4
    assert "cpu" in devices
    assert patched() == before


def _adam_step_peak(rounding: str) -> tuple[int, int]:
    """(allocated, requested) peak of a warmed-up Adam step over parameters of 1000 and 100 float32."""
    params = [torch.nn.Parameter(torch.randn(1000)), torch.nn.Parameter(torch.randn(100))]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.Adam(params)
    opt.step()  # the state (exp_avg, exp_avg_sq, step) exists before the measured step
    backend = TrackerBackend(rounding)
    backend.start()
    try:
        opt.step()
        peak = backend.peak()
    finally:
        backend.stop()
    return peak.allocated, peak.requested


def test_optimizers_take_foreach_when_predicting_cuda() -> None:
    # single-tensor Adam on the CPU's paths: per parameter sqrt(exp_avg_sq), then its quotient: 2 x 4000 B
    assert _adam_step_peak("none") == (2 * 4000, 2 * 4000)
    # foreach, as on CUDA: sqrt of every exp_avg_sq at once (4000 + 400 B), each rounded up to 512 B
    assert _adam_step_peak("cuda") == (4096 + 512, 4000 + 400)
    described = TrackerBackend("cuda").describe()
    assert described.endswith(
        "; a GPU's code paths: foreach optimizers, CUDA's autocast (--gpumem-paths=cpu for the CPU's)"
    )


COMPILED = """
import pytest
import torch

N = 1 << 16


def chain(x):
    return (x.sin().cos() * 2 + 1).sum()


def two_branches(x):
    return x.sin() + x.cos()


@pytest.mark.parametrize("fullgraph", [False, True])
def test_fused_chain(gpumem, fullgraph):
    compiled = torch.compile(chain, fullgraph=fullgraph)
    x = torch.randn(N)
    with gpumem.phase("compiled"):
        out = compiled(x)
    # eager would hold sin, cos, *2 and +1 (4N each, two at a time); the fused program writes one scalar
    assert gpumem.peak("compiled") == 4
    assert torch.allclose(out, chain(x))


def test_output_buffer(gpumem):
    compiled = torch.compile(two_branches)
    x = torch.randn(N)
    compiled(x)  # compiled outside the phase
    with gpumem.phase("compiled"):
        out = compiled(x)
    # eager: sin and cos (4N each) and their sum (4N) coexist; compiled: the output only
    assert gpumem.peak("compiled") == 4 * N
    del out


def test_compiled_backward(gpumem):
    y = torch.randn(N, requires_grad=True)
    compiled = torch.compile(lambda t: (t.sin() * t).sum())
    loss = compiled(y)
    with gpumem.phase("backward"):
        loss.backward()
    # the seed (4) and the gradient buffer the compiled backward writes (4N)
    assert gpumem.peak("backward") == 4 + 4 * N
"""


@pytest.mark.slow
def test_compiled_programs_are_measured_as_compiled(
    tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, reported: Reported
) -> None:
    tracker.makepyfile(COMPILED)
    # a cold compile starts the compiler's worker threads inside the call: they are not the test's
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tracker.path / "inductor-cache"))
    # a subprocess: Inductor registers operator libraries on first import, once per process
    result = tracker.runpytest_subprocess(*UNPLUGGED, "--gpumem-json=out.json")
    result.assert_outcomes(passed=4)
    assert [test["notes"] for test in reported().values()] == [[], [], [], []]


@pytest.mark.parametrize("flag", ["--gpumem-json", "--gpumem-markdown"])
def test_reports_never_overwrite_the_baselines(tracker: pytest.Pytester, flag: str) -> None:
    baselines = tracker.path / "gpumem-baselines.json"
    baselines.write_text("precious", encoding="utf-8")
    tracker.makepyfile("def test_x(gpumem): pass")
    result = tracker.runpytest(f"{flag}=gpumem-baselines.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"ERROR: {flag}=*gpumem-baselines.json: that is the baseline file; write the report elsewhere"]
    )
    assert baselines.read_text(encoding="utf-8") == "precious"


def test_fake_tensors_are_not_memory() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    backend = TrackerBackend()
    backend.start()
    try:
        real = torch.ones(1000)  # 4,000 B
        with FakeTensorMode():
            big = torch.empty(1000, 1000) * 2  # 4 MB each, on paper only
        peak = backend.peak().allocated
    finally:
        backend.stop()
    assert peak == 4000
    assert backend.notes() == [
        "2 op outputs were fake tensors (FakeTensorMode): they hold no memory and were not counted; "
        "the figures are what the test's real tensors used"
    ]
    del real, big


def test_the_trackers_own_copy_of_the_allocator_is_no_thread_of_the_test() -> None:
    """A fit on meta copies the allocator's model on a thread of the tracker's own: no note blames the test;
    a thread the test starts in the same call is still named."""
    import threading

    from pytest_gpumem.backends.tracker.allocator_state import copied
    from pytest_gpumem.backends.tracker.backend import TrackerBackend

    backend = TrackerBackend(device="meta")
    backend.start()
    try:
        assert copied([1, [2]]) == [1, [2]]
        side = threading.Thread(target=lambda: None, name="side")
        side.start()
        side.join()
    finally:
        backend.stop()
    assert [note.split(" run without")[0] for note in backend.notes()] == ["threads started inside the call (side)"]
