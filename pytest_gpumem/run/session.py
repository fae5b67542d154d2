"""The state of one pytest run: options, the backend (made on first use), and the results."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import warnings
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import pytest

from pytest_gpumem.backends.base import Backend
from pytest_gpumem.budget import MARKER, Budget, Limit, all_of, budget_from_marker, closest_first
from pytest_gpumem.config import Options
from pytest_gpumem.errors import GpuMemError, GpuMemWarning
from pytest_gpumem.explain.replay import made_of, over_limit
from pytest_gpumem.explain.replay import section as explained
from pytest_gpumem.measure.advice import advice_clause, advice_section
from pytest_gpumem.measure.failures import (
    EVIDENCE_STATUSES,
    STATUS_LEAKED,
    STATUS_OOM,
    Watch,
    is_out_of_memory,
    leak_message,
    needs_real_values,
    out_of_memory_message,
    release_memory,
    survivors_section,
    write_evidence,
)
from pytest_gpumem.measure.meter import GpuMem
from pytest_gpumem.results import (
    REPORT_ATTRIBUTE,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_OVER,
    PhaseResult,
    TestResult,
    junit_properties,
    settle,
)
from pytest_gpumem.run.devices import VISIBLE, Assignment, assign, visible_devices
from pytest_gpumem.run.regression import STATUS_MISSING, BaselineRun, Judgement, selection_flags, verdict_status
from pytest_gpumem.sizes import format_size

METER_KEY = pytest.StashKey[GpuMem]()
RESULT_KEY = pytest.StashKey[TestResult]()  # the call's result, until its report is made


def budget_of(marks: Sequence[tuple[object, pytest.Mark]]) -> Budget | None:
    """The test's budget from its max_memory markers (closest level first)."""
    levels: dict[int, list[Budget]] = {}
    for node, mark in marks:
        levels.setdefault(id(node), []).append(budget_from_marker(mark.args, mark.kwargs))
    return closest_first([all_of(budgets) for budgets in levels.values()]) if levels else None


def _marked_meta(item: pytest.Item) -> bool:
    """Whether the closest max_memory marker that names a device names meta (bad markers fail later)."""
    for mark in item.iter_markers(MARKER):
        if "device" in mark.kwargs:
            return bool(mark.kwargs["device"] == "meta")
    return False


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def with_default(budget: Budget | None, default: Budget | None) -> Budget | None:
    """The suite-wide default limit applies to a test whose markers set no limit (a tolerance alone
    is not a limit)."""
    if default is None or (budget is not None and (budget.total is not None or budget.phases)):
        return budget
    return default if budget is None else dataclasses.replace(budget, total=default.total)


