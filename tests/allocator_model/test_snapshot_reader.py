"""The snapshot reader runs no code and refuses what is not a snapshot in one line; the replay gives a card's
peaks from its trace. Real cards' snapshots are read from ../shared/snapshots (skipped when absent)."""

from __future__ import annotations

import gc
import os
import pickle
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from cuda_allocator_model import ModelError
from cuda_allocator_model.snapshots import pickled
from cuda_allocator_model.snapshots.against import compare
from cuda_allocator_model.snapshots.pickled import MAX_TUPLES, Refused, extent
from cuda_allocator_model.snapshots.read import Snapshot, read_snapshot, snapshot_from_bytes
from cuda_allocator_model.snapshots.replay import replay, starts_empty

MiB = 1 << 20
SNAPSHOTS = Path(__file__).resolve().parents[3] / "shared" / "snapshots"
FROM_EMPTY = {  # the catalog's from-empty traces
    "NiuHuangxiaozi__assignment2-systems__fwd_ctx100_fp32.pickle",
    "NiuHuangxiaozi__assignment2-systems__fwd_ctx200_bf16autocast.pickle",
    "NiuHuangxiaozi__assignment2-systems__train_ctx100_fp32.pickle",
    "shreyansh26__MLSys-Experiments__profile_grad.pickle",
    "silmont2000__assignment2-systems__mem_snapshot.pickle",
    "a0kuma__ckptTry__mlp_actckpt_fwdbwd.pickle",
    "a0kuma__ckptTry__mlp_nockpt_fwdbwd.pickle",
    "dmasloff__effdl26-liger-kernel-report__ce_fwdbwd.pickle",
    "dmasloff__effdl26-liger-kernel-report__liger_ce_fwdbwd.pickle",
    "HugePandaCoder__octree-nca-groupeq__cuda_single_step.pickle",  # its one older segment is never used
}
FINAL_STATE = {  # segments only: no trace, or one event
    "CognitoBlocks__BlockZero__segments.pickle",
    "Yiyi-philosophy__LLM-inference__flexgen_opt1.3b_segments.pickle",
    "ZijianDu__Attention__sd_img2img_vit_segments.pickle",
}
SMALL, LARGE = 0x7F0000000000, 0x7F0010000000  # segment addresses of the hand-made trace


def frame(name: str, filename: str = "train.py", line: int = 1) -> dict[str, Any]:
    return {"name": name, "filename": filename, "line": line}


def event(action: str, addr: int, size: int, **extra: Any) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": [frame("step")], **extra}


def hand_made() -> dict[str, Any]:
    """A from-empty trace: 1000 B and 600 B in a 2 MiB small segment, the 1000 B freed, then 3,000,000 B in a
    20 MiB large segment, freed, its segment released."""
    trace = [
        event("segment_alloc", SMALL, 2 * MiB),
        event("alloc", SMALL, 1000, time_us=1),
        event("alloc", SMALL + 1024, 600, compile_context="N/A", user_metadata=""),
        event("free_requested", SMALL, 1000),
        event("free_completed", SMALL, 1000),
        event("segment_alloc", LARGE, 20 * MiB),
        event("alloc", LARGE, 3_000_000),
        event("free_requested", LARGE, 3_000_000),
        event("free_completed", LARGE, 3_000_000),
        event("segment_free", LARGE, 20 * MiB),
    ]
    block = {"address": SMALL + 1024, "size": 1024, "requested_size": 600, "state": "active_allocated", "frames": []}
    free = {"address": SMALL, "size": 2 * MiB - 1024, "requested_size": 0, "state": "inactive", "frames": []}
    segment = {
        "device": 0, "address": SMALL, "total_size": 2 * MiB, "stream": 0, "segment_type": "small",
        "is_expandable": False, "blocks": [free, block], "segment_pool_id": (0, 0), "frames": [],
    }  # fmt: skip
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "expandable_segments": False}
    settings["roundup_power2_divisions"] = {str(1 << i): 0 for i in range(16)}
    annotations = [{"stage": "START", "name": "Optimizer.step#AdamW.step", "device": 0, "time_us": 5}]
    return {
        "segments": [segment],
        "device_traces": [trace, []],
        "allocator_settings": settings,
        "external_annotations": annotations,
    }


def refusal(data: bytes) -> str:
    with pytest.raises(ModelError) as caught:
        snapshot_from_bytes(data, "card.pickle")
    message = str(caught.value)
    assert "\n" not in message and message.startswith("card.pickle: ")
    return message


# ------------------------------------------------------------------------------------------- refused


