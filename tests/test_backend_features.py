"""A backend with only the documented methods: a capacity it cannot set fails that test in one line, and
--gpumem-snapshot-dir says once, in the header, that no trace will be written."""

from __future__ import annotations

import pytest

PLAIN = """
from pytest_gpumem.backends.tracker.backend import TrackerBackend

class Plain(TrackerBackend):
    name = "plain"
    configure = None  # a backend with only the documented methods

def pytest_gpumem_make_backend(config, name):
    return Plain() if name == "plain" else None
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
