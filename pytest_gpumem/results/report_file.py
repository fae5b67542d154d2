"""The one reader of a `--gpumem-json` report, for `pytest-gpumem compare`, `merge` and `history --reports`:
the document exactly as the plugin writes it (its version, backend, device, commit, and each test's
`TestResult`), or a `GpuMemError` of one line naming the file and the JSON path of the first value that
is not (`old.json: tests[3].call.peak_bytes must be an integer of bytes, got '12'`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

from pytest_gpumem.errors import GpuMemError, first_line
from pytest_gpumem.results import TestResult
from pytest_gpumem.results.checks import OffShape, json_key, refuse, short
from pytest_gpumem.results.codec import REPORT, Spec, decode

__all__ = ["MAX_REPORT_BYTES", "REPORT_VERSION", "MadeAt", "ReportFile", "read_report"]

REPORT_VERSION = 1
MAX_REPORT_BYTES = 256 * 1024 * 1024


def _is_sha(sha: str) -> bool:
    return len(sha) in (40, 64) and all(c in "0123456789abcdef" for c in sha)


@dataclass(frozen=True)
class MadeAt:
    """The commit a report was made at, and whether the work tree had uncommitted changes."""

    sha: Annotated[str, Spec(expected="a full commit hash in lower-case hex", check=_is_sha)]
    dirty: bool


_NAME = Spec(expected="a name or null")


@dataclass(frozen=True)
class _Header:
    """A report's document as its keys are read: the tests are each read by `TestResult`."""

    version: Annotated[
        int, Spec(expected=f"{REPORT_VERSION} (the report version this pytest-gpumem reads)", low=1, high=1)
    ]
    backend: Annotated[str | None, _NAME]
    device: Annotated[str | None, _NAME]
    commit: Annotated[MadeAt | None, Spec(expected='{"sha": a full commit hash, "dirty": true or false} or null')]
    tests: list[Any]


_TOP = replace(REPORT, top="report")
"""A report's own keys are named from its root (`version`, `tests[3]`), its missing ones from `report`."""


@dataclass(frozen=True)
class ReportFile:
    """A `--gpumem-json` report read back: its header and its tests in the order written (a test written
    twice with the same figures, once)."""

    path: Path
    version: int
    backend: str | None
    device: str | None
    commit: MadeAt | None
    tests: tuple[TestResult, ...]


def read_report(path: Path) -> ReportFile:
    """The report in `path`; `GpuMemError` (`path: what is wrong`) for anything the plugin would not write."""
    try:
        return _report(path, _document(path))
    except OffShape as exc:
        raise GpuMemError(f"{path}: {exc}") from None
    except RecursionError:  # JSON read, but too deep to walk
        raise GpuMemError(f"{path}: cannot read a gpumem report: nested too deeply") from None


def _document(path: Path) -> object:
    try:
        if not path.is_file():
            raise GpuMemError(f"{path}: not a file")
        if path.stat().st_size > MAX_REPORT_BYTES:
            raise GpuMemError(f"{path}: too large for a gpumem report (limit {MAX_REPORT_BYTES >> 20} MiB)")
        text = path.read_bytes().decode("utf-8-sig")
        return json.loads(text, object_pairs_hook=_unique, parse_constant=_constant, parse_float=_finite)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise GpuMemError(f"{path}: cannot read a gpumem report: {first_line(exc)}") from None


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        keys = [key for key, _ in pairs]
        raise ValueError(f"duplicate key {json_key(next(k for k in keys if keys.count(k) > 1))}")
    return out


def _constant(name: str) -> object:
    raise ValueError(f"{name} is not a valid JSON number")


def _finite(text: str) -> float:
    """A number the report's writer could have written (it writes no infinity: `1e999`)."""
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{short(text)} is out of range of a JSON number")
    return number


def _report(path: Path, doc: object) -> ReportFile:
    if not isinstance(doc, dict) or "tests" not in doc:
        raise GpuMemError(f"{path}: not a gpumem report (no list of tests; written by --gpumem-json?)")
    head = decode(_Header, doc, "report", _TOP)
    return ReportFile(path, head.version, head.backend, head.device, head.commit, _tests(head.tests))


def _tests(raw: list[Any]) -> tuple[TestResult, ...]:
    tests: dict[str, TestResult] = {}
    for i, entry in enumerate(raw):
        test = TestResult.from_json(entry, f"tests[{i}]")
        if not _printable(test.nodeid):
            raise refuse(
                f"tests[{i}].nodeid", "printable text (no control characters, no lone surrogates)", test.nodeid
            )
        kept = tests.setdefault(test.nodeid, test)
        if kept != test:
            raise OffShape(f"tests[{i}]: {json_key(test.nodeid)} appears twice with different figures")
    return tuple(tests.values())


def _printable(name: str) -> bool:
    return not any(ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) < 0xE000 for c in name)
