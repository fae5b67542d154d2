"""The state of one pytest run: options, the backend (made on first use), and the results."""

from __future__ import annotations

import json
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pytest_gpumem.backends.base import Backend
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.markers import MARKER, Budget, budget_from_marker
from pytest_gpumem.meter import GpuMem
from pytest_gpumem.report import document
from pytest_gpumem.results import STATUS_ERROR, STATUS_OK, STATUS_OVER, PhaseResult, TestResult
from pytest_gpumem.sizes import format_size

METER_KEY = pytest.StashKey[GpuMem]()


@dataclass(frozen=True)
class Options:
    backend: str
    backend_given: bool
    rounding: str
    report: bool
    json_path: Path | None


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
    """Per-run state, kept in `config.stash`; every hook of the plugin delegates here."""

    def __init__(self, config: pytest.Config, options: Options) -> None:
        self.config = config
        self.options = options
        self.results: list[TestResult] = []
        self._backend: Backend | None = None
        self.header_shown = False
        self.json_error: str | None = None

    @property
    def backend_ready(self) -> bool:
        return self._backend is not None

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
        return f"gpumem: {self.backend().describe()}"

    def meter(self, item: pytest.Item) -> GpuMem:
        meter = item.stash.get(METER_KEY, None)
        if meter is None:
            meter = item.stash[METER_KEY] = GpuMem(self.backend(), item.nodeid)
        return meter

    def measure_call(self, item: pytest.Item) -> Generator[None, object, object]:
        """The body of the `pytest_runtest_call` wrapper: measure the call of a test that asks for it."""
        mark = item.get_closest_marker(MARKER)
        if mark is None and METER_KEY not in item.stash:
            return (yield)
        try:
            budget = None if mark is None else budget_from_marker(mark.args, mark.kwargs)
            meter = self.meter(item)
        except GpuMemError as exc:
            error = f"{item.nodeid}: {exc}"
        else:
            return (yield from self._measured(item, meter, budget))
        backend = self._backend.name if self._backend else self.options.backend
        self.add(TestResult(item.nodeid, backend, "", None, status=STATUS_ERROR, message=error))
        pytest.fail(error, pytrace=False)

    def _measured(self, item: pytest.Item, meter: GpuMem, budget: Budget | None) -> Generator[None, object, object]:
        meter.begin_call()
        try:
            outcome = yield
        except GpuMemError as exc:
            error = f"{item.nodeid}: {exc}"
        except pytest.skip.Exception:
            meter.end_call()
            raise
        except BaseException as exc:
            self._finish(item, meter, budget, STATUS_ERROR, f"{type(exc).__name__}: {exc}".splitlines()[0])
            raise
        else:
            self._judge(item, meter, budget)
            return outcome
        self._finish(item, meter, budget, STATUS_ERROR, error)
        pytest.fail(error, pytrace=False)

    def _judge(self, item: pytest.Item, meter: GpuMem, budget: Budget | None) -> None:
        call = meter.end_call()
        if budget is None:
            self._finish(item, meter, budget, STATUS_OK, None)
            return
        unopened = budget.unopened(meter.phases)
        if unopened:
            opened = ", ".join(meter.phases) or "none"
            message = (
                f"{item.nodeid}: max_memory names phase {unopened[0]!r} that the test never opened (opened: {opened})"
            )
            self._finish(item, meter, budget, STATUS_ERROR, message)
            pytest.fail(message, pytrace=False)
        over = budget.violations(call, meter.phases)
        item.add_report_section("call", "gpumem", breakdown(call, meter.phases))
        if over:
            message = "; ".join(over)
            self._finish(item, meter, budget, STATUS_OVER, message)
            pytest.fail(message, pytrace=False)
        self._finish(item, meter, budget, STATUS_OK, None)

    def _finish(
        self, item: pytest.Item, meter: GpuMem, budget: Budget | None, status: str, message: str | None
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
            info=dict(meter.info),
        )
        self.add(result)
        item.config.hook.pytest_gpumem_result(item=item, result=result)

    def add(self, result: TestResult) -> None:
        self.results.append(result)

    def json_document(self) -> dict[str, Any]:
        backend = self._backend
        return document(
            self.results,
            backend.name if backend else (self.results[0].backend if self.results else None),
            str(backend.device) if backend else (self.results[0].device if self.results else None),
        )

    def write_json(self, path: Path) -> None:
        text = json.dumps(self.json_document(), indent=2, sort_keys=True) + "\n"
        path.write_text(text, encoding="utf-8")
