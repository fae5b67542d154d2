"""The allocator's model's own fixtures. This folder runs without torch (`.ci/pythons`, with
`--confcutdir tests/allocator_model`, on the oldest and newest Python the package supports): what its tests
share is here, not in tests/conftest.py, which imports torch."""

from __future__ import annotations

from pathlib import Path

import pytest

from cuda_allocator_model.snapshots.read import Snapshot, read_snapshot

SNAPSHOTS = Path(__file__).resolve().parents[3] / "shared" / "snapshots"


@pytest.fixture(scope="session")
def snapshot_cards() -> dict[str, Snapshot]:
    """The real cards' snapshots of ../shared/snapshots by file name, read once per worker (several test
    files replay them); skips where the folder is absent."""
    if not SNAPSHOTS.is_dir():
        pytest.skip(f"no snapshots folder at {SNAPSHOTS}")
    return {path.name: read_snapshot(path) for path in sorted(SNAPSHOTS.glob("*.pickle"))}
