"""Bad or odd input is refused in one line or carried whole: table cells with pipes and newlines,
hand-edited baseline files, hostile marker arguments and option values, hostile reports, huge figures."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest
from builders import BASELINES, assert_one_line_failure, phase_result, run, strict_json

from pytest_gpumem import values
from pytest_gpumem.baselines.schema import BaselineError, dumps, loads
from pytest_gpumem.budget import budget_from_marker
from pytest_gpumem.cli import main
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.report.markdown import markdown
from pytest_gpumem.report.terminal import table
from pytest_gpumem.results import Status, TestResult

# -------------------------------------------------------------------------------------- table cells


def hostile_result() -> TestResult:
    phases = {name: phase_result(name, 1024) for name in ("fwd|bwd", "two\nlines")}
    return TestResult.of(
        "test_x.py::test_it[a|b]",
        "tracker",
        "cpu",
        phase_result("call", 2048),
        phases,
        budget_text="fwd|bwd=1 MiB",
        status=Status.OK,
    )


def unescaped_pipes(line: str) -> int:
    return len(re.findall(r"(?<!\\)\|", line))


def table_lines(markdown_text: str) -> list[str]:
    """The Markdown summary's table, below its headline."""
    return [line for line in markdown_text.splitlines() if line.startswith("|")]


def check_markdown(text: str) -> None:
    lines = table_lines(text)
    assert len(lines) == 3
    assert len({unescaped_pipes(line) for line in lines}) == 1
    assert "fwd\\|bwd" in lines[0] and "two lines" in lines[0]
    assert "test_it[a\\|b]" in lines[2] and "fwd\\|bwd=1 MiB" in lines[2]


def test_markdown_cells_escape_pipes_and_newlines() -> None:
    check_markdown(markdown([hostile_result()]))


def test_text_table_keeps_one_line_per_row() -> None:
    lines = table([hostile_result()]).splitlines()
    assert len(lines) == 3
    assert "fwd|bwd" in lines[0] and "two lines" in lines[0]


def test_markdown_and_report_of_hostile_phase_names(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        test_suite="""
        import pytest, torch

        @pytest.mark.max_memory(**{"fwd|bwd": "1 MiB"})
        @pytest.mark.parametrize("p", ["a|b"])
        def test_it(gpumem, p):
            with gpumem.phase("fwd|bwd"):
                torch.ones(256)
            with gpumem.phase("two\\nlines"):
                torch.ones(256)
        """
    )
    result = run(tracker, "--gpumem-markdown=m.md", "--gpumem-report")
    result.assert_outcomes(passed=1)
    lines = table_lines((tracker.path / "m.md").read_text())
    assert len(lines) == 3 and len({unescaped_pipes(line) for line in lines}) == 1
    assert "fwd\\|bwd" in lines[0] and "two lines" in lines[0]
    assert "test_it[a\\|b]" in lines[2]
    result.stdout.fnmatch_lines(["test *fwd|bwd*two lines*call peak*"])
    result.stdout.no_fnmatch_line("lines *")


# ----------------------------------------------------------- baseline files, hand-edited (fast, no pytest run)

ENTRY: dict[str, Any] = {
    "identity": {"backend": "tracker", "device": "cpu", "capability": None, "total_memory": None},
    "peak_bytes": 400,
    "phases": {},
    "torch": "2.13.0",
    "cuda": None,
}
STATS: dict[str, Any] = {"l2": 1.0, "l1": 1.0, "sum": 1.0, "max_abs": 1.0, "proj": [1.0]}


def baseline_text(nodeid: str = "t.py::test_a", entry: dict[str, Any] | None = None, **gradient: object) -> str:
    data = dict(entry or ENTRY)
    if gradient:
        grad = {**STATS, **gradient}
        data["gradients"] = {"method": "m", "params": {"w": {"shape": [3], "dtype": "float32", "grad": grad}}}
    doc = {"schema": "pytest-gpumem-baselines", "version": 1, "entries": {nodeid: {"tracker | cpu": data}}}
    return json.dumps(doc)


