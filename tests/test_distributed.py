"""gpumem.distributed(): functions run on spawned ranks (gloo on CPU), each rank measured by its own
tracker; budgets and baselines per rank; a failing rank ends all ranks and fails its test in one line.

Spawning a world costs seconds, so each scenario shares one pytester run (exact bytes: float32 = 4 B)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from typing import Any

import pytest
from builders import UNPLUGGED, Reported, phase_result

from cuda_allocator_model.snapshots.read import read_snapshot
from cuda_allocator_model.snapshots.replay import replay
from pytest_gpumem.budget import budget_from_marker
from pytest_gpumem.cli import main
from pytest_gpumem.distributed.gloo import wait_for_gloo_idle
from pytest_gpumem.distributed.messages import DistributedError, Kind, Message, describe, done
from pytest_gpumem.distributed.spawn import Deadlines, Progress
from pytest_gpumem.distributed.worker import InRank
from pytest_gpumem.distributed.world import check_call, check_phase_names, check_started, explained
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.explain.composition import of_worlds, with_ranks
from pytest_gpumem.explain.text import made_of
from pytest_gpumem.measure.measurement import Measurement
from pytest_gpumem.measure.meter import GpuMem
from pytest_gpumem.measure.regions import mark_phase
from pytest_gpumem.results import TestResult
from pytest_gpumem.results.explanation import Cell, Explanation, PhaseExplanation, RanksExplanation, SampledTimeline
from pytest_gpumem.results.ranks import RankResult, World, worst_call

MiB = 1 << 20

FAULTS = """
import os, time
from pathlib import Path

import pytest, torch
import torch.distributed as dist

PIDS = Path(__file__).with_name("pids")
IMPORTED_IN = os.environ.get("PYTEST_CURRENT_TEST", "")  # in a rank: the parent's test, when it started it


def _note(name, rank):
    PIDS.mkdir(exist_ok=True)
    (PIDS / f"{name}-{rank}").write_text(str(os.getpid()))


def grow(rank, world_size, meter):
    _note("grow", rank)
    with meter.phase("forward"):
        torch.ones(1000 * (rank + 1))  # rank r: 4,000 (r + 1) B
    dist.barrier()
    return rank * 10


def raises(rank, world_size, meter):
    if rank == 1:
        with meter.phase("forward"):
            raise ValueError("bad batch")
    dist.barrier()


def hangs(rank, world_size, meter):
    _note("hangs", rank)
    time.sleep(600)  # every rank: which ranks are late is then known whatever the machine's load


def exits(rank, world_size, meter):
    _note("exits", rank)
    if rank == 1:
        os._exit(3)
    dist.barrier()


@pytest.mark.max_memory(forward="6 kB", explain=True)
def test_over_on_one_rank(gpumem):
    gpumem.distributed(grow)


def test_rank_raises(gpumem):
    gpumem.distributed(raises)


def test_rank_hangs(gpumem):
    gpumem.distributed(hangs, timeout=1)


def test_rank_exits(gpumem):
    gpumem.distributed(exits)


@pytest.mark.max_memory(capacity="6 kB")
def test_rank_out_of_memory(gpumem):
    gpumem.distributed(grow)


def test_not_picklable(gpumem):
    gpumem.distributed(lambda rank, world_size, meter: None)


def kills_its_server(rank, world_size, meter):
    _note("server", rank)
    if rank == 1:
        deadline = time.monotonic() + 60  # rank 0 noted first: on a loaded machine it may start later
        while not (PIDS / "server-0").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getppid(), 9)  # ranks are forked from gpumem's server
    time.sleep(600)


def test_server_dies(gpumem):
    gpumem.distributed(kills_its_server)


def nothing(rank, world_size, meter):
    pass


def test_ranks_that_run_nothing(gpumem):
    gpumem.distributed(nothing, 2)  # a rank done at once waits for the others to have joined


def _late():
    _note("late", os.environ["RANK"])
    time.sleep(600)


class Late:
    def __reduce__(self):
        return (_late, ())  # unpickled by each rank before it joins the group: no rank ever starts


def test_rank_never_starts(gpumem, monkeypatch):
    monkeypatch.setattr("pytest_gpumem.distributed.world.MIN_JOIN_TIMEOUT", 1.0)
    monkeypatch.setattr("pytest_gpumem.distributed.spawn.SLOW_START", 0.5)  # named once, before the deadline
    gpumem.distributed(nothing, 2, args=(Late(),), timeout=1)


def uses_conftest(rank, world_size, meter):
    from conftest import SETTINGS

    return SETTINGS["lr"]  # set by the parent's autouse fixture, not in a rank


def test_rank_lacks_the_conftest_set_up(gpumem):
    gpumem.distributed(uses_conftest, 1)


def refused(call):
    try:
        call()
    except Exception as exc:
        return str(exc)


def grows_and_starts_no_ranks(rank, world_size, meter):
    value = grow(rank, world_size, meter)
    starts = refused(lambda: meter.distributed(nothing, 1)), refused(lambda: meter.simulate_rank(nothing, 2))
    return value, *starts, IMPORTED_IN


def test_runs_normally_after(gpumem, request):
    ranks = gpumem.distributed(grows_and_starts_no_ranks)
    assert [r.value[0] for r in ranks] == [0, 10]
    assert all(r.value[3].endswith("::test_runs_normally_after (call)") for r in ranks)
    assert ranks[0].value[1].endswith(f"inside a rank of {request.node.nodeid}: ranks cannot start ranks")
    assert ranks[0].value[2].endswith("this process already has a process group; it cannot be simulated")
    assert [r.phases["forward"].peak_bytes for r in ranks] == [4000, 8000]
    assert [r.explanation for r in ranks] == [None, None]  # not explained: the ranks record nothing
