"""What every way of measuring provides: allocator-style counters with one resettable peak."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Counters:
    """Bytes as an allocator counts them: allocated (possibly rounded), requested (exact), reserved."""

    allocated: int
    requested: int
    reserved: int | None = None

    def max(self, other: Counters) -> Counters:
        reserved = self.reserved
        if other.reserved is not None:
            reserved = other.reserved if reserved is None else max(reserved, other.reserved)
        return Counters(max(self.allocated, other.allocated), max(self.requested, other.requested), reserved)


@runtime_checkable
class Backend(Protocol):
    """A way of measuring. Like the CUDA caching allocator, it has current and peak counters and one
    global peak that `reset_peak` sets to the current value; the meter folds nested regions on top."""

    name: str

    @property
    def device(self) -> torch.device: ...

    def describe(self) -> str:
        """One line for the report header: backend, device and settings."""
        ...

    # Optional: `sees_earlier_allocations = False` for a backend that counts only what is allocated
    # while it observes (no full garbage collection is then needed before a test's call).
    # Optional: `identity() -> dict` with backend, device and optionally capability and total_memory,
    # which key stored baselines; without it, the backend's name and str(device) are used.

    def start(self) -> None:
        """Begin observing (called once per measured test, before any region opens)."""
        ...

    def stop(self) -> None:
        """Stop observing; must undo everything `start` did, also after an error."""
        ...

    def settle(self) -> None:
        """Make the counters current before a reading (e.g. synchronize the device)."""
        ...

    def current(self) -> Counters: ...

    def peak(self) -> Counters: ...

    def reset_peak(self) -> None: ...


def collect_garbage(full: bool) -> None:
    """Free reference cycles so that tensors kept alive only by them do not count in the next region.

    A full collection walks every object (about 0.1 s once torch is loaded); the young generations
    hold the cycles a test has just made and take microseconds.
    """
    if full:
        gc.collect()
    else:
        gc.collect(1)
