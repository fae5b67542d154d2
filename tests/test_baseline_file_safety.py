"""The baseline file under stress: concurrent writers merge, killed writers leave nothing behind, and files
that are not plain baseline JSON (FIFOs, devices, huge files, link loops, huge numbers) are refused."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from pytest_gpumem.baselines import file as F
from pytest_gpumem.baselines import update as U
from pytest_gpumem.baselines.schema import BaselineError, BaselineStore
from pytest_gpumem.constants import DEFAULT_FILENAME
from pytest_gpumem.results.baseline import DeviceIdentity, Entry, Environment

BASELINES = DEFAULT_FILENAME
TRACKER = DeviceIdentity("tracker", "cpu")
ENV = Environment("2.13.0", None)


def entry(peak: int) -> Entry:
    return Entry.measured(TRACKER, ENV, peak, {"made": peak})


def peaks(path: Path) -> dict[str, int]:
    """Node id -> stored peak, as the file on disk has them."""
    return {nodeid: per_device[TRACKER.key].peak_bytes for nodeid, per_device in F.load(path).entries.items()}


def wait_for(condition: Callable[[], bool], what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def two_entries(path: Path) -> BaselineStore:
    store = BaselineStore(path)
    U.update(store, {"a": entry(1), "b": entry(2)})
    return store


def left_behind(path: Path) -> list[str]:
    """The hidden files a write leaves next to the baseline file, but for the empty lock file (filelock
    keeps it on Linux and macOS)."""
    lock = path.with_name(f".{path.name}.lock")
    kept = {lock.name} if lock.exists() and lock.stat().st_size == 0 else set()
    return sorted(name for name in os.listdir(path.parent) if name.startswith(".") and name not in kept)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / BASELINES


# -------------------------------------------------------------------------------------- atomic writes


def test_write_creates_file_with_umask_permissions(path: Path) -> None:
    F.write(two_entries(path))
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_write_keeps_existing_permissions(path: Path) -> None:
    F.write(BaselineStore(path))
    path.chmod(0o640)
    F.write(two_entries(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_write_follows_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real.json"
    link = tmp_path / "link.json"
    F.write(BaselineStore(real))
    link.symlink_to(real)
    F.write(two_entries(link))
    assert link.is_symlink()
    assert F.load(real).entries == two_entries(link).entries


@pytest.mark.parametrize("target", ["replace", "fsync", "fdopen", "dumps"])
def test_failed_write_keeps_the_old_file(path: Path, monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    old = two_entries(path)
    F.write(old)
    before = path.read_bytes()
    new = F.load(path)
    U.update(new, {"tests/test_c.py::test_new": entry(1)})

    def boom(*args: object, **kwargs: object) -> Any:
        raise OSError(28, "No space left on device")

    if target == "dumps":
        monkeypatch.setattr(F, "dumps", boom)
    else:
        monkeypatch.setattr(os, target, boom)
    with pytest.raises(BaselineError) as info:
        F.write(new)
    monkeypatch.undo()
    assert "could not write baseline file" in str(info.value)
    assert "previous file is unchanged" in str(info.value)
    assert path.read_bytes() == before
    assert left_behind(path) == []


def test_interrupt_during_write_keeps_old_file_and_propagates(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    F.write(two_entries(path))
    before = path.read_bytes()

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        F.write(BaselineStore(path))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert left_behind(path) == []


def test_write_of_a_corrupted_store_fails_cleanly(path: Path) -> None:
    store = BaselineStore(path)
    store.entries["t"] = {TRACKER.key: entry(1)}
    object.__setattr__(store.entries["t"][TRACKER.key], "peak_bytes", float("nan"))  # bypass validation
    with pytest.raises(BaselineError, match="could not write baseline file"):
        F.write(store)
    assert not path.exists()
    assert left_behind(path) == []


# ------------------------------------------------------------------------------------- merging writes


def test_second_writer_merges_added_updated_and_removed_entries(path: Path) -> None:
    first = BaselineStore(path)
    U.update(first, {"keep": entry(1), "change": entry(2), "drop": entry(3)})
    F.write(first)
    a, b = F.load(path), F.load(path)
    U.update(a, {"from_a": entry(10), "change": entry(20)})
    U.prune(b, ["drop"], TRACKER)
    U.update(b, {"from_b": entry(30)})
    F.write(a)
    F.write(b)
    assert peaks(path) == {"keep": 1, "change": 20, "from_a": 10, "from_b": 30}
    assert b.entries == F.load(path).entries  # the store now holds what was written


def test_two_runs_that_found_no_file_both_keep_their_entries(path: Path) -> None:
    a, b = F.load(path), F.load(path)
    U.update(a, {"a": entry(1)})
    U.update(b, {"b": entry(2)})
    F.write(a)
    F.write(b)
    assert peaks(path) == {"a": 1, "b": 2}


def test_unchanged_entries_do_not_overwrite_another_writers_update(path: Path) -> None:
    first = BaselineStore(path)
    U.update(first, {"t": entry(1)})
    F.write(first)
    a, b = F.load(path), F.load(path)
    U.update(a, {"t": entry(5)})
    assert U.update(b, {"t": entry(1)}).unchanged == ["t"]
    U.prune(b, ["never-there"], TRACKER)
    U.update(b, {"other": entry(7)})
    F.write(a)
    F.write(b)
    assert peaks(path) == {"t": 5, "other": 7}


def test_write_to_another_path_copies_the_store_as_it_is(tmp_path: Path) -> None:
    store = BaselineStore(tmp_path / BASELINES)
    U.update(store, {"t": entry(1)})
    F.write(store)
    store = F.load(tmp_path / BASELINES)
    copy = tmp_path / "copy.json"
    F.write(store, copy)
    assert copy.read_bytes() == (tmp_path / BASELINES).read_bytes()


def test_size_limit_is_checked_before_reading(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path.write_text("{}")
    monkeypatch.setattr(F, "MAX_FILE_BYTES", 1)
    with pytest.raises(BaselineError, match=r"too large \(2 bytes, limit 1 B\)"):
        F.load(path)


def test_a_lock_held_too_long_fails_the_write_and_leaves_the_file(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = BaselineStore(path)
    U.update(store, {"t": entry(1)})
    F.write(store)
    before = path.read_bytes()
    U.update(store, {"u": entry(2)})
    monkeypatch.setattr(F, "LOCK_TIMEOUT_S", 0.2)
    held = r"cannot lock \.gpumem-baselines\.json\.lock: .*held it for 0\.2 s"
    another_write = FileLock(path.with_name(f".{BASELINES}.lock"))
    with another_write, pytest.raises(BaselineError, match=held):
        F.write(store)
    assert path.read_bytes() == before


def test_write_refuses_a_file_corrupted_since_load_and_leaves_it(path: Path) -> None:
    store = BaselineStore(path)
    U.update(store, {"t": entry(1)})
    F.write(store)
    U.update(store, {"u": entry(2)})
    path.write_text("{ broken")
    with pytest.raises(BaselineError, match="not valid JSON"):
        F.write(store)
    assert path.read_text() == "{ broken"
    assert left_behind(path) == []


WRITER = """
import sys, time
from pathlib import Path
from pytest_gpumem.baselines import file as F, update as U
from pytest_gpumem.results.baseline import DeviceIdentity, Entry, Environment

