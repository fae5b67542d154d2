"""What a fit's sampled sizes say of larger ones: each run's peak and largest single allocation
extrapolated, to guess the answer and bound what a run asks of the host."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from pytest_gpumem.measure.fit import MAX_BATCH, Sample


@dataclass(frozen=True)
class SampledGrowth:
    """What the sampled sizes say of larger ones, to guess the answer and bound what a run asks of the
    host: each of a run's peak and its largest single allocation extrapolated to n as the higher of the
    line through the two largest sampled sizes and the polynomial through the three largest (a step that
    makes n x n tensors grows as n squared: a line through its peaks would put a run at terabytes)."""

    sizes: tuple[int, ...]  # the sampled sizes, ascending and distinct
    peaks: tuple[int, ...]  # the peak at each
    allocations: tuple[int, ...]  # the largest single allocation at each (its peak's rise where not recorded)

    def peak(self, n: int, curve: bool = True) -> int:
        return _extrapolate(self.sizes, self.peaks, n, curve)

    def asks(self, n: int, capacity: int) -> int:
        """Bytes a run of size n held to `capacity` may take: its peak, or the capacity and the
        allocation that passes it (the tracker raises once the allocation is made)."""
        return min(self.peak(n), capacity + _extrapolate(self.sizes, self.allocations, n))

    def reach(self, capacity: int, curve: bool = True) -> int:
        """The largest size whose extrapolated peak is within the capacity (1 to MAX_BATCH); `curve=False`:
        by the line alone (reserved bytes, whose segments make any three sizes a curve)."""
        good, bad = 0, 1
        while bad < MAX_BATCH and self.peak(bad, curve) <= capacity:
            good, bad = bad, min(2 * bad, MAX_BATCH)
        if self.peak(bad, curve) <= capacity:
            return MAX_BATCH
        while bad - good > 1:
            middle = (good + bad) // 2
            good, bad = (middle, bad) if self.peak(middle, curve) <= capacity else (good, middle)
        return max(good, 1)


def _extrapolate(sizes: Sequence[int], values: Sequence[int], n: int, curve: bool = True) -> int:
    """The higher of the line through the last two (size, value) points and (with `curve`) the polynomial
    through the last three, at n, in whole bytes (a single point: its value)."""
    if len(sizes) < 2:
        return values[-1]
    (a, b), (ya, yb) = sizes[-2:], values[-2:]
    line = Fraction(yb) + Fraction(yb - ya, b - a) * (n - b)
    if not curve:
        return max(math.ceil(line), 0)
    points = list(zip(sizes[-3:], values[-3:], strict=True))
    polynomial = sum(
        (Fraction(y) * math.prod(Fraction(n - x, xi - x) for x, _ in points if x != xi) for xi, y in points),
        Fraction(0),
    )
    return max(math.ceil(max(line, polynomial)), 0)


def growth_of(sizes_run: Sequence[int], samples: Sequence[Sample]) -> SampledGrowth:
    """The sampled sizes' peaks and largest allocations, the largest run of each size kept."""
    by_size: dict[int, Sample] = {}
    for n, sample in zip(sizes_run, samples, strict=True):
        if n not in by_size or sample.peak > by_size[n].peak:
            by_size[n] = sample
    sizes = sorted(by_size)
    peaks = tuple(by_size[n].peak for n in sizes)
    allocations = tuple(_largest_allocation(by_size[n]) for n in sizes)
    rises = tuple(by_size[n].peak - by_size[n].start for n in sizes)
    single = rises if None in allocations else allocations
    return SampledGrowth(tuple(sizes), peaks, tuple(int(a or 0) for a in single))


def _largest_allocation(sample: Sample) -> int | None:
    """The largest rise of the sample's timeline from one event to the next (None without one)."""
    timeline = sample.timeline
    if timeline is None or not len(timeline):
        return None
    before = (sample.start, *timeline.allocated[:-1])
    return max(after - earlier for earlier, after in zip(before, timeline.allocated, strict=True))
