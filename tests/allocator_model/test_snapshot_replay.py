"""`pytest-gpumem replay`: a card's trace replayed through the allocator's model from the state walked back
at its start, its agreement with the card counted request by request, and what-ifs under other settings
and capacities. Snapshots are made here by hand; the shared corpus (../shared/snapshots) is replayed when
present."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path
from typing import Any

import pytest

from cuda_allocator_model.model import AllocatorOutOfMemory, CachingAllocatorModel
from cuda_allocator_model.settings import AllocatorSettings
from cuda_allocator_model.snapshots.agreement import agree
from cuda_allocator_model.snapshots.command import settings_for
from cuda_allocator_model.snapshots.read import Snapshot, snapshot_from_bytes
from cuda_allocator_model.snapshots.start import may_have_wrapped, restore, start_state
from cuda_allocator_model.snapshots.whatif import what_if
from pytest_gpumem.backends.tracker.torch_snapshot import RecordedModel, snapshot_of
from pytest_gpumem.cli import main

MiB = 1 << 20
LARGE = 0x7F0000000000


def event(action: str, addr: int, size: int, line: int = 7, **extra: Any) -> dict[str, Any]:
    frames = [{"name": "step", "filename": "/home/me/train.py", "line": line}]
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": frames, **extra}


def freed(addr: int, size: int) -> list[dict[str, Any]]:
    return [event("free_requested", addr, size), event("free_completed", addr, size)]


def segment(address: int, size: int, blocks: list[tuple[int, int, int, str]], kind: str = "large") -> dict[str, Any]:
    return {
        "device": 0, "address": address, "total_size": size, "stream": 0, "segment_type": kind,
        "is_expandable": False, "frames": [],
        "blocks": [{"address": a, "size": s, "requested_size": r, "state": st} for a, s, r, st in blocks],
    }  # fmt: skip


def snapshot(
    segments: list[dict[str, Any]], trace: list[dict[str, Any]], conf: str = "", max_split: int = -1
) -> Snapshot:
    settings = {"PYTORCH_CUDA_ALLOC_CONF": conf, "max_split_size": max_split, "expandable_segments": False}
    raw = {"segments": segments, "device_traces": [trace], "allocator_settings": settings}
    return snapshot_from_bytes(pickle.dumps(raw), "hand.pickle")


def warm() -> Snapshot:
    """Recording began with A (8 MiB at LARGE) and B (4 MiB after it) live in one 20 MiB segment; the trace
    frees B, takes 6 MiB where B was (split from the 12 MiB left free), and frees it."""
    b, c = LARGE + 8 * MiB, LARGE + 8 * MiB
    trace = [*freed(b, 4 * MiB), event("alloc", c, 6 * MiB), *freed(c, 6 * MiB)]
    blocks = [(LARGE, 8 * MiB, 8 * MiB, "active_allocated"), (LARGE + 8 * MiB, 12 * MiB, 0, "inactive")]
    return snapshot([segment(LARGE, 20 * MiB, blocks)], trace)


def from_empty(sizes: list[int], oom: tuple[int, int] | None = None) -> Snapshot:
    """Requests of `sizes` (each >= 10 MiB: a segment of its own, rounded to 2 MiB), none freed, at
    addresses LARGE, LARGE + 1 GiB, ...; then an `oom` of (size, device_free) where given."""
    trace: list[dict[str, Any]] = []
    for i, size in enumerate(sizes):
        addr = LARGE + i * 1024 * MiB
        trace += [event("segment_alloc", addr, -(-size // (2 * MiB)) * 2 * MiB), event("alloc", addr, size, 10 + i)]
    if oom is not None:
        trace.append({**event("oom", 0, oom[0]), "device_free": oom[1]})
    return snapshot([], trace)


# --------------------------------------------------------------------------------- the state at the start


def test_the_start_is_walked_back_from_the_final_segments() -> None:
    start = start_state(warm())
    assert [(s.address, s.size, s.small) for s in start.segments] == [(LARGE, 20 * MiB, False)]
    assert [(b.address, b.requested) for b in start.live] == [(LARGE, 8 * MiB), (LARGE + 8 * MiB, 4 * MiB)]
    assert start.exact and not start.empty and start.reserved == 20 * MiB


def test_a_gap_of_at_most_1_mib_after_a_live_block_is_its_unsplit_tail() -> None:
    requested = 19 * MiB + 1000  # rounded: 19 MiB + 1024 B; 1 MiB - 1024 B of the segment left after it
    blocks = [(LARGE, 20 * MiB, requested, "active_allocated")]
    model = CachingAllocatorModel()
    restore(model, start_state(snapshot([segment(LARGE, 20 * MiB, blocks)], [])))
    assert model.live_blocks() == {LARGE: 20 * MiB}
    assert (model.allocated, model.reserved, model.requested) == (20 * MiB, 20 * MiB, requested)
    model.check_consistency()


def test_a_live_oversize_block_makes_the_start_inexact() -> None:
    blocks = [(LARGE, 40 * MiB, 30 * MiB, "active_allocated")]  # 10 MiB left unsplit: max_split_size 20 MiB
    start = start_state(snapshot([segment(LARGE, 40 * MiB, blocks)], [], max_split=20 * MiB))
    assert start.caveats == ("1 live blocks of max_split_size or more: an unsplit remainder over 1 MiB is missed",)


def test_a_round_event_count_says_the_ring_buffer_may_have_wrapped() -> None:
    assert may_have_wrapped(10_000) and may_have_wrapped(100_000)
    assert not may_have_wrapped(19_917) and not may_have_wrapped(0)


@pytest.mark.parametrize(("overflowed", "said"), [(True, "wrapped"), (False, None), (None, "may have")])
def test_a_recorded_overflow_flag_says_for_sure_whether_the_ring_buffer_wrapped(
    overflowed: bool | None, said: str | None
) -> None:
    trace = [event("alloc", LARGE, 4 * MiB), *freed(LARGE, 4 * MiB)] * 1000  # 3,000 events: a round number
    raw: dict[str, Any] = {"segments": [segment(LARGE, 20 * MiB, [(LARGE, 20 * MiB, 0, "inactive")])]}
    raw |= {"device_traces": [trace], "trace_alloc_overflowed": overflowed}
    caveats = start_state(snapshot_from_bytes(pickle.dumps(raw))).caveats
    wrapped = [c for c in caveats if "ring buffer" in c]
    assert len(wrapped) == (said is not None) and all(said in c for c in wrapped if said)


# ------------------------------------------------------------------------------------------ agreement


def test_a_warm_trace_replays_in_agreement_with_the_card() -> None:
    a = agree(warm())
    assert (a.requests, a.decisions_matched, a.placements_matched, a.reserved_matched) == (1, 1, 1, 1)
    assert a.new_segments == 0 and a.peak_reserved_card == a.peak_reserved_model == 20 * MiB
    assert a.exact and a.first_mismatch is None


def test_new_segments_go_to_the_cards_addresses() -> None:
    a = agree(from_empty([12 * MiB, 30 * MiB]))
    assert (a.new_segments, a.decisions_matched, a.placements_matched) == (2, 2, 2)
    assert a.peak_reserved_model == 42 * MiB and a.exact


def test_a_placement_the_model_would_not_make_is_counted() -> None:
    trace = [event("segment_alloc", LARGE, 20 * MiB), event("alloc", LARGE + 4 * MiB, 2 * MiB)]
    a = agree(snapshot([], trace))
    assert (a.decisions_matched, a.placements_matched, a.first_mismatch) == (1, 0, 0)
    assert not a.exact


def test_the_cards_segment_releases_are_followed() -> None:
    trace = [event("segment_alloc", LARGE, 12 * MiB), event("alloc", LARGE, 12 * MiB), *freed(LARGE, 12 * MiB)]
    trace += [event("segment_free", LARGE, 12 * MiB), event("segment_alloc", LARGE, 14 * MiB)]
    trace += [event("alloc", LARGE, 14 * MiB)]
    a = agree(snapshot([segment(LARGE, 14 * MiB, [(LARGE, 14 * MiB, 14 * MiB, "active_allocated")])], trace))
    assert a.start.empty and a.releases_unmatched == 0
    assert (a.decisions_matched, a.reserved_matched, a.peak_reserved_model) == (2, 2, 14 * MiB)


def test_the_out_of_memory_event_is_reproduced_with_the_capacity_it_gives() -> None:
    # 12 + 14 MiB reserved when a 30 MiB request fails with 10 MiB free: capacity 36 MiB, 26 + 30 > 36
    a = agree(from_empty([12 * MiB, 14 * MiB], oom=(30 * MiB, 10 * MiB)))
    assert (a.capacity, a.card_oom_at, a.model_oom_at) == (36 * MiB, 2, 2) and a.exact


def test_an_out_of_memory_event_the_model_would_serve_is_a_disagreement() -> None:
    a = agree(from_empty([12 * MiB], oom=(30 * MiB, 100 * MiB)))
    assert (a.card_oom_at, a.model_oom_at) == (1, None) and not a.exact


# ------------------------------------------------------------------------------------------- what-ifs


def test_a_capacity_runs_out_at_the_request_with_its_size_and_frame() -> None:
    outcome = what_if(from_empty([12 * MiB, 12 * MiB]), AllocatorSettings(), 20 * MiB, "as recorded", "20 MiB")
    oom = outcome.out_of_memory
    assert oom is not None and (oom.request, oom.size, oom.frame) == (1, 12 * MiB, "train.py:11 step")
    assert outcome.peak_reserved == 12 * MiB


def test_expandable_segments_map_pages_of_the_large_segment_size() -> None:
    # 12 MiB maps one 20 MiB page; the second 12 MiB needs 4 MiB more: a second page. 24 MiB allocated.
    settings = AllocatorSettings(expandable_segments=True)
    outcome = what_if(from_empty([12 * MiB, 12 * MiB]), settings, None, "expandable_segments:True", "unlimited")
    assert (outcome.peak_reserved, outcome.unallocated_at_peak, outcome.out_of_memory) == (40 * MiB, 16 * MiB, None)
    assert list(outcome.reserved) == [0, 20 * MiB, 40 * MiB]


def test_a_what_if_conf_is_read_after_the_snapshots_own() -> None:
    recorded = snapshot([], [], conf="max_split_size_mb:100", max_split=100 * MiB)
    both = settings_for(recorded, "expandable_segments:True")
    assert both.max_split_size == 100 * MiB and both.expandable_segments
    assert settings_for(recorded, None).max_split_size == 100 * MiB


# ------------------------------------------------------------------------------------ the command line


def write(tmp_path: Path, snap: Snapshot | dict[str, Any] | bytes, name: str = "card.pickle") -> Path:
    path = tmp_path / name
    path.write_bytes(snap if isinstance(snap, bytes) else pickle.dumps(snap))
    return path


def raw_from_empty() -> dict[str, Any]:
    trace = [event("segment_alloc", LARGE, 12 * MiB), event("alloc", LARGE, 12 * MiB)]
    trace += [event("segment_alloc", LARGE + 1024 * MiB, 12 * MiB), event("alloc", LARGE + 1024 * MiB, 12 * MiB, 9)]
    seg = [(LARGE, 12 * MiB, 12 * MiB, "active_allocated")]
    seg2 = [(LARGE + 1024 * MiB, 12 * MiB, 12 * MiB, "active_allocated")]
    segments = [segment(LARGE, 12 * MiB, seg), segment(LARGE + 1024 * MiB, 12 * MiB, seg2)]
    return {"segments": segments, "device_traces": [trace]}


def test_replay_prints_the_agreement_and_the_what_ifs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, raw_from_empty())
    args = ["replay", str(path), "--alloc-conf", "expandable_segments:True", "--capacity", "20 MiB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "segment decisions 2/2 (2 new segments)" in out and "placements 2/2" in out
    assert "peak reserved: card 24.0 MiB, model equal" in out
    rows = [line.split() for line in out.splitlines() if line.endswith("train.py:9")]
    # 12 MiB fits 20 MiB, a second 12 MiB segment does not; expandable: one 20 MiB page, 8 MiB of it free
    assert rows == [
        ["as", "recorded", "20", "MiB", "12.0", "MiB", "0", "B", "#1", "12.0", "MiB", "train.py:9"],
        ["expandable_segments:True", "20", "MiB", "20.0", "MiB", "8.0", "MiB", "#1", "12.0", "MiB", "train.py:9"],
    ]  # fmt: skip
    assert max(map(len, out.splitlines()[1:])) <= 100


def test_replay_writes_json_for_machines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "replay.json"
    assert main(["replay", str(write(tmp_path, raw_from_empty())), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    device = doc["devices"][0]
    assert device["agreement"]["placements_matched"] == 2 and device["agreement"]["start"]["empty"]
    assert device["what_if"] == [
        {"setting": "as recorded", "capacity": "unlimited", "peak_reserved": 24 * MiB, "unallocated_at_peak": 0,
         "peak_allocated": 24 * MiB, "out_of_memory": None, "ignored": []},
    ]  # fmt: skip


def test_replay_draws_a_page_without_network_assets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "replay.html"
    args = ["replay", str(write(tmp_path, raw_from_empty())), "--alloc-conf", "expandable_segments:True"]
    assert main([*args, "--html", str(out)]) == 0
    page = out.read_text()
    assert page.count("<svg") == 1 and page.count("<polyline") == 5  # the card's, reserved and allocated per setting
    assert "<script" not in page and "src=" not in page and "href=" not in page


def test_the_page_marks_each_capacity_where_each_row_runs_out_and_the_cards_curve(tmp_path: Path) -> None:
    out = tmp_path / "replay.html"
    assert main(["replay", str(write(tmp_path, raw_from_empty())), "--capacity", "20 MiB", "--html", str(out)]) == 0
    page = out.read_text()
    assert "20 MiB: 20.0 MiB</text>" in page and page.count("<circle") == 1
    assert "the card, as traced: peak reserved 24.0 MiB (25,165,824 B)" in page
    assert (
        "as recorded, 20 MiB: peak reserved 12.0 MiB (12,582,912 B); runs out at request #1, 12.0 MiB (train.py:9 step)"
        in page
    )


@pytest.mark.parametrize(
    ("content", "found"),
    [
        (b"version https://git-lfs.github.com/spec/v1\noid sha256:00\n", "a Git LFS pointer"),
        (pickle.dumps({"segments": []}), "not a memory snapshot"),
        (pickle.dumps(raw_from_empty())[:40], "cut short"),
        (b"cos\nsystem\n(S'true'\ntR.", "names the global os.system"),
    ],
)
def test_a_bad_file_is_refused_in_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, found: str
) -> None:
    path = write(tmp_path, content, "bad.pickle")
    assert main(["replay", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"pytest-gpumem replay: error: {path}: ") and found in captured.err
    assert captured.err.count("\n") == 1


def test_a_missing_file_is_refused_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(tmp_path / "none.pickle")]) == 2
    assert "none.pickle: cannot read the snapshot" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [("--alloc-conf", "max_split_size_mb:x", "--alloc-conf"), ("--capacity", "Z80", "unknown card 'Z80'")],
)
def test_a_bad_what_if_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, said: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["replay", str(write(tmp_path, raw_from_empty())), option, value])
    assert exited.value.code == 2 and said in capsys.readouterr().err


# ---------------------------------------------------------------------------------- the shared corpus


def test_every_card_of_the_corpus_is_replayed_exactly(snapshot_cards: dict[str, Snapshot]) -> None:
    for name, snap in snapshot_cards.items():
        for device, trace in enumerate(snap.traces):
            if trace:
                a = agree(snap, device)
                assert a.decisions_matched == a.reserved_matched == a.requests, name
                assert a.placements_matched >= 0.999 * a.requests, name
                assert a.peak_reserved_card == a.peak_reserved_model, name


# ------------------------------------------------------------------------- snapshots we write ourselves


def recorded(conf: str, seed: int) -> dict[str, Any]:
    """A snapshot written by our recorded allocator model: 600 requests of training-like sizes, most freed
    soon after, an empty_cache() half way."""
    rng = random.Random(seed)
    model = RecordedModel(AllocatorSettings.parse(conf))
    sizes = [512, 3000, 700_000, 1 << 20, 3 << 20, 12 << 20, 25 << 20]
    live: list[int] = []
    for key in range(600):
        if key == 300:
            model.empty_cache()
        if live and rng.random() < 0.45:
            model.free(live.pop(rng.randrange(len(live))))
        model.malloc(key, rng.choice(sizes) - rng.randrange(500), stream=rng.choice((0, 0, 0, 7)))
        live.append(key)
    return snapshot_of(model, conf)


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:20", "roundup_power2_divisions:4"])
def test_a_snapshot_we_wrote_replays_exactly(conf: str) -> None:
    a = agree(snapshot_from_bytes(pickle.dumps(recorded(conf, seed=1))))
    assert a.requests == 600 and a.start.empty and a.exact


@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_a_recording_begun_late_is_walked_back_and_replays_exactly(conf: str) -> None:
    raw = recorded(conf, seed=2)
    trace = raw["device_traces"][0]
    cut = next(i for i in range(len(trace) // 2, len(trace)) if trace[i]["action"] == "alloc")
    cut -= sum(1 for e in reversed(trace[:cut]) if e["action"].startswith("segment"))  # keep them with it
    raw["device_traces"][0] = trace[cut:]
    a = agree(snapshot_from_bytes(pickle.dumps(raw)))
    assert not a.start.empty and a.start.exact
    assert a.exact and a.requests == sum(1 for e in trace[cut:] if e["action"] == "alloc")


@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_an_out_of_memory_we_wrote_is_reproduced_at_the_same_request(conf: str) -> None:
    model = RecordedModel(AllocatorSettings.parse(conf), capacity=200 * MiB)
    served = 0
    with pytest.raises(AllocatorOutOfMemory):
        for key in range(100):
            model.malloc(key, 30 * MiB + 1000 * key)
            served += 1
    a = agree(snapshot_from_bytes(pickle.dumps(snapshot_of(model, conf))))
    assert a.capacity == 200 * MiB and a.card_oom_at == a.model_oom_at == served and a.exact


# ------------------------------------------------------------------------------ outputs and limits


def test_an_output_over_the_snapshot_or_over_another_output_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, raw_from_empty())
    before = path.read_bytes()
    assert main(["replay", str(path), "--json", str(tmp_path / "." / "card.pickle")]) == 2
    assert f"--json {tmp_path}/card.pickle is the snapshot read; write it elsewhere" in capsys.readouterr().err
    out = tmp_path / "out"
    assert main(["replay", str(path), "--json", str(out), "--html", str(out)]) == 2
    assert f"--html {out} is --json's output too" in capsys.readouterr().err
    assert path.read_bytes() == before and not out.exists()


def test_a_memory_fraction_is_of_the_named_cards_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 0.1 of the H100-80GB's 85,020,639,232 B is 8,502,063,923 B: 6 GiB fits, 6 GiB + 2 GiB does not
    trace = [event("segment_alloc", LARGE, 6 << 30), event("alloc", LARGE, 6 << 30, 10)]
    trace += [event("segment_alloc", LARGE + (8 << 30), 2 << 30), event("alloc", LARGE + (8 << 30), 2 << 30, 11)]
    path = write(tmp_path, {"segments": [], "device_traces": [trace]}, "fraction.pickle")
    conf = "per_process_memory_fraction:0.1"
    assert main(["replay", str(path), "--alloc-conf", conf, "--capacity", "H100-80GB"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if "H100-80GB" in line]
    assert [row[0] for row in rows] == ["as", conf]
    assert rows[0][-1] == "no" and rows[1][-4:] == ["#1", "2.0", "GiB", "train.py:11"]
    assert main(["replay", str(path), "--alloc-conf", conf, "--capacity", "24 GiB"]) == 2
    assert "--capacity 24 GiB is a size, not a card: name one" in capsys.readouterr().err
    assert main(["replay", str(path), "--alloc-conf", conf]) == 2
    assert "per_process_memory_fraction is a share of a card's memory, but no --capacity names a card" in (
        capsys.readouterr().err
    )


# ------------------------------------------------------------------------------------ a final state only


def final_state() -> dict[str, Any]:
    """No trace: a 20 MiB segment holding 8 MiB live (allocated at train.py:12), a free 2 MiB small segment,
    and a private pool's 40 MiB segment holding 30 MiB live (at cache.py:5)."""
    small, private = LARGE + 64 * MiB, LARGE + 128 * MiB
    a = segment(
        LARGE, 20 * MiB, [(LARGE, 8 * MiB, 8 * MiB, "active_allocated"), (LARGE + 8 * MiB, 12 * MiB, 0, "inactive")]
    )
    a["blocks"][0]["frames"] = [{"name": "step", "filename": "/home/me/train.py", "line": 12}]
    b = segment(small, 2 * MiB, [(small, 2 * MiB, 0, "inactive")], "small")
    c = segment(
        private,
        40 * MiB,
        [(private, 30 * MiB, 30 * MiB, "active_allocated"), (private + 30 * MiB, 10 * MiB, 0, "inactive")],
    )
    c["blocks"][0]["frames"] = [{"name": "kv", "filename": "/srv/cache.py", "line": 5}]
    c["segment_pool_id"] = (1, 0)
    return {"segments": [a, b, c], "device_traces": [[]]}


