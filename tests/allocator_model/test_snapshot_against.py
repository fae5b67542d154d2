"""A prediction held against a card: the two request sequences aligned on their sizes, peaks side by side,
the first requests that differ with the card's frames and our op and line. The snapshots are written here
(the card's as torch writes one, ours by the snapshot writer); the corpus (../shared/snapshots) is read when
present."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cuda_allocator_model.snapshots.against import compare, render, to_json
from cuda_allocator_model.snapshots.align import align
from cuda_allocator_model.snapshots.read import Snapshot, read_snapshot, snapshot_from_bytes
from pytest_gpumem.backends.tracker.torch_snapshot import RecordedModel, snapshot_bytes, snapshot_of

MiB = 1 << 20
SNAPSHOTS = Path(__file__).resolve().parents[3] / "shared" / "snapshots"


def recorded(*sizes: int) -> RecordedModel:
    """The allocator's model after requests of `sizes`, each freed after the next is made (the last kept)."""
    model = RecordedModel()
    for key, size in enumerate(sizes):
        model.malloc(key, size)
        if key:
            model.free(key - 1)
    return model


def ours(*sizes: int) -> Snapshot:
    """Our snapshot of requests of `sizes` (`recorded`)."""
    return snapshot_from_bytes(snapshot_bytes(snapshot_of(recorded(*sizes))), "ours.pickle")


def card_frames(op: str, line: int) -> list[dict[str, Any]]:
    """Frames as a card records them: C++ (the allocator, the op) then Python, innermost first."""
    return [
        {"name": "c10::cuda::CUDACachingAllocator::malloc", "filename": "??", "line": 0},
        {"name": f"at::_ops::{op}::call", "filename": "??", "line": 0},
        {"name": "forward", "filename": "/home/u/model.py", "line": line},
        {"name": "forward", "filename": "/usr/lib/python3/site-packages/torch/nn/modules/module.py", "line": 9},
    ]


def card(*requests: tuple[int, str, int]) -> Snapshot:
    """A card's snapshot (the trace torch records) of requests (size, op, line), as `ours` orders them."""
    written = snapshot_of(recorded(*(size for size, _, _ in requests)))
    allocs = [e for e in written["device_traces"][0] if e["action"] == "alloc"]
    for event, (_, op, line) in zip(allocs, requests, strict=True):
        event["frames"] = card_frames(op, line)
    return snapshot_from_bytes(snapshot_bytes(written), "card.pickle")


def test_the_same_work_agrees_in_every_request_and_peak() -> None:
    comparison = compare(ours(4000, 12 * MiB, 400), ours(4000, 12 * MiB, 400))
    assert comparison.agree
    assert (comparison.aligned, comparison.difference_count) == (3, 0)
    assert "every request of the card is the prediction's, in order and size" in render(comparison)


def test_peaks_are_each_snapshots_own() -> None:
    comparison = compare(card((4000, "empty", 1), (12 * MiB, "mm", 7)), ours(4000, 8 * MiB))
    # card: 4,096 B block + 12 MiB; ours: 4,096 B + 8 MiB; reserved 2 MiB small + 12 MiB / 20 MiB large
    assert (comparison.card.allocated, comparison.card.requested, comparison.card.reserved) == (
        4096 + 12 * MiB, 4000 + 12 * MiB, 14 * MiB,
    )  # fmt: skip
    assert (comparison.ours.allocated, comparison.ours.requested, comparison.ours.reserved) == (
        4096 + 8 * MiB, 4000 + 8 * MiB, 22 * MiB,
    )  # fmt: skip
    assert not comparison.agree


def test_the_first_difference_names_the_cards_op_and_line_and_ours() -> None:
    comparison = compare(
        card((4000, "empty", 1), (12 * MiB, "mm", 7), (400, "add_Tensor", 8)), ours(4000, 8 * MiB, 400)
    )
    assert (comparison.aligned, comparison.difference_count) == (2, 1)
    (difference,) = comparison.differences
    assert difference.kind == "replace"
    assert difference.card is not None and difference.ours is not None
    assert (difference.card.index, difference.card.size, difference.card.op) == (1, 12 * MiB, "mm")
    assert difference.card.line == "model.py:7 forward"
    assert (difference.ours.index, difference.ours.size, difference.ours.op) == (1, 8 * MiB, "?")


def test_a_request_only_one_side_makes_is_said() -> None:
    comparison = compare(card((4000, "empty", 1), (600, "add_Tensor", 3), (400, "mul", 4)), ours(4000, 400))
    (difference,) = comparison.differences
    assert (difference.kind, difference.ours, difference.card_count, difference.our_count) == ("delete", None, 1, 0)
    text = render(comparison)
    assert "card #1: 600 B by add_Tensor at model.py:3 forward" in text
    assert "ours: nothing here" in text


def test_the_text_fits_100_columns_and_shows_peaks_side_by_side() -> None:
    comparison = compare(card((4000, "empty" * 30, 1), (12 * MiB, "mm", 7)), ours(4000, 8 * MiB))
    lines = render(comparison).splitlines()
    assert max(map(len, lines)) <= 100
    assert lines[3:7] == [
        "                          card    prediction  difference",
        "peak allocated        12.0 MiB       8.0 MiB  -4.0 MiB (-33.3%)",
        "peak reserved         14.0 MiB      22.0 MiB  +8.0 MiB (+57.1%)",
        "peak requested        12.0 MiB       8.0 MiB  -4.0 MiB (-33.3%)",
    ]


