"""The files a run writes: the JSON report and the Markdown table at its end, and, test by test, the
picture of an explained test (--gpumem-html) and the memory trace of a failing one (--gpumem-snapshot-dir)."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_gpumem.backends.base import Backend
    from pytest_gpumem.measure.meter import GpuMem
    from pytest_gpumem.results import TestResult

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


def write_picture(folder: Path, result: TestResult) -> Path:
    """The explained test's memory over time, one self-contained HTML file in `folder`."""
    from pytest_gpumem.report.html import write_html

    assert result.explanation is not None, "only an explained test has a picture"
    return write_html(folder, result.explanation, result.info.get("advice"))


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
    from pytest_gpumem.measure.failures import write_evidence

    if trace is None and isinstance(meter.backend, TakesSnapshots):
        trace = meter.backend.snapshot()
    return write_evidence(folder, result.nodeid, result.status, result.message, trace)


def shown(path: Path, start: Path) -> str:
    """`path` relative to `start` (where pytest was started), when it is below it."""
    try:
        return str(path.relative_to(start))
    except ValueError:
        return str(path)


def plural(count: int, word: str) -> str:
    return f"{count:,} {word}{'s' if count != 1 else ''}"