path, name, go = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
tracker = DeviceIdentity("tracker", "cpu")
store = F.load(path)
Path(f"{go}.{name}").touch()
while not go.exists():
    time.sleep(0.001)
for i in range(25):
    U.update(store, {f"{name}::test_{i}": Entry.measured(tracker, Environment(None, None), i, {})})
    F.write(store)
"""


def test_concurrent_writer_processes_lose_no_entry(tmp_path: Path) -> None:
    path, go = tmp_path / BASELINES, tmp_path / "go"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    procs = [subprocess.Popen([sys.executable, str(script), str(path), name, str(go)]) for name in ("a", "b", "c")]
    wait_for(lambda: all(Path(f"{go}.{n}").exists() for n in "abc"), "the writers to load")
    go.touch()
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert sorted(F.load(path).entries) == sorted(f"{n}::test_{i}" for n in "abc" for i in range(25))
    assert left_behind(path) == []


SLOW_TEST = """
import pathlib, time, torch

def test_{name}(gpumem):
    torch.ones(10)  # something to record: a test that allocates nothing needs no baseline
    pathlib.Path("{name}.ready").touch()
    deadline = time.monotonic() + 60
    while not pathlib.Path("{other}.ready").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
"""


@pytest.mark.slow  # a second pytest process, importing torch
def test_two_concurrent_update_runs_keep_both_runs_entries(tracker: pytest.Pytester) -> None:
    """Run b in its own process, run a in this one: each test waits for the other's, so both runs update
    the file at once."""
    tracker.makepyfile(test_a=SLOW_TEST.format(name="a", other="b"), test_b=SLOW_TEST.format(name="b", other="a"))
    tracker.makepyfile(test_old="import torch\n\ndef test_old(gpumem):\n    torch.ones(10)\n")
    tracker.runpytest("--gpumem-update=all", "test_old.py").assert_outcomes(passed=1)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    unplugged = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest")  # each costs the process seconds
    other = subprocess.Popen(
        [sys.executable, "-m", "pytest", *unplugged, "--gpumem-update=all", "test_b.py"],
        cwd=tracker.path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        here = tracker.runpytest("--gpumem-update=all", "test_a.py")
    finally:
        output = other.communicate(timeout=300)[0].decode()
    assert [here.ret, other.returncode] == [0, 0], output
    assert all("1 added" in out for out in (str(here.stdout), output)), output
    entries = json.loads((tracker.path / BASELINES).read_text())["entries"]
    assert sorted(entries) == ["test_a.py::test_a", "test_b.py::test_b", "test_old.py::test_old"]


# ------------------------------------------------------------------------------------ temporary files


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temp_files_are_named_by_pid(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real_replace = os.replace

    def spy(src: str, dst: str) -> None:
        seen.append(Path(src).name)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    F.write(BaselineStore(path))
    (name,) = seen
    assert name.startswith(f".{BASELINES}.{os.getpid()}.") and name.endswith(".tmp")


def test_write_removes_temp_files_of_dead_or_old_writers_only(path: Path) -> None:
    folder = path.parent
    hour_ago = time.time() - 3600
    names = {
        f".{BASELINES}.{dead_pid()}.abc123.tmp": False,  # its writer is gone
        f".{BASELINES}.{os.getpid()}.abc123.tmp": True,  # alive and recent
        f".{BASELINES}.{os.getppid()}.old123.tmp": False,  # alive, but an hour old (pids are reused)
        f".{BASELINES}.x8y9z0ab.tmp": True,  # name without pid (older versions): recent
        f".{BASELINES}.k7l8m9no.tmp": False,  # and an hour old
        f".other.json.{dead_pid()}.abc123.tmp": True,  # not ours
        "notes.tmp": True,
    }
    for name in names:
        (folder / name).write_text("partial")
    for name in (f".{BASELINES}.{os.getppid()}.old123.tmp", f".{BASELINES}.k7l8m9no.tmp"):
        os.utime(folder / name, (hour_ago, hour_ago))
    F.write(BaselineStore(path))
    kept = {name for name in names if (folder / name).exists()}
    assert kept == {name for name, stays in names.items() if stays}
    assert path.exists()


KILLED_WRITER = """
import os, sys, time
from pathlib import Path
from pytest_gpumem.baselines import file as F, update as U
from pytest_gpumem.results.baseline import DeviceIdentity, Entry, Environment

