"""The end of a run's baselines, on the controller (or a run without xdist) after the last test, in a module
of its own: only runs whose baselines are active import it. Warnings, unused baselines, the tests that want
one, the file updated, pruned and written; whether the run left tests out; the slack's hint."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import pytest

from cuda_allocator_model import format_size
from pytest_gpumem.run.regression import identity_of

if TYPE_CHECKING:
    from pytest_gpumem.backends.base import Backend
    from pytest_gpumem.baselines.update import UpdateSummary
    from pytest_gpumem.results import TestResult
    from pytest_gpumem.results.baseline import DeviceIdentity, Entry
    from pytest_gpumem.run.regression import BaselineRun


def slack_hint(results: Iterable[TestResult], slack: int) -> list[str]:
    """A line naming the tests whose peaks grew past their tolerance and passed only by the slack (the
    first three, each with its largest such growth), and the largest slack that fails them all."""
    from pytest_gpumem.baselines.compare import change_text, passed_by_slack

    grown: list[str] = []
    margin = slack  # the least growth past a tolerance's percent, among them
    for result in results:
        found = [c for c in result.verdict.comparisons if passed_by_slack(c, slack)] if result.verdict else []
        for comparison in found:
            assert comparison.allowed is not None and comparison.current is not None
            margin = min(margin, comparison.current - (comparison.allowed - slack))
        if found:
            # the largest growth, a phase's name before the call's when they grew alike
            worst = max(found, key=lambda c: ((c.current or 0) - (c.baseline or 0), c.phase is not None))
            grown.append(f"{result.nodeid} {worst.label} {change_text(worst.baseline or 0, worst.current or 0)}")
    if not grown:
        return []
    shown = ", ".join(grown[:3]) + (f" and {len(grown) - 3} more" if len(grown) > 3 else "")
    fails = f"{(margin - 1) // 1024}KiB" if margin > 1024 else str(margin - 1)
    tests, them = ("test", "it") if len(grown) == 1 else ("tests", "them")
    return [
        f"warning: {len(grown)} {tests} grew past the tolerance and passed only by the {format_size(slack)} "
        f"slack: {shown}; --gpumem-slack={fails} fails {them}"
    ]


def partial_run(config: pytest.Config, session: pytest.Session) -> bool:
    """Whether some tests may have been left out, so that an unused baseline may belong to one of
    them: anything but the configured test paths (or the rootdir) run whole and to the end."""
    source = config.args_source
    whole = source == pytest.Config.ArgsSource.TESTPATHS or (
        source == pytest.Config.ArgsSource.INVOCATION_DIR and config.invocation_params.dir == config.rootpath
    )
    narrowing = ("keyword", "markexpr", "ignore", "ignore_glob", "deselect", "lf", "stepwise", "collectonly")
    narrowed = any(getattr(config.option, name, None) for name in narrowing)
    return not whole or narrowed or bool(session.shouldstop) or bool(session.shouldfail)


def finish(
    run: BaselineRun,
    records: Iterable[tuple[str, Entry]],
    backend: Callable[[], Backend],
    missing: Sequence[str] = (),
    regressed: Sequence[str] = (),
) -> list[str]:
    """After the run: warnings, unused baselines, the tests that failed for want of a baseline
    (`missing`), and under --gpumem-update/--gpumem-prune the new file, saying which of the tests
    that grew past their baselines (`regressed`) it accepted. Returns the lines for the terminal
    summary."""
    from pytest_gpumem.baselines.compare import allocates_nothing, environment_warnings
    from pytest_gpumem.baselines.file import write
    from pytest_gpumem.baselines.update import UpdateSummary, unused, update

    assert run.store is not None, "finish() is called only when baselines are active"
    entries = dict(records)
    first = next(iter(entries.values()), None)
    identity = identity_of(backend()) if first is None else first.identity
    warnings = [] if first is None else environment_warnings(run.store, identity, first.environment)
    lines = [f"warning: {w}" for w in warnings]
    if first is None and run.options.update:
        lines.append(f"nothing to record (no measured test passed): {run.options.path} left as it was")
    stale = [] if run.partial else unused(run.store, identity, run.seen)
    summary = UpdateSummary()
    if run.options.update:
        passed = {n: e for n, e in entries.items() if n not in run.failed}
        if run.options.update_new_only:  # stored entries stay byte for byte
            summary.kept = [n for n, e in passed.items() if run.store.get(n, e.identity) is not None]
            passed = {n: e for n, e in passed.items() if run.store.get(n, e.identity) is None}
        for nodeid in [n for n, e in passed.items() if allocates_nothing(e)]:  # needs no baseline
            if run.store.remove(nodeid, passed.pop(nodeid).identity):
                summary.removed.append(nodeid)
        passed = {n: _keeping_composition(run, n, e) for n, e in passed.items()}
        update(run.store, passed, summary=summary)
        summary.accepted = [n for n in regressed if n in summary.updated]
    empty = [n for n, e in entries.items() if n not in run.failed and allocates_nothing(e)]
    empty = [n for n in empty if run.store.get(n, entries[n].identity) is None]
    if empty:
        tests = "test allocates" if len(empty) == 1 else "tests allocate"
        lines.append(f"{len(empty)} measured {tests} nothing (0 B in every phase): no baseline needed")
    if missing:
        lines.append(
            f"{len(missing)} measured {'test has' if len(missing) == 1 else 'tests have'} no baseline for "
            f"{identity.key} in {run.options.path.name}: "
            f"record them, measuring what this run measures, with: {run.record_command}"
        )
    lines += _prune_lines(run, stale, identity, summary)
    if summary.changed:
        path = write(run.store, run.options.path)
        lines.append(f"wrote {path}: {summary.describe()}")
        lines += summary.accepted_lines()
    elif run.options.update:
        lines.append(f"{run.options.path} unchanged: {summary.describe()}")
    return lines


def _keeping_composition(run: BaselineRun, nodeid: str, entry: Entry) -> Entry:
    """A run without --gpumem-explain that measures exactly the stored peaks keeps their stored
    composition (which still describes them); changed peaks make it stale, and it goes."""
    assert run.store is not None
    stored = run.store.get(nodeid, entry.identity)
    if entry.composition is not None or stored is None or stored.composition is None:
        return entry
    if (stored.peak_bytes, dict(stored.phases)) != (entry.peak_bytes, dict(entry.phases)):
        return entry
    return dataclasses.replace(entry, composition=stored.composition)


def _prune_lines(run: BaselineRun, stale: list[str], identity: DeviceIdentity, summary: UpdateSummary) -> list[str]:
    from pytest_gpumem.baselines.update import prune

    assert run.store is not None
    if run.options.prune and run.partial:
        return ["--gpumem-prune needs a full run (no test selection, no -k/-m, no collection error): nothing removed"]
    if run.options.prune:
        prune(run.store, stale, identity, summary=summary)
        return []
    if not stale:
        return []
    shown = ", ".join(stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
    return [f"{len(stale)} baselines for {identity.key} were used by no test: {shown} (remove: --gpumem-prune)"]
