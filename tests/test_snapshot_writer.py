"""Our predictions are written as torch memory snapshots: the allocator's model keeps torch's memory history
(requests, frees, segments, out-of-memory), memory_viz opens the file, our reader reads it back, and its
replay gives the figures the measurement reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cuda_allocator_model.model import AllocatorOutOfMemory
from cuda_allocator_model.settings import AllocatorSettings
from cuda_allocator_model.snapshots.agreement import agree
from cuda_allocator_model.snapshots.read import read_snapshot, snapshot_from_bytes
from cuda_allocator_model.snapshots.replay import replay
from cuda_allocator_model.snapshots.whatif import what_if
from pytest_gpumem.backends.tracker.torch_snapshot import RecordedModel, snapshot_bytes, snapshot_of

MiB = 1 << 20
BASE = 1 << 32  # the model's first segment address
OP = {"name": "unknown op", "filename": "??", "line": 0}  # no ledger: no op being dispatched


def actions(model: RecordedModel) -> list[tuple[str, int, int]]:
    return [(e["action"], e["addr"], e["size"]) for e in model.events]


def three_requests() -> RecordedModel:
    """4,000 B (a 2 MiB small segment, a 4,096 B block), 12 MiB (its own 12 MiB large segment: from 10 MiB a
    segment is the request rounded to 2 MiB), the 4,000 B freed, then 400 B (a 512 B block at the small
    segment's start, where the freed block merged back)."""
    model = RecordedModel()
    model.malloc(1, 4000)
    model.malloc(2, 12 * MiB)
    model.free(1)
    model.malloc(3, 400)
    return model


def test_requests_frees_and_segments_are_recorded_in_torchs_order() -> None:
    assert actions(three_requests()) == [
        ("segment_alloc", BASE, 2 * MiB),
        ("alloc", BASE, 4000),
        ("segment_alloc", BASE + 2 * MiB, 12 * MiB),
        ("alloc", BASE + 2 * MiB, 12 * MiB),
        ("free_requested", BASE, 4000),
        ("free_completed", BASE, 4000),
        ("alloc", BASE, 400),
    ]


def test_the_segments_at_the_end_hold_their_blocks_and_states() -> None:
    small, large = snapshot_of(three_requests())["segments"]
    assert (small["address"], small["total_size"], small["segment_type"]) == (BASE, 2 * MiB, "small")
    assert [(b["address"], b["size"], b["requested_size"], b["state"]) for b in small["blocks"]] == [
        (BASE, 512, 400, "active_allocated"),
        (BASE + 512, 2 * MiB - 512, 0, "inactive"),
    ]
    assert (small["allocated_size"], small["active_size"], small["requested_size"]) == (512, 512, 400)
    assert (large["address"], large["total_size"], large["segment_type"]) == (BASE + 2 * MiB, 12 * MiB, "large")
    assert [(b["size"], b["state"]) for b in large["blocks"]] == [(12 * MiB, "active_allocated")]
    assert small["blocks"][0]["frames"][0] == OP


def test_expandable_segments_map_and_unmap_pages() -> None:
    """30 MiB maps two 20 MiB pages; 15 MiB takes the 10 MiB left after it and one page more; freeing the
    30 MiB and emptying the cache unmaps the one page wholly free (the second is shared)."""
    model = RecordedModel(AllocatorSettings(expandable_segments=True))
    model.malloc(1, 30 * MiB)
    model.malloc(2, 15 * MiB)
    model.free(1)
    model.empty_cache()
    assert actions(model) == [
        ("segment_map", BASE, 40 * MiB),
        ("alloc", BASE, 30 * MiB),
        ("segment_map", BASE + 40 * MiB, 20 * MiB),
        ("alloc", BASE + 30 * MiB, 15 * MiB),
        ("free_requested", BASE, 30 * MiB),
        ("free_completed", BASE, 30 * MiB),
        ("segment_unmap", BASE, 20 * MiB),
    ]
    (segment,) = snapshot_of(model)["segments"]
    assert (segment["address"], segment["total_size"], segment["is_expandable"]) == (BASE + 20 * MiB, 40 * MiB, True)
    assert [(b["size"], b["state"]) for b in segment["blocks"]] == [
        (10 * MiB, "inactive"),
        (15 * MiB, "active_allocated"),
        (15 * MiB, "inactive"),
    ]


def test_a_refused_request_is_an_oom_event_with_the_bytes_left() -> None:
    model = RecordedModel(capacity=20 * MiB)
    model.malloc(1, 12 * MiB)
    with pytest.raises(AllocatorOutOfMemory):
        model.malloc(2, 12 * MiB)
    oom = model.events[-1]
    assert (oom["action"], oom["size"], oom["device_free"]) == ("oom", 12 * MiB, 8 * MiB)
    assert snapshot_from_bytes(snapshot_bytes(snapshot_of(model))).trace()[-1].device_free == 8 * MiB


def test_the_settings_are_written_as_torch_writes_them_and_read_back() -> None:
    settings = AllocatorSettings(max_split_size=128 * MiB, roundup_power2_divisions=(4,), expandable_segments=True)
    model = RecordedModel(settings)
    written = snapshot_of(model, "max_split_size_mb:128,roundup_power2_divisions:4,expandable_segments:True")
    assert written["allocator_settings"]["roundup_power2_divisions"]["1024"] == 4
    read = snapshot_from_bytes(snapshot_bytes(written))
    assert read.allocator_settings == settings
    assert read.alloc_conf == "max_split_size_mb:128,roundup_power2_divisions:4,expandable_segments:True"
    assert read.tier == "T2"


# ------------------------------------------------------------------ the tracker on meta, through torch


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, int]:
    """The three requests made by torch on meta under the tracker, written to a file: (file, the
    measurement's peaks, the line that made the 12 MiB tensor)."""
    import torch

    from pytest_gpumem.backends.base import Settings
    from pytest_gpumem.backends.tracker.backend import TrackerBackend
    from pytest_gpumem.backends.tracker.torch_snapshot import record

    backend = TrackerBackend(device="meta")
    backend.configure(Settings(None, origins=False, events=False, explain=False))
    backend.start()
    try:
        model = record(backend.ledger)
        assert model is not None
        a = torch.empty(1000, device="meta")  # 4,000 B
        line = sys._getframe().f_lineno + 1
        b = torch.empty(3 * MiB, device="meta")  # 12 MiB
        del a
        c = torch.empty(100, device="meta")  # 400 B
        del b, c
        peaks = backend.peak()
    finally:
        backend.stop()
    path = tmp_path_factory.mktemp("written") / "three.pickle"
    path.write_bytes(snapshot_bytes(snapshot_of(model)))
    return path, peaks, line


