from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._dynamo.repro.after_dynamo  # what torch.compile imports for any backend

# pytester's in-process runs drop modules first imported inside them; torch registers operator
# libraries on import (torch._dynamo -> torch._inductor.test_operators) and torch.compile's cache
# artifacts (torch._inductor.runtime.autotune_cache), which must not happen twice, so everything that
# inner runs may import lazily is imported here first.
torch.utils.checkpoint.checkpoint  # noqa: B018
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script_method, in torch's own modules
    import torch._inductor.compile_fx  # what the default backend imports


@pytest.fixture(autouse=True)
def _no_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inner runs fit their report to COLUMNS: without it they use the width of no terminal, whatever
    the terminal the suite runs in (a test that wants a width sets it). Under CI (or BUILD_NUMBER) pytest
    prints whole summary lines: inner runs print what a person's terminal shows."""
    for name in ("COLUMNS", "CI", "BUILD_NUMBER"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def tracker(pytester: pytest.Pytester) -> pytest.Pytester:
    """A pytester whose runs measure with the exact tracker, whatever the machine has."""
    pytester.makeini("[pytest]\ngpumem_backend = tracker\n")
    return pytester


@pytest.fixture
def reported(pytester: pytest.Pytester) -> Callable[..., dict[str, dict[str, Any]]]:
    """The tests of an inner run's JSON report (`--gpumem-json=out.json`), by the name after the file's."""

    def read(name: str = "out.json") -> dict[str, dict[str, Any]]:
        doc = json.loads((pytester.path / name).read_text(encoding="utf-8"))
        return {test["nodeid"].split("::", 1)[1]: test for test in doc["tests"]}

    return read
