"""--gpumem-torch-snapshots DIR: every measured test's prediction as a torch memory snapshot, one pickle per
test named after its id (as its picture and its evidence are), that memory_viz opens and `pytest-gpumem
replay` reads."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest

from pytest_gpumem.files import replace_atomically
from pytest_gpumem.run.outputs import file_stem, why

if TYPE_CHECKING:
    from pytest_gpumem.measure.measurement import Measurement
    from pytest_gpumem.run.session import GpuMemSession
    from pytest_gpumem.snapshots.write import RecordedModel

_FLAG = "--gpumem-torch-snapshots"
_RECORDED_KEY: pytest.StashKey[RecordedModel] = pytest.StashKey()


def begin(item: pytest.Item, session: GpuMemSession, measured: Measurement) -> None:
    """Record the call's requests, frees and segments from here on, when the run writes snapshots."""
    if session.options.torch_snapshots is None:
        return
    from pytest_gpumem.backends.tracker.ledger import StorageLedger
    from pytest_gpumem.snapshots.write import record

    ledger = getattr(measured.backend, "ledger", None)
    recorded = record(ledger) if isinstance(ledger, StorageLedger) else None
    if recorded is None:
        problem = f"{_FLAG}: none written: no CUDA allocator model (--gpumem-round=cuda)"
        if problem not in session.problems:
            session.problems.append(problem)
        return
    item.stash[_RECORDED_KEY] = recorded


def write(item: pytest.Item, session: GpuMemSession) -> None:
    """Write the snapshot of the call just ended (once: a later call of the hook finds nothing)."""
    recorded = item.stash.get(_RECORDED_KEY, None)
    folder = session.options.torch_snapshots
    if recorded is None or folder is None:
        return
    del item.stash[_RECORDED_KEY]
    from pytest_gpumem.snapshots.write import snapshot_bytes, snapshot_of

    path = folder / f"{file_stem(item.nodeid)}.pickle"
    data = snapshot_bytes(snapshot_of(recorded, os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        replace_atomically(path, data)
    except OSError as exc:
        session.problems.append(f"{_FLAG}: cannot write the snapshot of {item.nodeid} to {path}: {why(exc)}")
        return
    item.add_report_section("call", "gpumem torch snapshot", f"memory snapshot: {path}")
