"""The files a measured test may leave, one small class each, and `TEST_FILES`, the table that names the
option field holding each one's folder. A new per-test file is a `PerTestFile` here and a line in the table;
the judge asks each chosen one after every measured call, in the table's order, and names the file in the
test's report section."""

from __future__ import annotations

import dataclasses
import os
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import pytest

from pytest_gpumem.files import replace_atomically
from pytest_gpumem.run.outputs import WRITE_ERRORS, file_stem, shown_from, write_picture, write_trace

__all__ = ["TEST_FILES", "Noted", "PerTestFile", "Picture", "TorchSnapshot", "Trace", "Written", "chosen"]

if TYPE_CHECKING:
    from pytest_gpumem.backends.tracker.torch_snapshot import RecordedModel
    from pytest_gpumem.measure.measurement import Measurement
    from pytest_gpumem.measure.record import CallRecord
    from pytest_gpumem.results import TestResult


@dataclass(frozen=True)
class Noted:
    """A test's file (`path`, None where it leaves none of its own) with the notes its result keeps."""

    path: Path | None
    notes: tuple[str, ...]


Written = Path | Noted | None


@dataclass(frozen=True)
class PerTestFile(ABC):
    """One file a measured test may leave in `folder`, given by the option `flag`."""

    folder: Path
    flag: ClassVar[str]
    noun: ClassVar[str]  # what the file is, in the line saying it could not be written
    section: ClassVar[str]  # the title of the report section that names the file
    label: ClassVar[str]  # the words before its path there

    def begin(self, item: pytest.Item, measured: Measurement) -> str | None:
        """Called as the test's call starts; returns why the file cannot be written this run, or None."""
        return None

    @abstractmethod
    def write(self, item: pytest.Item, measured: Measurement, result: TestResult, record: CallRecord) -> Written:
        """Write the test's file; returns it, None when the test leaves none, or it with notes (why a file is not
        note the test's result keeps)."""

    def keep(self, result: TestResult, path: Path, root: Path) -> TestResult:
        """The result with what it keeps of the file written (nothing, but for the picture the report links)."""
        return result


class Picture(PerTestFile):
    flag, noun, section, label = "--gpumem-html", "picture", "gpumem picture", "memory over time"

    def write(self, item: pytest.Item, measured: Measurement, result: TestResult, record: CallRecord) -> Written:
        """The explained test's memory over time, and its advice, one self-contained page."""
        if result.explanation is None:
            return None
        return write_picture(self.folder, result.explanation, record.advice)

    def keep(self, result: TestResult, path: Path, root: Path) -> TestResult:
        return dataclasses.replace(result, html_path=shown_from(path, root))


class Trace(PerTestFile):
    flag, noun, section, label = "--gpumem-snapshot-dir", "trace", "gpumem evidence", "memory trace"

    def write(self, item: pytest.Item, measured: Measurement, result: TestResult, record: CallRecord) -> Written:
        """The memory trace of a test that failed on memory."""
        if not result.status.leaves_evidence:
            return None
        return write_trace(self.folder, measured, result, record.trace)


_RECORDED_KEY: pytest.StashKey[RecordedModel] = pytest.StashKey()
# one memory history cannot show a restart (docs/guides/torch-snapshots.md)
_RESTARTED = "none written: gpumem.fit restarted the allocator from a saved state"


