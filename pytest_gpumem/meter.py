"""The `gpumem` fixture object: the whole call and named phases measured on one backend.

A backend has a single resettable peak (like the CUDA allocator). Regions nest (a phase inside the
whole call), so before every reset the peak so far is folded into each open region's running maximum;
a region's peak is then its maximum minus what was allocated when it opened.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_gpumem.backends.base import Backend, Counters, collect_garbage
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.results import PhaseResult

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from pytest_gpumem.backends.recording import Survivor
    from pytest_gpumem.fit import BatchFit
    from pytest_gpumem.gradients import Fingerprint

CALL = "call"
SURVIVORS_SHOWN = 10


@dataclass
class _Region:
    name: str
    start: Counters
    high: Counters


class RegionStack:
    """Open regions over one backend, with the peak folding that lets them nest."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.open: list[_Region] = []

    def push(self, name: str, full_collect: bool = False) -> None:
        collect_garbage(full_collect)
        self.backend.settle()
        self._fold()
        self.backend.reset_peak()
        now = self.backend.current()
        self.open.append(_Region(name, now, now))

    def pop(self) -> PhaseResult:
        result = self.peek(len(self.open) - 1)
        self.open.pop()
        return result

    def peek(self, index: int) -> PhaseResult:
        """The figures of open region `index` so far (0 is the outermost), leaving it open."""
        self.backend.settle()
        self._fold()
        region = self.open[index]
        end = self.backend.current()
        return PhaseResult(
            name=region.name,
            peak_bytes=region.high.allocated - region.start.allocated,
            requested_peak_bytes=region.high.requested - region.start.requested,
            reserved_peak_bytes=region.high.reserved,
            net_bytes=end.allocated - region.start.allocated,
        )

    @contextmanager
    def unmeasured(self) -> Iterator[None]:
        """Run a block whose transient allocations must not count: the peak so far is folded into the
        open regions first and reset to the current value afterwards."""
        self.backend.settle()
        self._fold()
        try:
            yield
        finally:
            self.backend.settle()
            self.backend.reset_peak()

    def _fold(self) -> None:
        peak = self.backend.peak()
        for region in self.open:
            region.high = region.high.max(peak)