def test_a_pickle_naming_a_global_is_refused_without_running_it(tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    data = f"cos\nsystem\n(S'touch {ran}'\ntR.".encode()
    assert "the global os.system" in refusal(data)
    assert not ran.exists()


def test_a_global_inside_an_otherwise_good_snapshot_is_refused() -> None:
    from collections import OrderedDict

    snapshot = hand_made()
    snapshot["segments"][0]["blocks"][0]["frames"] = OrderedDict()
    assert "the global collections.OrderedDict" in refusal(pickle.dumps(snapshot))


def test_a_truncated_file_is_refused() -> None:
    data = pickle.dumps(hand_made())
    assert "cut short" in refusal(data[: len(data) // 2])


def test_a_git_lfs_pointer_is_refused() -> None:
    pointer = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 622340\n"
    assert "a Git LFS pointer" in refusal(pointer)


@pytest.mark.parametrize(
    ("value", "found"),
    [
        ([1, 2, 3], "holds a list, not a dict"),
        ({"weights": 1}, "without 'segments' and 'device_traces' (keys: weights)"),
        ({"segments": [], "device_traces": [[{"action": "alloc", "addr": 0, "size": "8"}]]}, "'size' is a str"),
        ({"segments": [], "device_traces": [[{"action": "teleport", "addr": 0, "size": 8}]]}, "unknown action"),
        ({"segments": [], "device_traces": [[{"action": "alloc", "addr": True, "size": 8}]]}, "'addr' is a bool"),
        (
            {"segments": [], "device_traces": [[{"action": "alloc", "addr": 0, "size": 8, "time_us": "1"}]]},
            "device_traces[0][0]: 'time_us' is a str",
        ),
        ({"segments": [{"address": 0}], "device_traces": []}, "segments[0] has no 'total_size'"),
    ],
)
def test_what_is_not_a_snapshot_is_refused_in_one_line(value: object, found: str) -> None:
    assert found in refusal(pickle.dumps(value))


def shared_traces() -> bytes:
    trace = hand_made()["device_traces"][0]
    return pickle.dumps({"segments": [], "device_traces": [trace] * 1000})


def with_event(**fields: Any) -> bytes:
    snapshot = hand_made()
    snapshot["device_traces"][0][1].update(fields)
    return pickle.dumps(snapshot)


def with_divisions(divisions: dict[Any, Any]) -> bytes:
    snapshot = hand_made()
    snapshot["allocator_settings"]["roundup_power2_divisions"] = divisions
    return pickle.dumps(snapshot)


@pytest.mark.parametrize(
    ("data", "found"),
    [
        (b"\x80\x04}}b.", "not a pickle of plain data (the opcode BUILD at byte 4)"),
        (b"\x80\x04\x8d" + struct.pack("<Q", 1 << 63) + b".", "cut short after 12 bytes (truncated: 9,223,372,036"),
        (b"\x80\x04}N" + b"\x85" * 1_000_000 + b"K\x01s.", f"more than {MAX_TUPLES:,} nested tuples"),
        (b"Nr" + struct.pack("<I", 1 << 27) + b".", "a memo index of 134,217,728 at byte 1"),
        (pickle.dumps({10**5000: 1}), "a dict without 'segments' and 'device_traces' (keys: none)"),
        (shared_traces(), "device_traces[1] is the very list of device_traces[0]"),
        (with_event(size=-4096), "device_traces[0][1]: 'size' is -4,096, outside [0, 1,152,921,504,606,846,976)"),
        (with_event(addr=1 << 70), "device_traces[0][1]: 'addr' is 1,180,591,620,717,411,303,424, outside [0, "),
        (with_divisions({"²": 4}), "'roundup_power2_divisions' has the key '²', not a power of two in MiB"),
    ],
    ids=["build", "2^63-long", "deep-tuple", "memo", "huge-key", "shared", "negative", "address", "key"],
)
def test_a_hostile_pickle_is_refused_in_one_line_before_it_is_built(data: bytes, found: str) -> None:
    assert found in refusal(data)


def test_flat_tuples_such_as_pool_ids_are_not_counted_against_the_nesting_bound() -> None:
    snapshot = hand_made()
    snapshot["device_traces"][0] *= 2 * MAX_TUPLES // 10
    for e in snapshot["device_traces"][0]:
        e["pool_id"] = (0, 0)
    assert len(snapshot_from_bytes(pickle.dumps(snapshot)).trace()) == 2 * MAX_TUPLES


def test_reading_stops_at_the_pickles_end(tmp_path: Path) -> None:
    path = tmp_path / "tail.pickle"
    path.write_bytes(pickle.dumps(hand_made()) + b"\x00not read" * 1000)
    assert len(read_snapshot(path).trace()) == 10


@pytest.mark.parametrize("op", [b"N", b"K\x07", b"J\x00\x00\x00\x01"], ids=["1-byte", "2-byte", "5-byte"])
def test_a_run_of_safe_opcodes_longer_than_a_chunk_is_read_to_its_stop(op: bytes) -> None:
    # Python 3.10 matches runs 4,096 opcodes at a time: 10,000 of them end in the third chunk, at the STOP
    data = b"\x80\x04" + op * 10_000 + b"." + b"N" * 100
    assert extent(data) == 2 + len(op) * 10_000 + 1


def test_a_long_run_of_opcodes_before_a_tuple_is_checked_in_bounded_memory() -> None:
    # the check of the tuple's items reread the whole run with a greedy repeat: 285 MiB for this 2 MiB file
    data = b"\x80\x04" + b"N" * (2 * MiB) + b"\x85."
    tracemalloc.start()
    try:
        assert extent(data) == len(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < len(data) // 2, f"a peak of {peak:,} bytes to check {len(data):,}"


@pytest.mark.parametrize(
    ("run", "tuple_op", "flat"),
    [
        (b"N" * 10_000, b"\x85", True),
        (b"N" * 10_000 + b"]K\x01", b"\x86", False),
        (b"N" * 8190 + b"]NN", b"\x86", True),  # chunks of 4,096, 4,096 and 1 opcodes: items in the last two
        (b"N" * 8190 + b"]NN", b"\x87", False),
        (b"\x8c\xff" + b"x" * 255 + b"K\x01" * 5000 + b"G" + bytes(8), b"\x87", True),
        (b"K\x01", b"\x86", False),  # fewer opcodes in the run than the tuple's items
    ],
    ids=["1-of-10000", "list-then-int", "across-chunks", "list-across-chunks", "texts-ints-float", "short-run"],
)
def test_a_tuple_is_flat_when_the_run_before_it_ends_in_as_many_scalars(
    run: bytes, tuple_op: bytes, flat: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pickled, "MAX_TUPLES", 0)
    data = b"\x80\x04" + run + tuple_op + b"."
    if flat:
        assert extent(data) == len(data)
    else:
        with pytest.raises(Refused, match="more than 0 nested tuples"):
            extent(data)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ModelError, match=r"fifo: not a regular file \(a pipe, a device\), not a snapshot"):
        read_snapshot(tmp_path / "fifo")


def test_frame_text_is_made_printable() -> None:
    snapshot = hand_made()
    snapshot["device_traces"][0][1]["frames"] = [frame("\x1b]0;owned\x07", "tr\ud800ain.py")]
    frame_read = snapshot_from_bytes(pickle.dumps(snapshot)).trace()[1].frames[0]
    assert (frame_read.name, frame_read.filename) == ("\u241b]0;owned\u2407", "tr\ufffdain.py")


def test_a_text_file_is_refused() -> None:
    assert "not a pickle" in refusal(b"hello, world\n")


def test_a_missing_file_is_refused_with_its_name(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"nothing\.pickle: cannot read"):
        read_snapshot(tmp_path / "nothing.pickle")


@pytest.mark.parametrize("was_on", [True, False])
def test_reading_leaves_the_garbage_collector_as_it_found_it(was_on: bool) -> None:
    """The reader pauses Python's collector while it builds a trace; a read, a refusal and a comparison
    give it back as they found it (a user's process whose collector stayed off would grow without bound)."""
    good, bad = pickle.dumps(hand_made()), pickle.dumps({"segments": 1})
    (gc.enable if was_on else gc.disable)()
    try:
        snapshot = snapshot_from_bytes(good)
        with pytest.raises(ModelError):
            snapshot_from_bytes(bad)
        compare(snapshot, snapshot)
        assert gc.isenabled() is was_on
    finally:
        gc.enable()


# ------------------------------------------------------------------------------------- a hand-made one


def test_a_hand_made_snapshot_reads_into_typed_records(tmp_path: Path) -> None:
    path = tmp_path / "hand.pickle"
    path.write_bytes(pickle.dumps(hand_made()))
    snapshot = read_snapshot(path)
    assert isinstance(snapshot, Snapshot) and snapshot.path == str(path)
    assert [len(t) for t in snapshot.traces] == [10, 0]
    second = snapshot.trace(0)[2]
    assert (second.action, second.addr, second.size, second.compile_context) == ("alloc", SMALL + 1024, 600, "N/A")
    assert second.frames[0].name == "step" and snapshot.trace(0)[1].time_us == 1
    assert [b.state for b in snapshot.segments[0].blocks] == ["inactive", "active_allocated"]
    assert snapshot.annotations[0].name == "Optimizer.step#AdamW.step"
    assert snapshot.allocator_settings is not None and snapshot.allocator_settings.describe() == ""
    assert snapshot.tier == "T6"  # user_metadata


def test_the_hand_made_trace_replays_to_peaks_derived_by_hand() -> None:
    figures = replay(snapshot_from_bytes(pickle.dumps(hand_made())))
    assert figures.from_empty
    # requested: 1000 + 600, then 600 + 3,000,000 after the first is freed
    assert figures.peak_requested == 3_000_600
    # blocks: 1000 -> 1024 and 600 -> 1024 B (512 B steps), 3,000,000 -> 3,000,320 B split off its 20 MiB
    # segment (more than 1 MiB remains); at the peak 1024 + 3,000,320
    assert figures.peak_allocated == 3_001_344
    # segments: 2 MiB small + 20 MiB large; the allocator's model fed the requests makes the same two
    assert figures.peak_reserved == figures.model_peak_reserved == 22 * MiB
    assert [e.size for e in figures.requests] == [1000, 600, 3_000_000]


def test_a_trace_that_frees_what_it_never_allocated_starts_warm() -> None:
    snapshot = hand_made()
    snapshot["device_traces"][0] = snapshot["device_traces"][0][3:]  # begins with the free of the 1000 B
    read = snapshot_from_bytes(pickle.dumps(snapshot))
    assert not starts_empty(read.trace())
    figures = replay(read)
    # live at the start: the 600 B block left at the end, and the 1000 B freed in the trace (1024 B counted)
    assert (figures.start_requested, figures.start_allocated) == (1600, 2048)
    # reserved at the start: the final 2 MiB segment; the trace adds 20 MiB and gives it back
    assert (figures.start_reserved, figures.peak_reserved) == (2 * MiB, 22 * MiB)


# ------------------------------------------------------------------------------------- real cards' files


@pytest.fixture
def cards(snapshot_cards: dict[str, Snapshot]) -> dict[str, Snapshot]:
    return snapshot_cards


def test_every_real_snapshot_reads(cards: dict[str, Snapshot]) -> None:
    assert len(cards) == 33
    assert {s.tier for s in cards.values()} == {"T0", "T1", "T2", "T3", "T4", "T5", "T6"}
    assert all(s.segments for s in cards.values())
    assert {name for name, s in cards.items() if len(s.trace(0)) < 2} == FINAL_STATE
    streams = {e.stream for e in cards["Maphsge4__select_n__llama_selectn_multistream.pickle"].trace()}
    assert len(streams) == 10


def test_torch_2_0s_blocks_lie_where_their_history_says(cards: dict[str, Snapshot]) -> None:
    name = "Yiyi-philosophy__LLM-inference__flexgen_opt1.3b_segments.pickle"
    raw = pickle.loads((SNAPSHOTS / name).read_bytes())
    live = [b["history"][-1]["addr"] for s in raw["segments"] for b in s["blocks"] if b["state"] != "inactive"]
    ours = [b for s in cards[name].segments for b in s.blocks if b.state != "inactive"]
    assert len(live) == 715 and live == [b.address for b in ours]
    assert all(sum(b.size for b in s.blocks) == s.total_size for s in cards[name].segments)


def test_the_from_empty_traces_are_the_catalogs(cards: dict[str, Snapshot]) -> None:
    assert {name for name, s in cards.items() if s.trace() and starts_empty(s.trace())} == FROM_EMPTY


def reserved_at_peak(snapshot: Snapshot) -> int:
    reserved = peak = 0
    for e in snapshot.trace():
        reserved += e.size if e.action == "segment_alloc" else -e.size if e.action == "segment_free" else 0
        peak = max(peak, reserved)
    return peak


@pytest.mark.parametrize("name", sorted(FROM_EMPTY))
def test_a_from_empty_replay_reserves_the_segments_of_its_trace(cards: dict[str, Snapshot], name: str) -> None:
    figures = replay(cards[name])
    assert figures.peak_reserved == reserved_at_peak(cards[name])
    assert figures.model_peak_reserved == figures.peak_reserved  # the allocator's model, fed the card's requests
    assert figures.peak_requested <= figures.peak_allocated <= figures.peak_reserved
