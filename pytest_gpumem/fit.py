"""The largest batch that fits: measure a step's peak at a few batch sizes, fit peak = a + b*n, extrapolate.

The fit is least squares in exact rational arithmetic (`Fraction`), so a workload whose peak is linear in
the batch size gives back its fixed and per-item bytes exactly and a residual of 0 bytes. A fit whose
largest residual is above the tolerance is refused: memory that is not linear in n (attention's n*n
scores, an allocator switching strategy) cannot be extrapolated from a line.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.sizes import format_size, parse_size, shorten

Measure = Callable[[Callable[[], object]], int]
"""Runs a callable once and returns the peak bytes it allocated above what existed when it began."""

DEFAULT_TOLERANCE = 0.01
"""Largest residual accepted, as a fraction of the largest measured peak (plus `DEFAULT_SLACK`)."""

DEFAULT_SLACK = 4096
"""Bytes of residual always accepted (small allocations whose sizes do not follow n exactly)."""

MAX_BATCH = 2**31 - 1
"""The answer when the peak does not grow with n: every batch up to this fits."""


@dataclass(frozen=True)
class BatchFit:
    """peak(n) = fixed + per_item * n fitted to measured peaks, and the largest n within `capacity`."""

    sizes: tuple[int, ...]
    peaks: tuple[int, ...]
    fixed: Fraction  # a: bytes independent of n
    per_item: Fraction  # b: bytes per unit of n
    residual: int  # largest |measured - fitted| over the sizes, in bytes (rounded up)
    capacity: int
    largest: int | None  # the largest n whose predicted peak <= capacity; None if the smallest size does not fit
    predicted_peak: int | None  # the predicted peak at `largest` (rounded up)

    @property
    def checked(self) -> bool:
        """Whether linearity was checked: a line through two distinct sizes always fits them."""
        return len(set(self.sizes)) >= 3

    @property
    def capped(self) -> bool:
        """Whether `largest` is MAX_BATCH because the peak does not grow fast enough to reach capacity."""
        return self.largest == MAX_BATCH

    def predict(self, n: int) -> Fraction:
        """The fitted peak at batch size `n`, exact."""
        return self.fixed + self.per_item * n

    def formula(self) -> str:
        """'16.0 MiB + 64.0 MiB x n' (the coefficients rounded to bytes for display)."""
        a, b = round(self.fixed), round(self.per_item)
        sign = "-" if b < 0 else "+"
        return f"{format_size(a)} {sign} {format_size(abs(b))} x n"

    def quality(self) -> str:
        if not self.checked:
            return f"{len(set(self.sizes))} sizes, linearity unchecked"
        if self.residual == 0:
            return "fit exact"
        return f"largest residual {format_size(self.residual)}"

    def describe(self) -> str:
        """One line: the largest batch, its predicted peak, the fitted line and how well it fits."""
        line = f"peak = {self.formula()}, {self.quality()}"
        cap = format_size(self.capacity)
        if self.largest is None:
            smallest = min(self.sizes)
            need = format_size(math.ceil(self.predict(smallest)))
            return f"no measured batch fits {cap}: the smallest, {smallest:,}, needs {need} ({line})"
        assert self.predicted_peak is not None
        capped = f", capped at {MAX_BATCH:,}: the peak does not reach {cap}" if self.capped else ""
        peak = format_size(self.predicted_peak)
        return f"largest batch that fits {cap}: {self.largest:,} (predicted peak {peak}; {line}{capped})"


def fit_peaks(
    step: Callable[[int], object],
    sizes: Sequence[int],
    capacity: int | str,
    measure: Measure,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    slack: int = DEFAULT_SLACK,
    confirm: bool = False,
) -> BatchFit:
    """Measure the peak of `step(n)` for each n in `sizes` with `measure`, fit a line, find the largest n.

    Raises GpuMemError (one line) on bad arguments and when the fit's largest residual exceeds
    `tolerance` x the largest peak + `slack` bytes. With `confirm`, `step` is also measured at the
    answer (unless it is None or MAX_BATCH): a peak that is the maximum of two lines (forward activations
    against backward gradients) looks linear on one side of their crossing and is refused there.
    """
    checked_sizes = _check_sizes(sizes)
    limit = parse_size(capacity)
    _check_tolerance(tolerance, slack)
    peaks = [_check_peak(measure(_bound(step, n)), n) for n in checked_sizes]
    fit = fit_measured(checked_sizes, peaks, limit, tolerance=tolerance, slack=slack)
    if confirm and fit.largest is not None and not fit.capped:
        _confirm(fit, _check_peak(measure(_bound(step, fit.largest)), fit.largest))
    return fit


def _confirm(fit: BatchFit, measured: int) -> None:
    """Refuse the answer when the peak measured at it exceeds the capacity."""
    if measured > fit.capacity:
        raise GpuMemError(
            f"the line fitted at sizes {_ints(fit.sizes)} predicts batch {fit.largest:,} fits "
            f"{fit.capacity:,} B with a peak of {fit.predicted_peak:,} B, but its measured peak is {measured:,} B: "
            "the peak is not linear beyond the measured sizes; measure sizes nearer the answer"
        )


def fit_measured(
    sizes: Sequence[int],
    peaks: Sequence[int],
    capacity: int | str,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    slack: int = DEFAULT_SLACK,
) -> BatchFit:
    """`fit_peaks` for peaks already measured: `peaks[i]` is the peak at batch size `sizes[i]`."""
    checked_sizes = _check_sizes(sizes)
    if len(peaks) != len(checked_sizes):
        raise GpuMemError(f"fit needs one peak per size: {len(checked_sizes)} sizes, {len(peaks)} peaks")
    checked_peaks = [_check_peak(p, n) for n, p in zip(checked_sizes, peaks, strict=True)]
    limit = parse_size(capacity)
    _check_tolerance(tolerance, slack)
    a, b = least_squares(checked_sizes, checked_peaks)
    residual = math.ceil(max(abs(p - (a + b * n)) for n, p in zip(checked_sizes, checked_peaks, strict=True)))
    allowed = tolerance * max(checked_peaks) + slack
    if residual > allowed:
        raise GpuMemError(
            f"peak is not linear in the batch size, refusing to extrapolate: sizes {_ints(checked_sizes)} "
            f"gave peaks {_ints(checked_peaks)} B; the best line misses by {residual:,} B "
            f"(allowed {tolerance:g} x largest peak + {slack:,} B = {math.floor(allowed):,} B)"
        )
    largest = largest_fitting(a, b, limit, min(checked_sizes))
    predicted = None if largest is None else math.ceil(a + b * largest)
    return BatchFit(tuple(checked_sizes), tuple(checked_peaks), a, b, residual, limit, largest, predicted)


def least_squares(xs: Sequence[int], ys: Sequence[int]) -> tuple[Fraction, Fraction]:
    """(a, b) minimising sum (y - a - b x)^2, exact; needs at least two distinct xs."""
    count, sx, sy = len(xs), sum(xs), sum(ys)
    sxx = sum(x * x for x in xs)
    sxy = sum(x * y for x, y in zip(xs, ys, strict=True))
    b = Fraction(count * sxy - sx * sy, count * sxx - sx * sx)
    a = (sy - b * sx) / count
    return a, b


def largest_fitting(a: Fraction, b: Fraction, capacity: int, smallest: int) -> int | None:
    """The largest n >= `smallest` with a + b*n <= capacity (MAX_BATCH at most), or None if none."""
    if a + b * smallest > capacity:
        return None
    if b <= 0:
        return MAX_BATCH
    return min(math.floor((capacity - a) / b), MAX_BATCH)


def _bound(step: Callable[[int], object], n: int) -> Callable[[], object]:
    return lambda: step(n)


def _ints(values: Sequence[int]) -> str:
    return ", ".join(f"{v:,}" for v in values)


def _check_sizes(sizes: Sequence[int]) -> list[int]:
    values = list(sizes)
    for n in values:
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise GpuMemError(f"fit sizes must be positive integers, got {shorten(n)} in {shorten(values)}")
    if len(set(values)) < 2:
        raise GpuMemError(f"fit needs at least 2 distinct sizes (3 to check linearity), got {shorten(values)}")
    return values


def _check_peak(peak: object, n: int) -> int:
    if isinstance(peak, bool) or not isinstance(peak, int) or peak < 0:
        raise GpuMemError(f"fit: the measured peak at size {n:,} must be an int >= 0 (bytes), got {shorten(peak)}")
    return peak


def _check_tolerance(tolerance: float, slack: int) -> None:
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < math.inf:
        raise GpuMemError(f"fit tolerance must be a finite number >= 0, got {shorten(tolerance)}")
    if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
        raise GpuMemError(f"fit slack must be an int >= 0 (bytes), got {shorten(slack)}")