"""


CONFTEST = """
import pytest

SETTINGS = {}


@pytest.fixture(autouse=True)
def configured():
    SETTINGS["lr"] = 0.1
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_faults_end_every_rank_and_fail_one_test_in_one_line(
    tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, reported: Reported
) -> None:
    own_tmp = tracker.mkdir("tmp")
    monkeypatch.setenv("TMPDIR", str(own_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    tracker.makepyfile(FAULTS)
    tracker.makeconftest(CONFTEST)
    result = tracker.runpytest("-v", "-p", "no:randomly", "--gpumem-json=out.json")
    result.assert_outcomes(passed=2, failed=9)
    result.stdout.fnmatch_lines(
        [
            "forward peak 8.0 kB on rank 1 exceeds max_memory forward=6 kB; made of inputs and other of "
            "(outside modules) 8.0 kB, ...",  # 132 columns with the region's name: the section's also: line
            "*Captured gpumem call*",
            "also: forward peak made of inputs and other of (outside modules) 8.0 kB, ...",
            "*::test_rank_raises: rank 1 failed: ValueError: bad batch (in phase 'forward')",
            "*::test_rank_hangs: ranks 0, 1 did not finish within 1 s (timeout=, --gpumem-dist-timeout); all ranks "
            "were ended",
            "*::test_rank_exits: rank 1 exited with code 3 before it finished",
            "*::test_rank_out_of_memory: rank 1 failed: OutOfMemoryError: tracker: out of memory: tried to allocate "
            "7.8 KiB with 0 B of the capacity 5.9 KiB already allocated (in phase 'forward')",
            "*::test_not_picklable: gpumem.distributed(): test_not_picklable.<locals>.<lambda> and its args must be "
            "picklable to reach the ranks (define the function at module level, not a lambda or a local function): "
            "AttributeError: Can't pickle local object *",
            "*::test_server_dies: rank ? was killed before it finished: gpumem's fork server, which started it, died",
            "*::test_rank_never_starts: ranks 0, 1 did not start within 1 s (still loading the function and its "
            "module)",
            "*::test_rank_lacks_the_conftest_set_up: rank 0 failed: KeyError: 'lr' (ranks import only the test module; "
            "conftest.py, fixtures, module globals and torch settings made in the parent do not reach them)",
        ]
    )
    result.stdout.fnmatch_lines(
        ["gpumem: waiting for ranks 0, 1 to start (0.5 s; each imports torch and the test module)"]
    )
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    result.stdout.no_fnmatch_line("*pytest_gpumem/distributed*.py:*")
    tests = reported()
    assert [t["status"] for t in tests.values()] == ["OVER BUDGET", *["error"] * 6, "ok", "error", "error", "ok"]
    assert all("\n" not in str(t["message"]) for t in tests.values())
    over = tests["test_over_on_one_rank"]["phases"]
    assert over["forward"] == {**over["forward@rank1"], "rank": 1}
    assert (over["forward@rank0"]["peak_bytes"], over["forward@rank0"]["rank"]) == (4000, 0)
    explained = tests["test_over_on_one_rank"]["explanation"]["phases"]
    assert {name: (explained[name]["peak_bytes"], explained[name]["rank"]) for name in over} == {
        "forward@rank0": (4000, 0),  # rank r: torch.ones(1000 (r + 1)), float32
        "forward@rank1": (8000, 1),
        "forward": (8000, 1),
        "ranks@rank0": (4000, 0),
        "ranks@rank1": (8000, 1),
        "ranks": (8000, 1),
    }
    assert explained["call"]["rank"] == 1  # the worst rank's run is the call's peak
    assert tests["test_runs_normally_after"]["explanation"] is None
    pids = {p.name: int(p.read_text()) for p in (tracker.path / "pids").iterdir()}
    noted = ("grow", "hangs", "exits", "server")  # and "late", maybe
    assert {f"{name}-{rank}" for name in noted for rank in (0, 1)} <= set(pids)
    assert not [pid for pid in pids.values() if _alive(pid)]
    assert not list(own_tmp.glob("gpumem-dist-*"))  # the rendezvous folders are gone


@pytest.mark.slow
def test_a_fork_server_that_cannot_start_fails_its_test_in_one_line(tracker: pytest.Pytester) -> None:
    """In its own process: the resource tracker multiprocessing starts with the test's environment dies too."""
    tracker.makepyfile(
        """
        def nothing(rank, world_size, meter):
            pass

        def test_world(gpumem, monkeypatch):
            monkeypatch.setenv("PYTHONHOME", "/nonexistent")
            gpumem.distributed(nothing, 2)
        """
    )
    result = tracker.runpytest_subprocess(*UNPLUGGED)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*::test_world: the ranks' fork server (a Python started as a spawned rank would be) exited with code 1 "
            "as it started; the test sets PYTHONHOME='/nonexistent': its own error is in the test's captured stderr",
        ]
    )
    result.stdout.no_fnmatch_line("*EOFError*")
    result.stdout.no_fnmatch_line("*pytest_gpumem/distributed*.py:*")