BAD_BASELINES = [
    ("a 400-digit gradient figure", baseline_text(l2=10**400), "l2: a number beyond the float range (an integer of"),
    ("a float past the range", baseline_text(sum=1.0).replace('"sum": 1.0', '"sum": 1e400'), "sum: a number beyond"),
    ("a huge projection", baseline_text(proj=[2**1024]), "proj[0]: a number beyond the float range"),
    ("an empty projection", baseline_text(proj=[]), "proj: expected a non-empty list"),
    ("a string statistic", baseline_text(max_abs="big"), "max_abs: expected a number"),
    ("a 5000-digit peak", baseline_text().replace('"peak_bytes": 400', '"peak_bytes": ' + "9" * 5000), "digits"),
    ("a peak of 2**63", baseline_text(entry={**ENTRY, "peak_bytes": 2**63}), "peak_bytes: expected an integer"),
    ("a NaN peak", baseline_text().replace('"peak_bytes": 400', '"peak_bytes": NaN'), "NaN is not a valid JSON"),
    ("Infinity", baseline_text().replace('"peak_bytes": 400', '"peak_bytes": -Infinity'), "-Infinity is not a"),
    ("a lone surrogate", baseline_text(nodeid="t.py::\ud800"), "lone surrogate"),
    ("a control character", baseline_text(nodeid="t.py::a\x00b"), 'node id "t.py::a\\u0000b" holds a control'),
    ("a newline in a node id", baseline_text(nodeid="t.py::a\nb"), "holds a control character"),
    ("nesting", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("a 400-digit version", baseline_text().replace('"version": 1', '"version": ' + "9" * 400), "an integer of 400"),
    ("a truncated file", baseline_text()[:-7], "(truncated?)"),
    ("a duplicate key", baseline_text().replace('"version": 1', '"version": 1, "version": 1'), 'duplicate key "vers'),
    ("a huge shape", baseline_text(l2=1.0).replace('"shape": [3]', '"shape": [' + "9" * 30 + "]"), "shape: expected"),
]


@pytest.mark.parametrize(("text", "problem"), [c[1:] for c in BAD_BASELINES], ids=[c[0] for c in BAD_BASELINES])
def test_a_hand_edited_baseline_file_is_refused_in_one_line_naming_it(text: str, problem: str) -> None:
    with pytest.raises(BaselineError) as refused:
        loads(text, "ci/gpumem-baselines.json")
    message = str(refused.value)
    assert message.startswith("baseline file ci/gpumem-baselines.json: ")
    assert problem in message
    assert len(message.splitlines()) == 1 and len(message) < 250


def test_unicode_node_ids_and_an_escaped_pair_round_trip() -> None:
    ids = ["t.py::test[ü\u2028]", "t.py::test[\U0001f600]"]
    text = "\n".join(baseline_text(nodeid=i) for i in ids[:1]).replace("\\u00fc", "ü")
    store = loads(text)
    store2 = loads(baseline_text(nodeid=ids[1]))  # json.dumps writes the emoji as an escaped surrogate pair
    assert list(store.entries) == ids[:1] and list(store2.entries) == ids[1:]
    assert loads(dumps(store2)).entries.keys() == store2.entries.keys()


# --------------------------------------------------- sizes, markers and option values (fast, no pytest run)

HUGE = 10**5000  # past Python's 4,300-digit limit for str(int)


@pytest.mark.parametrize(
    ("args", "kwargs", "problem"),
    [
        ((HUGE,), {}, "max_memory limit: size must be below 2**63 bytes, got an integer of 5,001 digits"),
        ((-HUGE,), {}, "size must not be negative, got a negative integer of 5,001 digits"),
        ((), {"tolerance": HUGE}, "max_memory tolerance: must be between 0 and 1000 percent, got an integer of 5,001"),
        ((), {"leak": HUGE}, "max_memory leak=: size must be below 2**63 bytes, got an integer of 5,001 digits"),
        ((), {"capacity": float("nan")}, "size must be an int (bytes) or a string like '64 MiB', got nan"),
        (("1 GiB" * 100,), {}, "size text must be at most 100 characters, got '1 GiB1 GiB1"),
        ((HUGE, 1), {}, "max_memory takes one positional limit, got 2: <a tuple whose repr raised>"),
        ((), {"tolerance": float("nan")}, "must be between 0 and 1000 percent, got nan"),
        ((), {"forward": "1e400 B"}, "max_memory forward=: cannot read size '1e400 B'"),
    ],
)
def test_a_hostile_marker_argument_is_one_short_line(
    args: tuple[Any, ...], kwargs: dict[str, Any], problem: str
) -> None:
    with pytest.raises(GpuMemError) as refused:
        budget_from_marker(args, kwargs)
    assert problem in str(refused.value)
    assert len(str(refused.value)) < 200


@pytest.mark.parametrize(
    ("parse", "value", "problem"),
    [
        ("devices_spec", "٣", "invalid devices '٣' (auto, or ordinals like 0,1)"),  # a digit, not an ASCII one
        ("devices_spec", "²", "invalid devices '²'"),
        ("devices_spec", "9" * 5000, "(5,000 characters) (auto, or ordinals like 0,1)"),
        ("devices_spec", "0,,1", "invalid devices '0,,1'"),
        ("devices_spec", "1,1", "a device is named twice"),
        ("tolerance", "9" * 5000, "invalid tolerance '99999"),
        ("tolerance", "nan", "invalid tolerance 'nan' (between 0 and 1000 percent)"),
        ("default_budget", "9" * 5000, "size text must be at most 100 characters"),
        ("default_budget", "0", "a limit must be above zero, got '0'"),
        ("default_budget", "-1 MB", "size must not be negative"),
        ("slack", "lots", "invalid slack 'lots': cannot read size 'lots'"),
        ("seconds", "1e400", "invalid timeout '1e400' (a number of seconds above 0)"),
        ("update_mode", "NEW", "invalid mode 'NEW' (new or all;"),
    ],
)
def test_a_hostile_option_value_is_one_short_line(parse: str, value: str, problem: str) -> None:
    function = getattr(values, parse)
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        function(value)
    assert problem in str(refused.value)
    assert len(str(refused.value)) < 250


# ------------------------------------------------------- pytest-gpumem compare | merge (in process, fast)


def entry(nodeid: str = "t::a", peak: int = 100) -> dict[str, Any]:
    """A test's entry as --gpumem-json writes it: a call that peaked at `peak` bytes, a phase "f" at 50."""
    return TestResult.of(nodeid, "tracker", "cpu", phase_result("call", peak), {"f": phase_result("f", 50)}).to_json()


TEST = entry()


def report_text(*tests: dict[str, Any], **top: object) -> str:
    doc = {"version": 1, "backend": "tracker", "device": "cpu", "commit": None, "tests": list(tests), **top}
    return json.dumps(doc)


BAD_REPORTS = [
    ("newer", report_text(TEST, version=2), "version must be 1 (the report version this pytest-gpumem reads), got 2"),
    ("version text", report_text(TEST, version="1"), "version must be 1 (the report version this pytest-gpumem"),
    ("status list", report_text({**TEST, "status": ["x"]}), "tests[0].status must be a status word as the report"),
    ("phase number", report_text({**TEST, "phases": {"f": 5}}), "tests[0].phases.f must be an object, got 5"),
    ("phase text", report_text({**TEST, "phases": {"f": {**TEST["call"], "peak_bytes": "x"}}}), ".f.peak_bytes must"),
    ("surrogate", report_text({**TEST, "nodeid": "t::\ud800"}), "tests[0].nodeid must be printable text"),
    ("newline", report_text({**TEST, "nodeid": "t::a\nb"}), "tests[0].nodeid must be printable text"),
    ("duplicate key", report_text(TEST).replace('"version": 1', '"version": 1, "version": 1'), 'duplicate key "ver'),
    ("NaN", report_text(TEST).replace('"peak_bytes": 50', '"peak_bytes": NaN'), "NaN is not a valid JSON number"),
    ("1e999", report_text({**TEST, "info": {"x": "inf"}}).replace('"inf"', "1e999"), "'1e999' is out of range of a"),
    ("nesting", '{"tests": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ("5000 digits", report_text(TEST).replace("100", "9" * 5000), "cannot read a gpumem report: Exceeds the limit"),
    ("twice", report_text(TEST, entry(peak=1)), 'tests[1]: "t::a" appears twice with different figures'),
    ("backend list", report_text({**TEST, "backend": ["x"]}), "tests[0].backend must be a backend's name, got ['x']"),
    ("device object", report_text(TEST, device={"a": 1}), "device must be a name or null, got {'a': 1}"),
    ("phases null", report_text({**TEST, "phases": None}), "tests[0].phases must be an object, got None"),
]


@pytest.mark.parametrize(("text", "problem"), [c[1:] for c in BAD_REPORTS], ids=[c[0] for c in BAD_REPORTS])
def test_a_hostile_report_exits_2_in_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, problem: str
) -> None:
    bad, good = tmp_path / "bad.json", tmp_path / "good.json"
    bad.write_text(text, encoding="utf-8", errors="surrogatepass")
    good.write_text(report_text(TEST), encoding="utf-8")
    for argv in (["compare", str(good), str(bad)], ["merge", str(good), str(bad), "-o", str(tmp_path / "all.json")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"pytest-gpumem {argv[0]}: error: {bad}: "), err
        assert problem in err and len(err.splitlines()) == 1 and len(err) < 300
    assert not (tmp_path / "all.json").exists()


def test_a_report_with_a_bom_and_unicode_ids_is_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text("\ufeff" + report_text(entry("t::ü\U0001f600")), encoding="utf-8")
    new.write_text(report_text(entry("t::ü\U0001f600", 2 << 20)), encoding="utf-8")
    assert main(["compare", str(old), str(new)]) == 1  # 2 MiB against 100 B: beyond 5% + 1 MiB
    assert "regressed: t::ü\U0001f600: call peak 2.0 MiB" in capsys.readouterr().out


@pytest.mark.parametrize("link", [False, True])
@pytest.mark.parametrize("command", ["compare", "merge"])
def test_output_onto_an_input_is_refused_and_the_input_kept(tmp_path: Path, command: str, link: bool) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(report_text(TEST), encoding="utf-8")
    b.write_text(report_text({**TEST, "nodeid": "t::b"}), encoding="utf-8")
    before = a.read_bytes()
    output = a
    if link:
        output = tmp_path / "link.json"
        output.symlink_to(a)
    argv = ["compare", str(a), str(b), "--markdown", str(output)] if command == "compare" else []
    argv = argv or ["merge", str(a), str(b), "-o", str(output)]
    assert main(argv) == 2
    assert a.read_bytes() == before


# ---------------------------------------------------------------------------- through pytest (few runs)


def test_a_400_digit_gradient_figure_stops_the_run_with_exit_4_and_keeps_the_file(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(test_a="def test_a(gpumem):\n    pass\n")
    stored = baseline_text(nodeid="test_a.py::test_a", l2=10**400)
    (tracker.path / BASELINES).write_text(stored, encoding="utf-8")
    result = run(tracker, "--gpumem-update")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: baseline file */{BASELINES}: *l2: a number beyond the float range*"])
    assert (tracker.path / BASELINES).read_text(encoding="utf-8") == stored
    assert_one_line_failure(result)


def test_a_limit_of_5001_digits_fails_its_test_in_one_line_also_into_the_json(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(test_a="import pytest\n\n@pytest.mark.max_memory(10 ** 5000)\ndef test_huge():\n    pass\n")
    result = run(tracker, "--gpumem-json=out.json", "--gpumem-report")
    result.assert_outcomes(failed=1)
    line = "test_a.py::test_huge: max_memory limit: size must be below 2**63 bytes, got an integer of 5,001 digits"
    result.stdout.fnmatch_lines([line])
    assert strict_json((tracker.path / "out.json").read_text())["tests"][0]["message"] == line
    assert_one_line_failure(result)


def test_hypothesis_health_check_shows_no_plugin_frames(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        test_h="""
        from hypothesis import given, strategies as st

        @given(st.integers(1, 3))
        def test_h(gpumem, n):
            pass

        def test_own_failure(gpumem):
            assert 1 == 2
        """
    )
    result = run(tracker)
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*FailedHealthCheck*function-scoped fixture 'gpumem'*", "*def test_own_failure*"])
    result.stdout.no_fnmatch_line("*pytest_gpumem/*")  # no frame of ours (the fixture's repr is the test's)
    result.stdout.no_fnmatch_line("*_measured*")
