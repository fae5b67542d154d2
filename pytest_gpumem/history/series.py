"""Per test, device identity and phase: the figures each committed version of the baseline file holds
(and, as series of their own, those of ``--gpumem-json`` reports made at commits of its history), the
steps between consecutive figures, and the growth from the first figure to the latest."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from cuda_allocator_model import format_size
from pytest_gpumem.baselines.compare import Tolerance
from pytest_gpumem.baselines.schema import BaselineError, Versions, paused_gc
from pytest_gpumem.errors import first_line
from pytest_gpumem.history.git import Commit, Version
from pytest_gpumem.results.baseline import DeviceIdentity, Entry

__all__ = [
    "Gate",
    "Series",
    "SeriesPoint",
    "Step",
    "build",
    "device_label",
    "gate_first",
    "growth_text",
    "offenders",
    "read",
    "signed",
]

CALL = "call"
"""The phase name shown for the whole call's peak."""

_REPORTED = " (reports)"
"""What a reported series' device label ends with."""

_Key = tuple[str, str, str, bool]
"""``(node id, identity key, phase, reported)``."""

_Stores = Sequence[tuple[Commit, dict[str, dict[str, Entry]]]]
"""Per commit, oldest first: entries by test id, then by identity key."""


class SeriesPoint(NamedTuple):
    commit: Commit
    value: int


@dataclass(frozen=True)
class Step:
    commit: Commit
    before: int
    after: int

    @property
    def change(self) -> int:
        return self.after - self.before


@dataclass
class Series:
    nodeid: str
    device: str
    phase: str
    points: list[SeriesPoint] = field(default_factory=list)
    reported: bool = False  # figures of --gpumem-json reports, not of the committed file

    @property
    def first(self) -> int:
        return self.points[0].value

    @property
    def latest(self) -> int:
        return self.points[-1].value

    @property
    def change(self) -> int:
        return self.latest - self.first

    @property
    def percent(self) -> float | None:
        """The total change in % of the first figure; None from nothing to something (no ratio)."""
        if self.first == 0:
            return 0.0 if self.latest == 0 else None
        return 100.0 * self.change / self.first

    @cached_property
    def steps(self) -> list[Step]:
        """The changes between consecutive points (read once the series is built: it is kept)."""
        pairs = zip(self.points, self.points[1:], strict=False)
        return [Step(b.commit, a.value, b.value) for a, b in pairs if a.value != b.value]

    @property
    def largest(self) -> Step | None:
        """The step that changed the figure most (in bytes, either way); the first of equal ones."""
        return max(self.steps, key=lambda s: abs(s.change), default=None)

    def growth(self) -> float:
        """The key the table sorts by: the % growth, from nothing to something above any ratio."""
        percent = self.percent
        return float("inf") if percent is None else percent


@dataclass
class Read:
    """The versions that parsed (oldest first) and one line for each that did not."""

    stores: list[tuple[Commit, dict[str, dict[str, Entry]]]]
    skipped: list[str]


def read(versions: Iterable[Version]) -> Read:
    """Parse each version as the baseline file's own reader does (a test's entries are checked again only
    where its JSON changed); a version that does not parse is named."""
    result, reader = Read([], []), Versions()
    with paused_gc():  # the stores kept so far would be walked again after each version
        for version in versions:
            _read_one(version, reader, result)
    return result


def _read_one(version: Version, reader: Versions, result: Read) -> None:
    commit = version.commit
    if version.data is None:  # deleted in this commit: nothing measured from here on
        result.stores.append((commit, {}))
        return
    try:
        entries = reader.entries(version.data, f"{commit.short}:{version.path}")
    except (BaselineError, ValueError) as exc:
        result.skipped.append(f"skipped {commit.short} ({commit.date} {commit.subject}): {first_line(exc)}")
        return
    result.stores.append((commit, entries))


