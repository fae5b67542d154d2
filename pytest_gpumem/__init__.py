"""pytest-gpumem: GPU memory as a tested property of PyTorch code.

pytest loads this package's plugin in every run, so the public names below are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cuda_allocator_model import lazy_names

if TYPE_CHECKING:
    from cuda_allocator_model import format_size as format_size
    from cuda_allocator_model import parse_size as parse_size
    from pytest_gpumem.advise.chunked import chunked_cross_entropy as chunked_cross_entropy
    from pytest_gpumem.backends.base import Backend as Backend
    from pytest_gpumem.backends.base import Counters as Counters
    from pytest_gpumem.backends.base import Settings as Settings
    from pytest_gpumem.backends.tracker.autocast import autocast_device_type as autocast_device_type
    from pytest_gpumem.budget import Budget as Budget
    from pytest_gpumem.budget import budget_from_marker as budget_from_marker
    from pytest_gpumem.errors import GpuMemError as GpuMemError
    from pytest_gpumem.errors import GpuMemWarning as GpuMemWarning
    from pytest_gpumem.measure.fit import BatchFit as BatchFit
    from pytest_gpumem.measure.meter import GpuMem as GpuMem
    from pytest_gpumem.results import PhaseResult as PhaseResult
    from pytest_gpumem.results import Status as Status
    from pytest_gpumem.results import TestResult as TestResult
    from pytest_gpumem.results.advice import Advice as Advice
    from pytest_gpumem.results.baseline import DeviceIdentity as DeviceIdentity
    from pytest_gpumem.results.baseline import Entry as Entry
    from pytest_gpumem.results.baseline import Verdict as Verdict
    from pytest_gpumem.results.explanation import Explanation as Explanation
    from pytest_gpumem.results.ranks import RankResult as RankResult

_HOMES = {
    "chunked_cross_entropy": "pytest_gpumem.advise.chunked",
    "Backend": "pytest_gpumem.backends.base",
    "Counters": "pytest_gpumem.backends.base",
    "Settings": "pytest_gpumem.backends.base",
    "autocast_device_type": "pytest_gpumem.backends.tracker.autocast",
    "GpuMemError": "pytest_gpumem.errors",
    "GpuMemWarning": "pytest_gpumem.errors",
    "Budget": "pytest_gpumem.budget",
    "Advice": "pytest_gpumem.results.advice",
    "BatchFit": "pytest_gpumem.measure.fit",
    "RankResult": "pytest_gpumem.results.ranks",
    "budget_from_marker": "pytest_gpumem.budget",
    "GpuMem": "pytest_gpumem.measure.meter",
    "PhaseResult": "pytest_gpumem.results",
    "TestResult": "pytest_gpumem.results",
    "Status": "pytest_gpumem.results",
    "DeviceIdentity": "pytest_gpumem.results.baseline",
    "Entry": "pytest_gpumem.results.baseline",
    "Verdict": "pytest_gpumem.results.baseline",
    "Explanation": "pytest_gpumem.results.explanation",
    "format_size": "cuda_allocator_model",
    "parse_size": "cuda_allocator_model",
}

__version__ = "0.1.0"
__all__ = sorted(_HOMES)


__getattr__ = lazy_names(__name__, _HOMES)
