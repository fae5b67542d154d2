"""What every way of measuring provides, in one base class: allocator-style counters with one resettable
peak (the abstract members), and what a backend may do beyond them (members with defaults that do
nothing or say "cannot"). A backend overrides what it can do; callers read its attributes and return
values, never its type.
"""

from __future__ import annotations

import abc
import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping

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


@dataclass(frozen=True)
class Settings:
    """What the next measurement asks of a backend (`Backend.configure`)."""

    capacity: int | None = None  # bytes of the device; None: all of it
    origins: bool = False  # record where each allocation came from
    events: bool = False  # record the sequence of allocations and frees
    explain: bool = False  # attribute every storage: what it is for, which module made it


class Backend(abc.ABC):
    """A way of measuring. Like the CUDA caching allocator, it has current and peak counters and one
    global peak that `reset_peak` sets to the current value; the meter folds nested regions on top.

    Subclasses set `name` and implement the abstract members; the others are what a backend may do
    beyond counting, each with a default that does nothing or says it cannot."""

    name: str
    sees_earlier_allocations: bool = True  # False: counts only what it saw allocated (no full gc needed)
    rounding: str = "none"  # "none" (exact) or "cuda" (the CUDA caching allocator's blocks)
    caps_the_process: bool = False  # `configure` holds the process to `Settings.capacity`
    records_events: bool = False  # `configure(events=True)` keeps a trace or history for evidence
    caps_a_block: bool = False  # `held_to` sets the capacity for a block

    @property
    @abc.abstractmethod
    def device(self) -> torch.device: ...

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for the report header: backend, device and settings."""

    @abc.abstractmethod
    def start(self) -> None:
        """Begin observing (called once per measured test, before any region opens)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop observing; must undo everything `start` did, also after an error."""

    @abc.abstractmethod
    def settle(self) -> None:
        """Make the counters current before a reading (e.g. synchronize the device)."""

    @abc.abstractmethod
    def current(self) -> Counters: ...

    @abc.abstractmethod
    def peak(self) -> Counters: ...

    @abc.abstractmethod
    def reset_peak(self) -> None: ...

    def configure(self, settings: Settings) -> None:
        """Take `settings` for the next measurement (called before each one). By default: nothing kept,
        so `caps_the_process`, `records_events` stay False and attribution() None.

        Args:
            settings: what the next measurement asks for: a capacity, origins, events, explanations.
        """
        return None

    def identity(self) -> DeviceIdentity | Mapping[str, Any]:
        """What stored baselines are keyed by (figures of one identity are never compared with another's):
        the backend and device, optionally capability and total memory. By default its name and device."""
        from pytest_gpumem.results.baseline import DeviceIdentity

        return DeviceIdentity(self.name, str(self.device))

    @property
    def capacity(self) -> int | None:
        """Bytes past which an allocation raises OutOfMemoryError; None: the device's own memory."""
        return None

    def held_to(self, capacity: int | None) -> contextlib.AbstractContextManager[None]:
        """Within the block, an allocation past `capacity` bytes raises OutOfMemoryError, whatever was
        configured; only where `caps_a_block` says so.

        Args:
            capacity: bytes the block may allocate; None: no capacity holds.
        """
        from pytest_gpumem.errors import GpuMemError

        raise GpuMemError(f"the {self.name} backend cannot hold a block to a capacity")

    def empty_cache(self) -> None:
        """Give back every cached segment without a live block (`torch.cuda.empty_cache()`)."""
        return None

    def clear_workspaces(self) -> None:
        """Free every cuBLAS workspace its allocator keeps (each measured test makes its own)."""
        return None

    def allocator_state(self) -> object | None:
        """The allocator's state now, for `start_afresh` to serve from again (`gpumem.fit` takes it when
        it begins); None where it cannot be set, as a real allocator's cannot."""
        return None

    def start_afresh(self, state: object | None) -> None:
        """Serve the next allocations from `state`, as a fresh test that reached the same point would:
        `gpumem.fit`'s loops each start there. Nothing where it cannot be set.

        Args:
            state: what `allocator_state()` returned; None: the live storages placed anew, no cache.
        """
        return None

    def expandable_segments(self) -> contextlib.AbstractContextManager[None] | None:
        """A block within which its allocator serves with expandable segments (`gpumem.fit` compares its
        answer with theirs); None where it cannot be changed or has them already."""
        return None

    def predict_card(self, card: str | None) -> None:
        """Predict the card called `card` from now on.

        Args:
            card: a card's name, as `cuda_allocator_model.cards` knows it; None: none named.
        """
        return None

    def predicting(self, card: str | None) -> contextlib.AbstractContextManager[None]:
        """Within the block, predict `card`; then the card predicted before.

        Args:
            card: a card's name, as `predict_card` takes it; None: none named.
        """
        return contextlib.nullcontext()

    def timeline(self) -> contextlib.AbstractContextManager[Callable[[], Timeline]] | None:
        """A block within which the bytes allocated after each event are recorded (its value, called after
        the block, returns them: `gpumem.fit` fits them); None: it records no timeline."""
        return None

    def attribution(self) -> Attributor | None:
        """The attributor of the measurement under way, when it explains its own peaks (`Settings.explain`);
        None: a shadow tracker beside it explains them."""
        return None

    def snapshot(self) -> Any:
        """The allocator's history, which PyTorch's memory visualizer opens; None when none was recorded."""
        return None

    def trace(self) -> dict[str, Any] | None:
        """The measurement's allocations and frees as JSON, when `Settings.events` asked for them."""
        return None

    def live_storages(self) -> dict[int, tuple[int, Origin | None]]:
        """Each storage the call made that is still allocated, by key: its counted bytes and its origin."""
        return {}

    def survivors(self, count: int) -> list[Survivor]:
        """The largest storages the call made that are still allocated, with what they hold.

        Args:
            count: how many to return at most, largest first.
        """
        return []

    def notes(self) -> list[str]:
        """What the last measurement could not see, one sentence each, for the test's report."""
        return []


def collect_garbage(full: bool) -> None:
    """Free reference cycles so that tensors kept alive only by them do not count in the next region.

    A full collection walks every object (about 0.1 s once torch is loaded); the young generations
    hold the cycles a test has just made and take microseconds.
    """
    if full:
        gc.collect()
    else:
        gc.collect(1)


def made_backend(made: object, option: str) -> Backend:
    """What `pytest_gpumem_make_backend` gave, if it is a `Backend`; else a `GpuMemError` naming `option`."""
    if isinstance(made, Backend):
        return made
    from pytest_gpumem.errors import GpuMemError

    raise GpuMemError(
        f"{option}: pytest_gpumem_make_backend gave an instance of {type(made).__name__[:40]}, "
        "not a backend: subclass pytest_gpumem.Backend"
    )
