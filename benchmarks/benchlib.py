"""Shared pieces of the benchmarks: workloads, the three ways of measuring phase peaks, timing, output.

Not a module of the package: the scripts next to it import it as `benchlib` (run them as
`python benchmarks/NAME.py`, which puts this folder on `sys.path`).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from tabulate import tabulate
from torch import nn

from pytest_gpumem.backends.base import Backend
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.measure.measurement import Measurement
from pytest_gpumem.measure.measuring import measuring
from pytest_gpumem.results import PhaseResult

PHASES = ("forward", "backward")
FP32 = 4  # bytes per float32 element
BF16 = 2


class PhaseMeter(Protocol):
    def phase(self, name: str) -> AbstractContextManager[None]: ...


Run = Callable[[PhaseMeter], None]
"""A workload ready to run: it opens phases "forward" and "backward" (and maybe others) on the meter."""
Prepare = Callable[[torch.device], Run]
"""Builds a workload's inputs and model (unmeasured) and returns the run."""


# --------------------------------------------------------------------------------------------- output


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", metavar="PATH", type=Path, default=None, help="also write the figures as JSON")
    return p


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "platform": platform.platform(),
    }


def show(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], notes: Sequence[str] = ()) -> None:
    print(f"\n== {title}")
    print(tabulate(rows, headers=list(headers), tablefmt="github", disable_numparse=True))
    for note in notes:
        print(f"  * {note}")


