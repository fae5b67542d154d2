"""torch.compile where a card is predicted (meta, --gpumem-round=cuda): a compiled function runs as
Inductor's partition, unfused (Inductor's own plan on meta read 4 MiB of a forward where a card holds 20, or
failed inside torch), and says so; torch's own compile failures on meta are one line. Exact bytes by hand."""

from __future__ import annotations

import contextlib
import fnmatch
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from builders import UNPLUGGED, Reported
from torch import nn

from pytest_gpumem import private_torch
from pytest_gpumem.backends.tracker import compiled
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.backends.tracker.compiled_notes import (
    COMPILED_CUDA_GRAPHS,
    COMPILED_EAGERLY,
    COMPILED_FOR_CPU,
    COMPILED_UNFUSED,
    compiled_as_chosen_note,
)

MiB = 1 << 20


def _mlp_forward(compiled: bool) -> tuple[int, int, int, list[str]]:
    """(forward peak, bytes held after it, the largest kernel temporaries, notes) of the issue's MLP on meta,
    exact bytes."""
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to("meta")
    run = torch.compile(model) if compiled else model
    x = torch.randn(512, 1024, device="meta")
    backend = TrackerBackend("none", device="meta")
    backend.start()
    try:
        loss = run(x).square().mean()
        figures = backend.peak().allocated, backend.current().allocated, backend.largest_kernel_temporaries
        del loss
    finally:
        backend.stop()
    return (*figures, backend.notes())


def test_a_compiled_mlp_on_meta_is_inductors_partition_unfused_and_says_so() -> None:
    eager, compiled = _mlp_forward(False), _mlp_forward(True)
    # eager: Linear(1024, 4096)'s output h and GELU's g (512 x 4096 float32, 8 MiB each), the second Linear's
    # y and its square (512 x 1024, 2 MiB each), then the 4-byte mean with its reduction's staging buffer and
    # semaphores; after it, h (GELU's backward), g (the second weight's gradient) and y (square's backward)
    # stay with the loss
    staging = eager[2]
    assert eager == (20 * MiB + 4 + staging, 18 * MiB + 4, staging, []) and 0 < staging < 1024
    # compiled: the partitioner saves h and g too (it recomputes neither); unfused, GELU is 0.5 h, h / sqrt(2),
    # erf, + 1 and their product: h, 0.5 h, h / sqrt(2) and erf coexist (4 x 8 MiB) before the first is freed
    assert compiled == (32 * MiB, 18 * MiB + 4, staging, [COMPILED_UNFUSED])
    # a card's Inductor keeps h and g (saved) and y; fused, its GELU writes g alone: 18 MiB, then the square
    assert compiled[0] >= 8 * MiB + 8 * MiB + 2 * MiB + 2 * MiB and compiled[1] >= 8 * MiB + 8 * MiB + 2 * MiB + 4


def _cross_entropy_gradient(monkeypatch: pytest.MonkeyPatch | None = None) -> tuple[int, list[str]]:
    """(bytes held after backward, notes) of a compiled cross_entropy over a 16 x 8 weight on meta; with
    `monkeypatch`, torch's meta kernels of the ops that decompose everywhere are left in place."""
    if monkeypatch is not None:
        monkeypatch.setattr(private_torch, "composite_ops_decomposed_on_meta", contextlib.nullcontext)
    torch.compiler.reset()  # the lambda's code is compiled anew in each call
    weight = torch.randn(16, 8, device="meta", requires_grad=True)
    target = torch.randint(0, 16, (4,), device="meta")
    compiled = torch.compile(lambda x: torch.nn.functional.cross_entropy(x @ weight.t(), target))
    backend = TrackerBackend("none", device="meta")
    backend.start()
    try:
        compiled(torch.randn(4, 8, device="meta")).backward()  # type: ignore[no-untyped-call]
        held = backend.current().allocated
    finally:
        backend.stop()
    assert weight.grad is not None
    return held, backend.notes()


