"""Stored baselines in a run: compare each measured test, tell whether the run left tests out (their
baselines are then not unused), and (controller only) update, prune, write."""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import pytest

from cuda_allocator_model import format_size
from pytest_gpumem.config import BaselineOptions, Options
from pytest_gpumem.constants import DEFAULT_SLACK_BYTES

if TYPE_CHECKING:
    from pytest_gpumem.backends.base import Backend
    from pytest_gpumem.baselines.schema import BaselineStore
    from pytest_gpumem.baselines.update import UpdateSummary
    from pytest_gpumem.budget import Budget
    from pytest_gpumem.measure.record import CallRecord
    from pytest_gpumem.results import TestResult
    from pytest_gpumem.results.baseline import DeviceIdentity, Entry
    from pytest_gpumem.run.judgement import Judgement


def identity_of(backend: Backend) -> DeviceIdentity:
    """What a baseline is valid for: the backend's own `identity()`, else its name and device. The
    identity may also be a mapping of its JSON keys (capability and total_memory optional), which was
    the contract before `DeviceIdentity`; anything else is a `GpuMemError` naming the backend."""
    from collections.abc import Mapping

    from pytest_gpumem.errors import GpuMemError
    from pytest_gpumem.results.baseline import DeviceIdentity
    from pytest_gpumem.results.checks import short

    own: object = backend.identity()
    if isinstance(own, DeviceIdentity):
        return own
    try:
        if not isinstance(own, Mapping):
            raise ValueError(f"expected a DeviceIdentity or a dict, got {short(own)}")
        return DeviceIdentity.from_json({"capability": None, "total_memory": None, **own})
    except ValueError as exc:
        raise GpuMemError(f"the {backend.name} backend's identity(): {exc}") from None


def selection_flags(options: Options, slack: int = DEFAULT_SLACK_BYTES) -> list[str]:
    """The options that decide which tests a run measures and for which device identity: a run that
    records baselines needs the same ones as the run that enforces them, or it records other tests (under
    --gpumem-all, the slack too: a test whose peaks stay within it needs no baseline)."""
    flags = [f"--gpumem-backend={options.backend}"] if options.backend_given else []
    flags += [] if options.rounding == "auto" else [f"--gpumem-round={options.rounding}"]
    flags += [] if options.device == "cpu" else [f"--gpumem-device={options.device}"]
    flags += [] if options.paths is None else [f"--gpumem-paths={options.paths}"]
    if not options.measure_all:
        return flags
    return [*flags, "--gpumem-all"] + ([] if slack == DEFAULT_SLACK_BYTES else [f"--gpumem-slack={slack}"])


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