def write_json(path: Path | None, data: dict[str, Any]) -> None:
    if path is None:
        return
    path.write_text(json.dumps({"machine": machine(), **data}, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(f"\nwrote {path}")


# ------------------------------------------------------------------------------------------ workloads

N = 1000  # elements of the small workloads: float32 4N = 4000 bytes


def _leaf(device: torch.device, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=device).requires_grad_(True)


def _step(meter: PhaseMeter, forward: Callable[[], torch.Tensor]) -> None:
    with meter.phase("forward"):
        loss = forward()
    with meter.phase("backward"):
        loss.backward()  # type: ignore[no-untyped-call]


def sum_of_product(device: torch.device) -> Run:
    x, y = _leaf(device, N), torch.randn(N, device=device)
    return lambda meter: _step(meter, lambda: torch.sum(x * y))


def saved_sigmoid(device: torch.device) -> Run:
    x = _leaf(device, N)
    return lambda meter: _step(meter, lambda: (x * 2).sigmoid().sum())


def checkpointed(device: torch.device) -> Run:
    from torch.utils.checkpoint import checkpoint

    x = _leaf(device, N)

    def forward() -> torch.Tensor:
        out: torch.Tensor = checkpoint(lambda t: (t * 2).sigmoid(), x, use_reentrant=False)
        return out.sum()

    return lambda meter: _step(meter, forward)


def autocast(device: torch.device) -> Run:
    x, w = _leaf(device, N), torch.randn(N, N // 4, device=device)
    dtype = torch.bfloat16 if device.type == "cpu" else torch.float16

    def forward() -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype):
            return (x @ w).float().sum()

    return lambda meter: _step(meter, forward)


class Net(nn.Module):
    """Linear(1024, 2048) -> Linear(2048, 1024), the model of the benchmarks and the README."""

    def __init__(self, width: int = 1024, hidden: int = 2048) -> None:
        super().__init__()
        self.layer1 = nn.Linear(width, hidden)
        self.layer2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.layer1(x))  # type: ignore[no-any-return]


BATCH = 64


def net(device: torch.device) -> Run:
    model, x = Net().to(device), torch.randn(BATCH, 1024, device=device)
    return lambda meter: _step(meter, lambda: model(x).sum())


@dataclass(frozen=True)
class Workload:
    name: str
    prepare: Prepare
    expected: dict[str, int | tuple[int, int]]  # hand-derived peak per phase (exact bytes, or low..high)
    why: dict[str, str] = field(default_factory=dict)


def core_workloads() -> list[Workload]:
    """The workloads of tests/test_tracker.py and the Net, with their peaks derived by hand."""
    n, q = N, N // 4
    h, o = BATCH * 2048 * FP32, BATCH * 1024 * FP32  # Net: hidden activation, output
    gw1, gw2, gb1, gb2 = 2048 * 1024 * FP32, 1024 * 2048 * FP32, 2048 * FP32, 1024 * FP32
    return [
        Workload(
            "sum(x*y)",
            sum_of_product,
            {"forward": 4 * n + 4, "backward": 4 + 4 * n},
            {"forward": "x*y (4N) + the scalar sum (4)", "backward": "seed ones_like(loss) (4) + grad*y = x.grad (4N)"},
        ),
        Workload(
            "sigmoid (saves output)",
            saved_sigmoid,
            {"forward": 8 * n, "backward": 4 * n + 4},
            {
                "forward": "x*2 (4N) + sigmoid out (4N); the sum (4) comes after x*2 is freed",
                "backward": "seed (4) + sigmoid grad (4N); saved out freed before grad*2 = x.grad (4N)",
            },
        ),
        Workload(
            "checkpoint",
            checkpointed,
            {"forward": 8 * n, "backward": 8 * n + 4},
            {
                "forward": "as sigmoid, but nothing is kept for backward",
                "backward": "seed (4) + recomputed x*2 and sigmoid out (4N each)",
            },
        ),
        Workload(
            "autocast bf16 x@w",
            autocast,
            {"forward": 2 * n + 2 * n * q + 2 * q + 4 * q, "backward": 4 + 2 * q + 2 * n},
            {
                "forward": "bf16 copies of x (2N) and w (2*N*N/4), bf16 product (2*N/4), its fp32 copy (4*N/4)",
                "backward": "seed (4), bf16 grad of the product (2*N/4), bf16 grad of x (2N); the fp32 x.grad "
                "(4N) is made after the saved bf16 w (2*N*N/4, made before the phase) is released",
            },
        ),
        Workload(
            "Net b64 fwd+bwd",
            net,
            {"forward": h + o + 4, "backward": 4 + gw2 + gb2 + gw1 + gb1 + h - h},
            {
                "forward": "hidden 64x2048 + output 64x1024 (fp32) + loss (4)",
                "backward": "seed (4; the output's grad is its expanded view), weight/bias grads of both layers "
                "(2 x 2048x1024 + 2048 + 1024 floats), and the grad of the hidden 64x2048, made once the saved "
                "hidden (same size, made before the phase) is released: + h - h",
            },
        ),
    ]


def strategy_workloads(scale: float = 1.0) -> list[Workload]:
    """Every reference_losses strategy (when that package imports), bounds from its own expectations."""
    try:
        from reference_losses import STRATEGIES
    except Exception:  # another engineer's package: any import failure means "skip"
        return []
    out = []
    for name, strategy in STRATEGIES.items():
        if strategy.needs_cuda and not torch.cuda.is_available():
            continue

        def prepare(device: torch.device, strategy: Any = strategy) -> Run:
            workload = strategy.build(scale, device)
            return lambda meter: strategy.run(meter, workload.clone())

        probe = strategy.build(scale, torch.device("cpu"))
        expected: dict[str, int | tuple[int, int]] = {
            e.phase: (e.low, e.high) for e in strategy.expect(probe) if not e.net
        }
        why = {e.phase: f"{e.low}..{e.high}: {e.why}" for e in strategy.expect(probe) if not e.net}
        out.append(Workload(f"ref:{name}", prepare, expected, why))
    return out


# --------------------------------------------------------------------------------------- three meters


def tracker_peaks(run: Run, backend: Backend | None = None) -> dict[str, int]:
    """Phase peaks from the plugin's meter (the tracker unless another backend is given)."""
    return {name: r.peak_bytes for name, r in phases_of(run, backend or TrackerBackend()).items()}


def phases_of(run: Run, backend: Backend) -> dict[str, PhaseResult]:
    """The phases `run` opens, measured on `backend` as the plugin measures a test's call."""
    with measuring(Measurement(backend, "bench")) as call:
        run(call.meter)
    return call.meter.phases


def tracker_results(run: Run, backend: Backend) -> dict[str, tuple[int, int]]:
    """(allocated peak, requested peak) per phase."""
    return {name: (r.peak_bytes, r.requested_peak_bytes) for name, r in phases_of(run, backend).items()}


class MemTrackerMeter:
    """Phases over one `torch.distributed._tools.mem_tracker.MemTracker`.

    MemTracker has no public peak reset, so entering a phase sets its private peak snapshot to the
    current one (what `MemTracker.__enter__` itself does); a phase's peak is its peak total minus the
    total when it began, summed over devices.
    """

    def __init__(self) -> None:
        from torch.distributed._tools.mem_tracker import MemTracker

        self.tracker = MemTracker()
        self.peaks: dict[str, int] = {}

    @staticmethod
    def _total(snapshot: dict[torch.device, dict[str, int]]) -> int:
        return sum(per_device.get("Total", 0) for per_device in snapshot.values())

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        current = self.tracker.get_tracker_snapshot("current")
        self.tracker._peak_mem_snap = deepcopy(current)
        self.tracker._peak_mem = {dev: snap.get("Total", 0) for dev, snap in current.items()}
        start = self._total(current)
        yield
        peak = self._total(self.tracker.get_tracker_snapshot("peak"))
        self.peaks[name] = max(self.peaks.get(name, 0), peak - start)


def memtracker_peaks(run: Run) -> dict[str, int]:
    meter = MemTrackerMeter()
    with meter.tracker:
        run(meter)
    return meter.peaks


class ProfilerMeter:
    """Phases as `record_function` ranges; peaks from the profiler's memory events afterwards."""

    PREFIX = "gpumem-phase:"

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with torch.profiler.record_function(self.PREFIX + name):
            yield


def profiler_peaks(run: Run) -> dict[str, int]:
    """Running sum of every [memory] event (allocations +, frees -, all threads, CPU and CUDA) in time
    order; a phase's peak is the highest running sum inside its range minus the sum when it began."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run(ProfilerMeter())
    events = prof.profiler.kineto_results.events()
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    peaks: dict[str, int] = {}
    for e in events:
        if not e.name().startswith(ProfilerMeter.PREFIX):
            continue
        begin, end = e.start_ns(), e.end_ns()
        running = high = sum(n for t, n in memory if t < begin)
        start = running
        for t, n in memory:
            if begin <= t <= end:
                running += n
                high = max(high, running)
        name = e.name().removeprefix(ProfilerMeter.PREFIX)
        peaks[name] = max(peaks.get(name, 0), high - start)
    return peaks


# ------------------------------------------------------------------------------------------- timing


def interleaved(
    candidates: dict[str, Callable[[], float]], rounds: int, warmup: int = 2, collect: bool = False
) -> dict[str, list[float]]:
    """Each round runs every candidate once, in turn, so that machine drift hits them all alike; with
    `collect`, each after a full garbage collection (untimed), so that the collections a candidate triggers
    scan what it left, not the young objects of the one before it (MemTracker's and the profiler's made
    one gen-1 collection take 9 ms, a third of the tracker + allocator model's time on Linear(64) b8)."""
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            if collect:
                gc.collect()
            times[name].append(fn())
    return times


def per_call(fn: Callable[[], None], repeat: int) -> float:
    """Seconds per call of `fn`, over `repeat` calls."""
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def median(values: Sequence[float]) -> float:
    return statistics.median(values)
