"""A backend from `pytest_gpumem_make_backend` that does not subclass `Backend` (the contract before the
base class: any object with its methods), adopted behind the base: what it has is used, the rest is
the base's defaults."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pytest_gpumem.backends.base import Backend, Counters, Settings
from pytest_gpumem.errors import GpuMemError

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from pytest_gpumem.backends.timeline import Timeline
    from pytest_gpumem.backends.tracker.attribution import Attributor
    from pytest_gpumem.results.baseline import DeviceIdentity

REQUIRED = ("name", "device", "describe", "start", "stop", "settle", "current", "peak", "reset_peak")
FORWARDED = (
    "empty_cache",
    "clear_workspaces",
    "predict_card",
    "predicting",
    "snapshot",
    "trace",
    "live_storages",
    "survivors",
    "notes",
)


def adopt(made: object, option: str) -> Backend:
    """`made` as a `Backend`; a `GpuMemError` naming `option` and what it lacks when it is none."""
    if isinstance(made, Backend):
        return made
    missing = [member for member in REQUIRED if getattr(made, member, None) is None]
    if missing:
        lacks = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise GpuMemError(
            f"{option}: pytest_gpumem_make_backend gave an instance of {type(made).__name__[:40]} without {lacks} "
            "of a backend's members: subclass pytest_gpumem.Backend"
        )
    return Adopted(made)


class Adopted(Backend):
    """`inner`'s members where it has them (an old-style `configure(capacity, origins, events)` too)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        for member in ("sees_earlier_allocations", "rounding"):
            if hasattr(inner, member):
                setattr(self, member, getattr(inner, member))
        self.sets_capacity = self.records_events = callable(getattr(inner, "configure", None))
        self.holds_capacity = callable(getattr(inner, "held_to", None))
        for member in FORWARDED:
            if callable(getattr(inner, member, None)):
                setattr(self, member, getattr(inner, member))

    @property
    def device(self) -> torch.device:
        device: torch.device = self.inner.device
        return device

    def describe(self) -> str:
        return str(self.inner.describe())

    def start(self) -> None:
        self.inner.start()

    def stop(self) -> None:
        self.inner.stop()

    def settle(self) -> None:
        self.inner.settle()

    def current(self) -> Counters:
        counters: Counters = self.inner.current()
        return counters

    def peak(self) -> Counters:
        counters: Counters = self.inner.peak()
        return counters

    def reset_peak(self) -> None:
        self.inner.reset_peak()

    def configure(self, settings: Settings) -> None:
        if not self.sets_capacity:
            return
        if settings.explain and callable(getattr(self.inner, "attribution", None)):
            self.inner.configure(settings.capacity, settings.origins, settings.events, explain=True)
        else:
            self.inner.configure(settings.capacity, settings.origins, settings.events)

    def identity(self) -> DeviceIdentity | Mapping[str, Any]:
        own = getattr(self.inner, "identity", None)
        return super().identity() if own is None else own()

    @property
    def capacity(self) -> int | None:
        capacity: int | None = getattr(self.inner, "capacity", None)
        return capacity

    def held_to(self, capacity: int | None) -> contextlib.AbstractContextManager[None]:
        if not self.holds_capacity:
            return super().held_to(capacity)
        held: contextlib.AbstractContextManager[None] = self.inner.held_to(capacity)
        return held

    def timeline(self) -> contextlib.AbstractContextManager[Callable[[], Timeline]] | None:
        own = getattr(self.inner, "timeline", None)
        return None if own is None else own()

    def attribution(self) -> Attributor | None:
        own = getattr(self.inner, "attribution", None)
        return None if own is None else own()
