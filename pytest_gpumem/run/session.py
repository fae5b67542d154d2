"""The state of one pytest run: its options, the backend (made on first use), each test's meter, the
results, and what the end of the run reports and writes."""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import pytest

from cuda_allocator_model import ModelError
from pytest_gpumem.run.late_markers import marked_meta
from pytest_gpumem.run.regression import BaselineRun, selection_flags
from pytest_gpumem.run.xdist import worker_id

if TYPE_CHECKING:
    from pytest_gpumem.backends.base import Backend
    from pytest_gpumem.config import Options
    from pytest_gpumem.measure.measurement import Measurement
    from pytest_gpumem.report.writers import RunInfo, Writer
    from pytest_gpumem.results import TestResult
    from pytest_gpumem.run.devices import Assignment

MEASUREMENT_KEY = pytest.StashKey["Measurement"]()
JUDGE = "gpumem-session"  # the name of the plugin that measures test calls, registered in runs that measure
BASELINES = "gpumem-baselines"  # the baseline run's hooks, registered where baselines are read or written
XDIST = "gpumem-xdist"  # the controller's hand-over hooks, registered where xdist is installed
REGISTERED = (JUDGE, BASELINES, XDIST)  # every plugin a run registers, removed at its end


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


class GpuMemSession:
    """Per-run state, kept in `config.stash`; the plugin's hooks delegate here. Test calls are measured by
    a `run.judge.Judge`, registered only in runs that measure something."""

    def __init__(self, config: pytest.Config, options: Options, baselines: BaselineRun) -> None:
        self.config = config
        self.options = options
        self.baselines = baselines
        baselines.selection = selection_flags(options, baselines.options.slack)
        self._results: dict[str, TestResult] = {}
        self._backend: Backend | None = None
        self._meta: Backend | None = None
        self.header_shown = False
        self.problems: list[str] = []
        self.baseline_lines: list[str] = []
        self.assignment: Assignment | None = None

    def backend(self) -> Backend:
        """The backend, made on first use so that runs that never measure never import torch."""
        if self._backend is None:
            name = self.options.backend
            backend = self.config.hook.pytest_gpumem_make_backend(config=self.config, name=name)
            if backend is None:
                from pytest_gpumem.errors import GpuMemError

                raise GpuMemError(
                    f"--gpumem-backend={name}: no such backend (built in: auto, cuda, accelerator, tracker)"
                )
            from pytest_gpumem.backends.base import made_backend

            self._backend = made_backend(backend, f"--gpumem-backend={name}")
        return self._backend

    @property
    def backend_name(self) -> str:
        """The backend's name if it was made, else the one asked for."""
        return self._backend.name if self._backend else self.options.backend

    def meta_backend(self) -> Backend:
        """The tracker on the meta device, for tests marked max_memory(device="meta") (any main backend)."""
        if self._meta is None:
            from pytest_gpumem.backends.tracker.backend import TrackerBackend

            main = self.backend()
            meta = main if str(main.device) == "meta" else None
            self._meta = meta or TrackerBackend(self.options.rounding, device="meta", paths=self.options.paths)
        return self._meta

    def measurement(self, item: pytest.Item, fresh: bool = False) -> Measurement:
        """The item's measurement (the gpumem fixture is a `GpuMem` on it); `fresh` (the fixture's setup, again on
        a rerun) starts a new one, so nothing of an earlier attempt (its info) carries over."""
        measured = None if fresh else item.stash.get(MEASUREMENT_KEY, None)
        if measured is None:
            from pytest_gpumem.measure.measurement import Measurement

            backend = self.meta_backend() if marked_meta(item) else self.backend()
            measured = item.stash[MEASUREMENT_KEY] = Measurement(backend, item.nodeid)
        return measured

    @property
    def measuring(self) -> bool:
        return self.config.pluginmanager.has_plugin(JUDGE)

    def header(self) -> list[str]:
        """The session's header: what measures, and on what terms, in lines that fit a terminal."""
        self.header_shown = True
        spread = "" if self.options.devices is None else f"; xdist workers get one device each ({self._spread()})"
        capacity = self.options.capacity
        cap = "" if capacity is None else f"; capacity {capacity.written}: {self._capacity_means()}"
        return _lines(f"gpumem: {self.backend().describe()}{spread}{cap}{self._no_traces()}")

    def _no_traces(self) -> str:
        if self.options.snapshot_dir is None or self.backend().records_events:
            return ""
        return f"; --gpumem-snapshot-dir: the {self.backend().name} backend records no trace, none will be written"

    def _capacity_means(self) -> str:
        if self.backend().name == "cuda":
            return "the process is capped with torch.cuda.set_per_process_memory_fraction"
        return "an allocation past it raises torch.OutOfMemoryError"

    def _spread(self) -> str:
        spec = self.options.devices
        return "all visible, round-robin" if spec == "auto" else f"cuda:{', cuda:'.join(map(str, spec or ()))}"

    def assign_device(self) -> None:
        """On an xdist worker under --gpumem-devices: see only this worker's device, before CUDA starts.
        On the controller: refuse, in one line, devices the caller cannot see."""
        worker = worker_id(self.config)
        if self.options.devices is None or (worker is None and not getattr(self.config.option, "numprocesses", None)):
            return
        from pytest_gpumem.run.devices import VISIBLE, assign, visible_devices

        try:
            visible = visible_devices(os.environ, _cuda_device_count)
            assignment = assign(worker or "gw0", self.options.devices, visible)  # the controller only checks
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        if worker is not None and assignment is not None:
            self.assignment = assignment
            os.environ[VISIBLE] = assignment.visible

    def add(self, result: TestResult) -> None:
        """Keep `result`; a later attempt of the same test (a rerun) replaces the earlier one."""
        self._results.pop(result.nodeid, None)
        self._results[result.nodeid] = result

    @property
    def results(self) -> list[TestResult]:
        return list(self._results.values())

    def report_lines(self, width: int, long: bool = False) -> list[str]:
        if not self.results:
            return ["no test was measured (use the gpumem fixture or @pytest.mark.max_memory)"]
        from pytest_gpumem.report.terminal import table_lines

        return table_lines(self.results, width, long, self.options.columns, self.options.id_form)

    def finish(self, session: pytest.Session, exitstatus: int) -> None:
        """At the end of the run: workers hand their results over; the controller writes the files."""
        if worker_id(self.config) is not None:
            return  # each result went to the controller with its test's report
        writers = self.options.writers
        if writers or self.baselines.active:
            self._write_files(session, exitstatus, writers)
        try:
            self.config.hook.pytest_gpumem_session_results(config=self.config, results=tuple(self.results))
        except Exception as exc:  # another plugin's: one line, and the summary and the report still come
            from pytest_gpumem.errors import one_line

            self.problems.append(f"pytest_gpumem_session_results raised {one_line(exc)}")
        if self.problems and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _write_files(self, session: pytest.Session, exitstatus: int, writers: Sequence[Writer]) -> None:
        from pytest_gpumem.run.outputs import write_report

        self._progress(exitstatus, writers)
        results, run = self.results, self._run_info()
        for writer in writers:
            self._problem(write_report(writer.path, writer.flag, partial(writer.text, results, run)))
        if self.baselines.active:
            self._finish_baselines(session, exitstatus)

    def _run_info(self) -> RunInfo:
        from pytest_gpumem.report.writers import RunInfo

        backend, long = self._backend, self.config.get_verbosity() > 0
        name, device = (None, None) if backend is None else (backend.name, str(backend.device))
        record = self.baselines.record_command if self.baselines.active else None
        return RunInfo(name, device, self.config.rootpath, long, record)

    def _problem(self, problem: str | None) -> None:
        if problem is not None:
            self.problems.append(problem)

    def _progress(self, exitstatus: int, writers: Sequence[Writer]) -> None:
        """What the end of a run is about to do that takes time on a large suite, in one line each
        (nothing under -q): writing the report files, recording the baselines."""
        from pytest_gpumem.run.outputs import plural, shown

        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None or self.config.get_verbosity() < 0:
            return
        start = self.config.invocation_params.dir
        files = [shown(writer.path, start) for writer in writers]
        if files:
            reporter.write_line(f"gpumem: writing {plural(len(self.results), 'result')} to {' and '.join(files)}")
        options = self.baselines.options
        if not self.baselines.active or exitstatus == pytest.ExitCode.INTERRUPTED:
            return
        if options.update:
            tests = plural(sum(1 for r in self.results if r.baseline_entry is not None), "passed test")
            reporter.write_line(f"gpumem: updating {shown(options.path, start)} from {tests}")
        elif options.prune:
            where = shown(options.path, start)
            reporter.write_line(f"gpumem: removing the baselines that no test used from {where}")

    def _finish_baselines(self, session: pytest.Session, exitstatus: int) -> None:
        from pytest_gpumem.results import Status
        from pytest_gpumem.run.regression_end import finish, partial_run, slack_hint

        if exitstatus == pytest.ExitCode.INTERRUPTED:
            self.baseline_lines.append(f"run interrupted: {self.baselines.options.path} left as it was")
            return
        self.baselines.partial |= partial_run(self.config, session)
        try:
            records = [(r.nodeid, r.baseline_entry) for r in self.results if r.baseline_entry is not None]
            missing = [r.nodeid for r in self.results if r.status == Status.MISSING_BASELINE]
            regressed = [r.nodeid for r in self.results if r.status == Status.REGRESSED]
            self.baseline_lines += finish(self.baselines, records, self.backend, missing, regressed)
            self.baseline_lines += slack_hint(self.results, self.baselines.options.slack)
        except ModelError as exc:
            self.problems.append(str(exc))


def _lines(text: str, width: int = 100) -> list[str]:
    """`text` on lines of at most `width` columns where it can be, cut only at a "; " or before ", device "
    outside parentheses; each line after the first indented by two."""
    lines = [""]
    for joint, clause in _clauses(text):
        if lines[-1] and len(lines[-1]) + len(joint) + len(clause) > width:
            lines.append("  " + clause)
        else:
            lines[-1] += joint + clause
    return lines


def _clauses(text: str) -> list[tuple[str, str]]:
    """`text` as (joint, clause) pairs, cut at each "; " and ", device " outside parentheses."""
    pieces, depth, joint, start = [], 0, "", 0
    for at, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        cut = next((sep for sep in ("; ", ", ") if depth == 0 and text.startswith(sep, at)), None)
        if cut == ", " and not text.startswith(", device ", at):
            cut = None
        if cut is not None:
            pieces.append((joint, text[start:at]))
            joint, start = cut, at + len(cut)
    return [*pieces, (joint, text[start:])]
