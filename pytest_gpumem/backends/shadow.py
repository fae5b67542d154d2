"""A tracker beside another backend (cuda, accelerators), only to explain its peaks.

The measured figures stay the backend's own; the shadow counts the same storages as the tracker would,
rounded as the CUDA allocator rounds them, so that its composition can be set against the measured
peak: what it cannot see (workspaces, fragmentation of cached blocks) is the "unattributed" part.
"""

from __future__ import annotations

from typing import Any

from pytest_gpumem.backends.attribution import Attributor


class Shadow:
    def __init__(self) -> None:
        from pytest_gpumem.backends.tracker import StorageLedger

        self.ledger = StorageLedger("cuda")
        self._mode: Any = None

    def start(self) -> Attributor:
        from pytest_gpumem.backends.tracker import _make_mode_class

        attribution = Attributor(self.ledger.live, events=False)
        self.ledger.recorder = attribution
        attribution.install()
        try:
            self._mode = _make_mode_class()(self.ledger)
            self._mode.__enter__()
        except BaseException:
            attribution.remove()
            raise
        return attribution

    def stop(self) -> None:
        from pytest_gpumem.backends.tracker import _leave

        mode, self._mode = self._mode, None
        try:
            if mode is not None:
                _leave(mode)
        finally:
            recorder = self.ledger.recorder
            if isinstance(recorder, Attributor):
                recorder.remove()
            self.ledger.forget()
            self.ledger.recorder = None
