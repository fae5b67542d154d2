"""A rerun (pytest-rerunfailures) starts from nothing: the last attempt's fixtures and `info` reach the
report, and JUnit holds one gpumem status per test."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
from builders import Reported

FLAKY = """
import pytest, torch

attempts = []

@pytest.fixture
def noted(gpumem):
    gpumem.info["set_up"] = True
    return gpumem

@pytest.mark.flaky(reruns=1)
def test_flaky(noted):
    attempts.append(1)
    noted.info[f"attempt{len(attempts)}"] = True
    torch.ones(10)
    assert len(attempts) == 2
"""


def test_a_rerun_starts_from_nothing(tracker: pytest.Pytester, reported: Reported) -> None:
    pytest.importorskip("pytest_rerunfailures")
    tracker.makepyfile(FLAKY)
    tracker.runpytest("--junitxml=j.xml", "--gpumem-json=out.json", "-p", "no:randomly")
    assert reported()["test_flaky"]["info"] == {"set_up": True, "attempt2": True}
    *_, case = [c for c in ET.parse(tracker.path / "j.xml").iter("testcase") if c.get("name") == "test_flaky"]
    statuses = [p.get("value") for p in case.iter("property") if p.get("name") == "gpumem_status"]
    assert statuses == ["ok"]
