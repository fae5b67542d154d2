"""pytest-gpumem: GPU memory as a tested property of PyTorch code."""

from __future__ import annotations

from pytest_gpumem.backends.base import Backend, Counters
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.markers import Budget, budget_from_marker
from pytest_gpumem.meter import GpuMem
from pytest_gpumem.results import PhaseResult, TestResult
from pytest_gpumem.sizes import format_size, parse_size

__all__ = [
    "Backend",
    "Budget",
    "Counters",
    "GpuMem",
    "GpuMemError",
    "PhaseResult",
    "TestResult",
    "budget_from_marker",
    "format_size",
    "parse_size",
]
