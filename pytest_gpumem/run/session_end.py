"""The end of a run that writes files: the report files its options chose and, where baselines are active,
the baselines' end (imported only by such a run: an idle run reads none of it)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Protocol

import pytest

from cuda_allocator_model import ModelError
from pytest_gpumem.report.writers import RunInfo
from pytest_gpumem.run.outputs import plural, shown, write_report

if TYPE_CHECKING:
    from pytest_gpumem.backends.base import Backend
    from pytest_gpumem.report.writers import Writer
    from pytest_gpumem.results import TestResult
    from pytest_gpumem.run.regression import BaselineRun


class EndingRun(Protocol):
    """What the end of a run reads and adds to (`run.session.GpuMemSession`)."""

    config: pytest.Config
    baselines: BaselineRun
    problems: list[str]
    baseline_lines: list[str]

    @property
    def results(self) -> list[TestResult]: ...

    @property
    def made_backend(self) -> Backend | None: ...

    def backend(self) -> Backend: ...


def write_files(run: EndingRun, session: pytest.Session, exitstatus: int, writers: Sequence[Writer]) -> None:
    """Say what is written, write each file `writers` asked for, then end the baselines where active."""
    _progress(run, exitstatus, writers)
    results, info = run.results, _run_info(run)
    for writer in writers:
        problem = write_report(writer.path, writer.flag, partial(writer.text, results, info))
        if problem is not None:
            run.problems.append(problem)
    if run.baselines.active:
        _finish_baselines(run, session, exitstatus)


def _run_info(run: EndingRun) -> RunInfo:
    backend, long = run.made_backend, run.config.get_verbosity() > 0
    name, device = (None, None) if backend is None else (backend.name, str(backend.device))
    record = run.baselines.record_command if run.baselines.active else None
    return RunInfo(name, device, run.config.rootpath, long, record)


def _progress(run: EndingRun, exitstatus: int, writers: Sequence[Writer]) -> None:
    """What the end of a run is about to do that takes time on a large suite, in one line each
    (nothing under -q): writing the report files, recording the baselines."""
    config = run.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or config.get_verbosity() < 0:
        return
    start = config.invocation_params.dir
    files = [shown(writer.path, start) for writer in writers]
    if files:
        reporter.write_line(f"gpumem: writing {plural(len(run.results), 'result')} to {' and '.join(files)}")
    options = run.baselines.options
    if not run.baselines.active or exitstatus == pytest.ExitCode.INTERRUPTED:
        return
    if options.update:
        tests = plural(sum(1 for r in run.results if r.baseline_entry is not None), "passed test")
        reporter.write_line(f"gpumem: updating {shown(options.path, start)} from {tests}")
    elif options.prune:
        where = shown(options.path, start)
        reporter.write_line(f"gpumem: removing the baselines that no test used from {where}")


def _finish_baselines(run: EndingRun, session: pytest.Session, exitstatus: int) -> None:
    from pytest_gpumem.results import Status
    from pytest_gpumem.run.regression_end import finish, partial_run, slack_hint

    if exitstatus == pytest.ExitCode.INTERRUPTED:
        run.baseline_lines.append(f"run interrupted: {run.baselines.options.path} left as it was")
        return
    run.baselines.partial |= partial_run(run.config, session)
    try:
        results = run.results
        records = [(r.nodeid, r.baseline_entry) for r in results if r.baseline_entry is not None]
        missing = [r.nodeid for r in results if r.status == Status.MISSING_BASELINE]
        regressed = [r.nodeid for r in results if r.status == Status.REGRESSED]
        run.baseline_lines += finish(run.baselines, records, run.backend, missing, regressed)
        run.baseline_lines += slack_hint(results, run.baselines.options.slack)
    except ModelError as exc:
        run.problems.append(str(exc))
