"""The sentences of an advice: the test's report section, and what a failure line adds when the test
called `gpumem.advise` (the cheapest strategy that fits, or that none does)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from cuda_allocator_model import format_size
from pytest_gpumem.results.advice import AS_IS, Advice, cheapest

if TYPE_CHECKING:
    from pytest_gpumem.budget import Budget
    from pytest_gpumem.results import PhaseResult


def advice_section(advice: Advice | None) -> str:
    """The test's report section lines of its advice ('' when it did not call gpumem.advise)."""
    return "" if advice is None else "\n" + "\n".join(advice.lines())


def advice_clause(
    advice: Advice | None,
    budget: Budget | None,
    call: PhaseResult | None = None,
    phases: Mapping[str, PhaseResult] | None = None,
    *,
    oom: bool = False,
) -> str:
    """What a failure line adds when the test called gpumem.advise: the cheapest strategy that fits,
    e.g. '; checkpointing the 12 `GPT2Block`s fits: forward peak 5.2 GiB, +31% compute' (the region's
    peak as the budget counts it), or that none does."""
    return advice_forms(advice, budget, call, phases, oom=oom)[0]


def advice_forms(
    advice: Advice | None,
    budget: Budget | None,
    call: PhaseResult | None = None,
    phases: Mapping[str, PhaseResult] | None = None,
    *,
    oom: bool = False,
) -> tuple[str, ...]:
    """`advice_clause`'s clause, then its shorter forms for a line with less room: the strategy by its
    name, then without the compute it costs."""
    if advice is None:
        return ("",)
    capacity = advice.capacity if budget is None or budget.capacity is None else budget.capacity.bytes
    if oom:
        if capacity is None:
            return ("",)
        row = cheapest([r for r in advice.usable() if r.name != AS_IS and advice.fits(r, capacity)])
        if row is None:
            return _none_fits(advice, format_size(capacity), absolute=True)
        peak, live, fits = format_size(advice.absolute(row)), format_size(advice.live_bytes), format_size(capacity)
        return (
            f"; {row.description} fits {fits}: peak {peak} with the {live} live when the step "
            f"starts, {advice.compute(row)}",
            f"; {row.name} fits {fits}: peak {peak}, {advice.compute(row)}",
            f"; {row.name} fits {fits}: peak {peak}",
        )
    if call is None:
        return ("",)
    limits, observed, shown = _limits(budget, call, phases or {})
    if not limits:
        return ("",)
    found = advice.best_within(limits, observed)
    if found is None:
        return _none_fits(advice, "the budget")
    row, predicted = found
    region = next(iter(shown))
    peak = shown[region](predicted[region])
    return (
        f"; {row.description} fits the budget: {region} peak {peak}, {advice.compute(row)}",
        f"; {row.name} fits the budget: {region} peak {peak}, {advice.compute(row)}",
        f"; {row.name} fits: {region} peak {peak}, {advice.compute(row).split(', ')[0]}",
        f"; {row.name} fits: {region} peak {peak}",
    )


def _limits(
    budget: Budget | None, call: PhaseResult, phases: Mapping[str, PhaseResult]
) -> tuple[dict[str, int], dict[str, int], dict[str, Any]]:
    """Every limit of the budget on a region the test measured, what it measured there, and how each
    limit writes its figures; the exceeded regions come first."""
    limits: dict[str, int] = {}
    observed: dict[str, int] = {}
    shown: dict[str, Any] = {}
    if budget is None:
        return limits, observed, shown
    regions = [("call", budget.total, call)] if budget.total is not None else []
    regions += [(name, limit, phases[name]) for name, limit in budget.phases.items() if name in phases]
    regions.sort(key=lambda item: item[2].peak_bytes <= item[1].bytes)
    for name, limit, result in regions:
        assert limit is not None
        limits[name], observed[name], shown[name] = limit.bytes, result.peak_bytes, limit.fmt
    return limits, observed, shown


def _none_fits(advice: Advice, what: str, *, absolute: bool = False) -> tuple[str, ...]:
    tried = [r for r in advice.usable() if r.name != AS_IS]
    if not tried:
        return ("; gpumem.advise found no strategy to try",)
    lowest = min(tried, key=lambda r: r.peak_bytes or 0)
    assert lowest.peak_bytes is not None
    if absolute:
        peak = (
            f"peak {format_size(advice.absolute(lowest))} with the {format_size(advice.live_bytes)} live at the start"
        )
    else:
        peak = f"step peak {format_size(lowest.peak_bytes)} above its start"
    none = f"; none of the {len(tried)} strategies advise measured fits {what}"
    return f"{none} (lowest: {lowest.name}, {peak})", f"{none} (lowest: {lowest.name})", none