def test_the_trackers_requests_carry_the_op_and_the_tests_line(measured: tuple[Path, Any, int]) -> None:
    path, _, line = measured
    snapshot = read_snapshot(path)
    big = snapshot.trace()[3]
    assert (big.action, big.size) == ("alloc", 12 * MiB)
    op, user = big.frames
    assert (op.name, op.filename) == ("aten.empty.memory_format", "??")
    assert (Path(user.filename).name, user.line, user.name) == (Path(__file__).name, line, "measured")


def test_replaying_the_written_snapshot_gives_the_measured_peaks(measured: tuple[Path, Any, int]) -> None:
    path, peaks, _ = measured
    figures = replay(read_snapshot(path))
    assert figures.from_empty
    assert (figures.peak_allocated, figures.peak_requested, figures.peak_reserved) == (
        peaks.allocated,
        peaks.requested,
        peaks.reserved,
    )
    assert (peaks.allocated, peaks.requested, peaks.reserved) == (4096 + 12 * MiB, 4000 + 12 * MiB, 14 * MiB)


# torch's own viewer, `python -m torch.cuda._memory_viz ACTION ...`, once per ACTION in one interpreter (each
# of its runs would import torch again): what each printed, after a NUL line
MEMORY_VIZ = """
import json, runpy, sys
for args in json.loads(sys.argv[1]):
    print("\\0", flush=True)
    sys.argv = ["_memory_viz.py", *args]
    runpy.run_module("torch.cuda._memory_viz", run_name="__main__")
"""


def memory_viz(*commands: list[str]) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", MEMORY_VIZ, json.dumps(commands)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return done.stdout.split("\0\n")[1:]


