"""A tracker beside another backend (cuda, accelerators), only to explain its peaks.

The measured figures stay the backend's own; the shadow counts the same storages as the tracker would,
rounded as the CUDA allocator rounds them, so that its composition can be set against the measured
peak: what it cannot see (workspaces, fragmentation of cached blocks) is the "unattributed" part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pytest_gpumem.backends.tracker.attribution import Attributor
from pytest_gpumem.backends.tracker.mode import leave, mode_class

if TYPE_CHECKING:
    import torch

    from pytest_gpumem.backends.tracker.backend import StorageLedger


class Shadow:
    def __init__(self, device: torch.device) -> None:
        self.ledger = _device_ledger(device)
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
        try:
            if mode is not None:
                leave(mode)
        finally:
            recorder = self.ledger.recorder
            if isinstance(recorder, Attributor):
                recorder.remove()
            self.ledger.forget()
            self.ledger.recorder = None


def _device_ledger(device: torch.device) -> StorageLedger:
    """A ledger of the storages on `device` only, rounded as the CUDA allocator rounds them: what the
    measured backend counts (host tensors, a data table on the CPU, are not its memory)."""
    from pytest_gpumem.backends.tracker.backend import StorageLedger

    def ours(storage: torch.UntypedStorage) -> bool:
        found = storage.device
        return found.type == device.type and (device.index is None or found.index in (None, device.index))

    class DeviceLedger(StorageLedger):
        def add(self, storage: torch.UntypedStorage) -> None:
            if ours(storage):
                super().add(storage)

        def resized(self, storage: torch.UntypedStorage, before: int) -> None:
            if ours(storage):
                super().resized(storage, before)

        def grow_existing(self, storage: torch.UntypedStorage, before: int) -> None:
            if ours(storage):
                super().grow_existing(storage, before)

    return DeviceLedger("cuda")
