"""What every way of measuring provides (allocator-style counters with one resettable peak), and the
optional features a backend may have, one Protocol each: the meter, the session and the tools ask
`isinstance(backend, Feature)` and use the feature only where it is there.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from pytest_gpumem.backends.timeline import Timeline
    from pytest_gpumem.backends.tracker.attribution import Attributor
    from pytest_gpumem.backends.tracker.recording import Origin, Survivor
    from pytest_gpumem.results.baseline import DeviceIdentity


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
    global peak that `reset_peak` sets to the current value; the meter folds nested regions on top.
    What a backend may do beyond this is one of the feature Protocols below."""

    name: str

    @property
    def device(self) -> torch.device: ...

    def describe(self) -> str:
        """One line for the report header: backend, device and settings."""
        ...

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


@runtime_checkable
class IdentifiesDevice(Protocol):
    """A backend that identifies its device for baselines (without it: its name and `str(device)`)."""

    def identity(self) -> DeviceIdentity:
        """The backend and device, optionally capability and total memory: what stored baselines are
        keyed by (figures of one identity are never compared with another's)."""
        ...


@runtime_checkable
class Configurable(Protocol):
    """A backend that is told, before each measurement, the device's capacity and what to record."""

    def configure(self, capacity: int | None, origins: bool, events: bool) -> None:
        """For the next measurement: `capacity` bytes of the device (None: all of it); record where each
        allocation came from (`origins`) and the sequence of allocations and frees (`events`)."""
        ...


@runtime_checkable
class HasCapacity(Protocol):
    """A backend that holds the process to a capacity (the one `configure` set)."""

    @property
    def capacity(self) -> int | None:
        """Bytes past which an allocation raises OutOfMemoryError; None: the device's own memory."""
        ...


@runtime_checkable
class HoldsToCapacity(Protocol):
    """A backend that can set its capacity for a block: to the card a fit asks about (`gpumem.fit` runs its
    answers so) or to none (`gpumem.advise()` judges a capacity itself)."""

    def held_to(self, capacity: int | None) -> contextlib.AbstractContextManager[None]:
        """Within the block, an allocation past `capacity` bytes raises OutOfMemoryError, whatever capacity
        was set before; None: no capacity holds within the block."""
        ...


@runtime_checkable
class CachesMemory(Protocol):
    """A backend with an allocator's cache (the CUDA allocator's segments, or the tracker's model of it)."""

    def empty_cache(self) -> None:
        """Give back every cached segment without a live block (`torch.cuda.empty_cache()`)."""
        ...


@runtime_checkable
class KeepsWorkspaces(Protocol):
    """A backend whose allocator holds cuBLAS workspaces (one per handle and stream, kept once made): the
    CUDA allocator's, or the tracker's model of it."""

    def clear_workspaces(self) -> None:
        """Free every cuBLAS workspace (`torch._C._cuda_clearCublasWorkspaces()`): each measured test makes
        its own, and the one it leaves is not its leak."""
        ...


@runtime_checkable
class PredictsACard(Protocol):
    """A backend that predicts a named card (the tracker: its cuBLAS workspaces take the card's size)."""

    def predict_card(self, card: str | None) -> None:
        """Predict the card called `card` from now on (None: no card named; see `pytest_gpumem.cards`)."""
        ...

    def predicting(self, card: str | None) -> contextlib.AbstractContextManager[None]:
        """Within the block, predict `card`; then the card predicted before."""
        ...


@runtime_checkable
class RecordsTimeline(Protocol):
    """A backend that records the bytes allocated after each event of a block (`gpumem.fit` fits them)."""

    def timeline(self) -> contextlib.AbstractContextManager[Callable[[], Timeline]]:
        """Within the block, every allocation, resize and free is recorded; the value it gives, called after
        the block, returns the block's timeline."""
        ...


@runtime_checkable
class ExplainsItsPeaks(Protocol):
    """A backend that explains its own peaks: what each storage is for and which module made it (others
    are explained by a shadow tracker beside them)."""

    def configure(self, capacity: int | None, origins: bool, events: bool, explain: bool = False) -> None:
        """As `Configurable.configure`; `explain` also attributes every storage."""
        ...

    def attribution(self) -> Attributor | None:
        """The attributor of the measurement under way, when `configure` asked to explain."""
        ...


@runtime_checkable
class TakesSnapshots(Protocol):
    """A backend that takes allocator snapshots (the CUDA allocator's memory history)."""

    def snapshot(self) -> Any:
        """The allocator's history, which PyTorch's memory visualizer opens; None when none was recorded."""
        ...


@runtime_checkable
class RecordsTrace(Protocol):
    """A backend that records the allocations and frees of a measurement itself, as JSON."""

    def trace(self) -> dict[str, Any] | None:
        """The measurement's events, when `configure` asked for them; else None."""
        ...


@runtime_checkable
class CountsOnlyWhatItObserves(Protocol):
    """A backend that counts only what is allocated while it observes (with `sees_earlier_allocations`
    False), so that no full garbage collection is needed before a test's call."""

    sees_earlier_allocations: bool


@runtime_checkable
class ListsLiveStorages(Protocol):
    """A backend that lists the storages still allocated of those it counted."""

    def live_storages(self) -> dict[int, tuple[int, Origin | None]]:
        """Each storage the call made that is still allocated, by key: its counted bytes and its origin."""
        ...


@runtime_checkable
class FindsSurvivors(Protocol):
    """A backend that can say what the call left allocated: the largest storages, with what they hold."""

    def survivors(self, count: int) -> list[Survivor]:
        """The `count` largest storages the call made that are still allocated."""
        ...


@runtime_checkable
class RoundsLikeAnAllocator(Protocol):
    """A backend whose counted bytes follow an allocator's rounding of the requested bytes."""

    rounding: str  # "none" (exact) or "cuda" (the CUDA caching allocator's blocks)


@runtime_checkable
class HasNotes(Protocol):
    """A backend that says what its last measurement could not see."""

    def notes(self) -> list[str]:
        """One sentence each, for the test's report."""
        ...


def sees_earlier_allocations(backend: object) -> bool:
    """Whether `backend`'s counters include what was allocated before it began to observe."""
    return not isinstance(backend, CountsOnlyWhatItObserves) or backend.sees_earlier_allocations


def rounding_of(backend: object) -> str:
    """The allocator rounding `backend`'s counted bytes follow ("none" when it does not say)."""
    return backend.rounding if isinstance(backend, RoundsLikeAnAllocator) else "none"


def collect_garbage(full: bool) -> None:
    """Free reference cycles so that tensors kept alive only by them do not count in the next region.

    A full collection walks every object (about 0.1 s once torch is loaded); the young generations
    hold the cycles a test has just made and take microseconds.
    """
    if full:
        gc.collect()
    else:
        gc.collect(1)
