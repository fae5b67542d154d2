"""The shipped suite: every strategy against its naive reference, in values and in bytes.

Run with `pytest --pyargs reference_losses --gpumem-report`.
"""

from __future__ import annotations

from pytest_gpumem import GpuMem
from reference_losses.checks import check
from reference_losses.fixtures import Case


def test_loss_strategy(loss_case: Case, gpumem: GpuMem) -> None:
    check(loss_case, gpumem)


def test_training_strategy(training_case: Case, gpumem: GpuMem) -> None:
    check(training_case, gpumem)
