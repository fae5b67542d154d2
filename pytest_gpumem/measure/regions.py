"""Open regions (the whole call, the phases in it) over one backend, with the peak folding that lets
them nest, and the mark an exception carries of the phase it left.

A backend has a single resettable peak (like the CUDA allocator). Before every reset the peak so far is
folded into each open region's running maximum; a region's peak is then its maximum minus what was
allocated when it opened.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pytest_gpumem.backends.base import Backend, Counters, collect_garbage
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.results import PhaseResult, split_rank

if TYPE_CHECKING:
    from pytest_gpumem.backends.tracker.attribution import Attributor

_PHASE_MARK = "_gpumem_phase"


@dataclass
class Region:
    name: str
    start: Counters
    high: Counters


class RegionStack:
    """Open regions over one backend; an attributor (when the peaks are explained) is told where each
    region begins and ends."""

    def __init__(self, backend: Backend, attribution: Attributor | None = None) -> None:
        self.backend = backend
        self.attribution = attribution
        self.open: list[Region] = []

    def push(self, name: str, full_collect: bool = False) -> None:
        _refuse_rank_name(name)
        collect_garbage(full_collect)
        self.backend.settle()
        self._fold()
        self.backend.reset_peak()
        now = self.backend.current()
        self.open.append(Region(name, now, now))
        if self.attribution is not None:
            self.attribution.open_region(name)

    def pop(self) -> PhaseResult:
        result = self.peek(len(self.open) - 1)
        self.open.pop()
        if self.attribution is not None:
            self.attribution.close_region()
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
    def unmeasured(self, by: str = "") -> Iterator[None]:
        """Run a block whose transient allocations must not count (`by` names what runs, for the
        explanation's timeline): the peak so far is folded into the open regions first and reset to the
        current value afterwards."""
        self.backend.settle()
        self._fold()
        if self.attribution is not None:
            self.attribution.pause(by)
        try:
            yield
        finally:
            self.backend.settle()
            self.backend.reset_peak()
            if self.attribution is not None:
                self.attribution.resume()

    def _fold(self) -> None:
        peak = self.backend.peak()
        for region in self.open:
            region.high = region.high.max(peak)


def _refuse_rank_name(name: str) -> None:
    """A region named `NAME@rankN` would be read as rank N's phase NAME in every report, file and
    baseline (`split_rank`): the name is refused where it is chosen, not escaped everywhere it is read."""
    base, rank = split_rank(name)
    if rank is not None:
        raise GpuMemError(
            f"phase name {name!r} reads as rank {rank}'s phase {base!r} ('@rank' and a number end the "
            "phases of gpumem.distributed ranks): choose another name"
        )


def mark_phase(exc: BaseException, name: str) -> None:
    """Mark `exc` as having propagated out of phase `name`."""
    with contextlib.suppress(AttributeError):  # an exception class with __slots__
        setattr(exc, _PHASE_MARK, name)


def phase_left_by(exc: BaseException) -> str | None:
    """The phase that `exc` propagated out of, if any."""
    phase = getattr(exc, _PHASE_MARK, None)
    return phase if isinstance(phase, str) else None
