"""A card's memory snapshot (`torch.cuda.memory._dump_snapshot()`), read without running its code, and
replayed through the allocator's model: the card's figures (`card_figures`), its agreement with the model
(`agree`), what-ifs (`what_if`), a prediction set against it (`run_against`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cuda_allocator_model import lazy_names

if TYPE_CHECKING:
    from cuda_allocator_model.snapshots.against import run_against as run_against
    from cuda_allocator_model.snapshots.agreement import Agreement as Agreement
    from cuda_allocator_model.snapshots.agreement import agree as agree
    from cuda_allocator_model.snapshots.command import add_parser as add_replay_parser
    from cuda_allocator_model.snapshots.command import run as run_replay
    from cuda_allocator_model.snapshots.read import read_snapshot as read_snapshot
    from cuda_allocator_model.snapshots.read import snapshot_from_bytes as snapshot_from_bytes
    from cuda_allocator_model.snapshots.records import Event as Event
    from cuda_allocator_model.snapshots.records import Frame as Frame
    from cuda_allocator_model.snapshots.records import Snapshot as Snapshot
    from cuda_allocator_model.snapshots.records import SnapshotBlock as SnapshotBlock
    from cuda_allocator_model.snapshots.records import SnapshotSegment as SnapshotSegment
    from cuda_allocator_model.snapshots.replay import CardFigures as CardFigures
    from cuda_allocator_model.snapshots.replay import replay as card_figures
    from cuda_allocator_model.snapshots.start import StartState as StartState
    from cuda_allocator_model.snapshots.start import start_state as start_state
    from cuda_allocator_model.snapshots.whatif import DeviceReplay as DeviceReplay
    from cuda_allocator_model.snapshots.whatif import WhatIf as WhatIf
    from cuda_allocator_model.snapshots.whatif import what_if as what_if

_HOMES = {
    "Agreement": "cuda_allocator_model.snapshots.agreement",
    "CardFigures": "cuda_allocator_model.snapshots.replay",
    "DeviceReplay": "cuda_allocator_model.snapshots.whatif",
    "Event": "cuda_allocator_model.snapshots.records",
    "Frame": "cuda_allocator_model.snapshots.records",
    "Snapshot": "cuda_allocator_model.snapshots.records",
    "SnapshotBlock": "cuda_allocator_model.snapshots.records",
    "SnapshotSegment": "cuda_allocator_model.snapshots.records",
    "StartState": "cuda_allocator_model.snapshots.start",
    "WhatIf": "cuda_allocator_model.snapshots.whatif",
    "add_replay_parser": "cuda_allocator_model.snapshots.command:add_parser",
    "agree": "cuda_allocator_model.snapshots.agreement",
    "read_snapshot": "cuda_allocator_model.snapshots.read",
    "card_figures": "cuda_allocator_model.snapshots.replay:replay",
    "run_replay": "cuda_allocator_model.snapshots.command:run",
    "run_against": "cuda_allocator_model.snapshots.against",
    "snapshot_from_bytes": "cuda_allocator_model.snapshots.read",
    "start_state": "cuda_allocator_model.snapshots.start",
    "what_if": "cuda_allocator_model.snapshots.whatif",
}

__all__ = [
    "Agreement",
    "CardFigures",
    "DeviceReplay",
    "Event",
    "Frame",
    "Snapshot",
    "SnapshotBlock",
    "SnapshotSegment",
    "StartState",
    "WhatIf",
    "add_replay_parser",
    "agree",
    "card_figures",
    "read_snapshot",
    "run_against",
    "run_replay",
    "snapshot_from_bytes",
    "start_state",
    "what_if",
]


__getattr__ = lazy_names(__name__, _HOMES)