def test_memory_viz_opens_the_written_snapshot(measured: tuple[Path, Any, int], tmp_path: Path) -> None:
    path, _, _ = measured
    page = tmp_path / "trace.html"
    stats, trace, _ = memory_viz(["stats", str(path)], ["trace", str(path)], ["trace_plot", str(path), "-o", str(page)])
    assert "segments: 2" in stats and "total_reserved: 14.0MiB" in stats
    assert trace.splitlines()[1:5] == ["11 entries", f"a = cudaMalloc({BASE}, 2.0MiB)", "b = a[0:3.9KiB]",
                                       f"c = cudaMalloc({BASE + 2 * MiB}, 12.0MiB)"]  # fmt: skip
    assert "snapshot.pickle" in page.read_text(encoding="utf-8")


def test_the_option_writes_every_measured_tests_snapshot(pytester: pytest.Pytester, read_report: Any) -> None:
    pytester.makepyfile(
        """
        import pytest, torch

        @pytest.mark.max_memory("1 GB")
        def test_three():
            a = torch.empty(1000, device="meta")
            b = torch.empty(3 * 2**20, device="meta")

        def test_unmeasured():
            pass
        """
    )
    result = pytester.runpytest("--gpumem-device=meta", "--gpumem-torch-snapshots=snaps", "--gpumem-json=out.json")
    result.assert_outcomes(passed=2)
    (written,) = (pytester.path / "snaps").iterdir()
    assert written.name.startswith("test_the_option_writes_every_measured_tests_snapshot.py_test_three-")
    call = read_report(pytester.path / "out.json")["test_three"]["call"]
    figures = replay(read_snapshot(written))
    assert (figures.peak_allocated, figures.peak_requested, figures.peak_reserved) == (
        call["peak_bytes"],
        call["requested_peak_bytes"],
        call["reserved_peak_bytes"],
    )


