"""The `--gpumem-json` document: its version, the run's backend and device, the commit it was made at,
and each test's result; written at the end of a run (`document`) and read back (`read_report`) by the
one reader of `pytest-gpumem compare`, `merge` and `history --reports`."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_gpumem.baselines.schema import strict_json
from pytest_gpumem.errors import first_line
from pytest_gpumem.history.git import Head
from pytest_gpumem.results import TestResult
from pytest_gpumem.sizes import format_size, shorten

JSON_VERSION = 1
MAX_REPORT_BYTES = 256 * 1024 * 1024
NAMES = ("backend", "device")
"""What a report and each of its tests name the measurement by."""


def document(
    results: Sequence[TestResult], backend: str | None, device: str | None, commit: Head | None = None
) -> dict[str, Any]:
    """The `--gpumem-json` document; `commit` is the work tree's, None outside git."""
    return {
        "version": JSON_VERSION,
        "backend": backend,
        "device": device,
        "commit": None if commit is None else commit.to_json(),
        "tests": [r.to_json() for r in results],
    }


class ReportError(Exception):
    """A report that cannot be used: `reason` says why in a few words, the message names the file too."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


@dataclass(frozen=True)
class ReportedTest:
    """One test of a report: its figures checked, and its entry as written (`entry`, which a merge keeps
    whole, keys of later versions too)."""

    nodeid: str
    status: str
    backend: str | None
    device: str | None
    peaks: Mapping[str | None, int | None]  # the whole call (None) and each phase; None: not measured
    entry: Mapping[str, Any]


@dataclass(frozen=True)
class Report:
    """A `--gpumem-json` report read back, its tests by node id."""

    path: Path
    commit: Head | None  # the commit it was made at
    backend: str | None
    device: str | None
    tests: dict[str, ReportedTest]


def read_report(path: Path) -> Report:
    """The report in `path`, each test's node id, status, backend, device and peaks checked (the rest of
    an entry is its readers' to check); `ReportError` names what is wrong."""
    doc = _document(path)
    where = {key: _name(path, key, doc.get(key)) for key in NAMES}
    tests: dict[str, ReportedTest] = {}
    for i, raw in enumerate(doc["tests"]):
        test = _test(path, i, raw, where)
        if test.nodeid in tests and tests[test.nodeid].entry != test.entry:
            raise ReportError(path, f"{_quoted(test.nodeid)} appears twice with different figures")
        tests[test.nodeid] = test
    return Report(path, _made_at(path, doc.get("commit")), where["backend"], where["device"], tests)


def _document(path: Path) -> dict[str, Any]:
    """A report as far as its list of tests and its version."""
    try:
        if not path.is_file():
            raise ReportError(path, "not a file")
        if path.stat().st_size > MAX_REPORT_BYTES:
            raise ReportError(path, f"too large (limit {format_size(MAX_REPORT_BYTES)})")
        doc: object = strict_json(path.read_bytes().decode("utf-8-sig"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ReportError(path, f"cannot read a gpumem report: {first_line(exc)}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tests"), list):
        raise ReportError(path, "not a gpumem report (no list of tests; written by --gpumem-json?)")
    version = doc.get("version", JSON_VERSION)
    if type(version) is not int or not 1 <= version <= JSON_VERSION:
        raise ReportError(
            path, f"report version {shorten(version)} is not one this pytest-gpumem reads (1 to {JSON_VERSION})"
        )
    return doc


def _test(path: Path, i: int, raw: object, where: Mapping[str, str | None]) -> ReportedTest:
    """One test; one that names no backend or device was measured with the report's."""
    if not isinstance(raw, dict) or not isinstance(raw.get("nodeid"), str) or not raw["nodeid"]:
        raise ReportError(path, f"test {i} has no node id")
    nodeid = _quoted(raw["nodeid"])
    if not _printable(raw["nodeid"]):
        problem = "a node id must be printable text (no control characters, no lone surrogates)"
        raise ReportError(path, f"{nodeid}: {problem}")
    status = raw.get("status", "ok")
    if not isinstance(status, str):
        raise ReportError(path, f"{nodeid}: status must be a string, got {shorten(status)}")
    backend, device = (_name(path, f"{nodeid}: {key}", raw[key]) if key in raw else where[key] for key in NAMES)
    return ReportedTest(raw["nodeid"], status, backend, device, _peaks(path, nodeid, raw), raw)


def _name(path: Path, what: str, value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ReportError(path, f"{what} must be a name or null, got {shorten(value)}")
    return value


def _peaks(path: Path, nodeid: str, raw: dict[str, Any]) -> dict[str | None, int | None]:
    """The call's peak (None) and each phase's."""
    call, phases = raw.get("peak_bytes"), raw.get("phases", {})
    if not _is_size(call):
        raise ReportError(path, f"{nodeid}: peak_bytes must be a byte count or null, got {shorten(call)}")
    if not isinstance(phases, dict):
        raise ReportError(path, f"{nodeid}: phases must be an object of phase name -> figures, got {shorten(phases)}")
    bad = next((name for name, phase in phases.items() if not _is_phase(name, phase)), None)
    if bad is not None:
        raise ReportError(path, f"{nodeid}: phase {_quoted(bad, True)} must be an object with a peak_bytes byte count")
    peaks: dict[str | None, int | None] = {None: call}
    peaks.update((name, phase.get("peak_bytes")) for name, phase in phases.items())
    return peaks


def _made_at(path: Path, commit: object) -> Head | None:
    if commit is None:
        return None
    sha = commit.get("sha") if isinstance(commit, dict) else None
    dirty = commit.get("dirty") if isinstance(commit, dict) else None
    if not isinstance(sha, str) or len(sha) not in (40, 64) or not isinstance(dirty, bool):
        raise ReportError(
            path,
            f'"commit" must be {{"sha": a full commit hash, "dirty": true or false}} or null, got {shorten(commit)}',
        )
    return Head(sha.lower(), dirty)


def _quoted(text: str, quotes: bool = False) -> str:
    """`text` as JSON writes it (control characters and lone surrogates escaped), in quotes if asked."""
    written = json.dumps(text)
    return written if quotes else written[1:-1]


def _printable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return not any(ord(c) < 32 or ord(c) == 127 for c in text)


def _is_phase(name: str, phase: object) -> bool:
    return bool(name) and _printable(name) and isinstance(phase, dict) and _is_size(phase.get("peak_bytes"))


def _is_size(value: object) -> bool:
    return value is None or (type(value) is int and 0 <= value < 2**63)