def test_cross_entropy_compiled_on_meta_keeps_its_gradient() -> None:
    # torch's joint graph on meta took nll_loss's Python meta kernel and lost its gradient: the weight's
    # gradient (16 x 8 float32) is what the step leaves
    assert _cross_entropy_gradient() == (16 * 8 * 4, [COMPILED_UNFUSED])


def test_where_torch_still_loses_a_gradient_the_graph_runs_eagerly_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # with nll_loss's meta kernel in place torch warns of the lost gradient while compiling
    assert _cross_entropy_gradient(monkeypatch) == (16 * 8 * 4, [COMPILED_EAGERLY])


@pytest.mark.slow
def test_a_backward_inductor_compiled_before_the_call_is_noted_as_no_bound() -> None:
    # the forward ran compiled by Inductor before the measurement: its backward is Inductor's CPU program,
    # reached without Dynamo, and leaves y's gradient (1024 float32, one 4,096-byte block)
    y = torch.randn(1024, requires_grad=True)
    loss = torch.compile(lambda t: (t.sin() * t).sum())(y)
    backend = TrackerBackend("cuda")
    backend.start()
    try:
        loss.backward()
        held = backend.current().allocated
    finally:
        backend.stop()
    assert held == 4096 and backend.notes() == [COMPILED_FOR_CPU]


def _compiled_on_meta(**options: Any) -> tuple[int, list[str]]:
    """(peak bytes, notes) of relu(x @ x).sum() on a 64 x 64 x made in the call, compiled with `options` on
    meta."""
    torch.compiler.reset()
    compiled = torch.compile(lambda x: torch.relu(x @ x).sum(), **options)
    backend = TrackerBackend("none", device="meta")
    backend.start()
    try:
        compiled(torch.randn(64, 64, device="meta"))
        peak = backend.peak().allocated
    finally:
        backend.stop()
    return peak, backend.notes()


def test_a_users_own_backend_runs_as_chosen_and_says_it_is_no_bound() -> None:
    graphs: list[Any] = []

    def counted(graph: Any, inputs: Any) -> Any:
        graphs.append(graph)
        return graph.forward

    # the captured graph runs eagerly: x, x @ x and relu's output (64 x 64 float32, 16 KiB each); x @ x is
    # freed before the 4-byte sum
    assert len(graphs) == 0
    assert _compiled_on_meta(backend=counted) == (3 * 16384, [compiled_as_chosen_note({"counted"})])
    assert len(graphs) == 1
    assert _compiled_on_meta(backend="eager") == (3 * 16384, [compiled_as_chosen_note({"eager"})])


def test_inductor_with_cuda_graphs_is_run_unfused_and_called_no_bound() -> None:
    # the partition's graph frees x @ x after relu too: the same 48 KiB as eagerly
    assert _compiled_on_meta(mode="reduce-overhead") == (3 * 16384, [COMPILED_CUDA_GRAPHS])


def test_each_compiled_function_keeps_its_own_callback(monkeypatch: pytest.MonkeyPatch) -> None:
    found = private_torch.compile_stance_owner()
    assert found is not None
    chosen: list[Any] = []
    monkeypatch.setattr(*found, chosen.append)  # records each function's callback, compiles nothing
    for function in (lambda x: x + 1, lambda x: x * 2):
        torch.compile(function)(torch.ones(1))
    made = [compiled.callback(callback) for callback in chosen]
    assert [callback.hooks for callback in made] == [callback.hooks for callback in chosen]
    assert made[0] is not made[1] and compiled.callback(chosen[1]) is made[1]


def test_a_warning_while_compiling_is_warned_again_as_its_module_warned_it() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn_explicit("old", DeprecationWarning, fnmatch.__file__, 1, "fnmatch", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="fnmatch")
        compiled._warn_again(caught[0])  # the user's filter names the module: ignored, not raised
        warnings.filterwarnings("error", category=DeprecationWarning, module="fnmatch")
        with pytest.raises(DeprecationWarning, match="old"):
            compiled._warn_again(caught[0])


