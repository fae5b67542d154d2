"""pytest fixtures, the `--gpumem-scale` option and the report section of the reference strategies.

Loaded only on request, never by pytest-gpumem itself: by the package's own conftest.py (runs of the
shipped suite by path), by pytest-gpumem for `pytest --pyargs reference_losses` (before the command
line is parsed, so that `--gpumem-scale` is known), or by a user with `-p reference_losses.fixtures` or
`pytest_plugins = ["reference_losses.fixtures"]`. Every fixture name starts with `gpumem_`, so none
collides with a project's own. torch and the strategies are imported only inside fixtures and hooks.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from pytest_gpumem import GpuMem, TestResult
    from reference_losses.strategy import Outcome, Strategy

LOSS_NAMES = (
    "naive_sum", "dot", "einsum", "checkpoint_loss", "manual_cleanup",
    "full_ce", "chunked_ce", "chunked_ce_checkpoint",
)  # fmt: skip
TRAINING_NAMES = (
    "plain", "checkpoint_layer", "amp", "clip_grad", "optimizer_in_backward",
    "residual_plain", "checkpoint_blocks", "selective_checkpoint", "grad_accumulation",
    "compress_activations", "offload_activations",
)  # fmt: skip

INFO_KEY = "reference_strategy"
DIST_INFO_KEY = "reference_distributed"  # reference_losses.distributed.INFO_KEY, read without importing torch


def parse_scale(value: str) -> float:
    """`--gpumem-scale` value: a positive number multiplying the batch sizes of the workloads."""
    try:
        scale = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid scale {value!r} (a positive number, e.g. 1 or 0.5)") from None
    if not 0 < scale < float("inf"):
        raise argparse.ArgumentTypeError(f"invalid scale {value!r} (a positive number, e.g. 1 or 0.5)")
    return scale


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpumem")
    group.addoption(
        "--gpumem-scale",
        type=parse_scale,
        default=None,
        metavar="FACTOR",
        help="multiply the batch sizes of the reference_losses workloads. Default: 1 (ini gpumem_scale).",
    )
    parser.addini("gpumem_scale", "default for --gpumem-scale", default="1")


def _scale(config: pytest.Config) -> float:
    given = config.getoption("gpumem_scale")
    if given is not None:
        return float(given)
    try:
        return parse_scale(str(config.getini("gpumem_scale")).strip())
    except argparse.ArgumentTypeError as exc:
        raise pytest.UsageError(f"ini option gpumem_scale: {exc}") from None


@dataclass
class Case:
    """A strategy, its workload as built (never run: each run takes a clone), and what it is checked
    against: `reference` (the naive strategy in fp32) and, for reduced-precision strategies, `truth`
    (naive in fp64) and `naive_reduced` (naive in the strategy's dtype). On the meta device there are
    no values to compare: `reference` is None and only the bytes are checked."""

    strategy: Strategy
    workload: Any
    reference: Outcome | None
    truth: Outcome | None = None
    naive_reduced: Outcome | None = None
    dtype: torch.dtype | None = None


def pytest_configure(config: pytest.Config) -> None:
    _scale(config)  # a bad ini value is a usage error at start-up, not an error in every test


@pytest.fixture(scope="session")
def gpumem_scale(pytestconfig: pytest.Config) -> float:
    return _scale(pytestconfig)


@pytest.fixture(scope="session")
def gpumem_reference_outcomes() -> dict[tuple[Any, ...], Outcome]:
    """Naive outcomes by (strategy, dtype, scale, device), computed once per session, unmeasured."""
    return {}


@pytest.fixture(params=LOSS_NAMES)
def gpumem_loss_strategy(request: pytest.FixtureRequest) -> Strategy:
    from reference_losses.losses import LOSS_STRATEGIES

    return LOSS_STRATEGIES[request.param]


@pytest.fixture(params=TRAINING_NAMES)
def gpumem_training_strategy(request: pytest.FixtureRequest) -> Strategy:
    from reference_losses.training import TRAINING_STRATEGIES

    return TRAINING_STRATEGIES[request.param]


def _workload(gpumem: GpuMem, scale: float, name: str) -> Any:
    from reference_losses import models

    builders = {
        "product": models.build_product,
        "net": models.build_net,
        "residual": models.build_residual,
        "lm_head": models.build_lm_head,
    }
    return builders[name](scale, gpumem.device)


@pytest.fixture
def gpumem_net_model(gpumem: GpuMem, gpumem_scale: float) -> Any:
    """The Q&A's Net with an input batch and target on `gpumem.device` (a models.ModelWorkload)."""
    return _workload(gpumem, gpumem_scale, "net")


@pytest.fixture
def gpumem_residual_model(gpumem: GpuMem, gpumem_scale: float) -> Any:
    """The deep residual MLP with a batch and target on `gpumem.device` (a models.ModelWorkload)."""
    return _workload(gpumem, gpumem_scale, "residual")


@pytest.fixture
def gpumem_lm_head(gpumem: GpuMem, gpumem_scale: float) -> Any:
    """Hidden states, output embedding and targets on `gpumem.device` (a models.LMHeadWorkload)."""
    return _workload(gpumem, gpumem_scale, "lm_head")


def _naive(
    case_key: tuple[Any, ...],
    cache: dict[tuple[Any, ...], Outcome],
    strategy: Strategy,
    workload: Any,
    device: torch.device,
    dtype: torch.dtype,
) -> Outcome:
    from reference_losses.strategy import NullMeter, fast_reduced_matmuls, with_scales

    key = (*case_key, dtype)
    if key not in cache:
        clone = workload.clone(dtype)
        model = getattr(clone, "model", None)
        before = {} if model is None else {n: p.detach().clone() for n, p in model.named_parameters()}
        with fast_reduced_matmuls(device, dtype):
            outcome = strategy.run(NullMeter(), clone)
        cache[key] = with_scales(outcome, before)
    return cache[key]


def make_case(strategy: Strategy, gpumem: GpuMem, scale: float, cache: dict[tuple[Any, ...], Outcome]) -> Case:
    """Build the workload and the references (in setup, so that nothing of it is measured)."""
    import torch

    from reference_losses.losses import LOSS_STRATEGIES
    from reference_losses.strategy import NullMeter
    from reference_losses.training import TRAINING_STRATEGIES

    device = gpumem.device
    if strategy.needs_cuda and device.type != "cuda":
        pytest.skip(f"{strategy.name} needs a CUDA device (measuring on {device})")
    if device.type == "meta" and strategy.no_meta is not None:
        pytest.skip(f"{strategy.name} cannot run on the meta device: {strategy.no_meta}")
    naive = {**LOSS_STRATEGIES, **TRAINING_STRATEGIES}[strategy.reference]
    workload = _workload(gpumem, scale, strategy.workload)
    if device.type == "meta":
        # No values: the naive references cannot be computed (nor compared); only bytes are checked.
        return Case(strategy, workload, None)
    key = (naive.name, scale, str(device))
    case = Case(strategy, workload, _naive(key, cache, naive, workload, device, torch.float32))
    case.dtype = strategy.precision(device)
    if case.dtype is not None:
        case.truth = _naive(key, cache, naive, workload, device, torch.float64)
        case.naive_reduced = _naive(key, cache, naive, workload, device, case.dtype)
    if device.type != "cpu":
        # First use of cuBLAS (per handle: the autograd thread has its own) allocates a workspace
        # that stays; run once here so that it is not part of the measured peaks.
        strategy.run(NullMeter(), workload.clone())
    return case


@pytest.fixture
def gpumem_loss_case(
    gpumem_loss_strategy: Strategy,
    gpumem: GpuMem,
    gpumem_scale: float,
    gpumem_reference_outcomes: dict[tuple[Any, ...], Outcome],
) -> Case:
    """A loss strategy (one per LOSS_NAMES) with its workload and naive references, built in setup."""
    return make_case(gpumem_loss_strategy, gpumem, gpumem_scale, gpumem_reference_outcomes)


@pytest.fixture
def gpumem_training_case(
    gpumem_training_strategy: Strategy,
    gpumem: GpuMem,
    gpumem_scale: float,
    gpumem_reference_outcomes: dict[tuple[Any, ...], Outcome],
) -> Case:
    """A training strategy (one per TRAINING_NAMES) with its workload and naive references."""
    return make_case(gpumem_training_strategy, gpumem, gpumem_scale, gpumem_reference_outcomes)


# --- report ------------------------------------------------------------------------------------------


VALUES_NOT_CHECKED = (
    "reference_losses: {count} on the meta device: bytes checked against every bound (the tracker counts "
    "meta storages as on CPU); losses and gradients not compared with the naive reference (no values)"
)


RESULTS_KEY = pytest.StashKey[tuple["TestResult", ...]]()


@pytest.hookimpl(optionalhook=True)
def pytest_gpumem_session_results(config: pytest.Config, results: Sequence[TestResult]) -> None:
    """Keep the run's results (on the xdist controller, the workers' too) for the report section."""
    config.stash[RESULTS_KEY] = tuple(results)


def _report_asked(config: pytest.Config) -> bool:
    """`--gpumem-report`, else its ini twin (whose bad value pytest-gpumem refuses at start-up)."""
    given = config.getoption("gpumem_report")
    return bool(config.getini("gpumem_report") if given is None else given)


def _rows(results: Sequence[TestResult]) -> list[dict[str, Any]]:
    """The measured reference strategies."""
    rows = []
    for result in results:
        info = result.info.get(INFO_KEY)
        if isinstance(info, dict):
            phases = {name: phase.requested_peak_bytes for name, phase in result.phases.items()}
            row = {**info, "phases": phases, "backend": result.backend, "device": result.device}
            row["autocast"] = result.info.get("autocast")  # amp_step: which device's autocast rules applied
            total = result.phases.get("total")
            row["reserved"] = None if total is None else total.reserved_peak_bytes  # with the allocator's model
            if result.explanation is not None:  # --gpumem-explain: what each phase's peak was made of
                explained = result.explanation.phases
                row["composition"] = {name: explained[name].categories for name in phases if name in explained}
                row["labels"] = result.explanation.labels
            rows.append(row)
    return rows


def _distributed_summary(terminalreporter: pytest.TerminalReporter, results: Sequence[TestResult]) -> None:
    """The distributed strategies' table (reference_losses/distributed.py)."""
    if not any(DIST_INFO_KEY in result.info for result in results):
        return
    from reference_losses.distributed import report_lines

    terminalreporter.write_sep("=", "reference_losses: per-rank peaks of distributed strategies")
    for line in report_lines(results):
        terminalreporter.write_line(line)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    results = config.stash.get(RESULTS_KEY, ())
    if not results:
        return
    report = _report_asked(config)
    if report:
        _distributed_summary(terminalreporter, results)
    rows = _rows(results)
    unchecked = sum(1 for row in rows if row.get("values_checked") is False)
    if unchecked:
        count = f"{unchecked} strateg{'y' if unchecked == 1 else 'ies'} measured"
        terminalreporter.write_line(VALUES_NOT_CHECKED.format(count=count))
    if not rows or not report:
        return
    from reference_losses.report import report_lines

    terminalreporter.write_sep("=", "reference_losses: peak bytes per strategy")
    for line in report_lines(rows):
        terminalreporter.write_line(line)