SLEEPING = """
import os, time
from pathlib import Path


def sleeps(rank, world_size, meter):
    Path(f"rank{rank}.pids").write_text(f"{os.getpid()} {os.getppid()}")  # the rank and its server
    time.sleep(600)


def test_sleeps(gpumem):
    gpumem.distributed(sleeps, 2)
"""


@pytest.mark.slow
def test_a_killed_run_leaves_no_rank_and_no_server_behind(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(SLEEPING)
    run = tracker.popen([sys.executable, "-m", "pytest", *UNPLUGGED], stdout=subprocess.DEVNULL)
    noted = [tracker.path / f"rank{rank}.pids" for rank in (0, 1)]
    deadline = time.monotonic() + 120
    while not all(path.exists() and path.read_text() for path in noted) and time.monotonic() < deadline:
        time.sleep(0.1)
    run.terminate()
    run.wait()
    pids = {int(pid) for path in noted for pid in path.read_text().split()}
    assert len(pids) == 3  # two ranks, one server
    deadline = time.monotonic() + 10
    while [pid for pid in pids if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if _alive(pid)]


PER_RANK = """
import os, pytest, torch
from torch.nn.parallel import DistributedDataParallel
from reference_losses.distributed import run_strategies, sizes
from reference_losses.models import build_net, model_loss


def plain_ddp(meter, times=6):
    cpu = min(os.sched_getaffinity(0))
    for tid in os.listdir("/proc/self/task"):  # every thread on one CPU: gloo's worker is often late
        os.sched_setaffinity(int(tid), {cpu})
    rows = sizes(0.25, 2).rows
    for _ in range(times):
        w = build_net(0.25, meter.device)
        with meter.phase("plain.setup"):
            model = DistributedDataParallel(w.model)  # init_sync: a flat copy of the parameters is broadcast
        with meter.phase("plain.forward"):
            model_loss(model(w.inputs[:rows]), w.target[:rows])
        del model, w


def train(rank, world_size, meter):
    if os.environ.get("GROW_RANK1"):  # ddp.forward alone: rank 0 as stored (1,048,580 B), rank 1 4,000,000 B
        with meter.phase("ddp.forward"):
            torch.ones(1_000_000 if rank == 1 else 262_145)
        return
    run_strategies(rank, world_size, meter, 0.25)
    plain_ddp(meter)


def test_data_parallel(gpumem):
    gpumem.distributed(train, 2)
"""

# The Net at scale 0.25 on 2 ranks (see reference_losses/distributed.py): 64 rows a rank,
# P1 = 8,396,800, P2 = 8,392,704, P = 16,789,504, h1 = 64 * 2048 * 4 = 524,288, out = 262,144.
EXPECTED = {
    "ddp.setup": 16_789_504,  # P: the gradient buckets
    "ddp.forward": 1_048_580,  # h1 + out + out*target + 4
    "ddp.backward": 16_789_508,  # P + 4
    "ddp.step": 16_789_504,  # P of momentum
    "fsdp2.setup": 4_198_408,  # P1 / 2 + 8
    "fsdp2.forward": 25_706_496,  # h1 + P1 + 2 * P2
    "fsdp2.backward": 29_382_660,  # 2 * P1 + P2 + P2 / 2 + 4: layer1's copy-out, layer2's reduce-scatter in and out
    "fsdp2.step": 8_394_752,  # P / 2 of momentum
}


@pytest.mark.slow
def test_ddp_and_fsdp2_per_rank_bytes_and_baselines(
    tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, reported: Reported
) -> None:
    tracker.makepyfile(PER_RANK)
    tracker.runpytest("--gpumem-update", "--gpumem-json=out.json").assert_outcomes(passed=1)
    phases = reported()["test_data_parallel"]["phases"]
    for rank in ("@rank0", "@rank1", ""):  # each rank, then the worst one
        assert {name: phases[f"{name}{rank}"]["peak_bytes"] for name in EXPECTED} == EXPECTED
    for rank in ("@rank0", "@rank1"):  # a plain DDP(model), 6 times: the flat broadcast is gone before the buckets
        plain = [phases[f"plain.{name}{rank}"] for name in ("setup", "forward")]
        assert [(p["peak_bytes"], p["count"]) for p in plain] == [
            (EXPECTED["ddp.setup"], 6),
            (EXPECTED["ddp.forward"], 6),
        ]
    stored = json.loads((tracker.path / "gpumem-baselines.json").read_text())
    assert "ddp.forward@rank1" in json.dumps(stored)

    monkeypatch.setenv("GROW_RANK1", "1")
    result = tracker.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["ddp.forward@rank1 peak 3.8 MiB is 281.5% above baseline 1.0 MiB (tolerance 5% *"])
    result.stdout.no_fnmatch_line("*ddp.forward@rank0 peak*above*")


PATHS = """
import torch

def adam_step(meter, name):
    params = [torch.nn.Parameter(torch.ones(1024)) for _ in range(2)]
    optimizer = torch.optim.Adam(params)
    for p in params:
        p.grad = torch.ones(1024)
    with meter.phase(name):
        optimizer.step()

def in_rank(rank, world_size, meter):
    adam_step(meter, "adam")
    torch.ones(3 * 2**20 * (rank + 1))  # 12 MiB on rank 0, 24 MiB on rank 1: a large segment each

def test_adam(gpumem):
    adam_step(gpumem, "parent")
    gpumem.distributed(in_rank, 2)
"""


