"""The one line a measured test fails with when it runs out of memory or leaks, and its report section
of what it left allocated."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from pytest_gpumem.measure.failures import exception_text
from pytest_gpumem.report.advice import advice_clause
from pytest_gpumem.sizes import format_size

if TYPE_CHECKING:
    from pytest_gpumem.budget import Budget, Limit
    from pytest_gpumem.measure.meter import GpuMem

SURVIVORS_IN_MESSAGE = 3


def out_of_memory_message(
    meter: GpuMem, budget: Budget | None, exc: BaseException, capacity: Limit | None = None
) -> str:
    """One sentence: where it ran out, what it asked for, the peak so far, and the limit it hit (the
    capacity the test ran under, or the device's own memory); the budget only when it was already over;
    on the meta device, that it is a prediction."""
    phase = meter.phase_left_by(exc)
    where = f"in {phase}" if phase else "in the call"
    asked = re.search(r"[Tt]ried to allocate ([\d.,]+ ?[KMGTP]?i?B)", exception_text(exc))
    tried = f" (tried to allocate {asked.group(1)})" if asked else ""
    limits = ": the device's memory ran out" if capacity is None else f": past the {_capacity_hit(budget, capacity)}"
    limits += _allocator_state(exc)
    limits += _budget_over(budget, meter, phase)
    limits += "; a prediction on meta" if str(meter.device) == "meta" else ""
    advised = advice_clause(meter.advice, budget, oom=True)
    peak = format_size(meter.peak()) if capacity is None else capacity.fmt(meter.peak())
    return f"out of memory {where}{tried} after a peak of {peak}{limits}{advised}"


def _allocator_state(exc: BaseException) -> str:
    """Where the tracker models the CUDA allocator: what it held when the new segment did not fit, in
    CUDA's terms, and the setting that helps when fragmentation is the cause (the reserved but
    unallocated bytes would hold the request, but no free block does)."""
    error = getattr(exc, "allocator_error", None)
    if error is None:
        return ""
    free = error.reserved - error.allocated
    state = (
        f", with {format_size(error.reserved)} reserved: {format_size(error.allocated)} allocated and "
        f"{format_size(free)} reserved but unallocated"
    )
    if free >= error.requested:
        state += " (fragmentation: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets that memory serve it)"
    return state


def _capacity_hit(budget: Budget | None, capacity: Limit) -> str:
    """'capacity 10 kB (max_memory capacity=)'; the option's limit is written with its flag already."""
    source = " (max_memory capacity=)" if budget is not None and budget.capacity is capacity else ""
    return f"capacity {capacity.written}{source}"


def _budget_over(budget: Budget | None, meter: GpuMem, phase: str | None) -> str:
    """'; over its budget 100 MB too, at 120.3 MB' when the peak so far already exceeded the limit on the
    phase it ran out in (or on the call)."""
    if budget is None:
        return ""
    if phase is not None and phase in budget.phases and phase in meter.phases:
        name, limit, peak = f"{phase}=", budget.phases[phase], meter.phases[phase].peak_bytes
    elif budget.total is not None:
        name, limit, peak = "", budget.total, meter.peak()
    else:
        return ""
    return "" if peak <= limit.bytes else f"; over its budget {name}{limit.written} too, at {limit.fmt(peak)}"


def leak_message(meter: GpuMem, leak: Limit, net_bytes: int) -> str:
    shown = "; ".join(s.describe(leak.fmt) for s in meter.survivors[:SURVIVORS_IN_MESSAGE])
    more = len(meter.survivors) - SURVIVORS_IN_MESSAGE
    tail = f"; {more} more in the report section" if more > 0 else ""
    holding = meter.leak_holding
    held = "" if holding is None else f": {holding.describe(leak.fmt)}"
    largest = f"{'; largest' if held else ''}: {shown}{tail}" if shown else ""
    return f"left {leak.fmt(net_bytes)} allocated after the call (leak limit {leak.written}){held}{largest}"


def survivors_section(meter: GpuMem) -> str:
    return "".join(f"\nleft allocated: {survivor.describe()}" for survivor in meter.survivors)
