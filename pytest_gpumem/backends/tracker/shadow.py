"""A tracker beside another backend (cuda, accelerators), only to explain its peaks.

The measured figures stay the backend's own; the shadow counts the same storages as the tracker would,
rounded as the CUDA allocator rounds them, so that its composition can be set against the measured
peak: what it cannot see (workspaces, fragmentation of cached blocks) is the "unattributed" part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from pytest_gpumem.backends.tracker.attribution import Attributor
from pytest_gpumem.backends.tracker.backend import stop_counting
from pytest_gpumem.backends.tracker.ledger import StorageLedger
from pytest_gpumem.backends.tracker.mode import mode_class
from pytest_gpumem.backends.tracker.storages import Storage

if TYPE_CHECKING:
    import torch


class _DeviceLedger(StorageLedger):
    """A ledger of the storages on `device` only, rounded as the CUDA allocator rounds them: what the
    measured backend counts (host tensors, a data table on the CPU, are not its memory)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__("cuda")
        self.device_type, self.device_index = device.type, device.index

    def ours(self, storage: Storage) -> bool:
        found = cast("torch.UntypedStorage", storage).device
        return found.type == self.device_type and (
            self.device_index is None or found.index in (None, self.device_index)
        )

    def add(self, storage: Storage) -> None:
        if self.ours(storage):
            super().add(storage)

    def resized(self, storage: Storage, before: int) -> None:
        if self.ours(storage):
            super().resized(storage, before)

    def grow_existing(self, storage: Storage, before: int) -> None:
        if self.ours(storage):
            super().grow_existing(storage, before)


class Shadow:
    """The tracker's dispatch mode and an attributor on a ledger of `device`'s storages, for one call."""

    def __init__(self, device: torch.device) -> None:
        self.ledger = _DeviceLedger(device)
        self._mode: Any = None

    def start(self) -> Attributor:
        attribution = Attributor(self.ledger.live, events=False)
        self.ledger.recorder = attribution
        attribution.install()
        try:
            self._mode = mode_class()(self.ledger)
            self._mode.__enter__()
        except BaseException:
            attribution.remove()
            raise
        return attribution

    def stop(self) -> None:
        mode, self._mode = self._mode, None
        stop_counting(mode, self.ledger)
