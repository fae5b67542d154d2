"""The baseline file on disk: a guarded read (only a regular file of bounded size, never blocking), and a
write that merges with other runs under a lock and atomically replaces the file.

Concurrent writers merge: a store remembers what this run changed (``put``/``remove``), and ``write`` takes
an exclusive lock (``filelock`` on ``.<name>.lock`` next to the file; the empty lock file stays there on
Linux and macOS), re-reads the file when another run has replaced it since it was loaded, applies this
run's changes onto what is there now, and atomically replaces it. Temporary files are named
``.<name>.<pid>.<random>.tmp``; ones left by killed writers are removed by the next write.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from cuda_allocator_model import format_size
from pytest_gpumem.baselines.schema import BaselineError, BaselineStore, digest, dumps, loads
from pytest_gpumem.errors import one_line
from pytest_gpumem.files import replace_atomically

__all__ = ["LOCK_TIMEOUT_S", "MAX_FILE_BYTES", "STALE_TMP_AGE_S", "load", "read_file", "write"]

MAX_FILE_BYTES = 64 * 1024 * 1024
"""A larger baseline file is refused without being read."""
LOCK_TIMEOUT_S = 60.0
"""How long ``write`` waits for another run's write before giving up."""
STALE_TMP_AGE_S = 600.0
"""A temporary file this old is stale even when its pid looks alive (pids are reused)."""


def load(path: str | os.PathLike[str]) -> BaselineStore:
    """Read and validate a baseline file; a missing file is an empty store. Never modifies the file."""
    p = Path(path)
    raw = read_file(p)
    if raw is None:
        return BaselineStore(path=p, existed=False)
    return loads(raw, p)


def read_file(p: Path) -> bytes | None:
    """The bytes of a regular file of at most ``MAX_FILE_BYTES``, ``None`` when there is none.

    Opened without blocking and checked on the open descriptor, so a FIFO or device cannot hang the run.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(p, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        problem = "a symbolic link loop" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
        raise BaselineError(f"cannot read baseline file {p}: {problem}") from None
    try:
        info = os.fstat(fd)
        kind = _not_regular(info.st_mode)
        if kind is not None:
            raise BaselineError(f"cannot read baseline file {p}: {kind}, not a regular file")
        data = b"" if info.st_size > MAX_FILE_BYTES else _read_at_most(fd, MAX_FILE_BYTES + 1, p)
    finally:
        os.close(fd)
    if info.st_size > MAX_FILE_BYTES or len(data) > MAX_FILE_BYTES:
        size = max(info.st_size, len(data))
        raise BaselineError(
            f"cannot read baseline file {p}: too large ({size:,} bytes, limit {format_size(MAX_FILE_BYTES)})"
        )
    return data


def _read_at_most(fd: int, limit: int, p: Path) -> bytes:
    chunks: list[bytes] = []
    left = limit
    try:
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 24))):
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise BaselineError(f"cannot read baseline file {p}: {exc.strerror or exc}") from None
    return b"".join(chunks)


def _not_regular(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO (named pipe)",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    return next((name for test, name in kinds.items() if test(mode)), "not a file")


def write(store: BaselineStore, path: str | os.PathLike[str] | None = None) -> Path:
    """Merge this run's changes into the file and replace it atomically. Returns the path written.

    Under an exclusive lock: the file is re-read; when another run replaced it since ``store`` was read,
    ``store.changes`` are applied onto its entries (``store.entries`` becomes the merged result). The
    content goes to a temp file in the same folder, fsync, ``os.replace``. On any failure the previous
    file is left as it was, the temp file is removed, and a :class:`BaselineError` is raised
    (``KeyboardInterrupt`` and friends propagate unchanged). A file that ``load`` would refuse is refused
    here too, untouched. A symlink is followed (its target is replaced); an existing file keeps its
    permission bits. A ``path`` other than ``store.path`` receives the store's entries as they are.
    """
    own = Path(os.path.realpath(store.path))
    target = own if path is None else Path(os.path.realpath(path))
    if not target.parent.is_dir():
        raise BaselineError(f"could not write baseline file {target}: folder {target.parent} does not exist")
    with _locked(target):
        _remove_stale_temps(target)
        if target == own:
            _merge_with_file(store, target)
        data = _write_atomically(store, target)
    if target == own:
        store.digest = digest(data)
        store.existed = True
        store.changes.clear()
    _fsync_dir(target.parent)
    return target


def _merge_with_file(store: BaselineStore, target: Path) -> None:
    raw = read_file(target)
    if (None if raw is None else digest(raw)) == store.digest:
        return
    now = BaselineStore(target) if raw is None else loads(raw, target)
    for (nodeid, key), entry in store.changes.items():
        per_device = now.entries.setdefault(nodeid, {})
        if entry is None:
            per_device.pop(key, None)
        else:
            per_device[key] = entry
        if not per_device:
            del now.entries[nodeid]
    store.entries = now.entries


def _write_atomically(store: BaselineStore, target: Path) -> bytes:
    """Write the store to a temp file and rename it over ``target``; returns the bytes written."""
    try:
        data = dumps(store).encode("utf-8")
        replace_atomically(target, data, durable=True)
    except Exception as exc:
        raise BaselineError(
            f"could not write baseline file {target}: {one_line(exc)}; the previous file is unchanged"
        ) from exc
    return data


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``.<name>.lock`` next to ``target`` (the lock file itself may stay)."""
    from filelock import FileLock, Timeout

    path = target.with_name(f".{target.name}.lock")
    lock = FileLock(path, timeout=LOCK_TIMEOUT_S)
    try:
        lock.acquire()
    except Timeout:
        raise _lock_error(target, path, f"another run held it for {LOCK_TIMEOUT_S:g} s") from None
    except OSError as exc:
        raise _lock_error(target, path, one_line(exc)) from None
    try:
        yield
    finally:
        lock.release()


def _lock_error(target: Path, lock: Path, problem: str) -> BaselineError:
    return BaselineError(f"could not write baseline file {target}: cannot lock {lock.name}: {problem}")


def _remove_stale_temps(target: Path) -> None:
    """Remove temp files of killed writers: the pid in the name is gone, or the file is old (run under
    the lock, so no live writer of ours is between creating and renaming one)."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(?:(\d+)\.)?[A-Za-z0-9_]+\.tmp")
    now = time.time()
    with contextlib.suppress(OSError), os.scandir(target.parent) as names:
        for item in names:
            match = pattern.fullmatch(item.name)
            if match is None or not item.is_file(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError):
                pid = match.group(1)
                old = now - item.stat(follow_symlinks=False).st_mtime > STALE_TMP_AGE_S
                if old or (pid is not None and not _alive(int(pid))):
                    os.unlink(item.path)


def _alive(pid: int) -> bool:
    if sys.platform == "win32":  # os.kill(pid, 0) would terminate it: rely on the age alone
        return True
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows cannot open folders
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)
