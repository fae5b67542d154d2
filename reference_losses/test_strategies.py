"""The shipped suite: every strategy against its naive reference, in values and in bytes.

Run with `pytest --pyargs reference_losses --gpumem-report`; the fixtures come from fixtures.py, loaded
by this package's conftest.py (or, for --pyargs runs, by pytest-gpumem before the command line is parsed).
"""

from __future__ import annotations

from pytest_gpumem import GpuMem
from reference_losses.checks import check
from reference_losses.fixtures import Case


def test_loss_strategy(gpumem_loss_case: Case, gpumem: GpuMem) -> None:
    check(gpumem_loss_case, gpumem)


def test_training_strategy(gpumem_training_case: Case, gpumem: GpuMem) -> None:
    check(gpumem_training_case, gpumem)
