"""The ledger holds its events back for the allocator's model while nothing needs the model's answer at the op,
and replays them when anyone reads: every figure must be what the model gives when it serves each event at
its op. These tests fail if a held event is lost, served twice or served out of order."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from builders import FakeStorage, same_random_program

from cuda_allocator_model import AllocatorSettings, CachingAllocatorModel
from pytest_gpumem.backends.base import Counters
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.backends.tracker.ledger import REPLAY_AT, StorageLedger
from pytest_gpumem.backends.tracker.recording import Recorder

MIB = 2**20


def test_a_peak_that_depends_on_the_order_of_a_free_and_an_allocation_is_read_mid_phase(
    cuda_rounding: TrackerBackend,
) -> None:
    # 12 MiB takes a segment of its own; freed, the next 12 MiB reuses it: 12 MiB reserved at most. Served
    # out of order (the allocation before the free) the peak would be 24 MiB; a lost free, 24 MiB allocated.
    first = torch.empty(12 * MIB, dtype=torch.uint8)
    del first
    second = torch.empty(12 * MIB, dtype=torch.uint8)
    assert cuda_rounding.ledger._held  # nothing has read the model yet: both events are held
    assert cuda_rounding.current() == Counters(12 * MIB, 12 * MIB, 12 * MIB)
    assert cuda_rounding.peak() == Counters(12 * MIB, 12 * MIB, 12 * MIB)
    del second
    # 4 MiB splits the cached 12 MiB segment (8 MiB left, more than 1 MiB: split), no new segment
    third = torch.empty(4 * MIB, dtype=torch.uint8)
    assert cuda_rounding.current() == Counters(4 * MIB, 4 * MIB, 12 * MIB)
    del third


def test_more_events_than_are_held_at_once_are_all_served(cuda_rounding: TrackerBackend) -> None:
    count = REPLAY_AT + 100  # 1 KiB blocks: 2,048 to a 2 MiB segment of the small pool
    kept = [torch.empty(1024, dtype=torch.uint8) for _ in range(count)]
    assert len(cuda_rounding.ledger._held) == count - REPLAY_AT  # the first REPLAY_AT served in one replay
    assert cuda_rounding.current() == Counters(count * 1024, count * 1024, 2 * MIB)
    del kept[::2]
    assert cuda_rounding.current() == Counters(count // 2 * 1024, count // 2 * 1024, 2 * MIB)
    assert cuda_rounding.peak().allocated == count * 1024


def test_a_capacity_serves_each_allocation_at_its_op_and_runs_out_there(cuda_rounding: TrackerBackend) -> None:
    held = [torch.empty(MIB, dtype=torch.uint8)]  # held back: no capacity yet
    with cuda_rounding.held_to(3 * MIB):  # the held event served before the capacity applies
        assert not cuda_rounding.ledger._held
        held.append(torch.empty(MIB, dtype=torch.uint8))  # the same 2 MiB segment
        assert not cuda_rounding.ledger._held  # served at its op: the next may run out
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 2\.0 MiB"):
            held.append(torch.empty(MIB, dtype=torch.uint8))  # a second segment: 4 MiB reserved
    assert cuda_rounding.current() == Counters(2 * MIB, 2 * MIB, 2 * MIB)
    del held


def test_a_memory_fraction_of_the_card_serves_each_allocation_at_its_op_and_runs_out_there() -> None:
    settings = AllocatorSettings.parse("per_process_memory_fraction:0.5").on_card(8 * MIB)  # refused past 4 MiB
    ledger = StorageLedger("cuda", settings=settings)
    kept = [FakeStorage(1, MIB)]  # a 2 MiB segment of the small pool
    ledger.add(kept[0])
    assert not ledger._held
    kept.append(FakeStorage(2, 3 * MIB))  # a 20 MiB segment of the large pool: past the fraction
    with pytest.raises(MemoryError, match=r"per_process_memory_fraction 0\.5 of the card"):
        ledger.add(kept[1])
    assert (ledger.allocated, ledger.reserved) == (MIB, 2 * MIB)


def test_a_free_that_a_collection_makes_during_a_replay_is_served_in_it_after_the_events_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ledger = StorageLedger("cuda")
    dropped = [FakeStorage(1, 1000)]
    ledger.add(dropped[0])
    ledger.add(FakeStorage(2, 600))  # its last reference gone: its free is held too
    kept = FakeStorage(3, 2000)
    ledger.add(kept)
    malloc = CachingAllocatorModel.malloc

    def collecting(model: CachingAllocatorModel, key: int, nbytes: int, stream: int = 0) -> int:
        dropped.clear()  # the first storage's last reference: freed while the replay runs
        return malloc(model, key, nbytes, stream)

    monkeypatch.setattr(CachingAllocatorModel, "malloc", collecting)
    # served: 1 (1,024 B), 2 (1,024 B), 2's free, 3 (2,048 B), then 1's free, appended while 1 was served
    assert (ledger.allocated, ledger.peak_allocated) == (2048, 1024 + 2048)
    assert ledger.model is not None
    assert ledger.model.live_blocks() == {3: 2048}


SETTINGS = [
    "",
    "expandable_segments:True",
    "max_split_size_mb:24",
    "roundup_power2_divisions:4",
    "max_split_size_mb:32,roundup_power2_divisions:[256:1,512:2,>:8],large_segment_size_mb:16",
]


@pytest.mark.parametrize("origins", [False, True], ids=["bare", "origins kept"])
@pytest.mark.parametrize("conf", SETTINGS)
def test_held_events_leave_every_figure_as_events_served_at_their_op_do(conf: str, origins: bool) -> None:
    settings = AllocatorSettings.parse(conf)
    late = StorageLedger("cuda", settings=settings)
    late.recorder = Recorder(events=False) if origins else None  # a leak limit's: events still held
    at_once = StorageLedger("cuda", settings=settings)
    at_once.recorder = Recorder(events=True)  # keeps the bytes after each event: the model serves each at its op
    rng = random.Random(conf)
    reads = 0
    for step, roll in same_random_program((late, at_once), rng, 2500, (4096, 2 * MIB, 64 * MIB)):
        if roll < 0.92:
            late.empty_cache()
            at_once.empty_cache()
        elif roll < 0.93:
            late.reset_peak()
            at_once.reset_peak()
        else:
            reads += bool(late._held)  # a read that replays
            assert _figures(late) == _figures(at_once), f"read after event {step}"
    assert _figures(late) == _figures(at_once)
    assert late.model is not None and not late._held
    assert reads > 50


def _figures(ledger: StorageLedger) -> tuple[Any, ...]:
    model = ledger.model
    assert model is not None
    counters = (ledger.allocated, ledger.requested, ledger.reserved, model.inactive_split)
    peaks = (ledger.peak_allocated, ledger.peak_requested, ledger.peak_reserved, model.peak_inactive_split)
    counted = {key: ref.counted for key, ref in ledger.live.items()}
    return counters, peaks, model.segments(), counted, model.live_blocks(), model.num_alloc_retries


def test_the_ledger_serves_at_once_wherever_something_reads_after_each_event() -> None:
    ledger = StorageLedger("cuda")
    kept = [FakeStorage(1, 100)]
    ledger.add(kept[0])
    assert len(ledger._held) == 1
    ledger.recorder = Recorder(events=True)  # served before it looks: it sees what follows, in order
    assert not ledger._held
    ledger.add(FakeStorage(2, 100))
    assert not ledger._held
    assert ledger.recorder.events is not None
    assert [(e["action"], e["allocated"]) for e in ledger.recorder.events] == [("alloc", 1024), ("free", 512)]
    ledger.recorder = None
    kept += [FakeStorage(3, 100), FakeStorage(4, 100)]
    ledger.add(kept[1])  # served at once, as the first event after any change: it decides anew
    assert not ledger._held
    ledger.add(kept[2])
    assert len(ledger._held) == 1
    del kept


def test_a_recorder_of_origins_alone_leaves_the_events_held_and_names_each_storage_at_its_op() -> None:
    ledger = StorageLedger("cuda")
    ledger.recorder = Recorder(events=False)  # a leak limit's: where each storage came from, no figures
    ledger.op = "aten::empty"
    kept = [FakeStorage(1, 100)]
    ledger.add(kept[0])  # the first event after a change: served at once, and it decides anew
    kept.append(FakeStorage(2, 3000))
    ledger.add(kept[1])
    assert len(ledger._held) == 1
    origin = ledger._live[2].origin
    assert origin is not None and origin.op == "aten::empty"
    assert (ledger.allocated, {key: ref.counted for key, ref in ledger.live.items()}) == (512 + 3072, {1: 512, 2: 3072})
