"""Writing the files a run leaves: at its end, those the options chose of `report.writers.WRITERS` (the
JSON report, the Markdown table), and, test by test, those of `run.test_files.TEST_FILES` (the picture of
an explained test, the memory trace of a failing one), safely, and saying in one line why one could not be."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpumem.errors import first_line
from pytest_gpumem.files import replace_atomically

if TYPE_CHECKING:
    from pytest_gpumem.measure.measurement import Measurement
    from pytest_gpumem.results import TestResult
    from pytest_gpumem.results.advice import Advice
    from pytest_gpumem.results.explanation import Explanation

WRITE_ERRORS = (OSError, TypeError, ValueError, pickle.PicklingError)


def write_report(path: Path, flag: str, text: Callable[[], str]) -> str | None:
    """Writes `text()` to `path`; returns why it could not, in one line, or None."""
    try:
        write_file(path, text())
    except (OSError, TypeError, ValueError) as exc:
        return f"{flag}: cannot write {path}: {why(exc)}"
    return None


def why(exc: BaseException) -> str:
    """Why a write failed, in one line: the OS's words (`No space left on device`), else the error's."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return first_line(exc)


def write_file(path: Path, text: str) -> None:
    """Writes `text` to `path` in UTF-8, a lone surrogate as `\\udXXX` (not a lost file), or raises OSError
    naming `path`.

    A file, or a new one, is replaced through a temporary file in its folder (through a symbolic link, its
    target), keeping its mode, so that a failure (a full disk) leaves the old file whole. What is neither
    a file nor a folder (a device such as /dev/stdout or /dev/full, a pipe) is written directly, and a
    write it refuses is an error too, not a device node replaced by a file."""
    try:
        _write_file(path, text.encode("utf-8", errors="backslashreplace"))
    except OSError as exc:  # named after `path`, not after a temporary file or nothing (a device's flush)
        if exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path)) from None


def _write_file(path: Path, data: bytes) -> None:
    try:
        mode: int | None = path.stat().st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if mode is not None and not stat.S_ISREG(mode):
        with path.open("wb") as out:  # closing it flushes: a device that refuses the bytes raises here
            out.write(data)
        return
    replace_atomically(Path(os.path.realpath(path)), data)


def file_stem(nodeid: str) -> str:
    """A file name for a test: its id in safe characters, cut to 120, and a hash of the whole id that keeps
    different ids apart (its picture and its trace share it, so a test's files sit side by side)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid)[:120] + "-" + hashlib.sha1(nodeid.encode()).hexdigest()[:8]


def write_picture(folder: Path, explanation: Explanation, advice: Advice | None = None) -> Path:
    """The explained test's memory over time (and its advice, if it called gpumem.advise), one
    self-contained HTML file in `folder` (made if missing), named after the test; returns it."""
    from pytest_gpumem.report.html import render

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{file_stem(explanation.nodeid)}.html"
    write_file(path, render(explanation, advice))
    return path


def shown_from(path: Path, rootpath: Path) -> str:
    """`path` relative to the rootdir, with forward slashes (as the report links it)."""
    try:
        return Path(os.path.relpath(path, rootpath)).as_posix()
    except ValueError:  # on another drive than the rootdir (Windows)
        return path.as_posix()


def write_trace(folder: Path, measured: Measurement, result: TestResult, trace: Any) -> Path | None:
    """The failing test's memory trace: the one recorded, else the allocator's history taken now (CUDA).
    Returns the file written, or None when there was nothing to write."""
    if trace is None:
        trace = measured.backend.snapshot()
    return write_evidence(folder, result.nodeid, result.status, result.message, trace)


def write_evidence(folder: Path, nodeid: str, status: str, message: str | None, trace: Any) -> Path | None:
    """The trace of a failing test: JSON from the tracker, a memory-history pickle from CUDA (PyTorch's
    memory visualizer opens it). Returns the file written, or None when there was nothing to write."""
    if trace is None:
        return None
    stem = file_stem(nodeid)
    if isinstance(trace, dict) and str(trace.get("format", "")).startswith("pytest-gpumem"):
        path = folder / f"{stem}.json"
        doc = {"nodeid": nodeid, "status": status, "message": message, **trace}
        path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    else:
        path = folder / f"{stem}.pickle"
        path.write_bytes(pickle.dumps(trace))
    return path


def shown(path: Path, start: Path) -> str:
    """`path` relative to `start` (where pytest was started), when it is below it."""
    try:
        return str(path.relative_to(start))
    except ValueError:
        return str(path)


def plural(count: int, word: str) -> str:
    return f"{count:,} {word}{'s' if count != 1 else ''}"