@pytest.mark.slow
def test_every_rank_takes_the_code_paths_the_run_was_given_and_leaves_its_own_snapshot(
    tracker: pytest.Pytester, reported: Reported, capsys: pytest.CaptureFixture[str]
) -> None:
    tracker.makepyfile(PATHS)
    steps = {}
    for paths in ("cpu", "gpu"):
        options = ("--gpumem-round=cuda", "--gpumem-torch-snapshots=snaps", "--gpumem-json=out.json")
        result = tracker.runpytest(f"--gpumem-paths={paths}", "-rA", *options)
        result.assert_outcomes(passed=1)
        phases = reported()["test_adam"]["phases"]
        steps[paths] = phases["parent"]["peak_bytes"]
        assert phases["adam@rank0"]["peak_bytes"] == phases["adam@rank1"]["peak_bytes"] == steps[paths]
    assert steps["cpu"] != steps["gpu"]

    own, *ranks = sorted((tracker.path / "snaps").iterdir())  # the gpu run's: the test's own, then its ranks'
    stem = own.name.removesuffix(".pickle")
    assert [path.name.removeprefix(stem) for path in ranks] == [".ranks.rank0.pickle", ".ranks.rank1.pickle"]
    result.stdout.fnmatch_lines([f"memory snapshot of rank {rank}: {path}" for rank, path in enumerate(ranks)])
    own_figures, *figures = [replay(read_snapshot(path)) for path in (own, *ranks)]
    assert [(f.peak_allocated, f.peak_requested, f.peak_reserved) for f in figures] == [
        (p["peak_bytes"], p["requested_peak_bytes"], p["reserved_peak_bytes"])
        for p in (phases["ranks@rank0"], phases["ranks@rank1"])
    ]
    assert [f.peak_reserved for f in figures] == [14 * MiB, 26 * MiB]  # Adam's 2 MiB small segment, then 12 (r + 1)
    assert own_figures.peak_reserved == 2 * MiB  # the test's own process: Adam's small segment alone
    assert main(["replay", str(ranks[1])]) == 0
    assert "peak reserved: card 26.0 MiB, model equal" in capsys.readouterr().out


LOST_SNAPSHOT = """
import os

import pytest

from pytest_gpumem.errors import GpuMemError


def one_exits(rank, world_size, meter):
    if rank == 1:
        os._exit(3)


def test_caught(gpumem):
    with pytest.raises(GpuMemError, match="rank 1 exited with code 3"):
        gpumem.distributed(one_exits, 2)
"""


@pytest.mark.slow
def test_a_rank_that_leaves_no_torch_snapshot_is_warned_at_its_test(tracker: pytest.Pytester) -> None:
    """The test passes (it expects the rank's failure); the ranks without a snapshot are named in a warning at
    the test, beside the notes of its JSON."""
    tracker.makepyfile(test_lost=LOST_SNAPSHOT)
    result = tracker.runpytest("--gpumem-round=cuda", "--gpumem-torch-snapshots=snaps")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(
        [
            "*test_lost.py:*: GpuMemWarning: test_lost.py::test_caught: --gpumem-torch-snapshots: no snapshot of "
            "rank*1 of world 'ranks': ended before *finished, or could not write one",
        ]
    )


XDIST = """
import torch

def fill(rank, world_size, meter, n):
    with meter.phase("made"):
        torch.ones(n * (rank + 1))

def test_{name}(gpumem):
    gpumem.distributed(fill, 2, args=({n},))
"""


@pytest.mark.slow
def test_two_xdist_workers_start_worlds_at_once(tracker: pytest.Pytester, reported: Reported) -> None:
    pytest.importorskip("xdist")
    tracker.makepyfile(test_a=XDIST.format(name="a", n=1000), test_b=XDIST.format(name="b", n=3000))
    result = tracker.runpytest_subprocess(*UNPLUGGED, "-n", "2", "--gpumem-json=out.json")
    result.assert_outcomes(passed=2)
    tests = reported()
    assert {k: t["phases"]["made"]["peak_bytes"] for k, t in tests.items()} == {"test_a": 8000, "test_b": 24000}
    assert {k: t["peak_bytes"] for k, t in tests.items()} == {"test_a": 8000, "test_b": 24000}


BAD_CALLS = """
import pytest

def fn(rank, world_size, meter):
    pass

@pytest.mark.parametrize("kwargs", [
    {"world_size": 0}, {"world_size": True}, {"timeout": -1}, {"timeout": float("nan")}, {"name": "call"},
    {"name": "a@rank1"},
])
def test_bad(gpumem, kwargs):
    gpumem.distributed(fn, **kwargs)

def test_not_callable(gpumem):
    gpumem.distributed(3)

def test_inside_phase(gpumem):
    with gpumem.phase("outer"):
        gpumem.distributed(fn)

def test_timeout_option(gpumem, request):
    from pytest_gpumem.plugin import MEASUREMENT_KEY

    assert request.node.stash[MEASUREMENT_KEY].worlds.timeout == float(__import__("os").environ["EXPECTED_TIMEOUT"])
"""