def _not_json(info: object) -> str | None:
    """Why `info` cannot travel as JSON (to the report, the file, the xdist controller), or None."""
    if not isinstance(info, dict):
        return f"it was set to a {type(info).__name__}, not a dict"
    try:
        json.dumps(info, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        return str(exc)
    return None


def _plain_info(info: object) -> dict[str, Any]:
    """`info` in plain JSON types (a torch.Size becomes a list, a numpy float a float), or a description."""
    if _not_json(info) is None:
        plain: dict[str, Any] = json.loads(json.dumps(info, allow_nan=False))
        return plain
    try:
        text = repr(info)
    except Exception:
        text = f"<{type(info).__name__} whose repr raised>"
    return {"unreadable": text[:1000]}


def _expected(item: pytest.Item, exc: BaseException) -> bool:
    """Whether an xfail marker expects this very exception (then pytest, not the plugin, judges it)."""
    mark = item.get_closest_marker("xfail")
    if mark is None:
        return False
    raises = mark.kwargs.get("raises")
    return raises is None or (isinstance(raises, (type, tuple)) and isinstance(exc, raises))


def _memory_failure(
    meter: GpuMem, budget: Budget | None, exc: BaseException, capacity: Limit | None
) -> tuple[str, str] | None:
    """(status, one line) for an error that is about memory, not the test's code."""
    if is_out_of_memory(exc):
        return STATUS_OOM, out_of_memory_message(meter, budget, exc, capacity)
    meta = needs_real_values(exc, meter.device)
    return None if meta is None else (STATUS_ERROR, f"{meter.nodeid}: {meta}")


def _fail(message: str) -> NoReturn:
    """Fail the test with our one line. Not hidden: when every frame of a failure is hidden (the call
    wrappers hide theirs), pytest adds a line about `--full-trace` under it."""
    pytest.fail(message, pytrace=False)


def _first_line(exc: BaseException) -> str:
    """`Type: message` of the test's exception, also when its `__str__` raises."""
    try:
        text = str(exc)
    except Exception:
        text = f"<{type(exc).__name__}.__str__ raised>"
    return f"{type(exc).__name__}: {text}".splitlines()[0]


def _warn_notes(item: pytest.Item, notes: list[str]) -> None:
    """Each thing the measurement could not see, as a warning at the test's own line."""
    path, line = item.location[0], (item.location[1] or 0) + 1
    for note in notes:
        warnings.warn_explicit(GpuMemWarning(f"{item.nodeid}: {note}"), GpuMemWarning, path, line)


def breakdown(call: PhaseResult, phases: dict[str, PhaseResult]) -> str:
    """The report section of a measured test: every phase and the whole call."""
    lines = []
    for phase in [*phases.values(), call]:
        reserved = "" if phase.reserved_peak_bytes is None else f", reserved {format_size(phase.reserved_peak_bytes)}"
        lines.append(
            f"{phase.name}: peak {format_size(phase.peak_bytes)} (requested {format_size(phase.requested_peak_bytes)}"
            f"{reserved}), net {format_size(phase.net_bytes)}, entered {phase.count}x"
        )
    return "\n".join(lines)


class GpuMemSession:
    """Per-run state, kept in `config.stash`; the plugin's hooks delegate here. It registers itself as a
    plugin (wrapping test calls) only in runs that measure something."""

    def __init__(self, config: pytest.Config, options: Options, baselines: BaselineRun) -> None:
        self.config = config
        self.options = options
        self.baselines = baselines
        baselines.selection = selection_flags(options)
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
                raise GpuMemError(
                    f"--gpumem-backend={name}: no such backend (built in: auto, cuda, accelerator, tracker)"
                )
            self._backend = backend
        return self._backend

    def header(self) -> str:
        self.header_shown = True
        spread = "" if self.options.devices is None else f"; xdist workers get one device each ({self._spread()})"
        capacity = self.options.capacity
        cap = "" if capacity is None else f"; capacity {capacity.written}: {self._capacity_means()}"
        traces = ""
        if self.options.snapshot_dir is not None and not callable(getattr(self.backend(), "configure", None)):
            traces = (
                f"; --gpumem-snapshot-dir: the {self.backend().name} backend records no trace, none will be written"
            )
        return f"gpumem: {self.backend().describe()}{spread}{cap}{traces}"

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
        worker = getattr(self.config, "workerinput", {}).get("workerid")
        if self.options.devices is None or (worker is None and not getattr(self.config.option, "numprocesses", None)):
            return
        try:
            visible = visible_devices(os.environ, _cuda_device_count)
            assignment = assign(worker or "gw0", self.options.devices, visible)  # the controller only checks
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        if worker is not None and assignment is not None:
            self.assignment = assignment
            os.environ[VISIBLE] = assignment.visible

    def meter(self, item: pytest.Item, fresh: bool = False) -> GpuMem:
        """The item's meter; `fresh` (the fixture's setup, again on a rerun) starts a new one, so nothing of
        an earlier attempt (its info) carries over."""
        meter = None if fresh else item.stash.get(METER_KEY, None)
        if meter is None:
            backend = self.meta_backend() if _marked_meta(item) else self.backend()
            meter = item.stash[METER_KEY] = GpuMem(backend, item.nodeid)
        return meter

    def meta_backend(self) -> Backend:
        """The tracker on the meta device, for tests marked max_memory(device="meta") (any main backend)."""
        if self._meta is None:
            from pytest_gpumem.backends.tracker.backend import TrackerBackend

            main = self.backend()
            meta = main if str(main.device) == "meta" else None
            self._meta = meta or TrackerBackend(self.options.rounding, device="meta", paths=self.options.paths)
        return self._meta

    @property
    def measuring(self) -> bool:
        return self.config.pluginmanager.is_registered(self)

    def measure_calls(self) -> None:
        """Wrap test calls from now on (registered only in runs that measure: the others pay nothing)."""
        if not self.measuring:
            self.config.pluginmanager.register(self, "gpumem-session")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, object, object]:
        """Measure the call of a test that asks for it (a max_memory marker or the gpumem fixture), or
        of every test under --gpumem-all."""
        __tracebackhide__ = True  # the test's own failure shows the test's frames, not this wrapper's
        marks = list(item.iter_markers_with_node(MARKER))
        if not marks and METER_KEY not in item.stash and not self.options.measure_all:
            return (yield)
        try:
            budget = with_default(budget_of(marks), self.options.default_budget)
            meter = self.meter(item)
            watch = self.watch(budget, explain=self.baselines.explains(item.nodeid, meter.backend))
            watch.apply(meter.backend, meter)
        except GpuMemError as exc:
            error = f"{item.nodeid}: {exc}"
        else:
            return (yield from self._measured(item, meter, budget, watch))
        backend = self._backend.name if self._backend else self.options.backend
        result = TestResult(item.nodeid, backend, "", None, status=STATUS_ERROR, message=error)
        self.add(result)
        item.stash[RESULT_KEY] = result  # travels to the xdist controller with the report
        item.config.hook.pytest_gpumem_result(item=item, result=result)
        _fail(error)

    def _measured(
        self, item: pytest.Item, meter: GpuMem, budget: Budget | None, watch: Watch
    ) -> Generator[None, object, object]:
        __tracebackhide__ = True
        meter.begin_call()
        status = STATUS_ERROR
        try:
            outcome = yield
        except GpuMemError as exc:
            error = f"{item.nodeid}: {exc}"
        except (pytest.skip.Exception, pytest.xfail.Exception):
            meter.end_call()
            raise
        except BaseException as exc:
            failure = _memory_failure(meter, budget, exc, watch.capacity)
            if failure is None:
                try:
                    self._finish(item, meter, budget, STATUS_ERROR, _first_line(exc))
                finally:
                    meter.end_call_if_running()
                raise
            status, error = failure
            if _expected(item, exc):  # xfail(raises=...): the test behaves as it does unmeasured
                self._finish(item, meter, budget, status, error)
                raise
            exc.__traceback__ = None  # its frames hold the test's tensors
        else:
            self._judge(item, meter, budget, watch)
            return outcome
        if status == STATUS_OOM:
            release_memory()
        self._finish(item, meter, budget, status, error)
        if meter.has_call_result:
            item.add_report_section("call", "gpumem", breakdown(meter.result(), meter.phases))
        _fail(error)

    def watch(self, budget: Budget | None, explain: bool = False) -> Watch:
        options = self.options
        explain = explain or options.explain
        return Watch.of(
            budget, options.capacity, options.leak, evidence=options.snapshot_dir is not None, explain=explain
        )

    def _judge(self, item: pytest.Item, meter: GpuMem, budget: Budget | None, watch: Watch) -> None:
        call = meter.end_call()
        bad_info = _not_json(meter.info)
        if bad_info:
            message = f"gpumem.info must be a dict of JSON values (str, numbers, lists, dicts): {bad_info}"
            self._error(item, meter, budget, f"{item.nodeid}: {message}")
        unopened = [] if budget is None else budget.unopened(meter.phases)
        if unopened:
            opened = ", ".join(meter.phases) or "none"
            message = f"max_memory names phase {unopened[0]!r} that the test never opened (opened: {opened})"
            self._error(item, meter, budget, f"{item.nodeid}: {message}")
        over = [] if budget is None else budget.violations(call, meter.phases)
        leaked = watch.leak is not None and call.net_bytes > watch.leak.bytes
        judgement = self.baselines.judge(item.nodeid, meter, budget) if self.baselines.active else None
        section = breakdown(call, meter.phases) + survivors_section(meter) + explained(meter.explanation)
        section += advice_section(meter.advice)
        if judgement is not None and judgement.verdict.messages:
            section += "\n" + "\n".join(judgement.verdict.messages)
        section += "".join(f"\nnote: {note}" for note in meter.notes)
        if budget is not None or judgement is not None or meter.notes or leaked or meter.explanation or meter.advice:
            item.add_report_section("call", "gpumem", section)
        failure: str | None
        if over:
            advised = advice_clause(meter.advice, budget, call, meter.phases)
            made = made_of(meter.explanation, over_limit(budget, call, meter.phases)) if not advised else ""
            status, failure = STATUS_OVER, "; ".join(over) + made + advised
        elif leaked and watch.leak is not None:
            status, failure = STATUS_LEAKED, leak_message(meter, watch.leak, call.net_bytes)
        elif judgement is not None:
            status = verdict_status(judgement.verdict)
            failure = judgement.failure_message() if judgement.fails else None
        else:
            status, failure = STATUS_OK, None
        self._finish(item, meter, budget, status, failure, judgement)
        if failure:
            pytest.fail(failure, pytrace=False)

    def _error(self, item: pytest.Item, meter: GpuMem, budget: Budget | None, message: str) -> NoReturn:
        """Record the test as an error and fail it with one line."""
        self._finish(item, meter, budget, STATUS_ERROR, message)
        pytest.fail(message, pytrace=False)

    def _finish(
        self,
        item: pytest.Item,
        meter: GpuMem,
        budget: Budget | None,
        status: str,
        message: str | None,
        judgement: Judgement | None = None,
    ) -> None:
        call = meter.result() if meter.has_call_result else meter.end_call()
        result = TestResult(
            nodeid=item.nodeid,
            backend=meter.backend_name,
            device=str(meter.device),
            call=call,
            phases=meter.phases,
            budget=None if budget is None else budget.to_dict(),
            budget_text=None if budget is None else budget.describe(),
            status=status,
            message=message,
            info=_plain_info(meter.info),
            baseline=None if judgement is None else judgement.verdict.to_json(),
            record=None if judgement is None else judgement.entry.to_json(),
            notes=meter.notes,
            worker_device=None if self.assignment is None else self.assignment.describe(),
            explanation=meter.explanation,
        )
        self._picture(item, result)
        self.add(result)
        item.stash[RESULT_KEY] = result
        self._keep_evidence(item, meter, result)
        _warn_notes(item, meter.notes)
        item.config.hook.pytest_gpumem_result(item=item, result=result)

    def _picture(self, item: pytest.Item, result: TestResult) -> None:
        """--gpumem-html: the explained test's memory over time, one self-contained file."""
        folder = self.options.html_dir
        if folder is None or result.explanation is None:
            return
        from pytest_gpumem.explain.html import write_html

        try:
            path = write_html(folder, result.explanation, result.info.get("advice"))
        except (OSError, TypeError, ValueError) as exc:
            self.problems.append(f"--gpumem-html: cannot write the picture of {item.nodeid}: {exc}")
            return
        try:
            result.html = Path(os.path.relpath(path, self.config.rootpath)).as_posix()
        except ValueError:  # on another drive than the rootdir (Windows)
            result.html = path.as_posix()
        item.add_report_section("call", "gpumem picture", f"memory over time: {path}")

    def _keep_evidence(self, item: pytest.Item, meter: GpuMem, result: TestResult) -> None:
        folder, trace = self.options.snapshot_dir, meter.trace
        meter.trace = None  # a passing test's trace is not kept for the rest of the run
        if folder is None or result.status not in EVIDENCE_STATUSES:
            return
        snapshot = getattr(meter.backend, "snapshot", None)  # CUDA: the allocator's history, taken now
        try:
            if trace is None and callable(snapshot):
                trace = snapshot()
            path = write_evidence(folder, item.nodeid, result.status, result.message, trace)
        except (OSError, TypeError, ValueError, pickle.PicklingError) as exc:
            self.problems.append(f"--gpumem-snapshot-dir: cannot write the trace of {item.nodeid}: {exc}")
            return
        if path is not None:
            item.add_report_section("call", "gpumem evidence", f"memory trace: {path}")

    def add(self, result: TestResult) -> None:
        """Keep `result`; a later attempt of the same test (a rerun) replaces the earlier one."""
        self._results.pop(result.nodeid, None)
        self._results[result.nodeid] = result

    @property
    def results(self) -> list[TestResult]:
        return list(self._results.values())

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        """Settle the measured test's status with pytest's verdict, and send it along with the report
        (JSON text in an attribute that xdist hands to the controller test by test and --junitxml does not
        print; the JUnit properties are the short ones)."""
        report = yield
        result = item.stash.get(RESULT_KEY, None)
        if result is not None and report.when == "call":
            del item.stash[RESULT_KEY]
            settle(result, report)
            setattr(report, REPORT_ATTRIBUTE, json.dumps(result.to_dict(), allow_nan=False))
            properties = junit_properties(result)
            report.user_properties += properties
            # the teardown report, which --junitxml reads, copies the item's; a rerun replaces them
            item.user_properties[:] = [p for p in item.user_properties if not str(p[0]).startswith("gpumem")]
            item.user_properties += properties
        return report

    def report_lines(self, width: int, long: bool = False) -> list[str]:
        if not self.results:
            return ["no test was measured (use the gpumem fixture or @pytest.mark.max_memory)"]
        from pytest_gpumem.report.terminal import table_lines

        return table_lines(self.results, width, long)

    def finish(self, session: pytest.Session, exitstatus: int) -> None:
        """At the end of the run: workers hand their results over; the controller writes the files."""
        if hasattr(self.config, "workerinput"):
            return  # each result went to the controller with its test's report
        self._progress(exitstatus)
        self._write(self.options.json_path, "--gpumem-json", self._json_text)
        self._write(self.options.markdown_path, "--gpumem-markdown", self._markdown_text)
        if self.baselines.active:
            self._finish_baselines(session, exitstatus)
        if self.problems and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _progress(self, exitstatus: int) -> None:
        """What the end of a run is about to do that takes time on a large suite, in one line each
        (nothing under -q): writing the report files, recording the baselines."""
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None or self.config.get_verbosity() < 0:
            return
        files = [self._shown(p) for p in (self.options.json_path, self.options.markdown_path) if p is not None]
        count = f"{len(self.results):,} result{'s' if len(self.results) != 1 else ''}"
        if files:
            reporter.write_line(f"gpumem: writing {count} to {' and '.join(files)}")
        options = self.baselines.options
        if not self.baselines.active or exitstatus == pytest.ExitCode.INTERRUPTED:
            return
        if options.update:
            passed = sum(1 for r in self.results if r.record)
            tests = f"{passed:,} passed test{'s' if passed != 1 else ''}"
            reporter.write_line(f"gpumem: updating {self._shown(options.path)} from {tests}")
        elif options.prune:
            reporter.write_line(f"gpumem: removing the baselines that no test used from {self._shown(options.path)}")

    def _shown(self, path: Path) -> str:
        """`path` relative to where pytest was started, when it is below it."""
        try:
            return str(path.relative_to(self.config.invocation_params.dir))
        except ValueError:
            return str(path)

    def _finish_baselines(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus == pytest.ExitCode.INTERRUPTED:
            self.baseline_lines.append(f"run interrupted: {self.baselines.options.path} left as it was")
            return
        self.baselines.partial |= self._partial(session)
        try:
            records = [(r.nodeid, r.record) for r in self.results if r.record]
            missing = [r.nodeid for r in self.results if r.status == STATUS_MISSING]
            self.baseline_lines += self.baselines.finish(records, self.backend, missing)
        except GpuMemError as exc:
            self.problems.append(str(exc))

    def _partial(self, session: pytest.Session) -> bool:
        """Whether some tests may have been left out, so that an unused baseline may belong to one of
        them: anything but the configured test paths (or the rootdir) run whole and to the end."""
        config = self.config
        source = config.args_source
        whole = source == pytest.Config.ArgsSource.TESTPATHS or (
            source == pytest.Config.ArgsSource.INVOCATION_DIR and config.invocation_params.dir == config.rootpath
        )
        narrowing = ("keyword", "markexpr", "ignore", "ignore_glob", "deselect", "lf", "stepwise", "collectonly")
        narrowed = any(getattr(config.option, name, None) for name in narrowing)
        return not whole or narrowed or bool(session.shouldstop) or bool(session.shouldfail)

    def _markdown_text(self) -> str:
        from pytest_gpumem.report.terminal import markdown

        folder = None if self.options.markdown_path is None else self.options.markdown_path.parent
        return markdown(self.results, self.config.get_verbosity() > 0, self.config.rootpath, folder)

    def _json_text(self) -> str:
        from pytest_gpumem.report.terminal import document

        backend = self._backend
        first = self.results[0] if self.results else None
        doc = document(
            self.results,
            backend.name if backend else (first.backend if first else None),
            str(backend.device) if backend else (first.device if first else None),
        )
        return json.dumps(doc, indent=2, sort_keys=True, allow_nan=False) + "\n"

    def _write(self, path: Path | None, flag: str, text: Callable[[], str]) -> None:
        if path is None:
            return
        try:
            path.write_text(text(), encoding="utf-8")
        except (OSError, TypeError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self.problems.append(f"{flag}: cannot write {path}: {reason}")