def test_a_final_state_says_what_held_memory_and_whether_a_card_holds_it_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, report = write(tmp_path, final_state()), tmp_path / "final.json"
    assert main(["replay", str(path), "--capacity", "40 MiB", "--json", str(report)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert (
        "  default pool: reserved 22.0 MiB in 2 segments; allocated 8.0 MiB in 1 live blocks (requested 8.0 MiB)" in out
    )
    assert "    free in the cache 14.0 MiB: 2.0 MiB whole segments (empty_cache frees them), 12.0 MiB beside live " \
        "blocks (fragmentation), largest 12.0 MiB" in out  # fmt: skip
    assert [line.split()[-2:] for line in out if line.endswith(("step", "kv"))] == [
        ["cache.py:5", "kv"],
        ["train.py:12", "step"],
    ]
    device = json.loads(report.read_text())["devices"][0]
    assert device["all_pools"]["reserved"] == 62 * MiB and device["all_pools"]["allocated"] == 38 * MiB
    assert [p["pool"] for p in device["pools"]] == [[0, 0], [1, 0]] and device["pools"][1][
        "free_between_live_blocks"
    ] == 10 * MiB
    # again on an empty cache: 8 MiB takes a 20 MiB segment, 30 MiB one of 30 MiB: 50 MiB, past 40 MiB
    (what_if,) = device["what_if"]
    assert what_if["out_of_memory"]["size"] == 30 * MiB and what_if["headroom"] is None
    assert main(["replay", str(path), "--json", str(report)]) == 0
    (unlimited,) = json.loads(report.read_text())["devices"][0]["what_if"]
    assert (unlimited["peak_reserved"], unlimited["unallocated_at_peak"]) == (50 * MiB, 12 * MiB)


def test_a_card_that_ran_out_and_went_on_replays_under_its_own_capacity_to_its_peak(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """12 MiB, then a fit's probe of 2^53 B refused with 10 MiB free (the card's capacity: 22 MiB), then
    10 MiB more: the card went on to 22 MiB reserved, and so does the what-if under the card's capacity."""
    second = LARGE + 1024 * MiB
    trace = [event("segment_alloc", LARGE, 12 * MiB), event("alloc", LARGE, 12 * MiB)]
    trace += [{**event("oom", 0, 1 << 53, 9), "device_free": 10 * MiB}]
    trace += [event("segment_alloc", second, 10 * MiB), event("alloc", second, 10 * MiB)]
    report = tmp_path / "fit.json"
    assert (
        main(["replay", str(write(tmp_path, {"segments": [], "device_traces": [trace]})), "--json", str(report)]) == 0
    )
    (what_if,) = json.loads(report.read_text())["devices"][0]["what_if"]
    assert (what_if["capacity"], what_if["peak_reserved"]) == ("the card's 22.0 MiB", 22 * MiB)
    assert what_if["out_of_memory"] == {"request": 1, "size": 1 << 53, "frame": "train.py:9 step"}