def build(stores: _Stores, reported: _Stores = ()) -> list[Series]:
    """One series per test, identity and phase, over the versions that hold it (and one per test, identity
    and phase of the reports), sorted by growth."""
    found: dict[_Key, Series] = {}
    with paused_gc():  # a million points: the collector would walk them again and again
        for flag, each in ((False, stores), (True, reported)):
            rows: dict[tuple[str, str], tuple[Entry, list[tuple[list[SeriesPoint], int]]]] = {}
            for commit, entries in each:
                for nodeid, per_device in entries.items():
                    for key, entry in per_device.items():
                        row = rows.get((nodeid, key))
                        if row is None or row[0] is not entry:  # an entry read again is the same object
                            row = rows[nodeid, key] = (entry, _figures(found, nodeid, key, entry, flag))
                        for points, value in row[1]:
                            points.append(SeriesPoint(commit, value))
    return sorted(found.values(), key=lambda s: (-round(s.growth(), 1), s.nodeid, s.device, s.phase != CALL, s.phase))


def _figures(
    found: dict[_Key, Series], nodeid: str, key: str, entry: Entry, reported: bool
) -> list[tuple[list[SeriesPoint], int]]:
    """Each of the entry's figures (the call's, then its phases') with the points of its series."""
    figures = []
    for phase, value in ((CALL, entry.peak_bytes), *entry.phases.items()):
        series = found.get((nodeid, key, phase, reported))
        if series is None:
            label = device_label(entry.identity) + (_REPORTED if reported else "")
            series = found[nodeid, key, phase, reported] = Series(nodeid, label, phase, reported=reported)
        figures.append((series.points, value))
    return figures


def device_label(identity: DeviceIdentity) -> str:
    """``tracker cpu``, ``cuda NVIDIA H200 cc 9.0 140.4 GiB``: the identity, shorter than its key."""
    parts = [identity.backend, identity.device]
    if identity.capability is not None:
        parts.append(f"cc {identity.capability}")
    if identity.total_memory is not None:
        parts.append(format_size(identity.total_memory))
    return " ".join(parts)


def growth_text(series: Series) -> str:
    """``+21.7%``; ``new`` from nothing to something."""
    percent = series.percent
    return "new" if percent is None else f"{percent:+.1f}%"


@dataclass(frozen=True)
class Gate:
    """``--max-growth PCT --slack SIZE``: a series breaks it when its latest figure is above its first
    by more than the baseline gate's arithmetic allows (PCT % of the first figure plus SIZE bytes)."""

    tolerance: Tolerance
    since: str | None = None

    def broke(self, s: Series) -> bool:
        return s.latest > self.tolerance.upper(s.first)

    def describe(self) -> str:
        """``10% + 1.0 MiB since v1``."""
        return self.tolerance.describe() + (f" since {self.since}" if self.since is not None else "")


def offenders(series: Iterable[Series], gate: Gate) -> list[str]:
    """One line per series that broke ``gate``: the test, the phase, both figures and the commits of
    its steps. A reported series whose committed twin (same test, device and phase) broke it too is said
    on the twin's line, where its figures differ, not on a line of its own."""
    broken = [s for s in series if gate.broke(s)]
    committed = {(s.nodeid, s.device, s.phase): s for s in broken if not s.reported}
    said: dict[int, Series] = {}  # the committed twin's id -> the reported series said on its line
    for s in broken:
        twin = committed.get((s.nodeid, s.device.removesuffix(_REPORTED), s.phase)) if s.reported else None
        if twin is not None:
            said[id(twin)] = s
    lines = []
    for s in broken:
        if s.reported and any(reported is s for reported in said.values()):
            continue
        steps = ", ".join(f"{step.commit.short} {signed(step.change)}" for step in s.steps)
        count = f"{len(s.steps)} step{'' if len(s.steps) == 1 else 's'}"
        reported = said.get(id(s))
        also = (
            ""
            if reported is None or (reported.first, reported.latest) == (s.first, s.latest)
            else (f"; in the reports {format_size(reported.first)} -> {format_size(reported.latest)}")
        )
        lines.append(
            f"{s.nodeid} [{s.device}] {s.phase}: {format_size(s.first)} -> {format_size(s.latest)} "
            f"({growth_text(s)}, more than {gate.tolerance.describe()}) in {count}: {steps}{also}"
        )
    return lines


def gate_first(series: Sequence[Series], gate: Gate | None) -> list[Series]:
    """The series that broke ``gate`` first (each group in its order, by growth), so that a small change
    large in percent is never ranked above them."""
    return list(series) if gate is None else sorted(series, key=lambda s: not gate.broke(s))


def signed(n: int) -> str:
    return ("+" if n > 0 else "") + format_size(n)