def _finite_non_negative(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


class GpuMem:
    """Measures the test call and the phases opened with `phase(name)`; read with `peak` and `result`."""

    def __init__(self, backend: Backend, nodeid: str) -> None:
        self.backend = backend
        self.nodeid = nodeid
        self.info: dict[str, Any] = {}
        self._stack: RegionStack | None = None
        self._phase: str | None = None
        self._results: dict[str, PhaseResult] = {}
        self._call: PhaseResult | None = None
        self.notes: list[str] = []
        self.leak_check = False  # collect garbage before the call ends, and keep the call's survivors
        self.survivors: list[Survivor] = []
        self.trace: dict[str, Any] | None = None
        self._fits = 0
        self.gradients: Fingerprint | None = None
        self.gradient_tolerance: tuple[float | None, float | None] = (None, None)

    @property
    def device(self) -> torch.device:
        """Where the test's tensors should go to be measured (e.g. cuda:0, or cpu for the tracker)."""
        return self.backend.device

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def phases(self) -> dict[str, PhaseResult]:
        """The phases measured so far, in the order first opened."""
        return dict(self._results)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the block as phase `name`; the same name again keeps the maximum of the two."""
        __tracebackhide__ = True
        if not isinstance(name, str) or not name or name == CALL:
            raise GpuMemError(f"gpumem.phase() needs a non-empty name other than {CALL!r}, got {name!r}")
        if self._stack is None:
            raise GpuMemError(f"gpumem.phase({name!r}) works only while the test function of {self.nodeid} runs")
        if self._phase is not None:
            raise GpuMemError(f"gpumem.phase({name!r}) opened inside phase {self._phase!r}: phases cannot nest")
        stack = self._stack
        stack.push(name)
        self._phase = name
        try:
            yield
        except BaseException as exc:
            with contextlib.suppress(AttributeError):  # an exception class with __slots__
                exc._gpumem_phase = name  # type: ignore[attr-defined]
            raise
        finally:
            if self._stack is stack and self._phase == name:
                self._phase = None
                self._record(stack.pop())

    def fit(
        self,
        step: Callable[[int], object],
        sizes: Sequence[int],
        capacity: int | str,
        *,
        name: str = "fit",
        tolerance: float | None = None,
        slack: int | None = None,
        confirm: bool = False,
    ) -> BatchFit:
        """Run `step(n)` for each n in `sizes`, each in its own phase `name[i]`, fit peak = a + b*n exactly
        and return the largest n whose predicted peak fits `capacity` (see `pytest_gpumem.fit`)."""
        __tracebackhide__ = True
        from pytest_gpumem.fit import DEFAULT_SLACK, DEFAULT_TOLERANCE, fit_peaks

        self._fits += 1
        label = name if self._fits == 1 else f"{name}#{self._fits}"  # each fit's phases are its own
        counter = itertools.count()

        def measure(fn: Callable[[], object]) -> int:
            phase = f"{label}[{next(counter)}]"
            with self.phase(phase):
                fn()  # what the step returns is dropped inside the phase: freed before the next size
            return self._results[phase].peak_bytes

        found = fit_peaks(
            step,
            sizes,
            capacity,
            measure,
            tolerance=DEFAULT_TOLERANCE if tolerance is None else tolerance,
            slack=DEFAULT_SLACK if slack is None else slack,
            confirm=confirm,
        )
        self.info.setdefault("fits", []).append(found.describe())
        return found

    def check_gradients(
        self,
        model_or_named_tensors: torch.nn.Module | Mapping[str, torch.Tensor | None],
        *,
        rtol: float | None = None,
        atol: float | None = None,
    ) -> None:
        """Fingerprint the gradients now (a module's `.grad`; a dict's tensors are gradients themselves
        unless they are parameters), to compare with the stored baseline after the call; `rtol`/`atol`
        override the dtype's defaults. The fingerprint's own work is not measured."""
        __tracebackhide__ = True
        from pytest_gpumem.gradients import fingerprint

        if self._stack is None:
            raise GpuMemError(f"gpumem.check_gradients() works only while the test function of {self.nodeid} runs")
        for name, value in (("rtol", rtol), ("atol", atol)):
            if value is not None and not _finite_non_negative(value):
                raise GpuMemError(f"gpumem.check_gradients({name}=...) must be a finite number >= 0, got {value!r}")
        with self._stack.unmeasured():
            try:
                self.gradients = fingerprint(model_or_named_tensors)
            except (TypeError, ValueError) as exc:
                raise GpuMemError(f"gpumem.check_gradients(): {exc}") from None
        self.gradient_tolerance = (rtol, atol)

    def peak(self, name: str | None = None) -> int:
        """Peak bytes of phase `name` above its start, or of the whole call (so far) when `name` is None."""
        __tracebackhide__ = True
        return self.result(name).peak_bytes

    def result(self, name: str | None = None) -> PhaseResult:
        __tracebackhide__ = True
        if name is None or name == CALL:
            if self._call is not None:
                return self._call
            if self._stack is None or not self._stack.open:
                raise GpuMemError(f"the call of {self.nodeid} is measured only while its test function runs")
            return self._stack.peek(0)  # the call so far
        if name not in self._results:
            opened = ", ".join(self._results) or "none"
            raise GpuMemError(f"gpumem has no phase {name!r} in {self.nodeid} (phases measured: {opened})")
        return self._results[name]

    @property
    def has_call_result(self) -> bool:
        return self._call is not None

    def begin_call(self) -> None:
        """Start measuring the call; a rerun of the test starts from nothing (info set by fixtures stays)."""
        self._results, self._call, self.notes = {}, None, []
        self.gradients, self.gradient_tolerance = None, (None, None)
        self.survivors, self.trace, self._fits = [], None, 0
        self._stack = RegionStack(self.backend)
        self.backend.start()
        self._stack.push(CALL, full_collect=getattr(self.backend, "sees_earlier_allocations", True))

    def end_call(self) -> PhaseResult:
        stack = self._stack
        if stack is None:
            raise GpuMemError(f"gpumem: the call of {self.nodeid} was never begun")
        try:
            if self.leak_check:
                collect_garbage(True)  # what survives the call is what it leaves behind
            while len(stack.open) > 1:
                self._record(stack.pop())
            self._call = stack.pop()
            self._keep_evidence()
        finally:
            self._stack = None
            self._phase = None
            self.backend.stop()
            notes = getattr(self.backend, "notes", None)
            self.notes = list(notes()) if callable(notes) else []
        return self._call

    def _keep_evidence(self) -> None:
        """Read what the backend can tell about the call before it stops observing it."""
        survivors, trace = getattr(self.backend, "survivors", None), getattr(self.backend, "trace", None)
        if self.leak_check and callable(survivors) and self._call is not None and self._call.net_bytes > 0:
            self.survivors = survivors(SURVIVORS_SHOWN)
        self.trace = trace() if callable(trace) else None

    @staticmethod
    def phase_left_by(exc: BaseException) -> str | None:
        """The phase that `exc` propagated out of, if any (marked on the exception itself)."""
        phase = getattr(exc, "_gpumem_phase", None)
        return phase if isinstance(phase, str) else None

    def end_call_if_running(self) -> None:
        """End the call if it is still measured (after an error on the way out): the backend's
        observation must never outlive the test."""
        if self._stack is not None:
            self.end_call()

    def _record(self, result: PhaseResult) -> None:
        previous = self._results.get(result.name)
        self._results[result.name] = result if previous is None else previous.merged(result)
