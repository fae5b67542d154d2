"""The allocator model's reserved and inactive-split bytes after each event that an explanation follows."""

from __future__ import annotations

from array import array
from bisect import bisect_right
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from cuda_allocator_model.model import CachingAllocatorModel


class ServedByModel(Protocol):
    """What holds the allocator model of a measurement (the ledger, which makes a new one for each)."""

    @property
    def model(self) -> CachingAllocatorModel | None: ...


class AllocatorTrace:
    """Inactive-split bytes after every event (8 B each), reserved bytes each time they change: events
    are numbered as the attributor's, moment `m` is after `m` events, and moment 0 is an empty cache (each
    measurement starts with one)."""

    __slots__ = ("_source", "inactive_split", "reserved", "reserved_from")

    def __init__(self, source: ServedByModel) -> None:
        self._source = source
        self.inactive_split = array("q")
        self.reserved_from = array("q", [0])  # the moment from which `reserved` holds each value
        self.reserved = array("q", [0])

    def record(self) -> None:
        """The model's figures after the event just recorded."""
        model = self._source.model
        reserved = 0 if model is None else model.reserved
        inactive = self.inactive_split
        inactive.append(0 if model is None else model.inactive_split)
        if reserved != self.reserved[-1]:
            self.reserved_from.append(len(inactive))
            self.reserved.append(reserved)

    def at(self, moment: int) -> tuple[int, int]:
        """Reserved and inactive-split bytes at `moment`."""
        reserved = self.reserved[bisect_right(self.reserved_from, moment) - 1]
        return reserved, self.inactive_split[moment - 1] if moment else 0
