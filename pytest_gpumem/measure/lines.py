"""A step's timeline as lines in the batch size: the bytes allocated after each event, fitted per event.

When a step makes the same allocations and frees at every batch size and only their sizes change, the
bytes allocated after its i-th event are a line in n, and its peak at n is the highest of those lines: the
optimizer step's at small batches, the backward's at large ones. One line through the peaks of a few sizes
cannot see the crossing (it has slope 0 where the constant part is the highest); a line per event can. The
arithmetic is in integers, so a step whose sizes are affine in n gives its peak at any size exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from pytest_gpumem.backends.timeline import Timeline

MAX_BATCH = 2**31 - 1
"""The largest batch size a fit measures or answers."""


@dataclass(frozen=True, eq=False)
class Lines:
    """bytes_i(n) = base[i] + rise[i] * (n - low) / span for each event i, through the bytes at the smallest
    size `low` and at the largest, `low + span`; `residual` is the largest distance (bytes, rounded up) of
    any other size's bytes from its event's line: 0 when every event is exactly affine in n."""

    sizes: tuple[int, ...]  # the sizes fitted
    low: int
    span: int
    base: tuple[int, ...]
    rise: tuple[int, ...]
    residual: int
    timeline: Timeline  # the smallest size's: what made each event

    @property
    def exact(self) -> bool:
        """Whether a third size showed every event exactly on its line (two sizes always are)."""
        return self.residual == 0 and len(set(self.sizes)) >= 3

    @property
    def grows(self) -> bool:
        """Whether any event's bytes grow with n (else no size makes the peak reach a capacity)."""
        return any(r > 0 for r in self.rise)

    def at(self, n: int) -> Fraction:
        """The peak at batch size `n`: the highest event's bytes."""
        return Fraction(self._scaled(self.top(n), n), self.span)

    def peak(self, n: int) -> int:
        """The peak at batch size `n` in whole bytes (rounded up)."""
        return -(-self._scaled(self.top(n), n) // self.span)

    def top(self, n: int) -> int:
        """The index of the event whose bytes are the highest at `n` (the first of equals)."""
        scaled = [b * self.span + r * (n - self.low) for b, r in zip(self.base, self.rise, strict=True)]
        return max(range(len(scaled)), key=scaled.__getitem__)

    def largest_within(self, capacity: int) -> int | None:
        """The largest n >= 1 whose peak is at most `capacity` (MAX_BATCH at most; only if `grows`), or None
        when no n does."""
        bounds = [
            self.low + (capacity - b) * self.span // r for b, r in zip(self.base, self.rise, strict=True) if r > 0
        ]
        largest = min(min(bounds), MAX_BATCH)
        if largest < 1 or self.at(largest) > capacity:
            return None  # an event that shrinks with n is above the capacity below `largest` too
        return largest

    def _scaled(self, index: int, n: int) -> int:
        return self.base[index] * self.span + self.rise[index] * (n - self.low)


def fit_lines(sizes: Sequence[int], timelines: Sequence[Timeline]) -> Lines:
    """The lines through the timelines of `sizes` (distinct sizes, timelines with the same ops)."""
    order = sorted(range(len(sizes)), key=sizes.__getitem__)
    first, last = order[0], order[-1]
    low, span = sizes[first], sizes[last] - sizes[first]
    base = timelines[first].allocated
    rise = tuple(y - b for y, b in zip(timelines[last].allocated, base, strict=True))
    worst = 0
    for k in order[1:-1]:
        offset = sizes[k] - low
        for y, b, r in zip(timelines[k].allocated, base, rise, strict=True):
            worst = max(worst, abs(y * span - b * span - r * offset))
    return Lines(tuple(sizes), low, span, base, rise, -(-worst // span), timelines[first])
