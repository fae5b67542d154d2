"""An explanation in words: the test's report section, a few words for a table cell, and what a failure
message adds about the failing region's peak."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from cuda_allocator_model import format_size
from pytest_gpumem.explain.composition import TOP_MODULES, changes, largest
from pytest_gpumem.results.explanation import Explanation, PhaseExplanation, ReservedAtPeak, Tensor

if TYPE_CHECKING:
    from pytest_gpumem.budget import Budget, Limit
    from pytest_gpumem.results import PhaseResult

_Format = Callable[[int], str]

SECTION_WIDTH = 120  # columns of a line of the report section's explanation

_HOW_TO_EXPLAIN = "see what made it with --gpumem-explain or max_memory(explain=True)"
_HOW_TO_EXPLAIN_BRIEFLY = "see what made it with --gpumem-explain"


def describe(explanation: Explanation, fmt: _Format = format_size) -> list[str]:
    """Lines for the test's report section."""
    lines = [f"peak explained ({explanation.backend}):"]
    for name, phase in explanation.phases.items():
        lines.append(f"  {name}: peak {fmt(phase.peak_bytes)} = {_parts(explanation, phase, fmt)}")
        if phase.reserved_at_peak is not None:
            lines.append(f"    at the peak: {_reserved_clause(phase.reserved_at_peak, fmt)}")
        grown = _by_group(phase).items()
        modules = ", ".join(f"{m} {_signed(b, fmt)}{_blocks(explanation, m)}" for m, b in grown)
        if modules:
            lines.append(f"    by module: {modules}")
        for tensor in phase.tensors[:3]:
            lines.append(f"    alive at the peak: {_describe_tensor(explanation, tensor, fmt)}")
    return [part for line in lines for part in wrapped(line)]


def wrapped(line: str, width: int = SECTION_WIDTH) -> list[str]:
    """`line` in lines of at most `width` columns, cut after a comma, each further line indented two
    columns more than the first (what has no comma to cut at stays whole)."""
    indent = " " * (len(line) - len(line.lstrip()) + 2)
    parts, rest = [], line
    while len(rest) > width and (cut := rest.rfind(", ", 0, width - 1)) > len(indent):
        parts.append(rest[: cut + 1])
        rest = indent + rest[cut + 2 :]
    return [*parts, rest]


def _reserved_clause(reserved: ReservedAtPeak, fmt: _Format = format_size) -> str:
    """How much of the allocator's reserved memory held no block, e.g. "reserved 22.0 MiB, 20.0 MiB of it
    unallocated (18.0 MiB inactive split)"."""
    return (
        f"reserved {fmt(reserved.reserved)}, {fmt(reserved.unallocated)} of it unallocated "
        f"({fmt(reserved.inactive_split)} inactive split)"
    )


def _by_group(phase: PhaseExplanation) -> dict[str, int]:
    """Growth by module group (repeated blocks folded), largest first; `modules` of an explanation made
    before folding."""
    if phase.groups is None:
        return dict(phase.modules)
    totals: dict[str, int] = {}
    for cell in phase.groups:
        totals[cell.module] = totals.get(cell.module, 0) + cell.size
    return largest(changes({}, totals), TOP_MODULES)


def _blocks(explanation: Explanation, group: str) -> str:
    count = explanation.blocks(group)
    return "" if count is None else f" ({count} blocks)"


def _parts(explanation: Explanation, phase: PhaseExplanation, fmt: _Format) -> str:
    parts = [f"{explanation.label(c)} {_signed(b, fmt)}" for c, b in phase.categories.items() if b]
    if phase.unattributed_bytes:
        parts.append(f"unattributed {_signed(phase.unattributed_bytes, fmt)}")
    return ", ".join(parts) or "nothing"


def _signed(value: int, fmt: _Format) -> str:
    return f"-{fmt(-value)}" if value < 0 else fmt(value)


def _describe_tensor(explanation: Explanation, tensor: Tensor, fmt: _Format = format_size) -> str:
    shape = None if tensor.shape is None else list(tensor.shape)
    what, op = ("a storage" if tensor.dtype is None else f"{tensor.dtype}{shape}"), tensor.op
    if tensor.dtype is None and op.startswith(_WORKSPACE) and op.endswith(")"):  # "cuBLAS workspace (aten.mm)"
        what, op = _WORKSPACE.removesuffix(" ("), op.removeprefix(_WORKSPACE).removesuffix(")")
    where = f" at {tensor.where}" if tensor.where else ""
    used = f"{explanation.label(tensor.category)}, {tensor.module}"
    return f"{fmt(tensor.size)} {what} ({used}), made by {op}{where}"


_WORKSPACE = "cuBLAS workspace ("


def summary(explanation: Explanation, phase: str = "call", count: int = 2) -> str:
    """A few words for a table cell: the largest parts of a phase's peak."""
    found = explanation.phases.get(phase)
    if found is None:
        return ""
    parts = sorted(((b, c) for c, b in found.categories.items() if b > 0), reverse=True)[:count]
    return ", ".join(f"{explanation.label(c)} {format_size(b)}" for b, c in parts)


def section(explanation: Explanation | None) -> str:
    """The test's report section (empty when it was not explained)."""
    return "" if explanation is None else "\n" + "\n".join(describe(explanation))


def over_limit(budget: Budget | None, call: PhaseResult, phases: Mapping[str, PhaseResult]) -> list[tuple[str, Limit]]:
    """The regions whose peaks exceed the budget ("call" for the whole call), with their limits."""
    if budget is None:
        return []
    over = [("call", budget.total)] if budget.total is not None and call.peak_bytes > budget.total.bytes else []
    return over + [
        (n, limit) for n, limit in budget.phases.items() if n in phases and phases[n].peak_bytes > limit.bytes
    ]


def made_of(explanation: Explanation | None, over: Sequence[tuple[str, Limit]]) -> str:
    """What a failure message adds: the largest parts of the first failing region's peak (in its limit's
    units), or how to get them."""
    return made_of_forms(explanation, over)[0]


def made_of_forms(explanation: Explanation | None, over: Sequence[tuple[str, Limit]]) -> tuple[str, ...]:
    """`made_of`'s clause, then its shorter forms for a line with less room: the largest part alone, then
    without the region's name; how to see it with the option alone."""
    if not over:
        return ("",)
    if explanation is None:
        return f" ({_HOW_TO_EXPLAIN})", f" ({_HOW_TO_EXPLAIN_BRIEFLY})"
    region, limit = over[0]
    phase = explanation.phases.get(region)
    if phase is None:
        return ("",)
    cells = [c for c in phase.parts if c.size > 0][:2]
    parts = [
        f"{explanation.label(c.category)} of {c.module}{_blocks(explanation, c.module)} {limit.fmt(c.size)}"
        for c in cells
    ]
    if not parts:
        return ("",)
    return (
        f"; {region} peak made of {', '.join(parts)}, ...",
        f"; {region} peak made of {parts[0]}, ...",
        f"; made of {parts[0]}, ...",
    )
