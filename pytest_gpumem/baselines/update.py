"""Changing a store: record this run's measurements (``update``), find the entries no test used
(``unused``) and remove them (``prune``), with an ``UpdateSummary`` of what happened. Nothing here
touches the file (``file.write`` does).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from pytest_gpumem.baselines.schema import BaselineStore
from pytest_gpumem.results.baseline import DeviceIdentity, Entry

__all__ = ["UpdateSummary", "prune", "unused", "update"]


@dataclass
class UpdateSummary:
    """Node ids by what happened to their entry (for the current device); ``removed`` comes from prune."""

    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    """Measured, not re-recorded: the stored entry stays as it is (``--gpumem-update=new``)."""
    accepted: list[str] = field(default_factory=list)
    """Of ``updated``, those that had regressed: their new, larger peaks are the baseline now."""

    @property
    def changed(self) -> bool:
        """Whether the file needs writing."""
        return bool(self.added or self.updated or self.removed)

    def describe(self) -> str:
        """``"2 added, 1 updated, 10 unchanged, 0 removed"`` (and ``", 3 kept"`` when some were kept, ``" (1
        of them a regression, accepted)"`` when an updated one had regressed)."""
        kept = f", {len(self.kept)} kept" if self.kept else ""
        accepted = ""
        if self.accepted:
            regression = "a regression" if len(self.accepted) == 1 else "regressions"
            accepted = f" ({len(self.accepted)} of them {regression}, accepted)"
        return (
            f"{len(self.added)} added, {len(self.updated)} updated{accepted}, "
            f"{len(self.unchanged)} unchanged, {len(self.removed)} removed{kept}"
        )

    def accepted_lines(self) -> list[str]:
        """The regressions the update accepted, one line each, for a reviewer to see: their new, larger
        peaks are the baseline now, and no later run will fail on them."""
        return [
            f"accepted the regression of {nodeid}: its larger peaks are its baseline now" for nodeid in self.accepted
        ]


def update(
    store: BaselineStore,
    results: Mapping[str, Entry] | Iterable[tuple[str, Entry]],
    *,
    summary: UpdateSummary | None = None,
) -> UpdateSummary:
    """Record the measurements of tests that ran and passed; every other entry stays as it is.

    ``results`` maps node ids to ``Entry.measured(...)`` (pass only tests whose body passed; a memory
    regression itself is what an update accepts). Each entry is stored under its own identity, so xdist
    workers on different devices are fine.
    """
    out = summary if summary is not None else UpdateSummary()
    items = results.items() if isinstance(results, Mapping) else results
    for nodeid, entry in items:
        change = store.put(nodeid, entry)
        getattr(out, change).append(nodeid)
    return out


def unused(store: BaselineStore, identity: DeviceIdentity, seen_nodeids: Collection[str]) -> list[str]:
    """Node ids with a baseline for ``identity`` that are not in ``seen_nodeids``, sorted.

    Meaningful only after a full, unfiltered run: pass every collected test that was selected, whether
    it passed, failed or was skipped (a test skipped here keeps its baseline). Entries for other devices
    are never unused.
    """
    seen = seen_nodeids if isinstance(seen_nodeids, (set, frozenset)) else set(seen_nodeids)
    return [n for n in store.nodeids(identity) if n not in seen]


def prune(
    store: BaselineStore,
    nodeids: Iterable[str],
    identity: DeviceIdentity,
    *,
    summary: UpdateSummary | None = None,
) -> UpdateSummary:
    """Remove the entries of ``nodeids`` for ``identity`` (typically ``unused(...)``); others stay."""
    out = summary if summary is not None else UpdateSummary()
    for nodeid in nodeids:
        if store.remove(nodeid, identity):
            out.removed.append(nodeid)
    return out
