"""The files the end of a run writes, one small class each, in `WRITERS`. Each declares its own option (its
flag and help; the path is its value): a new report format is a `Writer` here and a line in the table, and
the option table (options.py), the options read (config.py) and the session follow from it. The session
writes whichever the options chose, in the table's order."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, NamedTuple

__all__ = ["WRITERS", "JsonReport", "MarkdownReport", "RunInfo", "Writer"]

if TYPE_CHECKING:
    from pytest_gpumem.results import TestResult


class RunInfo(NamedTuple):  # not a dataclass: an idle run imports it, and a dataclass compiles its methods
    """What a writer knows of the run besides its results."""

    backend: str | None  # the backend's name, None when the run made none
    device: str | None
    root: Path  # the rootdir: pictures' paths are relative to it; the commit is its work tree's
    long: bool  # -v: the long form of the table
    record: str | None  # the command that records missing baselines, when baselines are in use


class Writer(ABC):
    """One file written at the end of a run, to `path`, given by the option `flag` (its ini twin is the flag
    without its dashes: gpumem_json) whose help is `help`."""

    __slots__ = ("path",)
    flag: ClassVar[str]
    help: ClassVar[str]
    names_backend: ClassVar[bool] = False
    """Whether asking for it makes the run's header name the backend (the file records it)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @abstractmethod
    def text(self, results: Sequence[TestResult], run: RunInfo) -> str:
        """The file's text."""


class JsonReport(Writer):
    flag = "--gpumem-json"
    help = "write every measured test's figures to PATH as JSON."
    names_backend = True

    def text(self, results: Sequence[TestResult], run: RunInfo) -> str:
        """The JSON report: the run's backend and device (those of its first result when it made none),
        and the commit of the git work tree holding the rootdir (none outside git)."""
        from pytest_gpumem.report.commit import head
        from pytest_gpumem.report.json import document

        first = results[0] if results and run.backend is None else None
        backend, device = (first.backend, first.device) if first else (run.backend, run.device)
        doc = document(results, backend, device, head(run.root))
        return json.dumps(doc, indent=2, sort_keys=True, allow_nan=False) + "\n"


class MarkdownReport(Writer):
    flag = "--gpumem-markdown"
    help = "write the report table to PATH as Markdown (CI step summaries)."

    def text(self, results: Sequence[TestResult], run: RunInfo) -> str:
        """The Markdown summary, its links relative to the file's folder."""
        from pytest_gpumem.report.markdown import markdown

        return markdown(results, run.long, run.root, self.path.parent, run.record)


WRITERS: tuple[type[Writer], ...] = (JsonReport, MarkdownReport)
"""Each end-of-run file, in the order written (and of their options in `pytest --help`)."""