class TorchSnapshot(PerTestFile):
    flag, noun, section, label = "--gpumem-torch-snapshots", "snapshot", "gpumem torch snapshot", "memory snapshot"

    def begin(self, item: pytest.Item, measured: Measurement) -> str | None:
        """Record the call's requests, frees and segments from here on, on the allocator's model; each rank
        of the test's `gpumem.distributed()` worlds records its own."""
        from pytest_gpumem.backends.tracker.torch_snapshot import record_backend
        from pytest_gpumem.distributed.world import Worlds

        recorded = record_backend(measured.backend)
        if recorded is None:
            return f"{self.flag}: none written: no CUDA allocator model (--gpumem-round=cuda)"
        item.stash[_RECORDED_KEY] = recorded
        if isinstance(measured.worlds, Worlds):
            measured.run_worlds_with(replace(measured.worlds, snapshots=[]))
        return None

    def write(self, item: pytest.Item, measured: Measurement, result: TestResult, record: CallRecord) -> Written:
        """Every measured test's prediction as a torch memory snapshot, which memory_viz opens and
        `pytest-gpumem replay` reads (once: a later call of the judge finds nothing), and one per rank of
        its worlds; a test whose process allocated nothing beside its ranks has none of its own."""
        recorded = item.stash.get(_RECORDED_KEY, None)
        if recorded is None:
            return None
        del item.stash[_RECORDED_KEY]
        ranks = self._write_ranks(item, measured)
        restarted = recorded.restarted
        if restarted or (ranks is not None and not recorded.events):
            (self.folder / f"{file_stem(item.nodeid)}.pickle").unlink(missing_ok=True)  # an earlier run's
            if restarted:
                noted = ranks or Noted(None, ())
                return replace(noted, notes=(*noted.notes, f"{self.flag}: {_RESTARTED}"))
            return ranks
        path = self._write_own(item, recorded)
        return path if ranks is None else replace(ranks, path=path)

    def _write_own(self, item: pytest.Item, recorded: RecordedModel) -> Path:
        from pytest_gpumem.backends.tracker.torch_snapshot import snapshot_bytes, snapshot_of

        path = self.folder / f"{file_stem(item.nodeid)}.pickle"
        self.folder.mkdir(parents=True, exist_ok=True)
        replace_atomically(path, snapshot_bytes(snapshot_of(recorded, os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))))
        return path

    def _write_ranks(self, item: pytest.Item, measured: Measurement) -> Noted | None:
        """Each rank's snapshot beside the test's own, all named in one report section; the ranks that left
        none said in notes, a line a world; None where the test ran no world whose ranks recorded."""
        from pytest_gpumem.distributed.spawn import named_ranks
        from pytest_gpumem.distributed.world import Worlds

        worlds = measured.worlds
        if not isinstance(worlds, Worlds) or not worlds.snapshots:
            return None
        snapshots = list(worlds.snapshots)
        worlds.snapshots.clear()  # the bytes are not kept past the test
        stem, written, missing = file_stem(item.nodeid), [], defaultdict[str, list[int]](list)
        _forget_ranks(self.folder, stem)
        for snapshot in snapshots:
            if snapshot.data is None:
                missing[snapshot.world].append(snapshot.rank)
                continue
            path = self.folder / f"{stem}{snapshot.file_suffix()}"
            self.folder.mkdir(parents=True, exist_ok=True)
            replace_atomically(path, snapshot.data)
            written.append(f"{self.label} of rank {snapshot.rank}: {path}")
        if written:
            item.add_report_section("call", self.section, "\n".join(written))
        return Noted(
            None,
            tuple(
                f"{self.flag}: no snapshot of {named_ranks(ranks)} of world {world!r}: ended before "
                f"{'it' if len(ranks) == 1 else 'they'} finished, or could not write one"
                for world, ranks in missing.items()
            ),
        )


def _forget_ranks(folder: Path, stem: str) -> None:
    """The ranks' snapshots an earlier run of the test left in `folder`: a rank that leaves none this run
    leaves none at all."""
    if folder.is_dir():
        for path in folder.iterdir():
            if path.name.startswith(f"{stem}.") and path.name.endswith(".pickle") and ".rank" in path.name:
                path.unlink(missing_ok=True)


TEST_FILES: Mapping[str, type[PerTestFile]] = {
    "html_dir": Picture,
    "snapshot_dir": Trace,
    "torch_snapshots": TorchSnapshot,
}
"""Each per-test file by the option field (of `config.Options`) that holds its folder, in the order written."""


def begin(files: Sequence[PerTestFile], item: pytest.Item, measured: Measurement, problems: list[str]) -> None:
    """Each file's start, as the call starts; why one cannot be written joins `problems` (once a run)."""
    for file in files:
        problem = file.begin(item, measured)
        if problem is not None and problem not in problems:
            problems.append(problem)


def write(
    files: Sequence[PerTestFile],
    item: pytest.Item,
    measured: Measurement,
    result: TestResult,
    record: CallRecord,
    root: Path,
    problems: list[str],
) -> TestResult:
    """The files the test leaves, each named in its report section; the result with what it keeps of them.
    A write that fails joins `problems` (said once at the end of the run, in one line): the outcome stands."""
    for file in files:
        try:
            written = file.write(item, measured, result, record)
        except WRITE_ERRORS as exc:
            problems.append(f"{file.flag}: cannot write the {file.noun} of {item.nodeid}: {exc}")
            continue
        if isinstance(written, Noted):
            result = result.replaced(notes=(*result.notes, *written.notes))
            written = written.path
        if written is not None:
            result = file.keep(result, written, root)
            item.add_report_section("call", file.section, f"{file.label}: {written}")
    return result


def chosen(options: object) -> list[PerTestFile]:
    """The files `options` (a `config.Options`) ask for: each whose field holds a folder, in table order."""
    folders = ((file, getattr(options, field)) for field, file in TEST_FILES.items())
    return [file(folder) for file, folder in folders if folder is not None]
