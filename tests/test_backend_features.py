"""Backends a conftest.py plugs in: one that subclasses `pytest_gpumem.Backend` and overrides only the
required members runs, a capacity it cannot set fails that test in one line, and --gpumem-snapshot-dir
says once, in the header, that no trace will be written; an object that is no `Backend` is refused in one
line."""

from __future__ import annotations

import pytest

PLAIN = """
import torch
from pytest_gpumem import Backend, Counters

class Plain(Backend):
    name = "plain"
    device = torch.device("cpu")
    def describe(self): return "plain (a test double)"
    def start(self): pass
    def stop(self): pass
    def settle(self): pass
    def current(self): return Counters(0, 0)
    def peak(self): return Counters(0, 0)
    def reset_peak(self): pass

def pytest_gpumem_make_backend(config, name):
    return {"plain": Plain, "broken": object}.get(name, lambda: None)()
"""

SUITE = """
import pytest

@pytest.mark.max_memory(capacity="1 KiB")
def test_capped():
    pass

def test_plain(gpumem):
    pass
"""


def test_what_a_backend_cannot_do_is_said_in_one_line(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(PLAIN)
    pytester.makepyfile(SUITE)
    result = pytester.runpytest("--gpumem-backend=plain", "--gpumem-snapshot-dir=snaps")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "gpumem: plain (a test double)",
            "  --gpumem-snapshot-dir: the plain backend records no trace, none will be written",
        ]
    )
    result.stdout.fnmatch_lines(["*capacity 1 KiB: the plain backend cannot set a capacity"])


def test_an_object_that_is_no_backend_is_refused_in_one_line(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(PLAIN)
    pytester.makepyfile(SUITE)
    result = pytester.runpytest("--gpumem-backend=broken")
    assert result.ret != 0
    result.stderr.fnmatch_lines(
        [
            "ERROR: --gpumem-backend=broken: pytest_gpumem_make_backend gave an instance of object, not a backend: "
            "subclass pytest_gpumem.Backend"
        ]
    )
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
