"""Builders and readers that several test files share: inner runs, the stored baselines file, results."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpumem.results import PhaseResult

if TYPE_CHECKING:
    import torch

BASELINES = "gpumem-baselines.json"
UNPLUGGED = ("-p", "no:randomly", "-p", "no:cacheprovider", "-p", "no:hypothesispytest")
"""Plugins an inner pytest process does without: each costs it seconds (hypothesis's most)."""


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """An inner run that fails at any byte over a budget (no slack), without pytest's cache."""
    return pytester.runpytest("--gpumem-slack=0", "-p", "no:cacheprovider", *args)


def strict_json(text: str) -> Any:
    """`json.loads` that refuses NaN and Infinity, which strict JSON readers do not take."""

    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def stored_entries(pytester: pytest.Pytester) -> dict[str, dict[str, Any]]:
    """Node id -> the tracker's entry on the CPU, as the inner run's baselines file has it."""
    data = strict_json((pytester.path / BASELINES).read_text(encoding="utf-8"))
    return {nodeid: per_device["tracker | cpu"] for nodeid, per_device in data["entries"].items()}


def stored_gradients(pytester: pytest.Pytester, test: str) -> dict[str, Any]:
    """The stored gradient fingerprint's parameters of `test` in the inner run's test_suite.py."""
    params: dict[str, Any] = stored_entries(pytester)[f"test_suite.py::{test}"]["gradients"]["params"]
    return params


def assert_one_line_failure(result: pytest.RunResult) -> None:
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    result.stdout.no_fnmatch_line("*Traceback*")
    result.stdout.no_fnmatch_line("*pytest_gpumem/*")


def phase_result(name: str, peak: int, rank: int | None = None) -> PhaseResult:
    """A phase that peaked at `peak` bytes (requested alike, no cache) and kept nothing."""
    return PhaseResult(name, peak, peak, None, 0, rank=rank)


Reported = Callable[..., dict[str, dict[str, Any]]]  # the `reported` fixture: an inner run's tests by name


def model_with_grads(seed: int = 0, dtype: torch.dtype | None = None) -> torch.nn.Sequential:
    """A small MLP after one backward: every parameter has a gradient (float32 unless `dtype`)."""
    import torch
    from torch import nn

    dtype = dtype or torch.float32
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(dtype)
    x = torch.randn(8, 16, dtype=dtype)
    model(x).square().mean().backward()
    return model


class FakeStorage:
    """What the ledger reads of a storage: a key, a size and a device (and a weak reference to it)."""

    def __init__(self, key: int, size: int) -> None:
        self._cdata, self.size = key, size

    def nbytes(self) -> int:
        return self.size

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")
