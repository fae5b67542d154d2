"""Ranks forked from a server that has imported torch once, instead of each rank importing it anew.

A spawned rank is a fresh interpreter that imports torch and the rank's code (about 4 s of CPU). The
server is such a fresh interpreter, started like a spawned rank (same executable, flags, environment,
`sys.path` and working directory) with the rank's code imported; each rank is forked from it and then
prepared exactly as a spawned one (`multiprocessing.spawn.prepare`: `sys.path`, working directory, main
module as the parent has them now). So a rank starts from the state a spawned rank reaches, without the
parent's own state (its `conftest.py`, fixtures, patched globals, torch settings), in milliseconds.

The parent's environment, standard output and standard error at the moment the ranks start reach them as
they would reach spawned ones: ranks fork from a server started with the same environment (but the test's
name in `PYTEST_CURRENT_TEST` and the home folder) where torch and the other preloaded packages are found
in the same files now (the last two servers are kept running), and each rank takes the parent's current
stdout and stderr (pytest's capture of the test being run), both before anything of the test is imported
in the rank.

Nothing outlives the parent: a rank lets go of the pipe by which the server sees the parent alive, so the
server exits when the parent does, even when killed, and on Linux a rank is killed when its server dies.
The parent kills a server it replaces or leaves at exit, and a rank whose server died.

One thing differs from spawned ranks: forked from one server, the ranks share its seed of `str` hashes
(spawned ones each draw their own unless `PYTHONHASHSEED` is set).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.machinery
import io
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from multiprocessing import connection, context, forkserver, popen_forkserver, process, reduction, spawn, util
from typing import Any

from cuda_allocator_model import shorten
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.private_torch import DYNAMO

_RANK_CODE = ("pytest_gpumem.distributed.worker", "torch.multiprocessing", "torch.distributed", DYNAMO)
_BACKENDS = {"cuda": "pytest_gpumem.backends.cuda", "tracker": "pytest_gpumem.backends.tracker.backend"}


def preloaded(meter_kind: str) -> tuple[str, ...]:
    """What the server imports before forking ranks measured by `meter_kind`: what a spawned rank imports
    before it loads the test's module (the tracker's backend alone is some 800 modules)."""
    return (*_RANK_CODE, _BACKENDS[meter_kind])


# set for each test by pytest, pytester and tests that isolate a home folder; given to each rank instead
_PER_TEST = frozenset({"PYTEST_CURRENT_TEST", "HOME", "USERPROFILE", "PYTEST_DEBUG_TEMPROOT"})
_STREAMS = (1, 2)  # the parent's stdout and stderr, the first descriptors a rank inherits
_PR_SET_PDEATHSIG = 1  # prctl's option (linux/prctl.h)
_SOCKET_FOLDER_MAX = 80  # characters of the folder of the server's socket: its path fits 107 (AF_UNIX)


class _Servers:
    """The servers ranks are forked from, by what they were started with: the last few are kept running, so
    that tests alternating between two environments do not restart one each time."""

    KEPT = 2

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.servers: OrderedDict[tuple[object, ...], forkserver.ForkServer] = OrderedDict()
        util.Finalize(self, self.stop_all, exitpriority=-50)

    def connect(self, preload: tuple[str, ...], fds: list[int]) -> tuple[int, int]:
        """`ForkServer.connect_to_new_process` on a server with `preload` imported, started like a rank
        spawned now would be (one that died is started again), under the lock: no other thread stops it
        meanwhile."""
        key = (preload, *_start_key(preload))
        with self.lock:
            server = self.servers.pop(key, None) or _new_server(preload)
            self.servers[key] = server
            while len(self.servers) > self.KEPT:
                _stop(self.servers.popitem(last=False)[1])
            _ensure_running(server)
            return server.connect_to_new_process(fds)

    def not_started(self, preload: tuple[str, ...]) -> str:
        """Why the server for `preload` gave no rank (it exited as it started), once it is reaped."""
        with self.lock:
            server = self.servers.pop((preload, *_start_key(preload)), None)
            return _not_started(None if server is None else _reap(server))

    def stop_all(self) -> None:
        with self.lock:
            while self.servers:
                _stop(self.servers.popitem()[1])


def _new_server(preload: tuple[str, ...]) -> forkserver.ForkServer:
    server = forkserver.ForkServer()
    server.set_forkserver_preload(list(preload))
    return server


def _ensure_running(server: forkserver.ForkServer) -> None:
    """Started, in a socket folder short enough, where it never ran or died."""
    pid = server._forkserver_pid  # type: ignore[attr-defined]
    if pid is not None and os.waitpid(pid, os.WNOHANG)[0] == 0:
        return
    if pid is not None:
        _forget(server)
    with _short_socket_folder():
        server.ensure_running()


def _reap(server: forkserver.ForkServer) -> int | None:
    """The exit code of a server that is exiting or has exited (killed if it still runs), then forgotten."""
    pid = server._forkserver_pid  # type: ignore[attr-defined]
    if pid is None:
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    try:
        status = os.waitpid(pid, 0)[1]
    except ChildProcessError:
        status = None
    _forget(server)
    return None if status is None else os.waitstatus_to_exitcode(status)


def _not_started(code: int | None) -> str:
    """Why no rank could start: the server exited as it started, in the environment the test set."""
    how = "exited" if code is None else f"exited with code {code}"
    home = os.environ.get("PYTHONHOME")
    suspect = f"; the test sets PYTHONHOME={shorten(home)}" if home is not None else ""
    return (
        f"the ranks' fork server (a Python started as a spawned rank would be) {how} as it started{suspect}: "
        "its own error is in the test's captured stderr"
    )


def _stop(server: forkserver.ForkServer) -> None:
    """Killed rather than asked to stop: a descendant of a rank may hold the pipe whose closing asks it."""
    pid = server._forkserver_pid  # type: ignore[attr-defined]
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    _forget(server)


def _forget(server: forkserver.ForkServer) -> None:
    """Its pipe closed and its socket gone, once its process was reaped."""
    os.close(server._forkserver_alive_fd)  # type: ignore[attr-defined]
    address = server._forkserver_address  # type: ignore[attr-defined]
    if not util.is_abstract_socket_namespace(address):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address)
    server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None  # type: ignore[attr-defined]


_SERVERS = _Servers()


def _start_key(preload: tuple[str, ...]) -> tuple[object, ...]:
    """What a server's imports depend on: the interpreter, the environment, and the files the preloaded
    packages are found in now (not `sys.path` or the working directory as such: a test's folder in them
    changes no import of the server's)."""
    environ = tuple(sorted((k, v) for k, v in os.environ.items() if k not in _PER_TEST))
    tops = sorted({name.partition(".")[0] for name in preload})
    found = [importlib.machinery.PathFinder.find_spec(top, sys.path) for top in tops]
    return spawn.get_executable(), environ, tuple(spec.origin if spec else None for spec in found)


@contextlib.contextmanager
def _short_socket_folder() -> Iterator[None]:
    """multiprocessing binds the server's socket in its temporary folder (under TMPDIR); where that path is
    too long for a socket's address, in a private folder of the system's own temporary folder instead."""
    if len(util.get_temp_dir()) <= _SOCKET_FOLDER_MAX:
        yield
        return
    config = process.current_process()._config  # type: ignore[attr-defined]  # get_temp_dir's
    folder, kept = tempfile.mkdtemp(prefix="gpumem-", dir="/tmp"), config["tempdir"]
    util.Finalize(None, shutil.rmtree, args=(folder, True), exitpriority=-100)
    config["tempdir"] = folder
    try:
        yield
    finally:
        config["tempdir"] = kept


class _Popen(popen_forkserver.Popen):
    """`popen_forkserver.Popen` forking from our server (not multiprocessing's shared one, which a user may
    preload as they like), handing the rank the parent's current stdout, stderr and environment."""

    server_died = False

    def _launch(self, process_obj: Any) -> None:
        for fd in _STREAMS:
            self.duplicate_for_child(fd)
        prep_data = {**spawn.get_preparation_data(process_obj._name), "gpumem": _Arrival(dict(os.environ))}
        buf = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            context.set_spawning_popen(None)
        try:
            parent_w = self._hand_over(process_obj.preload, buf)
        except (EOFError, ConnectionError):  # the server refused or closed the connection: it exited as it started
            raise GpuMemError(_SERVERS.not_started(process_obj.preload)) from None
        self.pidfd = _pidfd(self.pid)
        kept = (parent_w, self.sentinel) if self.pidfd is None else (parent_w, self.sentinel, self.pidfd)
        self.finalizer = util.Finalize(self, util.close_fds, kept)  # type: ignore[attr-defined]

    def _hand_over(self, preload: tuple[str, ...], buf: io.BytesIO) -> int:
        """Send the rank to the server and read its pid; the rank's sentinel kept by this process is returned."""
        self.sentinel, w = _SERVERS.connect(preload, self._fds)  # type: ignore[attr-defined]
        parent_w = os.dup(w)  # as in popen_forkserver
        try:
            with open(w, "wb", closefd=True) as f:
                f.write(buf.getbuffer())
            self.pid = forkserver.read_signed(self.sentinel)
        except BaseException:
            os.close(parent_w)
            os.close(self.sentinel)
            raise
        return parent_w

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        """As `popen_forkserver`'s, except that a rank whose server died (which reports every exit) is
        killed, not taken for one that exited with code 255 while it may still run."""
        if self.returncode is not None or not connection.wait([self.sentinel], 0 if flag == os.WNOHANG else None):
            return self.returncode
        try:
            self.returncode = forkserver.read_signed(self.sentinel)
        except (OSError, EOFError):
            self.server_died = True
            with contextlib.suppress(ProcessLookupError):
                if self.pidfd is None:
                    os.kill(self.pid, signal.SIGKILL)
                else:  # never another process that took the pid of a rank that exited meanwhile
                    signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            self.returncode = -signal.SIGKILL
        return self.returncode


class _Arrival:
    """Read by the rank with its preparation data, before the test's module and the rank's function: it
    takes the parent's streams and environment then."""

    def __init__(self, environ: dict[str, str]) -> None:
        self.environ = environ

    def __reduce__(self) -> tuple[Any, tuple[dict[str, str]]]:
        return _arrive, (self.environ,)


def _arrive(environ: Mapping[str, str]) -> None:
    _take_streams(forkserver.get_inherited_fds() or [])
    _take_environ(environ)
    _tie_to_server()


def _pidfd(pid: int) -> int | None:
    """A descriptor of the rank's process (Linux), by which it is killed even after its pid was reused."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _tie_to_server() -> None:
    """The rank lets go of the pipe by which the server sees the parent alive (so that the server exits with
    the parent, whatever the rank and its children hold) and, on Linux, is killed when the server dies."""
    server: Any = forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    with contextlib.suppress(OSError, AttributeError):
        ppid = os.getppid()
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != ppid:  # the server died before the rank asked
            os._exit(1)


class RankProcess(context.ForkServerProcess):
    """A rank's process: forked from a server with `preload` imported, then given the parent's streams and
    environment."""

    def __init__(self, *args: Any, preload: tuple[str, ...], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.preload = preload

    @staticmethod
    def _Popen(process_obj: Any) -> _Popen:
        return _Popen(process_obj)

    @property
    def lost_its_server(self) -> bool:
        """Whether the server it was forked from died while it ran (it was killed then)."""
        popen = self._popen  # type: ignore[attr-defined]
        return isinstance(popen, _Popen) and popen.server_died


def _take_streams(inherited: list[int]) -> None:
    """The parent's stdout and stderr, sent first among the descriptors, replace the server's."""
    for fd, parents in zip(_STREAMS, inherited, strict=False):
        os.dup2(parents, fd)
        os.close(parents)


def _take_environ(environ: Mapping[str, str]) -> None:
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)
