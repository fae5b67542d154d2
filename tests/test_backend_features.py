"""Backends a conftest.py plugs in: one that subclasses `pytest_gpumem.Backend` and overrides only the
required members runs, a capacity it cannot set fails that test in one line, and --gpumem-snapshot-dir
says once, in the header, that no trace will be written; an object of the contract before the base class
(any object with the methods) still runs, and one without them is refused in one line."""

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

class OldStyle:
    name = "old-style"
    device = torch.device("cpu")
    describe, start, stop, settle = Plain.describe, Plain.start, Plain.stop, Plain.settle
    current, peak, reset_peak = Plain.current, Plain.peak, Plain.reset_peak

def pytest_gpumem_make_backend(config, name):
    return {"plain": Plain, "old-style": OldStyle, "broken": object}.get(name, lambda: None)()
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
        ["gpumem: *; --gpumem-snapshot-dir: the plain backend records no trace, none will be written"]
    )
    result.stdout.fnmatch_lines(["*capacity 1 KiB: the plain backend cannot set a capacity"])


def test_a_backend_of_the_contract_before_the_base_class_still_runs(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(PLAIN)
    pytester.makepyfile(SUITE)
    result = pytester.runpytest("--gpumem-backend=old-style")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*capacity 1 KiB: the old-style backend cannot set a capacity"])


def test_an_object_without_a_backends_members_is_refused_in_one_line(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(PLAIN)
    pytester.makepyfile(SUITE)
    result = pytester.runpytest("--gpumem-backend=broken")
    assert result.ret != 0
    result.stderr.fnmatch_lines(
        [
            "ERROR: --gpumem-backend=broken: pytest_gpumem_make_backend gave an instance of object without name, "
            "device, describe and 6 more of a backend's members: subclass pytest_gpumem.Backend"
        ]
    )
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
