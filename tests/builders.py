"""Builders and readers that several test files share: inner runs, the stored baselines file, results."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpumem.results import PhaseResult

if TYPE_CHECKING:
    import torch

    from pytest_gpumem.backends.tracker.ledger import StorageLedger

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


def same_random_program(
    ledgers: Sequence[StorageLedger], rng: random.Random, steps: int, most: tuple[int, ...]
) -> Iterator[tuple[int, float]]:
    """Send each ledger the same random program of fake storages: adds (sizes up to `most`'s, the first from 0,
    the others from 1 byte; a freed key sometimes reused), frees and resizes; the rolls of 0.9 and above are
    yielded with their step, for the caller's own events (resets, reads). The storages live until it ends."""
    kept: list[dict[int, FakeStorage]] = [{} for _ in ledgers]
    freed_keys: list[int] = []
    for step in range(steps):
        roll = rng.random()
        if roll < 0.45 or not kept[0]:
            key = freed_keys.pop(rng.randrange(len(freed_keys))) if freed_keys and roll < 0.1 else step + 10
            size = rng.choice((rng.randint(0, most[0]), *(rng.randint(1, top) for top in most[1:])))
            for ledger, storages in zip(ledgers, kept, strict=True):
                storages[key] = FakeStorage(key, size)
                ledger.add(storages[key])
        elif roll < 0.85:
            key = rng.choice(list(kept[0]))
            for storages in kept:
                del storages[key]  # its last reference: freed
            freed_keys.append(key)
        elif roll < 0.9:
            key, size = rng.choice(list(kept[0])), rng.randint(0, 8 * 2**20)
            for ledger, storages in zip(ledgers, kept, strict=True):
                storages[key].size = size
                ledger.resize(storages[key])
        else:
            yield step, roll
