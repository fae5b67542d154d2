"""The files a run writes: the JSON report and the Markdown table at its end, and, test by test, the
picture of an explained test (--gpumem-html) and the memory trace of a failing one (--gpumem-snapshot-dir)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_gpumem.backends.base import Backend
    from pytest_gpumem.measure.advice import Advice
    from pytest_gpumem.measure.meter import GpuMem
    from pytest_gpumem.results import TestResult
    from pytest_gpumem.results.explanation import Explanation

WRITE_ERRORS = (OSError, TypeError, ValueError, pickle.PicklingError)


def json_text(results: Sequence[TestResult], backend: Backend | None) -> str:
    """The JSON report: the run's backend and device (those of its first result when it made none)."""
    from pytest_gpumem.report.json import document

    first = results[0] if results else None
    name = backend.name if backend else (first.backend if first else None)
    device = str(backend.device) if backend else (first.device if first else None)
    return json.dumps(document(results, name, device), indent=2, sort_keys=True, allow_nan=False) + "\n"


def markdown_text(results: Sequence[TestResult], long: bool, rootpath: Path, path: Path) -> str:
    """The Markdown table, its links relative to the folder of `path`."""
    from pytest_gpumem.report.markdown import markdown

    return markdown(results, long, rootpath, path.parent)


def write_report(path: Path, flag: str, text: Callable[[], str]) -> str | None:
    """Writes `text()` to `path`; returns why it could not, in one line, or None."""
    try:
        path.write_text(text(), encoding="utf-8")
    except (OSError, TypeError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return f"{flag}: cannot write {path}: {reason}"
    return None


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
    path.write_text(render(explanation, advice), encoding="utf-8")
    return path


def shown_from(path: Path, rootpath: Path) -> str:
    """`path` relative to the rootdir, with forward slashes (as the report links it)."""
    try:
        return Path(os.path.relpath(path, rootpath)).as_posix()
    except ValueError:  # on another drive than the rootdir (Windows)
        return path.as_posix()


def write_trace(folder: Path, meter: GpuMem, result: TestResult, trace: Any) -> Path | None:
    """The failing test's memory trace: the one recorded, else the allocator's history taken now (CUDA).
    Returns the file written, or None when there was nothing to write."""
    from pytest_gpumem.backends.base import TakesSnapshots

    if trace is None and isinstance(meter.backend, TakesSnapshots):
        trace = meter.backend.snapshot()
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
