"""What grew: the compact composition a baseline stores of an explanation, and the change of a phase
between a stored composition and a current one, in a few words for a regression's message."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cuda_allocator_model import format_size
from pytest_gpumem.explain.blocks import fold
from pytest_gpumem.explain.composition import OTHER_MODULES, changes
from pytest_gpumem.results.categories import LABELS
from pytest_gpumem.results.explanation import Cell, Composition, Explanation, PhaseComposition

_STORED_CELLS = 8  # of an explanation made before folding
_TOP_GROWN = 3  # module groups a regression names


def compact(explanation: Explanation) -> Composition:
    """Per phase: the growth by category (sums to the peak), the category x module-group parts (all of
    them, repeated blocks folded, or the largest ones of an explanation made before folding) and how many
    blocks each folded group has."""
    out: Composition = {}
    for name, phase in explanation.phases.items():
        categories = {c: b for c, b in phase.categories.items() if b}
        if phase.unattributed_bytes:
            categories["unattributed"] = phase.unattributed_bytes
        if explanation.folded is not None and phase.groups is not None:
            cells = list(phase.groups)
            blocks = {g: n for g, n in explanation.folded.items() if any(cell.module == g for cell in cells)}
            out[name] = PhaseComposition(categories, cells, blocks)
        else:
            out[name] = PhaseComposition(categories, phase.cells[:_STORED_CELLS])
    return out


def what_grew(stored: Composition | None, current: Composition | None, phase: str) -> str | None:
    """Where `phase` grew against the baseline: the module groups ranked by their growth, repeated blocks
    folded, modules new in the peak or no longer in it named, e.g. "blocks.* +3.0 MiB (4 blocks): saved
    for backward +3.5 MiB, temporaries -0.5 MiB; head +64.0 KiB (new), parameters"; None when either side
    has no composition."""
    if not stored or not current or phase not in stored or phase not in current:
        return None
    old, new = stored[phase], current[phase]
    return _describe_growth(Growth.of(old, new)) or _category_growth(old, new)


@dataclass
class Growth:
    """A phase's change between two compact compositions, by module group and category."""

    groups: dict[str, dict[str, int]]  # group -> category -> change (bytes)
    added: list[str]  # groups only the current side has (None of it when a side lists only its largest)
    gone: list[str]
    blocks: dict[str, int]  # folded group -> how many blocks now
    was: dict[str, int]  # folded group -> how many blocks in the baseline

    @classmethod
    def of(cls, old: PhaseComposition, new: PhaseComposition) -> Growth:
        was, blocks = dict(old.folded or {}), dict(new.folded or {})
        folds = {*was, *blocks}
        before, after = _by_cell(old.cells, folds), _by_cell(new.cells, folds)
        complete = old.folded is not None and new.folded is not None
        if not complete:  # a side lists only its largest cells: one missing there may just be off the list
            common = before.keys() & after.keys()
            before = {k: v for k, v in before.items() if k in common}
            after = {k: v for k, v in after.items() if k in common}
        groups: dict[str, dict[str, int]] = {}
        for (category, group), size in changes(before, after).items():
            groups.setdefault(group, {})[category] = size
        old_groups, new_groups = {g for _, g in before}, {g for _, g in after}
        added = sorted(new_groups - old_groups - {OTHER_MODULES}) if complete else []
        gone = sorted(old_groups - new_groups - {OTHER_MODULES}) if complete else []
        return cls(groups, added, gone, blocks, was)

    def ranked(self) -> list[tuple[str, int]]:
        """The groups that grew, most first."""
        totals = [(group, sum(parts.values())) for group, parts in self.groups.items()]
        return sorted(((g, t) for g, t in totals if t > 0), key=lambda gt: (-gt[1], gt[0]))


def _describe_growth(grew: Growth) -> str:
    """The `_TOP_GROWN` groups that grew most, then the others new in the peak and those no longer in it by name."""
    ranked = grew.ranked()[:_TOP_GROWN]
    parts = [f"{g} +{format_size(total)}{_blocks_note(grew, g)}{_by_category(grew.groups[g])}" for g, total in ranked]
    shown = {group for group, _ in ranked}
    added = [group for group in grew.added if group not in shown]
    if added:
        parts.append(f"new in the peak: {_names(added)}")
    if grew.gone:
        parts.append(f"no longer in the peak: {_names(grew.gone)}")
    return "; ".join(parts)


def _blocks_note(grew: Growth, group: str) -> str:
    if group in grew.added:
        return " (new)"
    now, was = grew.blocks.get(group), grew.was.get(group)
    if now is None:
        return ""
    return f" ({now} blocks, was {was})" if was is not None and was != now else f" ({now} blocks)"


def _by_category(parts: Mapping[str, int], shown: int = 3) -> str:
    """A group's change by category, largest change first, shrunk parts too (when the peak moves to another
    moment, saved activations can grow while gradients shrink): the parts shown add up to the group's
    change, the ones past `shown` summed as "the rest"."""
    changed = sorted(((b, c) for c, b in parts.items() if b), key=lambda bc: (-abs(bc[0]), bc[1]))
    if len(changed) == 1:
        return f", {LABELS.get(changed[0][1], changed[0][1])}"
    listed = [(LABELS.get(c, c), b) for b, c in changed[:shown]]
    rest = sum(b for b, _ in changed[shown:])
    if rest:
        listed.append(("the rest", rest))
    return ": " + ", ".join(f"{label} {_signed(b)}" for label, b in listed)


def _signed(size: int) -> str:
    return f"+{format_size(size)}" if size >= 0 else f"-{format_size(-size)}"


def _names(groups: Sequence[str], shown: int = 3) -> str:
    more = f" and {len(groups) - shown} more" if len(groups) > shown else ""
    return ", ".join(groups[:shown]) + more


def _by_cell(cells: Sequence[Cell], folds: set[str]) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for cell in cells:
        key = (cell.category, fold(cell.module, folds))
        out[key] = out.get(key, 0) + cell.size
    return out


def _category_growth(old: PhaseComposition, new: PhaseComposition) -> str | None:
    grown = [(c, b) for c, b in changes(old.categories, new.categories).items() if b > 0]
    if not grown:
        return None
    category, size = max(grown, key=lambda part: part[1])
    return f"{LABELS.get(category, category)} +{format_size(size)}"