def test_bad_calls_fail_in_one_line_naming_the_value(tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    tracker.makepyfile(BAD_CALLS)
    monkeypatch.setenv("EXPECTED_TIMEOUT", "7.5")
    tracker.makeini("[pytest]\ngpumem_backend = tracker\ngpumem_dist_timeout = 30\n")
    result = tracker.runpytest("-p", "no:randomly", "--gpumem-dist-timeout=7.5")
    result.assert_outcomes(passed=1, failed=8)
    result.stdout.fnmatch_lines(
        [
            "*gpumem.distributed(world_size=...) must be an int >= 1, got 0",
            "*gpumem.distributed(world_size=...) must be an int >= 1, got True",
            "*gpumem.distributed(timeout=...) must be a number of seconds > 0, got -1",
            "*gpumem.distributed(timeout=...) must be a number of seconds > 0, got nan",
            "*gpumem.distributed(name=...) must be a phase name other than 'call', got 'call'",
            "*gpumem.distributed(name=...) must be a phase name other than 'call', got 'a@rank1'",
            "*gpumem.distributed() needs a function fn(rank, world_size, meter), got 3",
            "*gpumem.distributed() works only outside phase 'outer' in *test_inside_phase",
        ]
    )
    monkeypatch.setenv("EXPECTED_TIMEOUT", "30")
    tracker.runpytest("-k", "timeout_option").assert_outcomes(passed=1)  # the ini twin


def test_timeout_option_refuses_a_bad_value(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--gpumem-dist-timeout=0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gpumem-dist-timeout: invalid timeout '0' (a number of seconds above 0)"])
    assert "--gpumem-dist-timeout=SECONDS" in pytester.runpytest("--help").stdout.str()


# --- without spawning -------------------------------------------------------------------------------


def _world() -> World:
    ranks = [
        RankResult(0, phase_result("call", 500), {"fwd": phase_result("fwd", 300)}),
        RankResult(1, phase_result("call", 700), {"fwd": phase_result("fwd", 300), "bwd": phase_result("bwd", 50)}),
    ]
    return World(ranks, "gloo", "ranks")


def test_world_records_each_rank_and_the_worst() -> None:
    phases = {p.name: (p.peak_bytes, p.rank) for p in _world().phases()}
    assert phases == {
        "fwd@rank0": (300, 0),
        "ranks@rank0": (500, 0),
        "fwd@rank1": (300, 1),
        "bwd@rank1": (50, 1),
        "ranks@rank1": (700, 1),
        "fwd": (300, 0),  # a tie goes to the lowest rank
        "ranks": (700, 1),
        "bwd": (50, 1),
    }
    assert _world().summary() == {
        "name": "ranks",
        "world_size": 2,
        "process_group": "gloo",
        "peak_bytes": {"0": 500, "1": 700},
        "worst_rank": 1,
        "worst_peak": "700 B",
    }


def test_a_rank_phase_named_like_the_world_is_refused() -> None:
    check_phase_names(_world().ranks, "all")
    with pytest.raises(GpuMemError, match=r"^rank 0 measured a phase named 'fwd', the name gpumem\.distributed"):
        check_phase_names(_world().ranks, "fwd")


def test_the_call_is_the_worst_device() -> None:
    parent = phase_result("call", 600)
    assert worst_call(parent, None) == parent
    assert worst_call(parent, phase_result("ranks", 500, rank=1)) == parent
    assert worst_call(parent, phase_result("ranks", 700, rank=1)) == phase_result("call", 700, rank=1)


def test_rank_travels_in_json_only_when_set() -> None:
    plain, ranked = phase_result("fwd", 10), phase_result("fwd", 10, rank=3)
    assert "rank" not in plain.to_json()
    result = TestResult.of("t", "tracker", "cpu", plain, phases={"fwd": ranked})
    assert TestResult.from_json(json.loads(json.dumps(result.to_json()))).phases["fwd"] == ranked
    assert ranked.merged(phase_result("fwd", 20, rank=1)).rank == 1
    assert ranked.merged(phase_result("fwd", 5, rank=1)).rank == 3


def test_budget_messages_name_the_rank() -> None:
    budget = budget_from_marker(("1 kB",), {"fwd": "1 kB"})
    found = budget.violations(phase_result("call", 2000, rank=0), {"fwd": phase_result("fwd", 3000, rank=2)})
    assert found == [
        "call peak 2.0 kB on rank 0 exceeds max_memory 1 kB",
        "fwd peak 3.0 kB on rank 2 exceeds max_memory fwd=1 kB",
    ]


def _entry(peak: int, module: str, index: int) -> PhaseExplanation:
    """A phase of a rank's explanation whose peak is one module's activations."""
    cell = Cell("saved", module, peak)
    return PhaseExplanation(
        peak,
        {"saved": peak},
        {module: peak},
        [cell],
        [],
        live={"saved": peak},
        entries=1,
        groups=[cell],
        peak_index=index,
        spans=[(index, index + 1)],
    )


def _explanation(phases: dict[str, PhaseExplanation], folded: dict[str, int] | None = None) -> Explanation:
    return Explanation(
        "t", "tracker", ["saved"], {"saved": "saved for backward"}, phases, SampledTimeline(0, []), folded
    )


def _explained_world() -> World:
    explained = [
        _explanation({"call": _entry(500, "h.0", 4), "fwd": _entry(300, "h.0", 2)}, {"h.*": 2}),
        _explanation({"call": _entry(700, "h.1", 6), "fwd": _entry(300, "h.1", 3), "bwd": _entry(50, "head", 5)}),
    ]
    return World([replace(r, explanation=e) for r, e in zip(_world().ranks, explained, strict=True)], "gloo", "ranks")


def test_ranks_explanations_merge_into_the_tests_under_their_phase_names() -> None:
    ranks = explained(_explained_world())
    assert ranks is not None
    measured = {p.name: (p.peak_bytes, p.rank) for p in _world().phases()}
    assert {name: (e.peak_bytes, e.rank) for name, e in ranks.phases.items()} == measured  # names, peaks, worst ranks
    assert ranks.phases["fwd"].parts[0].module == "h.0"  # a tie goes to the lowest rank, as for the phases
    assert (ranks.phases["fwd@rank1"].spans, ranks.phases["fwd@rank1"].rank_peak_index) == ([], 3)  # not the test's
    assert ranks.call == ranks.phases["ranks"] and ranks.folded == {"h.*": 2}

    parent = _explanation({"call": _entry(600, "(outside modules)", 9), "bwd": _entry(80, "x", 1)})
    test = with_ranks(parent, ranks, ranks_peak=True)  # the ranks' 700 B run is the call's peak
    assert (test.phases["call"].rank, test.phases["bwd"].peak_bytes) == (1, 80)  # the test's own is higher
    assert with_ranks(parent, ranks, ranks_peak=False).phases["call"] == parent.phases["call"]
    budget = budget_from_marker((), {"fwd@rank1": "200 B"})
    assert made_of(test, [("fwd@rank1", budget.phases["fwd@rank1"])]) == (
        "; fwd@rank1 peak made of saved for backward of h.1 300 B, ..."
    )
    later = RanksExplanation({"fwd": _entry(900, "w", 1)}, {}, _entry(900, "w", 1))
    twice = of_worlds(ranks, later)
    assert (twice.phases["fwd"].peak_bytes, twice.call and twice.call.peak_bytes, twice.phases["bwd"].rank) == (
        900,
        900,
        1,
    )


def test_ranks_slow_to_start_are_named_once() -> None:
    said: list[str] = []
    deadlines = Deadlines(Progress(3, ready={0}), limit=1.0, join=60.0, say=said.append, now=100.0)
    deadlines.check(now=104.9)
    assert said == []
    deadlines.check(now=105.0)  # 5 s after the start
    deadlines.check(now=106.0)
    assert said == ["gpumem: waiting for ranks 1, 2 to start (5 s; each imports torch and the test module)"]


NCCL = """
import torch
import torch.distributed as dist


def fill(rank, world_size, meter):
    assert meter.device == torch.device("cuda", rank)
    with meter.phase("made"):
        x = torch.ones(1000 * (rank + 1), device=meter.device)  # 4,000 (r + 1) B, in 512-byte blocks
    dist.all_reduce(x)
    return dist.get_backend()


def test_nccl(gpumem):
    ranks = gpumem.distributed(fill, {world_size})
    assert [r.value for r in ranks] == ["nccl"] * {world_size}
    assert [r.phases["made"].peak_bytes for r in ranks] == [4096, 8192][:{world_size}]
"""


@pytest.mark.parametrize("world_size", [1, 2])
def test_nccl_with_one_device_per_rank(pytester: pytest.Pytester, world_size: int) -> None:
    import torch

    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} CUDA devices, {torch.cuda.device_count()} visible")
    pytester.makepyfile(NCCL.format(world_size=world_size))
    pytester.runpytest_subprocess("--gpumem-backend=cuda").assert_outcomes(passed=1)


SIMULATED = """
import pytest
from reference_losses.distributed import STEPS, sizes


def step(name):
    def run(rank, world_size, meter):
        STEPS[name](rank, meter, sizes(0.25, world_size), 0.25)
    return run


ddp, fsdp2 = step("ddp"), step("fsdp2")


@pytest.mark.parametrize("world_size", [2, 8])
def test_simulated(gpumem, world_size):
    gpumem.simulate_rank(ddp, world_size, rank=world_size - 1)
    gpumem.simulate_rank(fsdp2, world_size, rank=world_size - 1)


@pytest.mark.max_memory(device="meta")
def test_ddp_on_meta(gpumem):
    gpumem.simulate_rank(ddp, 8)


@pytest.mark.max_memory(device="meta")
def test_fsdp2_on_meta(gpumem):
    gpumem.simulate_rank(fsdp2, 8)


def test_bad_rank(gpumem):
    gpumem.simulate_rank(ddp, 2, rank=2)
"""

# World size 8 (16 rows a rank): h1 = 131,072, out = 65,536; P1 / 8 = 1,049,600, P2 / 8 = 1,049,088.
EXPECTED_8 = {
    "ddp.setup": 16_789_504,
    "ddp.forward": 262_148,  # h1 + 2 * out + 4
    "ddp.backward": 16_789_508,
    "ddp.step": 16_789_504,
    "fsdp2.setup": 1_049_632,  # P1 / 8 + 4 * 8
    "fsdp2.forward": 25_313_280,  # h1 + P1 + 2 * P2
    "fsdp2.backward": 26_235_396,  # 2 * P1 + P2 + P2 / 8 + 4
    "fsdp2.step": 2_098_688,  # P / 8
}


@pytest.mark.slow
def test_simulated_ranks_estimate_the_real_figures(tracker: pytest.Pytester, reported: Reported) -> None:
    tracker.makepyfile(SIMULATED)
    # requested bytes on meta too (not the allocator's model): the prediction equals what the ranks measure
    result = tracker.runpytest("-p", "no:randomly", "--gpumem-json=out.json", "--gpumem-round=none")
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines(
        [
            "E*RuntimeError: FSDP parameters should be materialized from meta device before training*",
            "*::test_bad_rank: gpumem.simulate_rank(rank=...) must be an int in 0..1, got 2",
        ]
    )
    tests = reported()
    simulated = {name: tests[f"test_simulated[{n}]"]["phases"] for name, n in (("2", 2), ("8", 8))}
    assert {k: simulated["2"][k]["peak_bytes"] for k in EXPECTED} == EXPECTED  # as measured on 2 real ranks
    assert {k: simulated["8"][k]["peak_bytes"] for k in EXPECTED_8} == EXPECTED_8
    meta = tests["test_ddp_on_meta"]["phases"]
    assert {k: v["peak_bytes"] for k, v in meta.items()} == {k: EXPECTED_8[k] for k in meta}
    assert set(meta) == {"ddp.setup", "ddp.forward", "ddp.backward", "ddp.step"}


@pytest.mark.parametrize(
    ("loaded", "ready", "message"),
    [
        ({0, 2}, set(), "rank 1 did not start within 8 s (still loading the function and its module)"),
        (set(), {0}, "ranks 1, 2 did not start within 8 s (still loading the function and its module)"),
        ({0, 1, 2}, {1}, "ranks 0, 2 did not form the process group within 8 s"),
    ],
)
def test_late_ranks_are_named_by_how_far_they_got(loaded: set[int], ready: set[int], message: str) -> None:
    deadlines = Deadlines(Progress(3, loaded=loaded, ready=ready), limit=1.0, join=8.0, say=None, now=100.0)
    deadlines.check(now=107.9)  # still within the join timeout
    with pytest.raises(DistributedError) as info:
        deadlines.check(now=108.0)
    assert (str(info.value), info.value.rank) == (message, int(message.split()[1].rstrip(",")))


def test_the_limit_runs_from_when_every_rank_has_joined() -> None:
    progress = Progress(3, loaded={0, 1, 2}, ready={0, 1, 2}, done={1: RankResult(1, phase_result("call", 500), {})})
    deadlines = Deadlines(progress, limit=1.0, join=8.0, say=None, now=100.0)
    deadlines.all_joined(now=107.0)
    deadlines.check(now=107.9)  # past the join timeout, within the limit
    with pytest.raises(DistributedError) as info:
        deadlines.check(now=108.0)
    assert (str(info.value), info.value.rank) == (
        "ranks 0, 2 did not finish within 1 s (timeout=, --gpumem-dist-timeout); all ranks were ended",
        0,
    )


@pytest.mark.parametrize(
    ("world_size", "message"),
    [
        (-2, "must be an int >= 1, got -2"),
        (2.0, "must be an int >= 1, got 2.0"),
        ("2", "must be an int >= 1, got '2'"),
        (
            10**6,
            "starts at most 64 ranks (each a process that imports torch; gpumem.simulate_rank() estimates "
            "one rank of a larger world), got 1000000",
        ),
    ],
)
def test_world_sizes_refused_in_one_line(world_size: Any, message: str) -> None:
    with pytest.raises(GpuMemError) as info:
        check_call(print, world_size, None, "ranks")
        check_started(world_size)
    assert str(info.value) == f"gpumem.distributed(world_size=...) {message}"


def test_a_rank_starts_no_ranks_and_simulates_none() -> None:
    with pytest.raises(GpuMemError, match=r"inside a rank of t\.py::test_a: ranks cannot start ranks$"):
        InRank("t.py::test_a").run(None, print, 1)  # type: ignore[arg-type]
    with pytest.raises(GpuMemError, match=r"already has a process group; it cannot be simulated$"):
        InRank("t.py::test_a").simulate(None, print, 2)


def test_a_meter_without_worlds_says_where_ranks_run() -> None:
    from pytest_gpumem.backends.tracker.backend import TrackerBackend

    measured = Measurement(TrackerBackend("none"), "t.py::test_a")
    meter = GpuMem(measured)
    measured.begin()
    try:
        with pytest.raises(GpuMemError, match=r"^gpumem.distributed\(\) runs ranks only for a meter given its worlds"):
            meter.distributed(print)
    finally:
        measured.end()


def test_a_rank_result_travels_as_json_and_its_value_pickled() -> None:
    result = RankResult(
        1, phase_result("call", 700, rank=1), {"fwd": phase_result("fwd", 300)}, {"loss": [1.5]}, {"k": 1}, ["n"]
    )
    message = Message.from_wire(done(result).to_wire())
    assert (message.kind, message.rank, message.result()) == (Kind.DONE, 1, result)
    assert json.loads(message.text)["phases"] == {"fwd": {**phase_result("fwd", 300).to_json()}}


def test_a_value_that_cannot_be_sent_or_loaded_is_named() -> None:
    with pytest.raises(TypeError) as sent:
        done(RankResult(0, phase_result("call", 0), {}, threading.Lock()))
    assert str(sent.value) == (
        "the function returned a value that cannot be sent back: TypeError: cannot pickle '_thread.lock' object"
    )
    unloadable = Message(
        Kind.DONE, 2, json.dumps(RankResult(2, phase_result("call", 0), {}).to_json()), b"not a pickle"
    )
    with pytest.raises(DistributedError) as loaded:
        unloadable.result()
    assert (str(loaded.value).split(":")[0], loaded.value.rank) == ("a rank's result cannot be loaded in the parent", 2)


def test_an_error_line_names_the_phase_it_left() -> None:
    error = ValueError("bad batch\nsecond line")
    mark_phase(error, "forward")
    assert describe(error) == "ValueError: bad batch (in phase 'forward')"
    assert describe(KeyError()) == "KeyError"


def test_idle_when_this_process_has_no_gloo_threads() -> None:
    assert wait_for_gloo_idle(limit=0.0)


def test_every_rank_takes_the_cublas_workspace_of_the_card_the_parent_predicts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pytest_gpumem.backends.tracker.backend import TrackerBackend
    from pytest_gpumem.distributed import world
    from pytest_gpumem.distributed.worker import rank_backend
    from pytest_gpumem.results.ranks import RankSpec

    given: list[RankSpec] = []

    def spawn(spec: RankSpec, limit: float, say: object) -> list[RankResult]:
        given.append(spec)
        return []

    monkeypatch.setattr(world, "spawn", spawn)
    parent = TrackerBackend("cuda")
    parent.predict_card("H100-80GB")  # compute capability 9.0: 32 MiB workspaces
    world.Worlds().run(Measurement(parent, "t.py::test_a"), print, 2)  # picklable, never run
    assert given[0].cublas_workspace == parent.workspace_bytes == 4096 * 8 * 1024
    assert rank_backend(0, given[0]).workspace_bytes == 4096 * 8 * 1024  # type: ignore[attr-defined]
    assert rank_backend(0, replace(given[0], cublas_workspace=None)).workspace_bytes == 8 * 2**20 + 128 * 1024  # type: ignore[attr-defined]


DDP_BUCKETS = """
import torch
from torch.nn.parallel import DistributedDataParallel

def wrap(rank, world_size, meter):
    model = torch.nn.Linear(256, 256)
    with meter.phase("setup"):
        model = DistributedDataParallel(model)
    with meter.phase("forward"):
        model(torch.ones(4, 256)).sum()

def test_ddp(gpumem):
    gpumem.distributed(wrap, 2)
"""


@pytest.mark.slow
def test_ddps_flat_buffers_are_its_gradient_buckets_and_a_broadcast_temporary(
    tracker: pytest.Pytester, reported: Reported
) -> None:
    tracker.makepyfile(DDP_BUCKETS)
    tracker.runpytest("--gpumem-explain", "--gpumem-json=out.json").assert_outcomes(passed=1)
    phases = reported()["test_ddp"]["explanation"]["phases"]
    flat = (256 * 256 + 256) * 4  # 263,168 B: every parameter, flattened
    for rank in ("@rank0", "@rank1"):
        # at the setup's peak: the copy of the parameters that DDP broadcasts from rank 0 (a cat)
        setup = [(t["op"], t["category"]) for t in phases[f"setup{rank}"]["tensors"] if t["bytes"] == flat]
        assert setup == [("aten.cat.default", "temporaries")]
        # kept after it: the Reducer's bucket, into which backward copies and all-reduces the gradients
        kept = [(t["op"], t["category"]) for t in phases[f"forward{rank}"]["tensors"] if t["bytes"] == flat]
        assert kept == [("aten.empty.memory_format", "gradients")]


def test_a_simulated_rank_may_tear_its_own_process_group_down(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import torch, torch.distributed as dist

        def step(rank, world_size, meter):
            with meter.phase("made"):
                torch.ones(1000)
            dist.destroy_process_group()  # as a training script's own teardown does

        def test_teardown(gpumem):
            gpumem.simulate_rank(step, 2)
            gpumem.simulate_rank(step, 4)  # the next world starts from no group
            assert not dist.is_initialized()
            assert gpumem.peak("made") == 4000
        """
    )
    tracker.runpytest().assert_outcomes(passed=1)


def keeps_12_mib(rank: int, world_size: int, meter: GpuMem, fail: bool) -> list[Any]:
    import torch

    kept = [torch.ones(1000), torch.ones(3 * 2**20)]  # 4,000 B: a 4,096 B block of a 2 MiB small segment; 12 MiB
    if fail:
        raise ValueError("bad batch")
    return kept


@pytest.mark.parametrize("fail", [False, True], ids=["returns", "raises"])
def test_a_rank_leaves_a_snapshot_of_its_run_even_when_it_raises(tmp_path: Any, fail: bool) -> None:
    from pytest_gpumem.distributed.worker import measure_rank, rank_backend, rank_snapshot_path
    from pytest_gpumem.results.ranks import RankSpec

    spec = RankSpec(
        "t.py::test_a", 2, "gloo", "", "tracker", "cuda", "cpu", None, 1.0, 1.0, b"", snapshots=str(tmp_path)
    )
    with contextlib.nullcontext() if not fail else pytest.raises(ValueError, match="bad batch"):
        call = measure_rank(1, spec, rank_backend(1, spec), keeps_12_mib, (fail,)).call
    figures = replay(read_snapshot(rank_snapshot_path(str(tmp_path), 1)))
    assert (figures.peak_allocated, figures.peak_reserved) == (12 * MiB + 4096, 14 * MiB)
    if not fail:
        assert (call.peak_bytes, call.reserved_peak_bytes) == (figures.peak_allocated, figures.peak_reserved)


def test_a_worlds_files_are_named_by_its_name_made_safe_and_numbered_when_taken() -> None:
    from pytest_gpumem.distributed.world import RankSnapshot, file_name_of_world

    assert file_name_of_world("ranks", set()) == "ranks"
    assert file_name_of_world("ranks", {"ranks", "ranks-2"}) == "ranks-3"
    assert file_name_of_world("tp/dp step" + "x" * 50, set()) == "tp_dp_step" + "x" * 30
    names = [RankSnapshot("ranks", rank, 11, b"").file_suffix() for rank in (10, 2, 0)]
    assert names == [".ranks.rank10.pickle", ".ranks.rank02.pickle", ".ranks.rank00.pickle"]
    assert RankSnapshot("ranks", 1, 2, b"").file_suffix() == ".ranks.rank1.pickle"