COMPILED_ON_META = """
from torch import compile as imported_compile
import pytest
import torch
from torch import nn


def test_imported_compile(gpumem):
    # bound before the measurement, Dynamo not yet loaded: still Inductor's partition, unfused
    imported_compile(lambda x: torch.relu(x @ x).sum())(torch.randn(64, 64, device=gpumem.device))


def test_own_backend_runs(gpumem):
    graphs = []

    def counted(graph, inputs):
        graphs.append(graph)
        return graph.forward

    torch.compile(lambda x: torch.relu(x @ x).sum(), backend=counted)(torch.randn(64, 64, device=gpumem.device))
    assert len(graphs) == 1


def test_mlp(gpumem):
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(gpumem.device)
    compiled = torch.compile(model)
    with gpumem.phase("forward"):
        loss = compiled(torch.randn(512, 1024, device=gpumem.device)).square().mean()
    with gpumem.phase("backward"):
        loss.backward()


def test_fullgraph_refuses_a_graph_break(gpumem):
    def broken(x):
        x = x * 2
        torch._dynamo.graph_break()
        return x + 1

    torch.compile(broken, fullgraph=True)(torch.ones(4, device=gpumem.device))
"""


@pytest.mark.slow
def test_compiled_code_on_meta_is_predicted_unfused_and_the_report_says_so(
    tracker: pytest.Pytester, reported: Reported
) -> None:
    tracker.makepyfile(COMPILED_ON_META)
    # a process that has not loaded Dynamo before the call: the first test's compile loads it inside the
    # measurement, through the `torch.compile` it imported before
    result = tracker.runpytest_subprocess(*UNPLUGGED, "--gpumem-device=meta", "--gpumem-json=out.json")
    result.assert_outcomes(passed=3, failed=1)  # fullgraph=True refuses a graph break, as unmeasured
    result.stdout.fnmatch_lines(["_* test_fullgraph_refuses_a_graph_break _*", "E * torch._dynamo.exc.Unsupported: *"])
    result.stdout.fnmatch_lines(
        [
            "gpumem: tracker (*)",
            "  device meta (*)",
            "  compiled: Inductor's partition, unfused (an upper bound), other *",
        ]
    )
    result.stdout.fnmatch_lines([f"*test_mlp: {COMPILED_UNFUSED}"])  # the note, as a warning at the test
    tests = reported()
    assert tests["test_imported_compile"]["notes"] == [COMPILED_UNFUSED]
    assert tests["test_own_backend_runs"]["notes"] == [compiled_as_chosen_note({"counted"})]
    assert tests["test_mlp"]["notes"] == [COMPILED_UNFUSED]
    assert tests["test_mlp"]["phases"]["forward"]["peak_bytes"] >= 18 * MiB  # Inductor's 4 MiB on meta is gone


INDUCTOR_ON_META = """
import torch
from torch import nn
from pytest_gpumem.backends.tracker.meta_errors import cannot_run_on_meta

compiled = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.ReLU()).to("meta"))
try:
    compiled(torch.randn(4, 8, device="meta", requires_grad=True)).sum().backward()
except RuntimeError as exc:
    print(cannot_run_on_meta(exc))
"""


@pytest.mark.slow
def test_inductors_failure_on_meta_is_one_line() -> None:
    # torch cannot compile a Linear + ReLU's joint graph for meta tensors (a node used before its definition);
    # in a process of its own: Inductor's failed compile leaves this one counting a checkpointed
    # cross-entropy on meta 320 KiB higher (the reference suite's chunked_ce_checkpoint)
    ran = subprocess.run([sys.executable, "-c", INDUCTOR_ON_META], capture_output=True, text=True, timeout=240)
    said = ran.stdout.strip()
    expected = "torch.compile's inductor cannot compile this graph for meta tensors (* in torch): measure it on the CPU"
    assert fnmatch.fnmatchcase(said, expected + " with --gpumem-round=cuda, at a shape that fits"), (
        ran.stdout + ran.stderr
    )
