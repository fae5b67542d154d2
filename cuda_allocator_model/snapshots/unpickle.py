"""A snapshot file's pickle loaded as plain data, with no code run: only a regular file is opened (mapped,
its pages read where the scan looks), its opcodes are scanned (`pickled`) up to its STOP, and the
unpickler refuses every global and persistent id; a Git LFS pointer, a cut file or damage is refused in
words (`Refuse`)."""

from __future__ import annotations

import contextlib
import gc
import io
import mmap
import os
import pickle
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final, NamedTuple

from cuda_allocator_model.errors import exception_text
from cuda_allocator_model.snapshots import pickled
from cuda_allocator_model.snapshots.fields import Refuse
from cuda_allocator_model.snapshots.pickled import Buffer

__all__ = ["Loaded", "collector_paused", "opened", "unpickle"]

_LFS_POINTER: Final = b"version https://git-lfs.github.com/spec/"


class _NoGlobals(pickle.Unpickler):
    """An unpickler that runs nothing: every global a pickle names is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise Refuse(f"a pickle that names the global {module}.{name}: refused (a snapshot holds plain data only)")

    def persistent_load(self, pid: Any) -> Any:
        raise Refuse("a pickle with a persistent id: refused (a snapshot holds plain data only)")


@contextlib.contextmanager
def opened(path: Path) -> Iterator[Buffer]:
    """The file's bytes, mapped (pages are read only where the scan looks): a regular file only."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd)
        if not stat.S_ISREG(mode.st_mode):
            kind = "a folder" if stat.S_ISDIR(mode.st_mode) else "not a regular file (a pipe, a device)"
            raise Refuse(f"{kind}, not a snapshot")
        if mode.st_size == 0:
            raise Refuse("an empty file, not a snapshot")
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
            yield mapped
    finally:
        os.close(fd)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the block: reading a trace makes a million containers
    that are not garbage, and each collection of them would walk them all again (it took 40% of
    `--against`'s time). A file's cycles, where one makes any, are collected once the block ends."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


class Loaded(NamedTuple):
    value: object
    extent: int  # the pickle's bytes: what bounds the work its lists may ask for


def unpickle(data: Buffer) -> Loaded:
    if data[: len(_LFS_POINTER)] == _LFS_POINTER:
        raise Refuse("a Git LFS pointer, not the snapshot it stands for (fetch it with `git lfs pull`)")
    if not len(data):
        raise Refuse("an empty file, not a snapshot")
    try:
        end = pickled.extent(data)
    except pickled.Refused as exc:
        raise Refuse(str(exc)) from None
    try:
        return Loaded(_NoGlobals(io.BytesIO(data[:end])).load(), end)
    except Refuse:
        raise
    except EOFError:
        raise Refuse(f"a pickle cut short after {end} bytes (truncated)") from None
    except RecursionError:
        raise Refuse("a pickle nested too deeply to be a snapshot") from None
    except Exception as exc:  # the scan let it through; whatever the unpickler still finds wrong is damage
        if "truncated" in exception_text(exc):
            raise Refuse(f"a pickle cut short after {end} bytes (truncated)") from None
        head = bytes(data[:16])
        raise Refuse(f"not a pickle, or a damaged one ({type(exc).__name__}; starts with {head!r})") from None
