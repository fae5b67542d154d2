"""The largest batch that fits: measure a step's peak at a few batch sizes, fit peak = a + b*n, extrapolate.

The peaks are absolute: the bytes allocated at the step's peak, everything already live when it began
(parameters, gradients, optimizer state) included, as the backend counts them (the tracker: what the
test's call made; CUDA: the device's allocated bytes). A batch "fits" when that predicted peak is within
the capacity, the same test the tracker's capacity applies when it raises OutOfMemoryError.

The fit is least squares in exact rational arithmetic (`Fraction`), so a workload whose peak is linear in
the batch size gives back its fixed and per-item bytes exactly and a residual of 0 bytes. A fit whose
largest residual is above the tolerance is refused: memory that is not linear in n (attention's n*n
scores, an allocator switching strategy) cannot be extrapolated from a line.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.sizes import format_size, is_binary, parse_size, shorten


@dataclass(frozen=True)
class Sample:
    """One run of the step, in bytes allocated as the backend counts them: when it began, at its peak and
    when it returned; `out_of_memory` when it raised OutOfMemoryError (the peak is then the one reached)."""

    start: int
    peak: int
    end: int
    out_of_memory: bool = False
    held: bool = False  # whether the backend held the run to a capacity (OutOfMemoryError past it)

    @property
    def left(self) -> int:
        """Bytes the run left allocated (state it created and kept: optimizer state, caches)."""
        return self.end - self.start


class Measure(Protocol):
    """Runs a callable once and returns its `Sample`; with `limit`, allocations past that many bytes
    raise OutOfMemoryError where the backend can enforce it (the sample then says out_of_memory)."""

    def __call__(self, fn: Callable[[], object], limit: int | None = None) -> Sample: ...


DEFAULT_TOLERANCE = 0.01
"""Largest residual accepted, as a fraction of the largest measured peak (plus `DEFAULT_SLACK`)."""

DEFAULT_SLACK = 4096
"""Bytes of residual always accepted (small allocations whose sizes do not follow n exactly)."""

MAX_BATCH = 2**31 - 1
"""The answer when the peak does not grow with n: every batch up to this fits; also the largest size."""


@dataclass(frozen=True)
class Check:
    """The step run again at a batch size under the capacity (`confirm=True`)."""

    size: int
    peak: int  # bytes allocated at its peak (the peak reached before it ran out, if it did)
    out_of_memory: bool
    enforced: bool  # whether the backend held the run to the capacity (else the peak is compared with it)

    def fits(self, capacity: int) -> bool:
        return not self.out_of_memory and self.peak <= capacity


@dataclass(frozen=True)
class BatchFit:
    """peak(n) = fixed + per_item * n fitted to measured absolute peaks, and the largest n within `capacity`."""

    sizes: tuple[int, ...]
    peaks: tuple[int, ...]  # bytes allocated at each size's peak, what was live before it included
    fixed: Fraction  # a: bytes independent of n, the `live` bytes included
    per_item: Fraction  # b: bytes per unit of n
    residual: int  # largest |measured - fitted| over the sizes, in bytes (rounded up)
    capacity: int
    largest: int | None  # the largest n whose predicted peak <= capacity; None if the smallest size does not fit
    predicted_peak: int | None  # the predicted peak at `largest` (rounded up)
    live: int = 0  # bytes allocated when the fit began
    left: tuple[int, ...] = ()  # bytes each size left allocated after it returned
    capacity_text: str | None = None  # the capacity as written, echoed in messages
    checks: tuple[Check, ...] = ()  # confirm=True: the answer, and the answer + 1

    @property
    def checked(self) -> bool:
        """Whether linearity was checked: a line through two distinct sizes always fits them."""
        return len(set(self.sizes)) >= 3

    @property
    def capped(self) -> bool:
        """Whether `largest` is MAX_BATCH because the peak does not grow fast enough to reach capacity."""
        return self.largest == MAX_BATCH

    @property
    def binary(self) -> bool:
        return self.capacity_text is None or is_binary(self.capacity_text)

    def size(self, n: int) -> str:
        """Bytes in the unit family the capacity was written in."""
        return format_size(n, binary=self.binary)

    def predict(self, n: int) -> Fraction:
        """The fitted absolute peak at batch size `n`, exact."""
        return self.fixed + self.per_item * n

    def formula(self) -> str:
        """'16.0 MiB + 64.0 MiB x n' (the coefficients rounded to bytes for display)."""
        a, b = round(self.fixed), round(self.per_item)
        sign = "-" if b < 0 else "+"
        return f"{self.size(a)} {sign} {self.size(abs(b))} x n"

    def quality(self) -> str:
        if not self.checked:
            return f"{len(set(self.sizes))} sizes, linearity unchecked"
        if self.residual == 0:
            return "fit exact"
        return f"largest residual {self.size(self.residual)}"

    def describe(self) -> str:
        """One line: the largest batch, its predicted peak (what was live included), the fitted line, how
        well it fits, and what confirming it found."""
        line = f"peak = {self.formula()}, {self.quality()}"
        cap = self.capacity_text or f"{self.capacity:,} B"
        counting = f"counting the {self.size(self.live)} allocated when the fit began"
        if self.largest is None:
            smallest = min(self.sizes)
            need = self.size(math.ceil(self.predict(smallest)))
            return f"no measured batch fits {cap}: the smallest, {smallest:,}, needs {need}, {counting} ({line})"
        assert self.predicted_peak is not None
        capped = f", capped at {MAX_BATCH:,}: the peak does not reach {cap}" if self.capped else ""
        peak = self.size(self.predicted_peak)
        confirmed = "".join(f"; {self._checked(check)}" for check in self.checks)
        return (
            f"largest batch that fits {cap}: {self.largest:,} (predicted peak {peak}, {counting}; "
            f"{line}{capped}){confirmed}"
        )

    def _checked(self, check: Check) -> str:
        if check.out_of_memory:
            return f"batch {check.size:,} ran out of memory after {self.size(check.peak)}"
        verb = "ran within the capacity" if check.enforced else "ran"
        return f"batch {check.size:,} {verb}, peak {self.size(check.peak)}"


def fit_peaks(
    step: Callable[[int], object],
    sizes: Iterable[int],
    capacity: int | str,
    measure: Measure,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    slack: int = DEFAULT_SLACK,
    confirm: bool = False,
) -> BatchFit:
    """Measure `step(n)` for each n in `sizes` with `measure`, fit a line to the absolute peaks, find the
    largest n whose predicted peak is within `capacity`.

    Raises GpuMemError (one line) on bad arguments, when the step keeps memory from one size to the next,
    and when the fit's largest residual exceeds `tolerance` x the largest peak + `slack` bytes. With
    `confirm`, `step` is run again at the answer and at the answer + 1 under the capacity (the backend
    raises OutOfMemoryError past it where it can): the answer must fit; the answer + 1 not fitting is
    reported. A peak that is the maximum of two lines (forward activations against backward gradients)
    looks linear on one side of their crossing and is refused there.
    """
    __tracebackhide__ = True
    checked_sizes = _check_sizes(sizes)
    limit = parse_size(capacity)
    _check_tolerance(tolerance, slack)
    if not isinstance(confirm, bool):
        raise GpuMemError(f"fit confirm= must be True or False, got {shorten(confirm)}")
    samples = []
    for n in checked_sizes:
        sample = _check_sample(measure(_bound(step, n)), n)
        if sample.out_of_memory:  # a measure that caught it: the step cannot run at a measured size
            raise GpuMemError(f"fit: the step ran out of memory at size {n:,}, after {format_size(sample.peak)}")
        samples.append(sample)
    fit = fit_samples(checked_sizes, samples, capacity, tolerance=tolerance, slack=slack)
    if confirm and fit.largest is not None and not fit.capped:
        checks = [_run_check(step, fit.largest, limit, measure)]
        if checks[0].fits(limit):
            checks.append(_run_check(step, fit.largest + 1, limit, measure))
        fit = BatchFit(**{**fit.__dict__, "checks": tuple(checks)})
        _confirm(fit)
    return fit


def _run_check(step: Callable[[int], object], n: int, capacity: int, measure: Measure) -> Check:
    __tracebackhide__ = True
    sample = _check_sample(measure(_bound(step, n), capacity), n)
    return Check(n, sample.peak, sample.out_of_memory, sample.held)


def _confirm(fit: BatchFit) -> None:
    """Refuse the answer when running it under the capacity ran out of memory or peaked past it."""
    check = fit.checks[0]
    if check.fits(fit.capacity):
        return
    cap = f"{fit.capacity:,} B" if fit.capacity_text is None else f"{fit.capacity_text} ({fit.capacity:,} B)"
    found = f"ran out of memory after {check.peak:,} B" if check.out_of_memory else f"peaked at {check.peak:,} B"
    raise GpuMemError(
        f"the line fitted at sizes {_ints(fit.sizes)} predicts batch {fit.largest:,} fits {cap} "
        f"with a peak of {fit.predicted_peak:,} B, but run under it the step {found}: "
        "the peak is not linear beyond the measured sizes; measure sizes nearer the answer"
    )


def fit_measured(
    sizes: Iterable[int],
    peaks: Sequence[int],
    capacity: int | str,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    slack: int = DEFAULT_SLACK,
) -> BatchFit:
    """`fit_peaks` for peaks already measured: `peaks[i]` is the absolute peak at batch size `sizes[i]`
    (nothing left behind between sizes)."""
    checked_sizes = _check_sizes(sizes)
    if isinstance(peaks, (str, bytes)) or not isinstance(peaks, Sequence) or len(peaks) != len(checked_sizes):
        count = len(peaks) if isinstance(peaks, Sequence) else shorten(peaks)
        raise GpuMemError(f"fit needs one peak per size: {len(checked_sizes)} sizes, {count} peaks")
    checked = [_check_peak(p, n) for n, p in zip(checked_sizes, peaks, strict=True)]
    samples = [Sample(0, p, 0) for p in checked]
    return fit_samples(checked_sizes, samples, capacity, tolerance=tolerance, slack=slack)


def fit_samples(
    sizes: Sequence[int],
    samples: Sequence[Sample],
    capacity: int | str,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    slack: int = DEFAULT_SLACK,
) -> BatchFit:
    """The line through the absolute peaks of `samples` (one per size, in the order they ran)."""
    limit = parse_size(capacity)
    _check_tolerance(tolerance, slack)
    peaks = [s.peak for s in samples]
    allowed = tolerance * max(peaks) + slack
    left = [s.left for s in samples]
    kept = [(n, b) for n, b in zip(sizes[1:], left[1:], strict=True) if b > allowed]
    if kept:
        raise GpuMemError(
            f"fit: the step keeps memory from one size to the next (size {kept[0][0]:,} left "
            f"{format_size(kept[0][1])} allocated after it returned; sizes {_ints(sizes)} left "
            f"{_ints(left)} B): each size's peak would include what earlier sizes kept; free it in the step"
        )
    a, b = least_squares(sizes, peaks)
    residual = math.ceil(max(abs(p - (a + b * n)) for n, p in zip(sizes, peaks, strict=True)))
    if residual > allowed:
        why = ""
        if left[0] > allowed:
            why = (
                f"; the first size left {format_size(left[0])} behind (optimizer state?): warm the step up "
                "first (run it once before the fit)"
            )
        raise GpuMemError(
            f"peak is not linear in the batch size, refusing to extrapolate: sizes {_ints(sizes)} "
            f"gave peaks {_ints(peaks)} B; the best line misses by {residual:,} B "
            f"(allowed {tolerance:g} x largest peak + {slack:,} B = {math.floor(allowed):,} B){why}"
        )
    largest = largest_fitting(a, b, limit, min(sizes))
    predicted = None if largest is None else math.ceil(a + b * largest)
    return BatchFit(
        tuple(sizes),
        tuple(peaks),
        a,
        b,
        residual,
        limit,
        largest,
        predicted,
        live=samples[0].start,
        left=tuple(left),
        capacity_text=capacity.strip() if isinstance(capacity, str) else None,
    )


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
    def run() -> object:
        __tracebackhide__ = True
        return step(n)

    return run


def _ints(values: Sequence[int]) -> str:
    return ", ".join(f"{v:,}" for v in values)


def _check_sizes(sizes: object) -> list[int]:
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise GpuMemError(f"fit sizes must be a list of positive integers, got {shorten(sizes)}")
    values: list[object] = list(sizes)
    checked = []
    for n in values:
        try:
            if isinstance(n, bool):
                raise TypeError
            size = operator.index(n)  # type: ignore[arg-type]  # int, numpy and torch integers
        except TypeError:
            raise GpuMemError(f"fit sizes must be positive integers, got {shorten(n)} in {shorten(values)}") from None
        if size <= 0 or size > MAX_BATCH:
            raise GpuMemError(
                f"fit sizes must be integers from 1 to {MAX_BATCH:,}, got {shorten(size, 32)} in {shorten(values)}"
            )
        checked.append(size)
    if len(set(checked)) < 2:
        raise GpuMemError(f"fit needs at least 2 distinct sizes (3 to check linearity), got {shorten(values)}")
    return checked


def _check_peak(peak: object, n: int) -> int:
    if isinstance(peak, bool) or not isinstance(peak, int) or peak < 0:
        raise GpuMemError(f"fit: the measured peak at size {n:,} must be an int >= 0 (bytes), got {shorten(peak)}")
    return peak


def _check_sample(sample: object, n: int) -> Sample:
    if not isinstance(sample, Sample):
        raise GpuMemError(f"fit: measuring size {n:,} must give a Sample, got {shorten(sample)}")
    for value in (sample.start, sample.peak, sample.end):
        _check_peak(value, n)
    return sample


def _check_tolerance(tolerance: float, slack: int) -> None:
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < math.inf:
        raise GpuMemError(f"fit tolerance must be a finite number >= 0, got {shorten(tolerance)}")
    if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
        raise GpuMemError(f"fit slack must be an int >= 0 (bytes), got {shorten(slack)}")
