"""GPU validation: the cuda backend and the tracker's prediction (--gpumem-round=cuda) side by side.

    python benchmarks/validate_cuda.py --json validate_cuda.json [--scale 1.0]
    python benchmarks/validate_cuda.py --allow-cpu --json /tmp/v.json   # exercises the code paths on CPU

For every reference_losses strategy (or, without that package, the core workloads), on the same CUDA
tensors: the cuda backend's allocated and requested peaks per phase, the tracker's predicted allocated
peak (CUDA rounding) and exact requested peak, the hand-derived bytes; then the same workload measured
again after all others ran (the allocator's cache then holds blocks of other sizes: the allocated peak may
change, the requested peak must not); and the cuda backend's cost per measured test. One table, one JSON.
Expected differences: allocated > requested (rounding to 512 B and whole segments); cuda > tracker when
kernels allocate scratch or cuBLAS/cuDNN workspaces through the caching allocator.
Without CUDA it exits 0 with a message, unless --allow-cpu substitutes the tracker for the cuda backend
(every figure then labelled "tracker (no CUDA)").

On CUDA it also checks the cuBLAS workspaces as the tracker's model serves them: after torch's are cleared,
a matmul adds its output and one workspace of the size `cuda_allocator_model.cards.cublas_workspace_bytes` gives
the device's compute capability (or CUBLAS_WORKSPACE_CONFIG), and a forward + backward leaves two (the
thread's and the autograd engine's device thread's), on the device and in the tracker alike.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import benchlib
import torch
from benchlib import Workload

from pytest_gpumem.backends.base import Backend
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.measure.measurement import Measurement
from pytest_gpumem.results import PhaseResult

CPU_STAND_IN = "tracker (no CUDA)"


def device_backend(allow_cpu: bool) -> tuple[torch.device, Backend, str] | None:
    if torch.cuda.is_available():
        from pytest_gpumem.backends.cuda import CudaBackend

        backend = CudaBackend()
        return backend.device, backend, "cuda"
    if allow_cpu:
        return torch.device("cpu"), TrackerBackend(), CPU_STAND_IN
    return None


def release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def measure_alone(workload: Workload, device: torch.device, backend: Backend) -> dict[str, Any]:
    """After a warm-up run (cuBLAS workspaces, first-use allocations) and an emptied cache."""
    warm = workload.prepare(device)
    warm(_Null())
    del warm
    release(device)
    torch.manual_seed(0)
    device_phases = benchlib.phases_of(workload.prepare(device), backend)
    release(device)
    torch.manual_seed(0)
    predicted = benchlib.phases_of(workload.prepare(device), TrackerBackend("cuda"))
    return {"device": device_phases, "predicted": predicted}


class _Null:
    from contextlib import nullcontext as _nullcontext

    def phase(self, name: str) -> Any:
        return self._nullcontext()


def _workspace_step(device: torch.device, allocated: Callable[[], int]) -> tuple[int, int]:
    """(bytes a 1024 x 1024 float32 matmul adds beyond its 4 MiB output, bytes a Linear-like forward and
    backward leave allocated once their tensors are gone), read with `allocated()`."""
    a = torch.empty(1024, 1024, device=device)
    before = allocated()
    c = torch.mm(a, a)
    mm_added = allocated() - before - 4 * 2**20
    del a, c
    start = allocated()
    w = torch.empty(256, 256, device=device, requires_grad=True)
    (torch.empty(64, 256, device=device) @ w).sum().backward()  # type: ignore[no-untyped-call]
    del w
    return mm_added, allocated() - start


def workspace_check(device: torch.device) -> dict[str, Any] | None:
    """The cuBLAS workspaces on the card and as the tracker predicts them (None without CUDA)."""
    if device.type != "cuda":
        return None
    from cuda_allocator_model.cards import cublas_workspace_bytes

    props = torch.cuda.get_device_properties(device)
    expected = cublas_workspace_bytes((props.major, props.minor), os.environ)

    def on_card() -> int:
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)

    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    card = _workspace_step(device, on_card)
    torch._C._cuda_clearCublasWorkspaces()
    tracker = TrackerBackend("cuda")
    tracker.ledger.workspace_bytes = expected
    tracker.start()
    try:
        predicted = _workspace_step(device, lambda: tracker.current().allocated)
    finally:
        tracker.stop()
    wanted = (expected, expected)  # one by the matmul; after the step, backward's beside the thread's
    return {"expected": expected, "card": card, "predicted": predicted, "ok": card == predicted == wanted}


def measure_after_others(workloads: list[Workload], device: torch.device, backend: Backend) -> dict[str, Any]:
    """Every workload once more, in reverse order, with the cache left as the others left it."""
    out: dict[str, Any] = {}
    for workload in reversed(workloads):
        torch.manual_seed(0)
        out[workload.name] = benchlib.phases_of(workload.prepare(device), backend)
    return out


def per_test_cost(backend: Backend, repeat: int = 30) -> float:
    """Seconds that measuring an empty test call costs (begin + end, gc.collect included)."""
    times = []
    for _ in range(repeat):
        measured = Measurement(backend, "cost")
        start = time.perf_counter()
        measured.begin()
        measured.end()
        times.append(time.perf_counter() - start)
    return benchlib.median(times)


def _hand(workload: Workload, phase: str) -> str:
    hand = workload.expected.get(phase)
    if hand is None:
        return ""
    return str(hand) if isinstance(hand, int) else f"{hand[0]}..{hand[1]}"


def rows_for(workload: Workload, alone: dict[str, Any], later: dict[str, PhaseResult]) -> list[list[str]]:
    rows = []
    for phase, measured in alone["device"].items():
        predicted = alone["predicted"].get(phase)
        again = later.get(phase)
        rows.append(
            [
                workload.name,
                phase,
                str(measured.peak_bytes),
                str(measured.requested_peak_bytes),
                "" if predicted is None else str(predicted.peak_bytes),
                "" if predicted is None else str(predicted.requested_peak_bytes),
                _hand(workload, phase),
                "" if again is None else str(again.peak_bytes),
                "" if again is None else f"{again.requested_peak_bytes - measured.requested_peak_bytes:+d}",
            ]
        )
    return rows


def _phase_json(phases: dict[str, PhaseResult]) -> dict[str, Any]:
    return {name: p.to_json() for name, p in phases.items()}


def _workspace_line(workspaces: dict[str, Any] | None) -> str:
    if workspaces is None:
        return "cuBLAS workspaces: no CUDA here, not checked"
    return (
        f"cuBLAS workspaces {'match' if workspaces['ok'] else 'DIFFER'}: {workspaces['expected']:,} B each; "
        f"matmul adds, step leaves: card {workspaces['card']}, tracker {workspaces['predicted']}"
    )


def _figures(
    label: str,
    backend: Backend,
    cost: float,
    workspaces: dict[str, Any] | None,
    workloads: list[Workload],
    alone: dict[str, Any],
    later: dict[str, Any],
) -> dict[str, Any]:
    """What the run found, as its --json writes it."""
    return {
        "backend": label,
        "describe": backend.describe(),
        "per_test_s": cost,
        "cublas_workspaces": workspaces,
        "workloads": {
            w.name: {
                "hand": w.expected,
                "alone": _phase_json(alone[w.name]["device"]),
                "predicted": _phase_json(alone[w.name]["predicted"]),
                "after_others": _phase_json(later[w.name]),
            }
            for w in workloads
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = benchlib.parser("cuda backend vs tracker prediction, per reference strategy")
    p.add_argument("--scale", type=float, default=1.0, help="reference_losses batch scale (default 1)")
    p.add_argument("--allow-cpu", action="store_true", help="without CUDA, run with the tracker as a stand-in")
    args: argparse.Namespace = p.parse_args(argv)
    chosen = device_backend(args.allow_cpu)
    if chosen is None:
        print("validate_cuda: no CUDA device here (torch.cuda.is_available() is False); nothing to validate. "
              "Run it on a GPU machine, or pass --allow-cpu to exercise the script with the tracker.")  # fmt: skip
        return 0
    device, backend, label = chosen
    started = time.perf_counter()
    workloads = benchlib.strategy_workloads(args.scale) or benchlib.core_workloads()
    alone = {w.name: measure_alone(w, device, backend) for w in workloads}
    later = measure_after_others(workloads, device, backend)
    rows = [row for w in workloads for row in rows_for(w, alone[w.name], later[w.name])]
    cost = per_test_cost(backend)
    workspaces = workspace_check(device)
    benchlib.show(
        f"{label} on {device} vs tracker prediction (rounding cuda); {backend.describe()}",
        [
            "workload",
            "phase",
            f"{label} alloc",
            f"{label} req",
            "pred alloc",
            "pred req",
            "hand",
            "alloc after others",
            "req change",
        ],
        rows,
        [
            f"{label} per measured test: {cost * 1e3:.2f} ms (begin + end, gc.collect included)",
            "alloc >= req: 512 B rounding and whole segments; device > pred: kernel scratch, cuBLAS/cuDNN workspaces",
            "req change must be 0 (order independence of requested bytes); alloc may move with the cache",
            _workspace_line(workspaces),
            f"total {time.perf_counter() - started:.1f} s",
        ],
    )
    benchlib.write_json(
        args.json, {"validate_cuda": _figures(label, backend, cost, workspaces, workloads, alone, later)}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
