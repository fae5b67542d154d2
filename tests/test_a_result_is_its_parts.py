"""A test's result is its parts (the record its report writes, its outcome, its budget as written, the
baseline's verdict and entry, where it ran, its picture), each field read by its name in the report; the
report's entry is the parts' fields in the published order, read back into the same parts."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from pytest_gpumem.results import BudgetView, Outcome, PhaseResult, Phases, Status, TestResult, WrittenRecord

CALL = PhaseResult("call", 4000, 4096, 8192, 100)
FORWARD = PhaseResult("forward", 3000, 3072, None, -20, count=2)
MESSAGE = "call peak 3.9 KiB exceeds max_memory 1 KiB"
NAMED: dict[str, Any] = {
    "phases": {"forward": FORWARD},
    "notes": ["a note"],
    "info": {"tokens": 12},
    "fits": ["batch 8 fits"],
    "distributed": [{"world_size": 2}],
    "simulated": [{"world_size": 4, "rank": 1}],
    "status": "OVER BUDGET",
    "message": MESSAGE,
    "detail": ["what grew"],
    "budget_limits": {"call": 1024},
    "budget_text": "1 KiB",
    "worker_device": "cuda:1",
    "html_path": "html/t.html",
}


def rich() -> TestResult:
    return TestResult.of("t.py::test_a", "tracker", "cpu", CALL, **NAMED)


def test_each_field_is_in_one_part_and_read_by_its_name_in_the_report() -> None:
    result = rich()
    assert result.record == WrittenRecord(
        "t.py::test_a", "tracker", "cpu", CALL, Phases({"forward": FORWARD}), ("a note",), {"tokens": 12},
        None, ("batch 8 fits",), None, ({"world_size": 2},), ({"world_size": 4, "rank": 1},),
    )  # fmt: skip
    assert result.outcome == Outcome(Status.OVER_BUDGET, MESSAGE, ("what grew",))  # a word is a Status
    assert result.budget == BudgetView({"call": 1024}, "1 KiB")
    assert (result.status, result.budget_text, result.peak_bytes, result.baseline_entry) == (
        Status.OVER_BUDGET, "1 KiB", 4000, None,
    )  # fmt: skip
    assert TestResult.of(**result.named()) == result
    assert result.replaced(status="ok").outcome == Outcome(Status.OK, MESSAGE, ("what grew",))
    with pytest.raises(TypeError, match=r"^a TestResult has no field 'statu'$"):
        result.replaced(statu="ok")


def test_the_entry_keeps_the_published_keys_in_their_order() -> None:
    assert list(rich().to_json()) == [
        *("nodeid", "backend", "device", "peak_bytes", "call", "phases", "budget", "budget_text", "status"),
        *("message", "detail", "info", "baseline", "record", "notes", "worker_device", "explanation", "html"),
        *("fits", "advice", "distributed", "simulated"),
    ]


def test_an_entry_read_back_is_the_result_it_was_written_from_part_by_part() -> None:
    result = rich()
    text = json.dumps(result.to_json())
    read = TestResult.from_json(json.loads(text))
    assert read == result and json.dumps(read.to_json()) == text
    for part in ("record", "outcome", "budget"):
        for f in dataclasses.fields(getattr(result, part)):
            written, back = getattr(getattr(result, part), f.name), getattr(getattr(read, part), f.name)
            assert (type(back), back) == (type(written), written), f.name
    with pytest.raises(TypeError, match="read-only"):
        read.phases["g"] = CALL  # type: ignore[index]


def test_a_result_made_from_its_fields_positionally_is_refused_pointing_at_of() -> None:
    """The constructor before the parts took fields (`TestResult(nodeid, backend, device, call)`): such a call
    is refused at once, not left to fail where a field is read."""
    call = PhaseResult("call", 1, 1, None, 0)
    with pytest.raises(TypeError, match=r"TestResult\.of\(nodeid, backend, device, call, \.\.\.\) makes one"):
        TestResult("t.py::a", "tracker", "cpu", call)  # type: ignore[arg-type]