class BaselineRun:
    """The baseline store of a run. Workers and the controller both compare; only the controller
    (or a run without xdist) updates, prunes and writes, after the last test. Registered as a plugin (hashed
    by identity); a plain class, as every run makes one: an idle run pays for no generated methods."""

    def __init__(self, options: BaselineOptions, store: BaselineStore | None) -> None:
        self.options = options
        self.store = store
        self.failed: set[str] = set()
        self.seen: set[str] = set()
        self.partial = False
        self.selection: list[str] = []  # selection_flags() of the run

    @property
    def record_command(self) -> str:
        """How to record the baselines this run lacks, measuring what this run measures."""
        return shlex.join(["pytest", *self.selection, "--gpumem-update=new"])

    @property
    def active(self) -> bool:
        """Baselines are in use when the file exists or the run is asked to record or require them."""
        return self.store is not None

    # hooks, registered for the run when baselines are active: which tests ran, failed, were left out

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seen.add(report.nodeid)
        if report.failed:
            self.failed.add(report.nodeid)

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        if items:
            self.partial = True

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed or report.skipped:  # a module that skipped itself: its tests did not run
            self.partial = True

    def pytest_keyboard_interrupt(self) -> None:
        """Also called for pytest.exit(), whatever return code it asks for: the run did not finish."""
        self.partial = True

    def explains(self, nodeid: str, backend: Backend) -> bool:
        """Whether the run explains `nodeid` (it is measured once either way), so that a regression can name
        what grew: when this run records its baseline (which then stores the composition), or when the
        stored baseline says what its peaks were made of."""
        stored = None if self.store is None else self.store.get(nodeid, identity_of(backend))
        return self._records(stored) or (stored is not None and stored.composition is not None)

    def _records(self, stored: Entry | None) -> bool:
        """Whether this run records the test whose stored entry is `stored` (if it passes): every test
        under --gpumem-update, only those without one under --gpumem-update=new."""
        return self.options.update and (stored is None or not self.options.update_new_only)

    def judge(self, record: CallRecord, backend: Backend, budget: Budget | None) -> Judgement:
        """The comparison of the call `record` (measured on `backend`) with its stored baseline."""
        import torch

        from pytest_gpumem.baselines.compare import Tolerance, compare
        from pytest_gpumem.explain.growth import compact
        from pytest_gpumem.results.baseline import Entry, Environment
        from pytest_gpumem.run.judgement import Judgement

        assert self.store is not None, "judge() is called only when baselines are active"

        entry = Entry.measured(
            identity_of(backend),
            Environment.from_torch(torch),
            record.call.peak_bytes,
            {name: phase.peak_bytes for name, phase in record.phases.items()},
            record.gradients,
            None if record.explanation is None else compact(record.explanation),
        )
        percent = self.options.tolerance if budget is None or budget.tolerance is None else budget.tolerance
        rtol, atol = record.gradient_tolerance
        nodeid = record.nodeid
        stored = self.store.get(nodeid, entry.identity)
        # a test this run records is accepted as it is (what is missing, a regression); one it leaves as
        # stored (--gpumem-update=new) is judged as without the option
        records = self._records(stored)
        verdict = compare(
            nodeid,
            entry,
            stored,
            Tolerance(percent, self.options.slack),
            strict=self.options.strict and not records,
            grad_rtol=rtol,
            grad_atol=atol,
            record=self.record_command,
        )
        fails = verdict.failed and not records
        composed = stored is not None and stored.composition is not None
        return Judgement(verdict, entry, fails, composed, tuple(self.selection))

    def finish(
        self,
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

        assert self.store is not None, "finish() is called only when baselines are active"
        entries = dict(records)
        first = next(iter(entries.values()), None)
        identity = identity_of(backend()) if first is None else first.identity
        warnings = [] if first is None else environment_warnings(self.store, identity, first.environment)
        lines = [f"warning: {w}" for w in warnings]
        if first is None and self.options.update:
            lines.append(f"nothing to record (no measured test passed): {self.options.path} left as it was")
        stale = [] if self.partial else unused(self.store, identity, self.seen)
        summary = UpdateSummary()
        if self.options.update:
            passed = {n: e for n, e in entries.items() if n not in self.failed}
            if self.options.update_new_only:  # stored entries stay byte for byte
                summary.kept = [n for n, e in passed.items() if self.store.get(n, e.identity) is not None]
                passed = {n: e for n, e in passed.items() if self.store.get(n, e.identity) is None}
            for nodeid in [n for n, e in passed.items() if allocates_nothing(e)]:  # needs no baseline
                if self.store.remove(nodeid, passed.pop(nodeid).identity):
                    summary.removed.append(nodeid)
            passed = {n: self._keeping_composition(n, e) for n, e in passed.items()}
            update(self.store, passed, summary=summary)
            summary.accepted = [n for n in regressed if n in summary.updated]
        empty = [n for n, e in entries.items() if n not in self.failed and allocates_nothing(e)]
        empty = [n for n in empty if self.store.get(n, entries[n].identity) is None]
        if empty:
            tests = "test allocates" if len(empty) == 1 else "tests allocate"
            lines.append(f"{len(empty)} measured {tests} nothing (0 B in every phase): no baseline needed")
        if missing:
            lines.append(
                f"{len(missing)} measured {'test has' if len(missing) == 1 else 'tests have'} no baseline for "
                f"{identity.key} in {self.options.path.name}: "
                f"record them, measuring what this run measures, with: {self.record_command}"
            )
        lines += self._prune_lines(stale, identity, summary)
        if summary.changed:
            path = write(self.store, self.options.path)
            lines.append(f"wrote {path}: {summary.describe()}")
            lines += summary.accepted_lines()
        elif self.options.update:
            lines.append(f"{self.options.path} unchanged: {summary.describe()}")
        return lines

    def _keeping_composition(self, nodeid: str, entry: Entry) -> Entry:
        """A run without --gpumem-explain that measures exactly the stored peaks keeps their stored
        composition (which still describes them); changed peaks make it stale, and it goes."""
        assert self.store is not None
        stored = self.store.get(nodeid, entry.identity)
        if entry.composition is not None or stored is None or stored.composition is None:
            return entry
        if (stored.peak_bytes, dict(stored.phases)) != (entry.peak_bytes, dict(entry.phases)):
            return entry
        return dataclasses.replace(entry, composition=stored.composition)

    def _prune_lines(self, stale: list[str], identity: DeviceIdentity, summary: UpdateSummary) -> list[str]:
        from pytest_gpumem.baselines.update import prune

        assert self.store is not None
        if self.options.prune and self.partial:
            return [
                "--gpumem-prune needs a full run (no test selection, no -k/-m, no collection error): nothing removed"
            ]
        if self.options.prune:
            prune(self.store, stale, identity, summary=summary)
            return []
        if not stale:
            return []
        shown = ", ".join(stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
        return [f"{len(stale)} baselines for {identity.key} were used by no test: {shown} (remove: --gpumem-prune)"]
