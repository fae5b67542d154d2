"""An allocation as the attributor keeps it: where the storage came from, the module that made it and
its category (how the test used it, settled as the test runs); and a measured region's span of events."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from pytest_gpumem.backends.tracker.recording import Origin
from pytest_gpumem.results.categories import CATEGORIES

# which use wins when a storage has several: an input the graph saves stays an input
_RANK = {category: rank for rank, category in enumerate((*CATEGORIES[:3], "inputs", "saved", "temporaries"))}
NO_MODULE = "(outside modules)"


@dataclass(eq=False, slots=True)
class Allocation(Origin):
    """A storage the call made: where it came from, and (settled as the test runs) what it is for."""

    id: int = 0
    module: str = NO_MODULE
    category: str = "temporaries"
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    unsaved_at: int = -1  # the event after which no graph saves it any more (-1: saved to the end, or never)

    def mark(self, category: str) -> None:
        """A use was seen; the most specific one wins (a parameter saved for backward is a parameter)."""
        if _RANK[category] < _RANK[self.category]:
            self.category = category

    def category_at(self, moment: int) -> str:
        """What it was for after event `moment`: saved for backward until its graphs released it, then what
        made it (only a temporary ranks below saved)."""
        if self.category == "saved" and 0 <= self.unsaved_at <= moment:
            return "temporaries"
        return self.category

    @property
    def category_now(self) -> str:
        """What it is for after the last event recorded."""
        return self.category_at(sys.maxsize)


@dataclass(frozen=True)
class RegionSpan:
    """One entry into a measured region (the call or a phase): the event indices it spans."""

    name: str
    start: int
    end: int
