"""How a fit finds its answer: sample the step, fit a line per timeline event where the ops are the same
at every size, then show the answer with training loops held to the capacity.

Order of work, each step one line here: sample the sizes (the first again if it left state behind, as a
warm-up); fit the lines through the timelines of the sizes that make the largest's ops; where no event
grows, sample twice the largest until one does; guess the answer (the lines', else where the sampled
peaks extrapolated reach the capacity); run a loop of `LOOP_STEPS` steps at the guess held to the capacity,
from the state the fit began with (optimizer state the fit's runs made is forgotten first, so that the
loop's first step makes it among its own activations, as a fresh process's does); gallop up or down from
the guess until a size's loop runs and the next size's runs out, then bisect. Where the backend serves
with a model of the caching allocator without expandable segments, the answer with them is found too:
where the two differ, fragmentation decided the answer. The answer is always shown by a loop that ran
and one at the next size that ran out, except where runs cannot be made (`runs_refused`): the lines'
answer is then given as not confirmed. On the CPU, a run that the sampled sizes extrapolated put past
what the host can give is refused before it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from cuda_allocator_model import format_size, parse_capacity, shorten
from pytest_gpumem.backends.base import Backend
from pytest_gpumem.backends.timeline import Timeline
from pytest_gpumem.errors import GpuMemError, from_the_model
from pytest_gpumem.measure.fit import LOOP_STEPS, MAX_BATCH, BatchFit, Found, Measure, integers
from pytest_gpumem.measure.fit_arguments import check_sizes, check_step, check_tolerance
from pytest_gpumem.measure.fit_growth import growth_of
from pytest_gpumem.measure.fit_runs import Fit, bound_step
from pytest_gpumem.measure.host import HOST_SHARE, host_available
from pytest_gpumem.measure.lines import Lines, fit_lines

FIT_CAPACITY = "gpumem.fit(capacity=...)"  # how its errors name the argument

DEFAULT_TOLERANCE = 0.01
"""Largest distance of a size's bytes from its event's line accepted, as a fraction of the largest peak
(plus `DEFAULT_SLACK`); beyond it the lines do not answer. It also bounds what a size may leave allocated."""

DEFAULT_SLACK = 4096
"""Bytes always accepted (small allocations whose sizes do not follow n exactly)."""

_FLAT_REACH = 1024
"""How many times the largest size given a step whose peak does not grow is sampled up to, before it is
refused: tensors the meter does not count (on another device) must not be made at billions of rows."""


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
    backend: Backend | None = None,
) -> BatchFit:
    """Measure `step(n)` for each n in `sizes` with `measure` and find the largest n whose loop of
    `LOOP_STEPS` steps runs within `capacity` (see the module's order of work).

    `confirm` runs loops at the lines' answer and the next size held to the capacity; `runs_refused` says
    why no run at the sizes the capacity allows can be made here (the lines' answer is then not
    confirmed); `backend`, the one `measure` runs on, bounds the runs by the host's memory on the CPU and
    finds the answer with expandable segments too. Raises GpuMemError (one line) on bad arguments, when
    the step keeps memory from one size to the next, and where the answer needs runs that cannot be made.
    """
    __tracebackhide__ = True
    check_step(step)
    checked = check_sizes(sizes)
    with from_the_model():
        judged = parse_capacity(capacity, FIT_CAPACITY)
    check_tolerance(tolerance, slack)
    if not isinstance(confirm, bool):
        raise GpuMemError(f"fit confirm= must be True or False, got {shorten(confirm)}")
    fit = Fit(step, measure, judged.bytes, runs_refused, backend, given=max(checked))
    fit.began = None if backend is None else backend.allocator_state()
    fit.warmed = _warmed(backend, fit.began)
    with fit.optimizers.watching(), fit.gradients.watching():
        for n in checked:
            fit.sizes.append(n)
            fit.samples.append(fit.sample(n))
        fit.host = _host(backend)
        fit.allowed = round(tolerance * max(s.peak for s in fit.samples)) + slack
        began = fit.samples[0].start
        warm_up = fit.warm_up = _warm_up(fit)
        text = capacity.strip() if isinstance(capacity, str) else None
        base = BatchFit((), (), judged.bytes, None, 0, Found.TIMELINE, False, began, (), text)
        base = replace(
            base, warm_up=warm_up, reserved=fit.samples[0].reserved, card=judged if judged.on_a_card else None
        )
        return _answered(fit, base, confirm)


def _warmed(backend: Backend | None, began: object | None) -> bool:
    """Whether the fit began on more reserved bytes than its live storages placed anew take (a warm-up's
    cache), the allocator's state left as it was."""
    if backend is None or began is None:
        return False
    reserved = backend.current().reserved
    backend.start_afresh(None)  # no state: what is live placed anew
    placed = backend.current().reserved
    backend.start_afresh(began)
    return reserved is not None and placed is not None and reserved > placed


def _answered(fit: Fit, base: BatchFit, confirm: bool) -> BatchFit:
    __tracebackhide__ = True
    lines, note = _lines(fit)
    while lines is not None and not lines.grows:
        lines, note = _sample_larger(fit)
    fit.growth = growth_of(fit.sizes, fit.samples)
    if lines is None:
        guess = fit.growth.reach(fit.capacity, curve=not base.reserved)
        return _searched(fit, base, note, min(guess, fit.over - 1))
    return _from_lines(fit, replace(base, lines=lines, note=note), lines, confirm)


def _host(backend: Backend | None) -> int | None:
    """Bytes a run may take of the host's memory beyond what is live: `HOST_SHARE` of what it has available
    (the CPU tracker; None where runs take no host memory or it cannot be read)."""
    if backend is None or backend.device.type != "cpu":
        return None
    available = host_available()
    return None if available is None else int(available * HOST_SHARE)


def _warm_up(fit: Fit) -> int:
    """Run the first size again when it left state behind (optimizer state, caches, the cuBLAS workspaces
    of its first matmuls), and always where the peaks are of reserved bytes (its next run starts on the
    cache and the workspaces the first left); refuse a step that keeps memory from one size to the next.
    Returns the bytes the first run left where they made it run again."""
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


def _lines(fit: Fit) -> tuple[Lines | None, str]:
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


def _sample_larger(fit: Fit) -> tuple[Lines | None, str]:
    """No event grew with n over the sizes sampled: sample twice the largest, held to the capacity."""
    __tracebackhide__ = True
    largest = max(fit.sizes)
    if largest >= min(MAX_BATCH, _FLAT_REACH * fit.given):
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
        fit.over = n
        return None, f"the peak did not grow up to size {largest:,}"
    fit.sizes.append(n)
    fit.samples.append(sample)
    return _lines(fit)


def _from_lines(fit: Fit, base: BatchFit, lines: Lines, confirm: bool) -> BatchFit:
    """The lines' answer, shown by loops at it and the next size; searched from it where they disagree."""
    __tracebackhide__ = True
    answer = lines.largest_within(fit.capacity)
    shown = 1 if answer is None else answer
    at = lines.timeline.place(lines.top(shown))
    found = fit.result(base, answer, lines.peak(shown), at=at)
    if not confirm or fit.runs_refused is not None:
        return replace(found, unconfirmed="confirm=False" if not confirm else str(fit.runs_refused))
    curve = shown if fit.growth is None or found.reserved else fit.growth.reach(fit.capacity)  # host safety
    if lines.residual and answer is not None and curve < answer:  # a line under a curve: n x n tensors
        missed = format_size(lines.residual)
        why = f"the sizes' bytes curve away from the lines by up to {missed}: {answer:,} was not run, {curve:,} was"
        return _searched(fit, base, why, curve)
    ran = _search(fit, shown)
    if ran != answer:
        held = "none fits" if answer is None else f"{answer:,} fits"
        why = f"the timelines' answer, {held}, did not hold in a loop of {LOOP_STEPS} steps"
        if answer is not None and ran is not None and ran > answer:
            why = f"the timelines' answer, {answer:,}, was not the largest: {answer + 1:,} ran {LOOP_STEPS} steps too"
        return _with_expandable(fit, _shown(fit, base, ran, why))
    check = fit.known[shown]
    peak, at = (found.peak_bytes, at) if check.out_of_memory else (check.peak, check.at or at)
    return _with_expandable(fit, fit.result(found, answer, peak, at=at, confirmed=True))


def _searched(fit: Fit, base: BatchFit, why: str, guess: int) -> BatchFit:
    __tracebackhide__ = True
    if fit.runs_refused is not None:
        raise GpuMemError(f"fit: {why}, so the answer must be searched with real runs, but {fit.runs_refused}")
    return _with_expandable(fit, _shown(fit, base, _search(fit, guess), why))


def _search(fit: Fit, guess: int) -> int | None:
    """The largest size whose loop ran with the next size's running out, bracketed from `guess` (see
    `_bracket`), then bisected; None when batch 1 runs out."""
    __tracebackhide__ = True
    good, bad = _bracket(fit, min(max(guess, 1), MAX_BATCH))
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fit.fits(middle) else (good, middle)
    return good or None


def _bracket(fit: Fit, guess: int) -> tuple[int, int | None]:
    """A size that fits (0: none does) and a larger one that does not (None: MAX_BATCH fits): from a guess
    that fits, up by 1, 2, 4... sizes; from one that does not, its size less 1, then the largest sampled
    size whose step fitted alone and the next (a guess off by more than one), then down by 1, 2, 4...
    sizes."""
    __tracebackhide__ = True
    if fit.fits(guess):
        good, jump = guess, 1
        while good < MAX_BATCH:
            n = min(good + jump, MAX_BATCH)
            if not fit.fits(n):
                return good, n
            good, jump = n, 2 * jump
        return good, None
    bad, jump = guess, 1
    sampled = [n for n, s in zip(fit.sizes, fit.samples, strict=True) if s.peak <= fit.capacity and n < guess - 1]
    hint = max(sampled, default=None)
    while bad > 1:
        n = max(bad - jump, 1)
        if jump == 2 and hint is not None:
            n, hint = hint, None
            if fit.fits(n):  # the boundary is often right above what the samples showed
                return (n, n + 1) if not fit.fits(n + 1) else (n + 1, bad)
        elif fit.fits(n):
            return n, bad
        bad, jump = n, 2 * jump
    return 0, 1


def _shown(fit: Fit, base: BatchFit, answer: int | None, why: str) -> BatchFit:
    """The searched answer with the peak of its loop (batch 1's, where it ran out)."""
    check = fit.known[1 if answer is None else answer]
    return fit.result(base, answer, check.peak, at=check.at, found=Found.SEARCH, confirmed=True, note=why)


def _with_expandable(fit: Fit, found: BatchFit) -> BatchFit:
    """The answer with expandable segments too, where the backend serves reserved bytes without them."""
    __tracebackhide__ = True
    backend = fit.backend
    serving = None if backend is None or not found.reserved else backend.expandable_segments()
    if backend is None or serving is None:
        return found
    checks, known, began = fit.checks, fit.known, fit.began
    fit.checks, fit.known = [], {}
    # before the live storages are placed anew: what the fit's runs made (optimizer state, gradients,
    # workspaces) a fresh process makes in its warm-up or its loop's first step
    fit.optimizers.forget_state()
    fit.gradients.forget()
    backend.clear_workspaces()
    try:
        with serving:
            fit.began = _fresh_start(fit, backend)
            answer = _search(fit, 1 if found.largest is None else found.largest)
        return replace(found, expandable=answer, expandable_checks=tuple(fit.checks))
    finally:
        fit.checks, fit.known, fit.began = checks, known, began


def _fresh_start(fit: Fit, backend: Backend) -> object | None:
    """The allocator's state a fresh process serving with these settings has where the fit began: what is
    live placed anew in the order it was made, then, where the fit began on a warm-up's cache, a step of the
    first size (the warm-up, run again: its cache is what the loops start on)."""
    __tracebackhide__ = True
    if fit.warmed:
        fit.measure(bound_step(fit.step, fit.sizes[0], 1, None), None)
    return backend.allocator_state()