def stuck(src, dst):
    Path(sys.argv[2]).touch()
    time.sleep(600)

os.replace = stuck
store = F.load(sys.argv[1])
U.update(store, {"new": Entry.measured(DeviceIdentity("tracker", "cpu"), Environment(None, None), 1, {})})
F.write(store)
"""


def test_a_writer_killed_mid_write_leaves_the_file_and_the_next_write_cleans_up(tmp_path: Path) -> None:
    path, stuck = tmp_path / BASELINES, tmp_path / "stuck"
    first = BaselineStore(path)
    U.update(first, {"old": entry(1)})
    F.write(first)
    before = path.read_bytes()
    script = tmp_path / "killed.py"
    script.write_text(KILLED_WRITER)
    proc = subprocess.Popen([sys.executable, str(script), str(path), str(stuck)])
    try:
        wait_for(stuck.exists, "the writer to reach os.replace")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    (temp,) = left_behind(path)
    assert temp.startswith(f".{BASELINES}.{proc.pid}.") and temp.endswith(".tmp")
    assert path.read_bytes() == before
    store = F.load(path)
    U.update(store, {"next": entry(2)})
    F.write(store)
    assert left_behind(path) == []
    assert peaks(path) == {"old": 1, "next": 2}


# ------------------------------------------------------------------------------- files that are refused


def refused(tracker: pytest.Pytester, problem: str, *args: str) -> None:
    """The run stops with exit 4 and one line naming the file and ``problem``."""
    result = tracker.runpytest("-p", "no:cacheprovider", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    (line,) = [line for line in result.stderr.lines if line.strip()]
    assert line.startswith("ERROR: ") and BASELINES in line and problem in line, line


@pytest.mark.parametrize("update", [False, True], ids=["compare", "update"])
def test_fifo_is_refused_without_hanging(tracker: pytest.Pytester, update: bool) -> None:
    tracker.makepyfile("def test_one(gpumem):\n    pass\n")
    os.mkfifo(tracker.path / BASELINES)
    args = ["--gpumem-update"] if update else []
    result = tracker.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"ERROR: cannot read baseline file */{BASELINES}: a FIFO (named pipe), not a regular file"]
    )
    assert (tracker.path / BASELINES).is_fifo()


def test_symlink_to_a_device_is_refused(tracker: pytest.Pytester) -> None:
    (tracker.path / BASELINES).symlink_to("/dev/zero")
    refused(tracker, "a character device, not a regular file")


@pytest.mark.parametrize("update", [False, True], ids=["compare", "update"])
def test_huge_file_is_refused_unread(tracker: pytest.Pytester, update: bool) -> None:
    path = tracker.path / BASELINES
    with path.open("wb") as handle:
        handle.truncate(F.MAX_FILE_BYTES + 1)  # sparse: costs no disk
    refused(tracker, "too large (67,108,865 bytes, limit 64.0 MiB)", *(["--gpumem-update"] if update else []))
    assert path.stat().st_size == F.MAX_FILE_BYTES + 1


def test_symlink_loop_is_refused_under_update(tracker: pytest.Pytester) -> None:
    (tracker.path / BASELINES).symlink_to(BASELINES)
    refused(tracker, "a symbolic link loop", "--gpumem-update")
    assert os.readlink(tracker.path / BASELINES) == BASELINES


def test_symlink_loop_is_refused_in_a_plain_run(tracker: pytest.Pytester) -> None:
    tracker.makepyfile("def test_one(gpumem):\n    pass\n")
    (tracker.path / BASELINES).symlink_to(BASELINES)
    refused(tracker, "a symbolic link loop")


def test_unreadable_file_is_refused(
    tracker: pytest.Pytester, runpytest_bound_by_file_modes: Callable[..., pytest.RunResult]
) -> None:
    path = tracker.path / BASELINES
    F.write(BaselineStore(path))
    path.chmod(0)
    result = runpytest_bound_by_file_modes("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    (line,) = [line for line in result.stderr.lines if line.strip()]
    assert line.startswith("ERROR: ") and BASELINES in line and "Permission denied" in line, line


NUMBER_CASES = {
    "peak-400-digits": ('"peak_bytes": 4000', '"peak_bytes": ' + "9" * 400, "got an integer of 400 digits"),
    "phase-2**63": ('"made": 4000', f'"made": {2**63}', 'phases["made"]: expected an integer 0 <= n < 2**63'),
    "peak-5000-digits": ('"peak_bytes": 4000', '"peak_bytes": ' + "9" * 5000, "a number of more than 4300 digits"),
}


@pytest.mark.parametrize("old, new, problem", list(NUMBER_CASES.values()), ids=list(NUMBER_CASES))
def test_numbers_out_of_range_are_refused(tracker: pytest.Pytester, old: str, new: str, problem: str) -> None:
    tracker.makepyfile("def test_one(gpumem):\n    pass\n")
    store = BaselineStore(tracker.path / BASELINES)
    U.update(store, {"test_one.py::test_one": entry(4000)})
    F.write(store)
    path = tracker.path / BASELINES
    text = path.read_text().replace(old, new, 1)
    assert text != path.read_text()
    path.write_text(text)
    refused(tracker, problem)
    assert path.read_text() == text


def test_a_refused_file_is_not_rewritten_at_the_end_of_an_update(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        textwrap.dedent(
            f"""
            import pathlib, torch

            def test_one(gpumem):
                torch.ones(10)  # something to record, so that the update writes
                pathlib.Path({BASELINES!r}).write_text("{{ half")
            """
        )
    )
    result = tracker.runpytest("-p", "no:cacheprovider", "--gpumem-update")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([f"*baseline file */{BASELINES}: not valid JSON*"])
    assert (tracker.path / BASELINES).read_text() == "{ half"
