"""The state of one pytest run: its options, the backend (made on first use), each test's meter, the
results, and what the end of the run reports and writes."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pytest

from pytest_gpumem.run.late_markers import marked_meta
from pytest_gpumem.run.regression import BaselineRun, selection_flags
from pytest_gpumem.run.xdist import worker_id

if TYPE_CHECKING:
    from pytest_gpumem.backends.base import Backend
    from pytest_gpumem.config import Options
    from pytest_gpumem.measure.measurement import Measurement
    from pytest_gpumem.report.writers import Writer
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
    def made_backend(self) -> Backend | None:
        """The backend if it was made (a run that measured nothing made none)."""
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
        from pytest_gpumem.run.header import header_lines

        self.header_shown = True
        return header_lines(self.options, self.backend())

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
        from pytest_gpumem.run.session_end import write_files

        write_files(self, session, exitstatus, writers)