def test_without_the_allocators_model_the_run_says_none_was_written(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(gpumem):\n    pass\n")
    result = pytester.runpytest("--gpumem-backend=tracker", "--gpumem-torch-snapshots=snaps")
    line = "gpumem: --gpumem-torch-snapshots: none written: no CUDA allocator model (--gpumem-round=cuda)"
    result.stdout.fnmatch_lines([line])
    assert len(line) <= 100
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert not list((pytester.path / "snaps").iterdir())


@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable"])
def test_what_empty_cache_gives_back_replays_as_an_empty_cache(expandable: bool) -> None:
    """100 MiB and 60 MiB, both freed, empty_cache(), then 80 MiB: the model reserves 160 MiB at most (not
    240 MiB: the cache was emptied before the 80 MiB), and the file says so to every replay of it."""
    model = RecordedModel(AllocatorSettings(expandable_segments=expandable))
    model.malloc(1, 100 * MiB)
    model.malloc(2, 60 * MiB)
    model.free(1)
    model.free(2)
    model.empty_cache()
    model.malloc(3, 80 * MiB)
    released = [e for e in model.events if e["action"] in ("segment_free", "segment_unmap")]
    assert released and all("emptyCache" in e["frames"][0]["name"] for e in released)
    snapshot = snapshot_from_bytes(snapshot_bytes(snapshot_of(model)))
    agreement = agree(snapshot)
    assert agreement.exact and agreement.releases_unmatched == 0
    settings = snapshot.allocator_settings or AllocatorSettings()
    again = what_if(snapshot, settings, None, "as recorded", "unlimited")
    assert again.peak_reserved == model.peak_reserved == 160 * MiB


def test_a_distributed_tests_ranks_leave_a_file_each_and_its_notes_name_the_ranks_that_left_none(
    tmp_path: Path,
) -> None:
    """A world of 11 ranks whose ranks 3 and 7 were ended before they wrote theirs, then a second world of the
    same name: each rank's bytes in a file named by its world and rank; the test's own file, with nothing
    recorded in its own process, is not written, and an earlier run's files of it and of rank 3 are gone."""
    from types import SimpleNamespace

    from pytest_gpumem.backends.tracker.backend import TrackerBackend
    from pytest_gpumem.distributed.world import RankSnapshot, Worlds
    from pytest_gpumem.measure.measurement import Measurement
    from pytest_gpumem.results import TestResult
    from pytest_gpumem.run.outputs import file_stem
    from pytest_gpumem.run.test_files import Noted, TorchSnapshot

    sections: list[tuple[str, str, str]] = []
    item = SimpleNamespace(stash=pytest.Stash(), nodeid="test_d.py::test_world")
    item.add_report_section = lambda *section: sections.append(section)
    files = TorchSnapshot(tmp_path / "snaps")
    measured = Measurement(TrackerBackend("cuda"), item.nodeid, Worlds())
    assert files.begin(item, measured) is None  # type: ignore[arg-type]
    assert isinstance(measured.worlds, Worlds) and measured.worlds.snapshots == []  # the ranks are asked to record
    measured.worlds.snapshots.extend(
        RankSnapshot("ranks", r, 11, None if r in (3, 7) else bytes([r])) for r in range(11)
    )
    measured.worlds.snapshots.append(RankSnapshot("ranks-2", 0, 1, None))
    result = TestResult.of(item.nodeid, "tracker", "cpu", None, distributed=[{"world_size": 11}])
    stale = [tmp_path / "snaps" / f"{file_stem(item.nodeid)}{end}" for end in (".pickle", ".ranks.rank03.pickle")]
    stale[0].parent.mkdir()
    for path in stale:  # an earlier run's, when the test's process and rank 3 left files
        path.write_bytes(b"old")
    noted = files.write(item, measured, result, None)  # type: ignore[arg-type]
    assert measured.worlds.snapshots == []  # the bytes are not kept past the test
    written = sorted((tmp_path / "snaps").iterdir())
    stem = "test_d.py_test_world-" + written[0].name.split("-")[1].split(".")[0]
    assert [(path.name.removeprefix(stem), path.read_bytes()) for path in written] == [
        (f".ranks.rank{rank:02d}.pickle", bytes([rank])) for rank in range(11) if rank not in (3, 7)
    ]
    (section,) = sections
    assert section[:2] == ("call", "gpumem torch snapshot")
    assert section[2].splitlines()[1] == f"memory snapshot of rank 1: {written[1]}"
    assert noted == Noted(
        None,
        (
            "--gpumem-torch-snapshots: no snapshot of ranks 3, 7 of world 'ranks': ended before they finished, "
            "or could not write one",
            "--gpumem-torch-snapshots: no snapshot of rank 0 of world 'ranks-2': ended before it finished, "
            "or could not write one",
        ),
    )


def test_a_recording_model_is_copied_with_its_history_and_serves_the_same_ledger() -> None:
    """What a fit keeps between its runs under --gpumem-torch-snapshots: the ledger holds the test's storages
    (weak references, which cannot be copied) and stays the one the copy serves."""
    import torch

    from pytest_gpumem.backends.tracker.allocator_state import copied
    from pytest_gpumem.backends.tracker.ledger import StorageLedger

    ledger = StorageLedger("cuda")
    kept = torch.ones(1000, device="meta")
    ledger.add(kept.untyped_storage())
    model = RecordedModel(ledger=ledger)
    model.malloc(1, 4000)
    copy = copied(model)
    assert (copy._ledger, copy.reserved, actions(copy)) == (ledger, model.reserved, actions(model))
    copy.malloc(2, 400)
    assert len(copy.events) == len(model.events) + 1


def test_a_fit_leaves_no_snapshot_that_would_replay_below_its_peak(pytester: pytest.Pytester) -> None:
    """A fit runs each size from a saved state of the allocator: one history cannot show it going back, so
    the test leaves no file of its own (an earlier run's is removed) and says why."""
    from pytest_gpumem.run.outputs import file_stem

    pytester.makepyfile(
        test_fitting="""
        import torch

        def test_fit(gpumem):
            gpumem.fit(lambda n: torch.ones(n, 1024, device=gpumem.device).sum(), [8, 16], "8 MiB")
        """
    )
    earlier = pytester.path / "snaps" / f"{file_stem('test_fitting.py::test_fit')}.pickle"
    earlier.parent.mkdir()
    earlier.touch()
    result = pytester.runpytest("--gpumem-device=meta", "--gpumem-torch-snapshots=snaps", "-p", "no:randomly")
    result.stdout.fnmatch_lines(["*--gpumem-torch-snapshots: none written: gpumem.fit restarted the allocator*"])
    assert (result.ret, list(earlier.parent.iterdir())) == (0, [])
