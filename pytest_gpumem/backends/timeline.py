"""A run's timeline: the bytes allocated after each allocation, resize and free, with the op and source line
of each allocation. `gpumem.fit` compares the timelines of one step at several batch sizes: where the ops
are the same, each point's bytes are a line in the batch size, and the step's peak at any size is the
highest of those lines. Pure Python: a backend fills a `TimelineRecorder` as its allocations happen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

FREED = "free"
RESIZED = "resize"


@dataclass(frozen=True, eq=False)
class Timeline:
    """One run's events in order: `ops[i]` made the change (an op's name, or FREED, RESIZED), after which
    `allocated[i]` bytes were held (allocated; reserved where the backend models an allocator's cache);
    `where[i]` is the source line that led to an allocation."""

    ops: tuple[str, ...]
    allocated: tuple[int, ...]
    where: tuple[str | None, ...]

    def __len__(self) -> int:
        return len(self.ops)

    def peak(self) -> int:
        return max(self.allocated, default=0)

    def same_ops(self, other: Timeline) -> bool:
        """Whether both runs made the same changes in the same order (only their sizes may differ)."""
        return self.ops == other.ops

    def first_difference(self, other: Timeline) -> int:
        """The index of the first event where the two runs differ (the shorter's length if one is a prefix)."""
        return next(
            (i for i, (a, b) in enumerate(zip(self.ops, other.ops, strict=False)) if a != b), min(len(self), len(other))
        )

    def place(self, index: int) -> str:
        """'aten.mm.default (test_x.py:12)': what made event `index`, and the line that led to it."""
        where = self.where[index]
        return self.ops[index] if where is None else f"{self.ops[index]} ({where})"


class TimelineRecorder:
    """Collects a run's events; `name` turns an op into its name, `where` finds the source line of the
    allocation being made (both called at each allocation)."""

    __slots__ = ("_allocated", "_name", "_ops", "_where", "_wheres")

    def __init__(self, name: Callable[[object], str], where: Callable[[], str | None]) -> None:
        self._name, self._where = name, where
        self._ops: list[str] = []
        self._allocated: list[int] = []
        self._wheres: list[str | None] = []

    def allocated(self, op: object, total: int) -> None:
        self._ops.append(self._name(op))
        self._allocated.append(total)
        self._wheres.append(self._where())

    def changed(self, action: str, total: int) -> None:
        """A free or a resize (FREED, RESIZED) that left `total` bytes allocated."""
        self._ops.append(action)
        self._allocated.append(total)
        self._wheres.append(None)

    def timeline(self) -> Timeline:
        return Timeline(tuple(self._ops), tuple(self._allocated), tuple(self._wheres))
