"""The baseline store and the comparison, unit by unit: file format, validation, atomic writes, update."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cuda_allocator_model.sizes import format_size
from pytest_gpumem.baselines import compare as C
from pytest_gpumem.baselines import file as F
from pytest_gpumem.baselines import schema
from pytest_gpumem.baselines import update as U
from pytest_gpumem.baselines.schema import BaselineError, BaselineStore
from pytest_gpumem.constants import DEFAULT_FILENAME
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.results.baseline import BaselineStatus, DeviceIdentity, Entry, Environment, Verdict
from pytest_gpumem.results.explanation import Cell, PhaseComposition
from pytest_gpumem.results.gradients import Fingerprint, GradStats, ParamFingerprint

H200 = DeviceIdentity("cuda", "NVIDIA H200", "9.0", 150_754_820_096)
A100 = DeviceIdentity("cuda", "NVIDIA A100-SXM4-80GB", "8.0", 85_094_678_528)
TRACKER = DeviceIdentity("tracker", "cpu")
ENV = Environment("2.13.0", "12.8")
NO_SLACK = C.Tolerance(5, 0)


def decimal(n: int) -> str:
    return format_size(n, binary=False)


def grads(scale: float = 1.0) -> Fingerprint:
    stats = GradStats(1.5 * scale, 3.25 * scale, -0.125 * scale, 0.75 * scale, (0.5 * scale, -1.0 * scale))
    return Fingerprint(
        params={
            "fc.weight": ParamFingerprint((4, 3), "float32", stats),
            "fc.bias": ParamFingerprint((4,), "float32", None),
        },
        method="test-method",
    )


def entry(
    peak: int = 16_000_000,
    phases: dict[str, int] | None = None,
    identity: DeviceIdentity = H200,
    env: Environment = ENV,
    gradients: Fingerprint | None = None,
) -> Entry:
    if phases is None:
        phases = {"forward": 16_000_000, "backward": 8_000_000}
    return Entry.measured(identity, env, peak, phases, gradients)


def sample_store(path: Path) -> BaselineStore:
    store = BaselineStore(path)
    U.update(
        store,
        {
            "tests/test_b.py::test_two[bf16-ünïcode]": entry(gradients=grads()),
            "tests/test_a.py::test_one": entry(peak=1234, phases={}),
            "tests/test_a.py::test_zero": entry(peak=0, phases={"z": 0, "a": 5}),
        },
    )
    U.update(store, {"tests/test_a.py::test_one": entry(identity=A100, env=Environment("2.12.0", None))})
    U.update(store, {"tests/test_a.py::test_one": entry(identity=TRACKER, env=Environment(None, None))})
    return store


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / DEFAULT_FILENAME


# ------------------------------------------------------------------------------------------ file format


def test_round_trip_is_byte_stable(path: Path) -> None:
    store = sample_store(path)
    F.write(store)
    first = path.read_bytes()
    F.write(store)
    assert path.read_bytes() == first
    loaded = F.load(path)
    assert loaded.existed
    assert loaded.entries == store.entries
    F.write(loaded)
    assert path.read_bytes() == first
    assert schema.dumps(loaded).encode() == first


def test_format_is_sorted_indented_and_newline_terminated(path: Path) -> None:
    F.write(sample_store(path))
    text = path.read_text(encoding="utf-8")
    obj = json.loads(text)
    assert text == json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    assert text.endswith("}\n") and not text.endswith("\n\n")
    assert obj["schema"] == schema.SCHEMA and obj["version"] == schema.VERSION
    assert list(obj["entries"]) == sorted(obj["entries"])
    assert "ünïcode" in text  # readable in diffs, not \\u escapes
    one = obj["entries"]["tests/test_a.py::test_one"]
    assert set(one) == {H200.key, A100.key, TRACKER.key}
    assert one[H200.key]["identity"] == {
        "backend": "cuda",
        "capability": "9.0",
        "device": "NVIDIA H200",
        "total_memory": 150_754_820_096,
    }
    assert one[A100.key]["torch"] == "2.12.0" and one[A100.key]["cuda"] is None
    assert "gradients" not in one[H200.key]
    assert H200.key == "cuda | NVIDIA H200 | cc 9.0 | 150754820096 B"
    assert TRACKER.key == "tracker | cpu"


ONE_ENTRY = """{
  "entries": {
    "t.py::test_ü": {
      "tracker | cpu": {
        "composition": {
          "forward": {
            "categories": {
              "saved": 1
            },
            "cells": [
              [
                "saved",
                "h.*",
                1
              ]
            ],
            "folded": {
              "h.*": 2
            }
          }
        },
        "cuda": null,
        "identity": {
          "backend": "tracker",
          "capability": null,
          "device": "cpu",
          "total_memory": null
        },
        "peak_bytes": 1024,
        "phases": {
          "forward": 1,
          "step": 2
        },
        "torch": "2.13.0"
      }
    }
  },
  "schema": "pytest-gpumem-baselines",
  "version": 1
}
"""


def test_an_entry_is_written_as_sorted_indented_json_and_read_back_the_same(path: Path) -> None:
    composition = {"forward": PhaseComposition({"saved": 1}, [Cell("saved", "h.*", 1)], {"h.*": 2})}
    one = Entry.measured(TRACKER, Environment("2.13.0", None), 1024, {"step": 2, "forward": 1}, None, composition)
    store = BaselineStore(path)
    U.update(store, {"t.py::test_ü": one})
    F.write(store)
    assert path.read_text(encoding="utf-8") == ONE_ENTRY
    assert F.load(path).get("t.py::test_ü", TRACKER) == one


def test_missing_file_is_an_empty_store(path: Path) -> None:
    store = F.load(path)
    assert not store.existed and len(store) == 0 and store.path == path
    assert not path.exists()


def test_baseline_error_is_a_gpumem_error() -> None:
    assert issubclass(BaselineError, GpuMemError)


# ------------------------------------------------------------------------------------ refused files

VALID = json.loads(schema.dumps(sample_store(Path("x.json"))))
ONE = "tests/test_a.py::test_one"


def mutated(change: Any) -> str:
    obj = json.loads(json.dumps(VALID))
    change(obj)
    return json.dumps(obj, indent=2)


def _set(*keys_and_value: Any) -> Any:
    *keys, value = keys_and_value

    def change(obj: Any) -> None:
        for key in keys[:-1]:
            obj = obj[key]
        obj[keys[-1]] = value

    return change


def _del(*keys: Any) -> Any:
    def change(obj: Any) -> None:
        for key in keys[:-1]:
            obj = obj[key]
        del obj[keys[-1]]

    return change


GOOD_TEXT = json.dumps(VALID, indent=2)
E = ("entries", ONE, H200.key)
BAD_FILES: dict[str, tuple[str | bytes, str]] = {
    "empty": ("", "empty"),
    "whitespace": ("  \n", "empty"),
    "truncated": (GOOD_TEXT[: len(GOOD_TEXT) // 2], "truncated"),
    "garbage": ("not json at all", "not valid JSON"),
    "merge-conflict": ("<<<<<<< HEAD\n{}\n=======\n{}\n>>>>>>> branch\n", "merge conflict"),
    "not-utf8": (b'{"schema": "\xff\xfe"}', "not UTF-8"),
    "json-list": ("[1, 2, 3]", "not a pytest-gpumem baseline file"),
    "foreign-object": ('{"machine_info": {}, "benchmarks": []}', "not a pytest-gpumem baseline file"),
    "wrong-schema": (mutated(_set("schema", "syrupy")), "not a pytest-gpumem baseline file"),
    "newer-version": (mutated(_set("version", 2)), "schema version 2 is newer"),
    "version-string": (mutated(_set("version", "1")), '"version" must be an integer'),
    "version-bool": (mutated(_set("version", True)), '"version" must be an integer'),
    "version-zero": (mutated(_set("version", 0)), '"version" must be an integer'),
    "missing-version": (mutated(_del("version")), '"version" must be an integer'),
    "unknown-top-key": (mutated(_set("extra", 1)), "unknown top-level key 'extra'"),
    "entries-list": (mutated(_set("entries", [])), '"entries" must be an object'),
    "empty-nodeid": (mutated(_set("entries", "", {})), "empty test node id"),
    "per-device-list": (mutated(_set("entries", ONE, [])), "expected an object of device -> entry"),
    "negative-peak": (mutated(_set(*E, "peak_bytes", -1)), "peak_bytes: expected an integer 0 <= n < 2**63"),
    "float-peak": (mutated(_set(*E, "peak_bytes", 1.5)), "peak_bytes: expected an integer 0 <= n < 2**63"),
    "bool-peak": (mutated(_set(*E, "peak_bytes", True)), "peak_bytes: expected an integer 0 <= n < 2**63"),
    "string-peak": (mutated(_set(*E, "peak_bytes", "16 MB")), "peak_bytes: expected an integer 0 <= n < 2**63"),
    "null-peak": (mutated(_set(*E, "peak_bytes", None)), "peak_bytes: expected an integer 0 <= n < 2**63"),
    "phase-negative": (mutated(_set(*E, "phases", "forward", -5)), 'phases["forward"]: expected an integer'),
    "phase-float": (mutated(_set(*E, "phases", "forward", 2.0)), 'phases["forward"]: expected an integer'),
    "phases-list": (mutated(_set(*E, "phases", [1])), "phases: expected an object"),
    "empty-phase-name": (mutated(_set(*E, "phases", "", 1)), "phase names must be non-empty"),
    "unknown-entry-key": (mutated(_set(*E, "note", "hi")), "unknown key 'note'"),
    "missing-entry-key": (mutated(_del(*E, "torch")), "missing key 'torch'"),
    "entry-not-object": (mutated(_set(*E, 7)), "expected an object"),
    "torch-not-string": (mutated(_set(*E, "torch", 2.13)), "torch: expected a version string"),
    "identity-missing-key": (mutated(_del(*E, "identity", "device")), "identity: missing key 'device'"),
    "identity-extra-key": (mutated(_set(*E, "identity", "uuid", "x")), "identity: unknown key 'uuid'"),
    "identity-total-negative": (
        mutated(_set(*E, "identity", "total_memory", -1)),
        "identity.total_memory: expected an integer 0 <= n < 2**63",
    ),
    "identity-key-mismatch": (
        mutated(_set(*E, "identity", "device", "NVIDIA H100")),
        "key does not match its identity",
    ),
    "peak-400-digits": (
        mutated(_set(*E, "peak_bytes", 10**400)),
        "peak_bytes: expected an integer 0 <= n < 2**63 (bytes), got an integer of 401 digits",
    ),
    "peak-2**63": (mutated(_set(*E, "peak_bytes", 2**63)), "peak_bytes: expected an integer 0 <= n < 2**63"),
    "phase-400-digits": (mutated(_set(*E, "phases", "forward", 10**400)), 'phases["forward"]: expected an integer'),
    "total-memory-400-digits": (
        mutated(_set(*E, "identity", "total_memory", 10**400)),
        "identity.total_memory: expected an integer 0 <= n < 2**63",
    ),
    "peak-5000-digits": (
        GOOD_TEXT.replace('"peak_bytes": 1234', '"peak_bytes": ' + "9" * 5000, 1),
        "not valid JSON: a number of more than",
    ),
    "nan": (GOOD_TEXT.replace('"peak_bytes": 1234', '"peak_bytes": NaN', 1), "NaN is not a valid JSON number"),
    "duplicate-key": (
        GOOD_TEXT.replace('"version": 1', '"version": 1, "version": 1', 1),
        'duplicate key "version"',
    ),
}
G = ("entries", "tests/test_b.py::test_two[bf16-ünïcode]", H200.key, "gradients")
BAD_FILES.update(
    {
        "gradients-not-object": (mutated(_set(*G, [])), "gradients: expected an object"),
        "gradients-null": (
            mutated(_set(*G, None)),
            'entries["tests/test_b.py::test_two[bf16-ünïcode]"]["cuda | NVIDIA H200 | cc 9.0 | 150754820096 B"]: '
            "gradients: expected an object, got None",
        ),
        "composition-null": (mutated(_set(*E, "composition", None)), "composition: expected an object of phase name"),
        "gradients-bad-stat": (
            mutated(_set(*G, "params", "fc.weight", "grad", "l2", "big")),
            'gradients.params["fc.weight"].grad.l2: expected a number',
        ),
        "gradients-bad-shape": (
            mutated(_set(*G, "params", "fc.weight", "shape", [4, -3])),
            'gradients.params["fc.weight"].shape',
        ),
        "gradients-unknown-key": (mutated(_set(*G, "extra", 1)), "gradients: unknown key 'extra'"),
    }
)


@pytest.mark.parametrize("content, expected", list(BAD_FILES.values()), ids=list(BAD_FILES))
def test_bad_file_is_refused_and_left_untouched(path: Path, content: str | bytes, expected: str) -> None:
    raw = content if isinstance(content, bytes) else content.encode("utf-8")
    path.write_bytes(raw)
    before = os.stat(path)
    with pytest.raises(BaselineError) as info:
        F.load(path)
    message = str(info.value)
    assert expected in message
    assert str(path) in message
    assert "\n" not in message
    assert path.read_bytes() == raw
    after = os.stat(path)
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)
    assert os.listdir(path.parent) == [path.name]


def test_newer_version_says_upgrade(path: Path) -> None:
    path.write_text(mutated(_set("version", 7)))
    with pytest.raises(BaselineError, match=r"schema version 7 is newer than this pytest-gpumem reads \(1\)"):
        F.load(path)


def test_older_json_of_our_own_loads(path: Path) -> None:
    path.write_text(GOOD_TEXT)  # not in our formatting: still valid
    assert len(F.load(path)) == len(sample_store(path))


def test_unreadable_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BaselineError, match="cannot read baseline file"):
        F.load(tmp_path)  # a folder


# ----------------------------------------------------------------------------------------- tolerance


def test_tolerance_boundaries_are_exact() -> None:
    tol = C.Tolerance(5, 0)
    assert tol.upper(16_000_000) == 16_800_000
    assert tol.lower(16_000_000) == 15_200_000
    slack = C.Tolerance(5, 1 << 20)
    assert slack.upper(16_000_000) == 16_800_000 + (1 << 20)
    assert slack.lower(16_000_000) == 15_200_000 - (1 << 20)
    # decimal percentages are exact: 0.1% of 1000 is 1, not 0.99999...
    assert C.Tolerance(0.1, 0).upper(1000) == 1001
    assert C.Tolerance(2.5, 0).upper(1000) == 1025
    assert C.Tolerance(5, 0).upper(33) == 34  # floor(1.65)
    assert C.Tolerance(5, 0).lower(33) == 32  # ceil(31.35)
    assert C.Tolerance(0, 0).upper(7) == 7


@pytest.mark.parametrize(
    "tol, slack",
    [(5, 0), (5, 1 << 20), (0, 0), (2.5, 512), (0.1, 0), (37.3, 3)],
)
@pytest.mark.parametrize("stored", [0, 1, 33, 999, 16_000_000, 123_456_789_012])
def test_just_inside_passes_one_byte_over_fails(tol: float, slack: int, stored: int) -> None:
    tolerance = C.Tolerance(tol, slack)
    allowed = tolerance.upper(stored)
    base = entry(peak=stored, phases={"forward": stored})
    inside = C.compare("t", entry(peak=allowed, phases={"forward": allowed}), base, tolerance)
    assert inside.status in (BaselineStatus.OK, BaselineStatus.IMPROVED) and not inside.failed
    assert inside.status == BaselineStatus.OK or allowed < stored
    over = C.compare("t", entry(peak=allowed, phases={"forward": allowed + 1}), base, tolerance)
    assert over.status == BaselineStatus.REGRESSED and over.failed
    assert [c.status for c in over.comparisons] == [BaselineStatus.OK, BaselineStatus.REGRESSED]
    lower = tolerance.lower(stored)
    if lower >= 0:
        at_lower = C.compare("t", entry(peak=stored, phases={"forward": lower}), base, tolerance)
        assert at_lower.status == BaselineStatus.OK
    if lower - 1 >= 0:
        below = C.compare("t", entry(peak=stored, phases={"forward": lower - 1}), base, tolerance)
        assert below.status == BaselineStatus.IMPROVED and not below.failed


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True, "5"])
def test_bad_tolerance_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="tolerance"):
        C.Tolerance(bad, 0)


@pytest.mark.parametrize(("bad", "echo"), [(-1, "-1"), ("1", "'1'"), (True, "True"), (2**63, str(2**63))])
def test_bad_slack_is_refused(bad: object, echo: str) -> None:
    with pytest.raises(ValueError) as refused:
        C.Tolerance(5, bad)  # type: ignore[arg-type]
    assert str(refused.value) == f"slack: expected an integer 0 <= n < 2**63 (bytes), got {echo}"


# ---------------------------------------------------------------------------------------- comparison


def test_regression_message_is_exact() -> None:
    base = entry(peak=16_000_000, phases={"forward": 16_000_000})
    current = entry(peak=16_000_000, phases={"forward": 20_100_000})
    verdict = C.compare("t", current, base, NO_SLACK, fmt=decimal)
    assert verdict.status == BaselineStatus.REGRESSED and verdict.failed
    assert verdict.problems == ("forward peak 20.1 MB is 25.6% above baseline 16.0 MB (tolerance 5%)",)
    assert verdict.failure_message() == verdict.problems[0]
    forward = verdict.comparisons[1]
    assert (forward.phase, forward.baseline, forward.current, forward.allowed) == (
        "forward",
        16_000_000,
        20_100_000,
        16_800_000,
    )
    assert forward.change_percent == pytest.approx(25.625)


def test_regression_message_mentions_slack_and_uses_binary_units_by_default() -> None:
    base = entry(peak=16 << 20, phases={})
    verdict = C.compare("t", entry(peak=24 << 20, phases={}), base)
    assert verdict.problems == ("call peak 24.0 MiB is 50.0% above baseline 16.0 MiB (tolerance 5% + 1.0 MiB)",)


def test_whole_call_and_every_phase_are_compared() -> None:
    base = entry(peak=100_000_000, phases={"forward": 50_000_000, "backward": 80_000_000})
    current = entry(peak=200_000_000, phases={"forward": 50_000_000, "backward": 90_000_000})
    verdict = C.compare("t", current, base, NO_SLACK, fmt=decimal)
    assert [(c.label, c.status) for c in verdict.comparisons] == [
        ("call", BaselineStatus.REGRESSED),
        ("forward", BaselineStatus.OK),
        ("backward", BaselineStatus.REGRESSED),
    ]
    assert len(verdict.problems) == 2
    assert verdict.problems[0].startswith("call peak 200.0 MB is 100.0% above baseline 100.0 MB")


def test_improvement_passes_with_a_note() -> None:
    base = entry(peak=16_000_000, phases={"forward": 16_000_000})
    current = entry(peak=16_000_000, phases={"forward": 12_000_000})
    verdict = C.compare("t", current, base, NO_SLACK, fmt=decimal)
    assert verdict.status == BaselineStatus.IMPROVED and not verdict.failed
    assert verdict.problems == ()
    assert verdict.notes == (
        "forward peak 12.0 MB is 25.0% below baseline 16.0 MB (tolerance 5%): "
        "improved, baseline can be lowered (--gpumem-update)",
    )


def test_regression_wins_over_improvement() -> None:
    base = entry(peak=100, phases={"forward": 100, "backward": 100})
    current = entry(peak=100, phases={"forward": 10, "backward": 200})
    verdict = C.compare("t", current, base, NO_SLACK)
    assert verdict.status == BaselineStatus.REGRESSED and verdict.failed
    assert len(verdict.problems) == 1 and len(verdict.notes) == 1


def test_new_test_passes_unless_strict() -> None:
    verdict = C.compare("t", entry(), None)
    assert verdict.status == BaselineStatus.NEW and not verdict.failed
    assert verdict.notes == (f"no baseline for this test on {H200.key} (record one with --gpumem-update)",)
    assert {c.status for c in verdict.comparisons} == {BaselineStatus.NEW}
    strict = C.compare("t", entry(), None, strict=True)
    assert strict.status == BaselineStatus.NEW and strict.failed and strict.problems == verdict.notes


def test_a_verdict_status_is_its_bare_word_in_text_and_json() -> None:
    verdict = C.compare("t", entry(peak=2000, phases={}), entry(peak=1000, phases={}), NO_SLACK)
    assert (str(verdict.status), f"{verdict.label}") == ("REGRESSED", "REGRESSED")
    assert json.loads(json.dumps(verdict.to_json()))["comparisons"][0]["status"] == "REGRESSED"


def test_report_status_says_missing_baseline_only_when_that_fails() -> None:
    from pytest_gpumem.outcome import verdict_status

    stored = entry(peak=1000, phases={"f": 1000})
    cases = [
        ("NEW", False, C.compare("t", stored, None)),
        ("MISSING BASELINE", True, C.compare("t", stored, None, strict=True)),
        ("MISSING BASELINE", True, C.compare("t", entry(peak=1000, phases={"f": 1000, "g": 1}), stored, strict=True)),
        ("MISSING BASELINE", True, C.compare("t", entry(1000, {"f": 1000}, gradients=grads()), stored, strict=True)),
        ("ok", False, C.compare("t", stored, stored, NO_SLACK, strict=True)),
        ("IMPROVED", False, C.compare("t", entry(peak=500, phases={"f": 1000}), stored, NO_SLACK)),
        ("REGRESSED", True, C.compare("t", entry(peak=2000, phases={"f": 1000}), stored, NO_SLACK)),
    ]
    for status, failed, verdict in cases:
        assert (verdict_status(verdict), verdict.failed) == (status, failed)


def test_new_phase_is_a_note_unless_strict() -> None:
    base = entry(peak=100, phases={"forward": 100})
    current = entry(peak=100, phases={"forward": 100, "optimizer": 50})
    verdict = C.compare("t", current, base, NO_SLACK)
    assert verdict.status == BaselineStatus.OK and not verdict.failed
    assert verdict.notes == ("optimizer peak 50 B has no baseline (record one with --gpumem-update)",)
    assert C.compare("t", current, base, NO_SLACK, strict=True).failed


def test_phase_that_did_not_run_is_a_note() -> None:
    base = entry(peak=100, phases={"forward": 100, "backward": 70})
    verdict = C.compare("t", entry(peak=100, phases={"forward": 100}), base, NO_SLACK)
    assert verdict.status == BaselineStatus.OK and not verdict.failed
    assert verdict.comparisons[-1].status == BaselineStatus.MISSING
    assert verdict.notes == ("backward has a baseline (70 B) but was not measured in this run",)


def test_zero_baseline() -> None:
    base = entry(peak=0, phases={})
    assert C.compare("t", entry(peak=0, phases={}), base, NO_SLACK).status == BaselineStatus.OK
    verdict = C.compare("t", entry(peak=512, phases={}), base, NO_SLACK)
    assert verdict.status == BaselineStatus.REGRESSED
    assert verdict.problems == ("call peak 512 B is 512 B above baseline 0 B (tolerance 5%)",)
    assert verdict.comparisons[0].change_percent is None
    assert C.compare("t", entry(peak=512, phases={}), base, C.Tolerance(5, 512)).status == BaselineStatus.OK


def test_gradients_are_compared_when_both_sides_have_them() -> None:
    base = entry(gradients=grads())
    same = C.compare("t", entry(gradients=grads()), base)
    assert same.gradient_status == BaselineStatus.OK and not same.failed and same.label == BaselineStatus.OK
    changed = C.compare("t", entry(gradients=grads(1.01)), base)
    assert changed.status == BaselineStatus.OK and changed.gradient_status == BaselineStatus.CHANGED and changed.failed
    assert changed.label == BaselineStatus.CHANGED
    assert "gradient 'fc.weight'" in changed.failure_message()
    assert C.compare("t", entry(gradients=grads(1.01)), base, grad_rtol=0.05).gradient_status == BaselineStatus.OK
    new = C.compare("t", entry(gradients=grads()), entry())
    assert new.gradient_status == BaselineStatus.NEW and not new.failed
    assert C.compare("t", entry(gradients=grads()), entry(), strict=True).failed
    gone = C.compare("t", entry(), base)
    assert gone.gradient_status is None and not gone.failed and gone.notes


def test_verdict_and_entry_survive_json(path: Path) -> None:
    verdict = C.compare("t", entry(peak=10**9, gradients=grads(2)), entry(gradients=grads()), NO_SLACK)
    wire = json.loads(json.dumps(verdict.to_json()))
    assert (wire["status"], wire["gradient_status"]) == ("REGRESSED", "CHANGED")
    assert Verdict.from_json(wire) == verdict
    e = entry(gradients=grads())
    assert Entry.from_json(json.loads(json.dumps(e.to_json()))) == e


def test_entry_validates_its_values() -> None:
    with pytest.raises(ValueError, match="peak_bytes"):
        entry(peak=-1)
    with pytest.raises(ValueError, match=r'phases\["f"\]'):
        entry(phases={"f": 1.5})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"identity\.device"):
        DeviceIdentity("cuda", "")
    no_blocks = {"call": PhaseComposition({}, [], {"h.*": 0})}  # a folded group has one block or more
    with pytest.raises(ValueError, match="composition"):
        Entry.measured(TRACKER, ENV, 0, {}, None, no_blocks)


# ------------------------------------------------------------------------------- environment warnings


def test_no_warning_when_versions_match(path: Path) -> None:
    store = BaselineStore(path)
    U.update(store, {"a": entry(), "b": entry()})
    assert C.environment_warnings(store, H200, ENV) == []
    assert C.environment_warnings(BaselineStore(path), H200, ENV) == []


def test_version_mismatch_is_one_warning(path: Path) -> None:
    store = BaselineStore(path)
    old = Environment("2.12.0", "12.4")
    U.update(store, {"a": entry(env=old), "b": entry(env=old), "c": entry(), "d": entry(identity=A100)})
    warnings = C.environment_warnings(store, H200, ENV)
    assert warnings == [
        f"2 of 3 baselines in {path} for {H200.key} were recorded with torch 2.12.0 / CUDA 12.4 (2); "
        "this run uses torch 2.13.0 / CUDA 12.8: peaks can differ between versions "
        "(refresh with --gpumem-update)"
    ]


def test_other_device_only_is_a_warning(path: Path) -> None:
    store = BaselineStore(path)
    U.update(store, {"a": entry(identity=A100), "b": entry(identity=A100), "c": entry(identity=TRACKER)})
    (warning,) = C.environment_warnings(store, H200, ENV)
    assert warning == (
        f"{path} has no baselines for this device ({H200.key}); it has baselines for {A100.key} (2), {TRACKER.key} (1)"
    )


def test_environment_from_torch_module() -> None:
    class Version:
        cuda = "12.8"

    class FakeTorch:
        __version__ = "2.13.0+cu128"
        version = Version

    assert Environment.from_torch(FakeTorch) == Environment("2.13.0+cu128", "12.8")
    assert Environment("2.13.0", None).describe() == "torch 2.13.0 / no CUDA"


# ----------------------------------------------------------------------------------- update and prune


def test_update_records_and_summarises(path: Path) -> None:
    store = sample_store(path)
    F.write(store)
    store = F.load(path)
    untouched = {
        ("tests/test_a.py::test_one", A100.key): store.entries["tests/test_a.py::test_one"][A100.key],
        ("tests/test_a.py::test_zero", H200.key): store.entries["tests/test_a.py::test_zero"][H200.key],
    }
    summary = U.update(
        store,
        {
            "tests/test_a.py::test_one": entry(peak=1234, phases={}),  # same values
            "tests/test_b.py::test_two[bf16-ünïcode]": entry(peak=1, gradients=grads()),
            "tests/test_new.py::test_new": entry(),
        },
    )
    assert summary.added == ["tests/test_new.py::test_new"]
    assert summary.updated == ["tests/test_b.py::test_two[bf16-ünïcode]"]
    assert summary.unchanged == ["tests/test_a.py::test_one"]
    assert summary.removed == []
    assert summary.changed
    assert summary.describe() == "1 added, 1 updated, 1 unchanged, 0 removed"
    for (nodeid, key), value in untouched.items():
        assert store.entries[nodeid][key] is value
    assert store.get("tests/test_b.py::test_two[bf16-ünïcode]", H200) == entry(peak=1, gradients=grads())
    F.write(store)
    reloaded = F.load(path)
    assert reloaded.entries == store.entries


def test_update_without_changes_needs_no_write(path: Path) -> None:
    store = sample_store(path)
    summary = U.update(store, {"tests/test_a.py::test_one": entry(peak=1234, phases={})})
    assert not summary.changed


def test_unused_and_prune_touch_only_this_device(path: Path) -> None:
    store = BaselineStore(path)
    U.update(store, {"a": entry(), "b": entry(), "c": entry(), "d": entry(identity=A100)})
    U.update(store, {"b": entry(identity=A100)})
    stale = U.unused(store, H200, ["a", "x"])
    assert stale == ["b", "c"]
    assert U.unused(store, A100, ["a", "x"]) == ["b", "d"]
    summary = U.update(store, {"a": entry(peak=5)})
    U.prune(store, stale, H200, summary=summary)
    assert summary.removed == ["b", "c"]
    assert summary.describe() == "0 added, 1 updated, 0 unchanged, 2 removed"
    assert sorted(store.entries) == ["a", "b", "d"]
    assert list(store.entries["b"]) == [A100.key]
    assert store.nodeids(H200) == ["a"]
    assert U.unused(store, H200, ["a"]) == []
    assert U.prune(store, ["zzz"], H200).removed == []
    F.write(store)
    assert F.load(path).entries == store.entries


# ----------------------------------------------------------------------------------- import and speed


@pytest.mark.parametrize(
    "modules",
    [
        "pytest_gpumem.baselines.schema, pytest_gpumem.baselines.file, pytest_gpumem.baselines.update, "
        "pytest_gpumem.baselines.compare, pytest_gpumem.results.baseline",
        "pytest_gpumem.gradients.fingerprint, pytest_gpumem.gradients.mismatches, pytest_gpumem.results.gradients",
    ],
    ids=["baselines", "gradients"],
)
def test_baseline_and_gradient_modules_do_not_import_torch(modules: str) -> None:
    code = f"import sys, {modules}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_ten_thousand_entries_round_trip(path: Path) -> None:
    """Correct at scale; the time it takes is a benchmark (benchmarks/scale.py), not a test."""
    n = 10_000
    store = BaselineStore(path)
    U.update(
        store,
        {
            f"tests/test_m{i % 50}.py::test_case[{i}]": entry(
                peak=10_000_000 + i, phases={"forward": 6_000_000 + i, "backward": 9_000_000, "step": 1}
            )
            for i in range(n)
        },
    )
    F.write(store)
    current = {
        nodeid: entry(peak=10_000_000 + i * 200, phases={"forward": 6_000_000, "backward": 9_000_000, "step": 1})
        for i, nodeid in enumerate(sorted(store.entries))
    }
    tol = C.Tolerance()
    loaded = F.load(path)
    C.environment_warnings(loaded, H200, ENV)
    verdicts = [C.compare(nodeid, e, loaded.get(nodeid, H200), tol) for nodeid, e in current.items()]
    summary = U.update(loaded, current)
    F.write(loaded)
    assert len(verdicts) == n and len(summary.updated) + len(summary.unchanged) == n
    assert any(v.status == BaselineStatus.REGRESSED for v in verdicts)
    assert schema.dumps(F.load(path)) == schema.dumps(loaded)


# ------------------------------------------------------------------------------ files written before


BEFORE = Path(__file__).parent / "data" / "written-before-typed-results"
"""A baseline file and a ``--gpumem-json`` report written by pytest-gpumem before results were typed."""


def test_a_baseline_file_written_before_typed_results_loads_and_its_report_is_refused_in_one_line() -> None:
    from pytest_gpumem.errors import GpuMemError
    from pytest_gpumem.results.report_file import read_report

    raw = (BEFORE / DEFAULT_FILENAME).read_bytes()
    store = F.load(BEFORE / DEFAULT_FILENAME)
    assert schema.dumps(store).encode() == raw  # what a user stored reads and writes back byte for byte
    with pytest.raises(GpuMemError) as refused:  # a report is output: the one reader takes today's shape only
        read_report(BEFORE / "report.json")
    assert str(refused.value) == f'{BEFORE / "report.json"}: report has no "commit"'
