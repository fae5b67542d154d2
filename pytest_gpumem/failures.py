"""When memory goes wrong: out of memory, leaks, and the evidence a failing test leaves behind."""

from __future__ import annotations

import gc
import hashlib
import json
import pickle
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.sizes import format_size

if TYPE_CHECKING:
    from pytest_gpumem.backends.base import Backend
    from pytest_gpumem.markers import Budget, Limit
    from pytest_gpumem.meter import GpuMem

STATUS_OOM = "OUT OF MEMORY"
STATUS_LEAKED = "LEAKED"
# statuses that leave evidence in --gpumem-snapshot-dir
EVIDENCE_STATUSES = frozenset((STATUS_OOM, STATUS_LEAKED, "OVER BUDGET", "REGRESSED"))
SURVIVORS_IN_MESSAGE = 3


@dataclass(frozen=True)
class Watch:
    """What a measured test is held to beyond its peaks: the device's capacity, the bytes it may leak,
    and whether its trace is kept for evidence."""

    capacity: Limit | None
    leak: Limit | None
    evidence: bool
    explain: bool = False

    @classmethod
    def of(
        cls, budget: Budget | None, capacity: Limit | None, leak: Limit | None, evidence: bool, explain: bool = False
    ) -> Watch:
        """The test's own marker values first, then the run's options."""
        if budget is not None:
            capacity = budget.capacity or capacity
            leak = budget.leak if budget.leak is not None else leak
            explain = explain or budget.explain
        return cls(capacity, leak, evidence, explain)

    def apply(self, backend: Backend, meter: GpuMem) -> None:
        """Set up the backend for the next call (every measured test: nothing carries over)."""
        meter.leak_check = self.leak is not None
        meter.explain = self.explain
        configure = getattr(backend, "configure", None)
        if callable(configure):
            capacity = None if self.capacity is None else self.capacity.bytes
            origins = self.leak is not None or self.evidence
            if callable(getattr(backend, "attribution", None)):  # it explains its own peaks
                configure(capacity, origins=origins, events=self.evidence, explain=self.explain)
            else:
                configure(capacity, origins=origins, events=self.evidence)
        elif self.capacity is not None:  # a test held to a capacity must not run without one
            raise GpuMemError(f"capacity {self.capacity.written}: the {backend.name} backend cannot set a capacity")


def is_out_of_memory(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, torch.OutOfMemoryError)


def out_of_memory_message(meter: GpuMem, budget: Budget | None, exc: BaseException) -> str:
    """One sentence: where it ran out, what it asked for, the peak so far and the limits."""
    phase = meter.phase_left_by(exc)
    where = f"in {phase}" if phase else "in the call"
    asked = re.search(r"[Tt]ried to allocate ([\d.,]+ ?[KMGTP]?i?B)", _text(exc))
    tried = f" (tried to allocate {asked.group(1)})" if asked else ""
    limits = "" if budget is None or not budget.describe() else f"; budget {budget.describe()}"
    from pytest_gpumem.measure.advice import advice_clause

    advised = advice_clause(meter.advice, budget, oom=True)
    return f"out of memory {where}{tried} after a peak of {format_size(meter.peak())}{limits}{advised}"


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return ""


def needs_real_values(exc: BaseException, device: object) -> str | None:
    """On the meta device, an op that needs real values (`.item()`, `nonzero`, a boolean mask, copying
    data out) fails; the one line that says so, naming the op, or None for any other error."""
    from pytest_gpumem.backends.meta_errors import cannot_run_on_meta

    reason = cannot_run_on_meta(exc) if str(device) == "meta" else None
    return None if reason is None else f"this test cannot run on the meta device (tensors without data): {reason}"


def release_memory() -> None:
    """After an out-of-memory error: collect what its frames held, and return cached blocks to the device."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def leak_message(meter: GpuMem, leak: Limit, net_bytes: int) -> str:
    shown = "; ".join(s.describe(leak.fmt) for s in meter.survivors[:SURVIVORS_IN_MESSAGE])
    more = len(meter.survivors) - SURVIVORS_IN_MESSAGE
    tail = f"; {more} more in the report section" if more > 0 else ""
    largest = f": {shown}{tail}" if shown else ""
    return f"left {leak.fmt(net_bytes)} allocated after the call (leak limit {leak.written}){largest}"


def survivors_section(meter: GpuMem) -> str:
    return "".join(f"\nleft allocated: {survivor.describe()}" for survivor in meter.survivors)


def write_evidence(folder: Path, nodeid: str, status: str, message: str | None, trace: Any) -> Path | None:
    """The trace of a failing test: JSON from the tracker, a memory-history pickle from CUDA (PyTorch's
    memory visualizer opens it). Returns the file written, or None when there was nothing to write."""
    if trace is None:
        return None
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid)[:120] + "-" + hashlib.sha1(nodeid.encode()).hexdigest()[:8]
    if isinstance(trace, dict) and str(trace.get("format", "")).startswith("pytest-gpumem"):
        path = folder / f"{stem}.json"
        doc = {"nodeid": nodeid, "status": status, "message": message, **trace}
        path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    else:
        path = folder / f"{stem}.pickle"
        path.write_bytes(pickle.dumps(trace))
    return path
