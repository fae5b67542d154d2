"""The CPython internals the ranks' fork server copies or reaches into (`distributed/server.py`: `Popen._launch`
and `poll`, the `ForkServer`'s private fields, `multiprocessing.util`'s temporary folder) hold on this
Python. Needs neither torch nor tests/conftest.py: `.ci/pythons` runs it without that conftest on the oldest and
newest Python the package supports."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import io
import json
import os
import signal
import sys
import textwrap
import time
import tokenize
from collections.abc import Callable, Iterator
from multiprocessing import forkserver, process, util
from pathlib import Path
from typing import Any

import pytest

from pytest_gpumem.distributed import server

# What server.py was written against, the same on CPython 3.10 to 3.13: a new fingerprint means CPython changed
# the code, and the server's copy (or what it assumes of the original) is to be read against the new one.
REVIEWED = {  # the code, in `multiprocessing`: its fingerprints
    "popen_forkserver.Popen._launch": {"f151c17dbd793759"},
    "popen_forkserver.Popen.poll": {"a08dfce0029131f7"},
    "forkserver.ForkServer.ensure_running": {"755efef03fe73cab"},
    "forkserver.ForkServer.connect_to_new_process": {"de6b4cc5b3541c86"},
    "forkserver.ForkServer._stop_unlocked": {"e388911921fddc25"},
}
PRESERVED = ("_lock", "_preload_modules")  # a ForkServer's fields that stopping it leaves as they are


def fingerprint(code: Callable[..., Any]) -> str:
    """Of the code's tokens, without its comments and blank lines."""
    source = textwrap.dedent(inspect.getsource(code))
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.ENDMARKER}
    words = [
        {tokenize.INDENT: "<indent>", tokenize.DEDENT: "<dedent>", tokenize.NEWLINE: "<newline>"}.get(t.type, t.string)
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type not in skipped
    ]
    return hashlib.sha256(" ".join(words).encode()).hexdigest()[:16]


def in_multiprocessing(name: str) -> Callable[..., Any]:
    module, *path = name.split(".")
    code: Any = importlib.import_module(f"multiprocessing.{module}")
    for part in path:
        code = getattr(code, part)
    return code  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", sorted(REVIEWED))
def test_the_code_the_server_copies_is_the_code_it_was_written_against(name: str) -> None:
    found = fingerprint(in_multiprocessing(name))
    assert found in REVIEWED[name], (
        f"multiprocessing's {name} on Python {sys.version.split()[0]} (fingerprint {found}) is not the one "
        "pytest_gpumem/distributed/server.py was written against: read the server's use of it again"
    )


@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch) -> Iterator[server._Servers]:
    """Servers of the test's own, stopped after it (the suite's others are left running)."""
    own = server._Servers()
    monkeypatch.setattr(server, "_SERVERS", own)
    yield own
    own.stop_all()


def note(path: str, code: int) -> None:
    """A rank: what it runs as, said in a file and on the parent's streams, then exits with `code`."""
    Path(path).write_text(json.dumps({"pid": os.getpid(), "server": os.getppid(), "home": os.environ["HOME"]}))
    os.write(1, f"out of {Path(path).stem}\n".encode())
    os.write(2, f"err of {Path(path).stem}\n".encode())
    sys.exit(code)


def wait_forever(path: str) -> None:
    Path(path).write_text(str(os.getppid()))
    time.sleep(60)


def started(target: Callable[..., None], *args: object) -> server.RankProcess:
    rank = server.RankProcess(target=target, args=args, daemon=True, preload=("pytest_gpumem.distributed.server",))
    rank.start()
    return rank


def test_ranks_take_the_parents_streams_and_environment_and_give_their_pid_and_exit_code(
    servers: server._Servers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    ranks = []
    for name in ("first", "second"):  # HOME is the test's own: one server forks both
        monkeypatch.setenv("HOME", str(tmp_path / name))
        rank = started(note, str(tmp_path / f"{name}.json"), 3)
        rank.join(30)
        ranks.append(rank)
    first, second = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("first", "second"))
    assert [r.exitcode for r in ranks] == [3, 3]
    assert [first["pid"], second["pid"]] == [r.pid for r in ranks]
    assert first["server"] == second["server"] != os.getpid()
    assert [first["home"], second["home"]] == [str(tmp_path / "first"), str(tmp_path / "second")]
    out, err = capfd.readouterr()
    assert (out, err) == ("out of first\nout of second\n", "err of first\nerr of second\n")


def test_a_rank_whose_server_dies_is_killed_and_said_to_have_lost_it(servers: server._Servers, tmp_path: Path) -> None:
    said = tmp_path / "server"
    rank = started(wait_forever, str(said))
    deadline = time.monotonic() + 30
    while not said.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(int(said.read_text()), signal.SIGKILL)
    rank.join(30)
    assert (rank.exitcode, rank.lost_its_server) == (-signal.SIGKILL, True)


def test_a_stopped_server_is_as_a_new_one_was(servers: server._Servers, tmp_path: Path) -> None:
    # every field ensure_running sets (pid, pipe, socket, any a later Python adds) is let go of by server._forget
    started(note, str(tmp_path / "rank.json"), 0).join(30)
    (used,) = servers.servers.values()
    servers.stop_all()
    fresh = forkserver.ForkServer()
    assert {k: v for k, v in vars(used).items() if k not in PRESERVED} == {
        k: v for k, v in vars(fresh).items() if k not in PRESERVED
    }


def test_a_rank_starts_where_multiprocessings_temporary_folder_is_too_long_for_the_servers_socket(
    servers: server._Servers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the socket's path fits 107 characters: server._short_socket_folder binds it elsewhere, then puts it back
    folder = tmp_path / ("long" * 30)
    folder.mkdir()
    config = process.current_process()._config  # type: ignore[attr-defined]
    monkeypatch.setitem(config, "tempdir", str(folder))
    rank = started(note, str(tmp_path / "rank.json"), 0)
    rank.join(30)
    assert (rank.exitcode, util.get_temp_dir()) == (0, str(folder))
