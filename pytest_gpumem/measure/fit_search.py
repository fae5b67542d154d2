"""How a fit finds its answer: sample the step, fit a line per timeline event where the ops are the same
at every size, else search with runs held to the capacity; confirm where a run is cheap.

Order of work, each step one line here: sample the sizes (the first again if it left state behind, as a
warm-up); fit the lines through the timelines of the sizes that make the largest's ops; where no event
grows, sample twice the largest until one does; answer from the lines and run the answer and the next size
held to the capacity; where the lines cannot answer, or their answer did not hold, search: double from
the largest size that fits until one does not, then bisect. An answer is always a size shown to fit,
except where runs cannot be made (`runs_refused`): the lines' answer is then given as not confirmed.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from pytest_gpumem.backends.timeline import Timeline
from pytest_gpumem.cards import parse_capacity
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.measure.fit import MAX_BATCH, BatchFit, Check, Found, Measure, Sample, integers
from pytest_gpumem.measure.lines import Lines, fit_lines
from pytest_gpumem.sizes import format_size, shorten

FIT_CAPACITY = "gpumem.fit(capacity=...)"  # how its errors name the argument

DEFAULT_TOLERANCE = 0.01
"""Largest distance of a size's bytes from its event's line accepted, as a fraction of the largest peak
(plus `DEFAULT_SLACK`); beyond it the answer is searched. It also bounds what a size may leave allocated."""

DEFAULT_SLACK = 4096
"""Bytes always accepted (small allocations whose sizes do not follow n exactly)."""

FLAT_REACH = 1024
"""How many times the largest size given a step whose peak does not grow is sampled up to, before it is
refused: tensors the meter does not count (on another device) must not be made at billions of rows."""


@dataclass
class _Fit:
    """One fit under way: the step, how to measure it, the capacity and the runs made so far."""

    step: Callable[[int], object]
    measure: Measure
    capacity: int
    runs_refused: str | None  # why runs at the sizes the capacity allows cannot be made here; None: they can
    allowed: int = 0  # bytes a size may leave allocated, and a line may miss by
    given: int = 0  # the largest size the caller gave
    sizes: list[int] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    def sample(self, n: int, limit: int | None = None) -> Sample:
        __tracebackhide__ = True
        sample = _check_sample(self.measure(_bound(self.step, n), limit), n)
        if sample.out_of_memory and limit is None:
            raise GpuMemError(f"fit: the step ran out of memory at size {n:,}, after {format_size(sample.peak)}")
        return sample

    def fits(self, n: int) -> bool:
        """Run size `n` held to the capacity: whether it fits. Where the peaks are of reserved bytes, the
        size runs twice and the second run is judged: a training loop's steps start where the step before
        left the cache, and where its state (the gradients) sits in the segments changes what is reserved."""
        __tracebackhide__ = True
        first = self.sample(n, self.capacity) if self.samples[0].reserved else None
        if first is not None and first.out_of_memory:
            self.checks.append(Check(n, first.peak, True, first.held, first.place()))
            return False
        sample = self.sample(n, self.capacity)
        check = Check(n, sample.peak, sample.out_of_memory, sample.held, sample.place())
        self.checks.append(check)
        return check.fits(self.capacity)

    def result(self, base: BatchFit, answer: int | None, peak: int, **found: object) -> BatchFit:
        return replace(
            base,
            sizes=tuple(self.sizes),
            peaks=tuple(s.peak for s in self.samples),
            left=tuple(s.left for s in self.samples),
            checks=tuple(self.checks),
            largest=answer,
            peak_bytes=peak,
            **found,  # type: ignore[arg-type]
        )


def fit_peaks(
    step: Callable[[int], object],
    sizes: Iterable[int],
    capacity: int | str,
    measure: Measure,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    slack: int = DEFAULT_SLACK,
    confirm: bool = True,
    runs_refused: str | None = None,
) -> BatchFit:
    """Measure `step(n)` for each n in `sizes` with `measure` and find the largest n whose absolute peak is
    within `capacity` (see the module's order of work).

    `confirm` runs the answer and the next size held to the capacity; `runs_refused` says why no run at
    the sizes the capacity allows can be made here (the lines' answer is then not confirmed). Raises
    GpuMemError (one line) on bad arguments, when the step keeps memory from one size to the next, and
    where the answer needs runs that cannot be made.
    """
    __tracebackhide__ = True
    checked = _check_sizes(sizes)
    judged = parse_capacity(capacity, FIT_CAPACITY)
    limit = judged.bytes
    _check_tolerance(tolerance, slack)
    if not isinstance(confirm, bool):
        raise GpuMemError(f"fit confirm= must be True or False, got {shorten(confirm)}")
    fit = _Fit(step, measure, limit, runs_refused, given=max(checked))
    for n in checked:
        fit.sizes.append(n)
        fit.samples.append(fit.sample(n))
    fit.allowed = round(tolerance * max(s.peak for s in fit.samples)) + slack
    warm_up = _warm_up(fit)
    text = capacity.strip() if isinstance(capacity, str) else None
    base = BatchFit((), (), limit, None, 0, Found.TIMELINE, False, fit.samples[0].start, (), text, warm_up=warm_up)
    base = replace(base, reserved=fit.samples[0].reserved, card=judged if judged.on_a_card else None)
    lines, note = _lines(fit)
    while lines is not None and not lines.grows:
        lines, note = _sample_larger(fit)
    if lines is None:
        return _searched(fit, base, note)
    return _from_lines(fit, replace(base, lines=lines, note=note), lines, confirm)


def _warm_up(fit: _Fit) -> int:
    """Run the first size again when it left state behind (optimizer state, caches, the cuBLAS workspaces
    of its first matmuls), and always where the peaks are of reserved bytes (a training loop's steps run
    on the cache and the workspaces the first step left); refuse a step that keeps memory from one size to
    the next. Returns the bytes the first run left where they made it run again."""
    __tracebackhide__ = True
    first = fit.samples[0].left
    again = first > fit.allowed or (fit.samples[0].reserved and first > 0)
    if again:
        fit.samples[0] = fit.sample(fit.sizes[0])
    left = [s.left for s in fit.samples]
    kept = [(n, b) for n, b in zip(fit.sizes, left, strict=True) if b > fit.allowed]
    if kept:
        raise GpuMemError(
            f"fit: the step keeps memory from one size to the next (size {kept[0][0]:,} left "
            f"{format_size(kept[0][1])} allocated after it returned; sizes {integers(fit.sizes)} left "
            f"{integers(left)} B): each size's peak would include what earlier sizes kept; free it in the step"
        )
    return first if again else 0


def _lines(fit: _Fit) -> tuple[Lines | None, str]:
    """The lines through the timelines of the sizes that make the largest size's ops, and which sizes make
    others; None and why, where they cannot answer."""
    timelines: list[Timeline] = []
    for sample, n in zip(fit.samples, fit.sizes, strict=True):
        if sample.timeline is None:
            return None, "the backend records no timeline"
        if sample.timeline.peak() != sample.peak:
            return None, f"the timeline of size {n:,} misses its peak"
        timelines.append(sample.timeline)
    largest = max(range(len(fit.sizes)), key=fit.sizes.__getitem__)
    same = [i for i, t in enumerate(timelines) if t.same_ops(timelines[largest])]
    other = next((i for i in range(len(timelines)) if i not in same), None)
    note = "" if other is None else _differ(timelines, fit.sizes, other, largest)
    if len({fit.sizes[i] for i in same}) < 2:
        return None, note
    lines = fit_lines([fit.sizes[i] for i in same], [timelines[i] for i in same])
    if lines.residual > fit.allowed:
        return None, f"the sizes' bytes are not lines in n: off by up to {format_size(lines.residual)}"
    return lines, note


def _differ(timelines: Sequence[Timeline], sizes: Sequence[int], other: int, largest: int) -> str:
    first, last = timelines[other], timelines[largest]
    i = first.first_difference(last)
    ops = [t.ops[i] if i < len(t) else "the end" for t in (first, last)]
    return f"size {sizes[other]:,} takes other ops than {sizes[largest]:,} from event {i:,}: {ops[0]} for {ops[1]}"


def _sample_larger(fit: _Fit) -> tuple[Lines | None, str]:
    """No event grew with n over the sizes sampled: sample twice the largest, held to the capacity."""
    __tracebackhide__ = True
    largest = max(fit.sizes)
    if largest >= min(MAX_BATCH, FLAT_REACH * fit.given):
        raise GpuMemError(
            f"fit: the step's peak does not grow with the batch size ({format_size(fit.samples[0].peak)} from size "
            f"{min(fit.sizes):,} to {largest:,}): does step(n) use n, and make its tensors on the measured device?"
        )
    if fit.runs_refused is not None:
        raise GpuMemError(
            f"fit: the step's peak does not grow over sizes {integers(fit.sizes)} and larger sizes cannot be run "
            f"here ({fit.runs_refused}): measure larger sizes"
        )
    n = min(2 * largest, MAX_BATCH)
    sample = fit.sample(n, fit.capacity)
    if sample.out_of_memory or sample.peak > fit.capacity:
        fit.checks.append(Check(n, sample.peak, sample.out_of_memory, sample.held, sample.place()))
        return None, f"the peak did not grow up to size {largest:,}"
    fit.sizes.append(n)
    fit.samples.append(sample)
    return _lines(fit)


def _from_lines(fit: _Fit, base: BatchFit, lines: Lines, confirm: bool) -> BatchFit:
    __tracebackhide__ = True
    answer = lines.largest_within(fit.capacity)
    shown = 1 if answer is None else answer
    at = lines.timeline.place(lines.top(shown))
    found = fit.result(base, answer, lines.peak(shown), at=at)
    if not confirm or fit.runs_refused is not None:
        return replace(found, unconfirmed="confirm=False" if not confirm else str(fit.runs_refused))
    if _confirmed(fit, answer):
        check = next(c for c in fit.checks if c.size == shown)
        if check.out_of_memory:  # batch 1, which the lines say needs more than the capacity
            return fit.result(found, answer, found.peak_bytes, confirmed=True)
        return fit.result(found, answer, check.peak, at=check.at or at, confirmed=True)
    held = "none fits" if answer is None else f"{answer:,} fits"
    return _searched(fit, base, f"the timelines' answer, {held}, did not hold when run")


def _confirmed(fit: _Fit, answer: int | None) -> bool:
    __tracebackhide__ = True
    if answer is None:
        return not fit.fits(1)
    return fit.fits(answer) and (answer == MAX_BATCH or not fit.fits(answer + 1))


def _searched(fit: _Fit, base: BatchFit, why: str) -> BatchFit:
    """The answer from runs held to the capacity: double from the largest size known to fit until one
    does not, then bisect."""
    __tracebackhide__ = True
    if fit.runs_refused is not None:
        raise GpuMemError(f"fit: {why}, so the answer must be searched with real runs, but {fit.runs_refused}")
    known = [(n, s.peak <= fit.capacity) for n, s in zip(fit.sizes, fit.samples, strict=True)]
    known += [(c.size, c.fits(fit.capacity)) for c in fit.checks]
    good = max((n for n, ok in known if ok), default=0)
    bad = min((n for n, ok in known if not ok and n > good), default=None)
    while bad is None and good < MAX_BATCH:
        n = min(2 * max(good, 1), MAX_BATCH)
        good, bad = (n, None) if fit.fits(n) else (good, n)
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fit.fits(middle) else (good, middle)
    return _shown(fit, base, good or None, why)


def _shown(fit: _Fit, base: BatchFit, answer: int | None, why: str) -> BatchFit:
    """The searched answer with the peak of its run (a sampled size's, or a run held to the capacity)."""
    __tracebackhide__ = True
    shown = 1 if answer is None else answer
    run = next((c for c in reversed(fit.checks) if c.size == shown), None)
    if run is None and shown in fit.sizes:
        sample = fit.samples[fit.sizes.index(shown)]
        peak, at = sample.peak, sample.place()
    else:
        if run is None:
            fit.fits(shown)
            run = fit.checks[-1]
        peak, at = run.peak, run.at
    return fit.result(base, answer, peak, at=at, found=Found.SEARCH, confirmed=True, note=why)


def _bound(step: Callable[[int], object], n: int) -> Callable[[], object]:
    def run() -> object:
        __tracebackhide__ = True
        return step(n)

    return run


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
        raise GpuMemError(f"fit needs at least 2 distinct sizes (3 to check the lines), got {shorten(values)}")
    return checked


def _check_sample(sample: object, n: int) -> Sample:
    if not isinstance(sample, Sample):
        raise GpuMemError(f"fit: measuring size {n:,} must give a Sample, got {shorten(sample)}")
    for value in (sample.start, sample.peak, sample.end):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise GpuMemError(f"fit: the measured bytes at size {n:,} must be ints >= 0, got {shorten(value)}")
    return sample


def _check_tolerance(tolerance: float, slack: int) -> None:
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < float("inf"):
        raise GpuMemError(f"fit tolerance must be a finite number >= 0, got {shorten(tolerance)}")
    if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
        raise GpuMemError(f"fit slack must be an int >= 0 (bytes), got {shorten(slack)}")