def test_the_json_form_holds_every_figure() -> None:
    doc = to_json(compare(card((4000, "empty", 1), (12 * MiB, "mm", 7)), ours(4000, 8 * MiB)))
    json.dumps(doc, allow_nan=False)
    assert doc["card"]["peak_reserved"] == 14 * MiB and doc["prediction"]["peak_reserved"] == 22 * MiB
    assert doc["differences"][0]["card"] == {"index": 1, "bytes": 12 * MiB, "op": "mm", "line": "model.py:7 forward"}


@pytest.mark.skipif(not SNAPSHOTS.is_dir(), reason="the shared snapshot corpus is absent")
def test_a_real_card_against_itself_agrees() -> None:
    snapshot = read_snapshot(SNAPSHOTS / "NiuHuangxiaozi__assignment2-systems__fwd_ctx100_fp32.pickle")
    comparison = compare(snapshot, snapshot)
    assert comparison.agree and comparison.aligned == comparison.card.requests > 0


def test_the_replay_command_compares_against_a_prediction(tmp_path: Path) -> None:
    card_path, ours_path, report = tmp_path / "card.pickle", tmp_path / "ours.pickle", tmp_path / "against.json"
    card_path.write_bytes(snapshot_bytes(snapshot_of(recorded(4000, 12 * MiB))))
    ours_path.write_bytes(snapshot_bytes(snapshot_of(recorded(4000, 8 * MiB))))
    command = [sys.executable, "-m", "pytest_gpumem", "replay", str(card_path), "--against", str(ours_path)]
    done = subprocess.run([*command, "--json", str(report)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "peak reserved         14.0 MiB      22.0 MiB  +8.0 MiB (+57.1%)" in done.stdout.splitlines()
    assert json.loads(report.read_text(encoding="utf-8"))["devices"][0]["differences"][0]["card"]["bytes"] == 12 * MiB
    refused = subprocess.run([*command, "--capacity", "1 GB"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert "--against compares two snapshots as recorded: --capacity does not apply to it" in refused.stderr


def test_a_card_traced_on_another_device_is_compared_there_and_said(tmp_path: Path) -> None:
    written = snapshot_of(recorded(4000, 12 * MiB))
    written["device_traces"] = [[], written["device_traces"][0]]
    card_path, ours_path = tmp_path / "card.pickle", tmp_path / "ours.pickle"
    card_path.write_bytes(snapshot_bytes(written))
    ours_path.write_bytes(snapshot_bytes(snapshot_of(recorded(4000, 12 * MiB))))
    command = [sys.executable, "-m", "pytest_gpumem", "replay", str(card_path), "--against", str(ours_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == [f"card:       {card_path} (device 1)", f"prediction: {ours_path} (device 0)"]
    assert "every request of the card is the prediction's, in order and size" in lines
    refused = subprocess.run([*command, "--device", "0"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert "--device 0: the card's snapshot has no request on device 0 (it traced device 1)" in refused.stderr


def longest_common(a: list[int], b: list[int]) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        previous, row = row, [0]
        for j, y in enumerate(b):
            row.append(previous[j] + 1 if x == y else max(previous[j + 1], row[j]))
    return row[-1]


def test_the_alignment_is_a_longest_common_sequence_and_its_runs_rebuild_both() -> None:
    rng = random.Random(7)
    for _ in range(300):
        a = [rng.choice((1, 2, 3)) for _ in range(rng.randrange(30))]
        b = [x for x in a if rng.random() > 0.1] + [rng.choice((3, 4)) for _ in range(rng.randrange(3))]
        rng.shuffle(b[: rng.randrange(4)])
        result = align(a, b)
        assert result.matched == longest_common(a, b) and not result.cut
        starts = [(i1, j1) for _, i1, _, j1, _ in result.opcodes]
        assert starts == [(0, 0), *((i2, j2) for _, _, i2, _, j2 in result.opcodes[:-1])][: len(starts)]
        ends = [(i2, j2) for _, _, i2, _, j2 in result.opcodes[-1:]]
        assert ends == ([(len(a), len(b))] if a or b else [])
        assert all(a[i1:i2] == b[j1:j2] for tag, i1, i2, j1, j2 in result.opcodes if tag == "equal")


def test_100000_requests_of_few_sizes_align_in_linear_time() -> None:
    rng = random.Random(3)
    a = [rng.choice((512, 4096, MiB, 3 * MiB)) for _ in range(100_000)]
    b = [7 if i % 1000 == 0 else x for i, x in enumerate(a)]  # 100 requests replaced
    result = align(a, b)  # difflib: minutes; Myers with D = 200 edits: a tenth of a second
    assert result.matched == 99_900 and len([op for op in result.opcodes if op[0] != "equal"]) == 100


def test_more_differences_than_the_bound_are_one_run_and_said() -> None:
    a, b = list(range(2000)), list(range(2000, 4000))
    result = align(a, b, max_edits=100)
    assert result.cut and result.opcodes == (("replace", 0, 2000, 0, 2000),) and result.matched == 0
