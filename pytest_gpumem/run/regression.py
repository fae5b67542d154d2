"""Stored baselines in a run: which tests ran and failed, and each measured test compared with its baseline;
what the controller does with them after the last test is `run.regression_end`'s (an idle run loads neither)."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

import pytest

from pytest_gpumem.config import BaselineOptions, Options
from pytest_gpumem.constants import DEFAULT_SLACK_BYTES

if TYPE_CHECKING:
    from pytest_gpumem.backends.base import Backend
    from pytest_gpumem.baselines.schema import BaselineStore
    from pytest_gpumem.budget import Budget
    from pytest_gpumem.measure.record import CallRecord
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
