"""`pytest-gpumem compare` fails on a test that failed in the new run, and only warns about a test measured
on another backend or device than before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_gpumem.cli import main
from pytest_gpumem.results import PhaseResult, Status, TestResult


def report(path: Path, status: str, peak: int, backend: str = "tracker") -> Path:
    test = TestResult("t.py::test_a", backend, "cpu", PhaseResult("call", peak, peak, None, 0), status=Status(status))
    doc = {"version": 1, "backend": backend, "device": "cpu", "commit": None, "tests": [test.to_json()]}
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def compared(capsys: pytest.CaptureFixture[str], old: Path, new: Path) -> tuple[int, str]:
    code = main(["compare", str(old), str(new)])
    return code, capsys.readouterr().out


def test_a_test_that_failed_in_the_new_run_fails_the_comparison(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = report(tmp_path / "old.json", "ok", 80)
    code, out = compared(capsys, old, report(tmp_path / "new.json", "OUT OF MEMORY", 0))
    assert code == 1
    assert "failed in the new run: t.py::test_a (OUT OF MEMORY)" in out


def test_another_backend_is_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = report(tmp_path / "old.json", "ok", 80)
    code, out = compared(capsys, old, report(tmp_path / "other.json", "ok", 80, backend="cuda"))
    assert code == 0
    assert "warning: t.py::test_a was measured on another backend or device than before" in out


def test_growth_from_a_tiny_peak_is_said_in_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = report(tmp_path / "old.json", "ok", 8)
    code, out = compared(capsys, old, report(tmp_path / "new.json", "ok", 8 << 20))  # 8 B, then 8 MiB
    assert code == 1
    assert out.splitlines()[2].split("  ")[-2:] == ["+8.0 MiB", "REGRESSED"]  # not +104857500.0%
    assert "regressed: t.py::test_a: call peak 8.0 MiB is 8.0 MiB above baseline 8 B (tolerance 5% + 1.0 MiB)" in out
