"""What a run or the CLI writes survives hostile input: phase names XML cannot carry keep the JUnit file
readable, a write that fails (a full disk, a device) is an error in one line with a non-zero exit, a
picture's Markdown link reads for any folder name, and two reports on one path are refused."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from builders import phase_result

from pytest_gpumem.cli import main
from pytest_gpumem.report.markdown import link_target, markdown
from pytest_gpumem.results import TestResult
from pytest_gpumem.results.baseline import BaselineStatus, PhaseComparison, Verdict
from pytest_gpumem.run import outputs
from pytest_gpumem.run.hand_over import junit_properties

NO_SPACE = os.strerror(28)  # ENOSPC: "No space left on device", what /dev/full answers every write


@pytest.fixture
def full_device(tmp_path: Path) -> Path:
    """A device that refuses every write as a full disk does: /dev/full's twin in `tmp_path` as root (so
    that a writer that replaces the file instead of writing to it cannot replace the machine's own)."""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        device = tmp_path / "full"
        try:
            os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 7))
        except OSError:
            pytest.skip("no device node can be made here")
        return device
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    return Path("/dev/full")


def assert_still_a_device(path: Path) -> None:
    assert stat.S_ISCHR(path.stat().st_mode), f"{path} was replaced by a file"


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", *args)


def no_traceback(result: pytest.RunResult) -> None:
    text = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in text and "Traceback" not in text


# ------------------------------------------------------------------------------------------ JUnit XML

# each character XML cannot carry, and some it can; the expected property name of each (pytest's #xHH)
HOSTILE_PHASES = [
    ("bell\x07", "bell#x07"),
    ("nul\x00", "nul#x00"),
    ("esc\x1b[31mred\x1b[0m", "esc#x1B[31mred#x1B[0m"),
    ("lone \ud800 surrogate", "lone #xD800 surrogate"),
    ("del\x7f", "del#x7F"),
    ("not a char \ufffe", "not a char #xFFFE"),
    ("tab\tnewline\ncr\r", "tab\tnewline\ncr\r"),
    ("ü 日本 \U0001f600 <&>\"'", "ü 日本 \U0001f600 <&>\"'"),
]


def result_with_phases(*names: str) -> TestResult:
    phases = {name: phase_result(name, 64) for name in names}
    return TestResult.of("t.py::test_a", "tracker", "cpu", phase_result("call", 128), phases)


def test_junit_properties_write_what_xml_cannot_carry_as_pytest_does_and_keep_the_rest() -> None:
    properties = junit_properties(result_with_phases(*(name for name, _ in HOSTILE_PHASES)))
    assert properties == [
        ("gpumem_status", "ok"),
        ("gpumem_peak_bytes", "128"),
        *((f"gpumem_peak_bytes[{shown}]", "64") for _, shown in HOSTILE_PHASES),
    ]


def test_junit_xml_of_hostile_phase_names_parses_and_keeps_every_other_character(tracker: pytest.Pytester) -> None:
    names = [name for name, _ in HOSTILE_PHASES]
    tracker.makepyfile(
        test_suite=f"""
        import torch

        def test_phases(gpumem):
            for name in {names!a}:
                with gpumem.phase(name):
                    torch.ones(16)
        """
    )
    result = run(tracker, "--junitxml=junit.xml")
    no_traceback(result)
    result.assert_outcomes(passed=1)
    tree = ElementTree.parse(tracker.path / "junit.xml")
    properties = [(p.get("name"), p.get("value")) for p in tree.iter("property")]
    assert properties == [
        ("gpumem_status", "ok"),
        ("gpumem_peak_bytes", "64"),
        *((f"gpumem_peak_bytes[{shown}]", "64") for _, shown in HOSTILE_PHASES),
    ]


# --------------------------------------------------------------------- writes that fail, in the CLI

TEST = TestResult.of("t::a", "tracker", "cpu", phase_result("call", 100), {"f": phase_result("f", 50)}).to_json()
REPORT = json.dumps({"version": 1, "backend": "tracker", "device": "cpu", "commit": None, "tests": [TEST]})


@pytest.fixture
def report(tmp_path: Path) -> Path:
    path = tmp_path / "a.json"
    path.write_text(REPORT, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(lambda a, out: ["merge", a, "-o", out], id="merge -o"),
        pytest.param(lambda a, out: ["compare", a, a, "--markdown", out], id="compare --markdown"),
    ],
)
def test_a_cli_output_that_cannot_be_written_exits_2_in_one_line_naming_it(
    report: Path, full_device: Path, capsys: pytest.CaptureFixture[str], argv: Callable[[str, str], list[str]]
) -> None:
    args = argv(str(report), str(full_device))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err == f"pytest-gpumem {args[0]}: error: {full_device}: cannot write: {NO_SPACE}\n"
    assert_still_a_device(full_device)


def test_a_full_standard_output_exits_2_in_one_line(report: Path, full_device: Path) -> None:
    with full_device.open("w") as stdout:
        done = subprocess.run(
            [sys.executable, "-m", "pytest_gpumem", "compare", str(report), str(report)],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
    assert done.returncode == 2
    assert done.stderr == f"pytest-gpumem compare: error: standard output: cannot write: {NO_SPACE}\n"


def test_merge_writes_to_a_device_that_takes_it_instead_of_replacing_it(report: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest_gpumem", "merge", str(report), "-o", "/dev/stdout"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    written, said = done.stdout.rstrip("\n").rsplit("\n", 1)
    assert json.loads(written)["tests"] == [TEST]
    assert said == "merged 1 reports, 1 tests, into /dev/stdout"


# -------------------------------------------------------------------------- write_file, the one writer


def test_a_failed_replace_leaves_the_old_file_whole_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "out.json"
    path.write_text("old", encoding="utf-8")

    def full(src: str, dst: str) -> None:
        raise OSError(28, NO_SPACE)

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError) as failed:
        outputs.write_file(path, "new")
    assert (failed.value.strerror, failed.value.filename) == (NO_SPACE, str(path))
    assert path.read_text(encoding="utf-8") == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_a_written_file_keeps_its_mode_a_link_stays_a_link_and_a_surrogate_is_written_escaped(
    tmp_path: Path,
) -> None:
    target, link = tmp_path / "target.md", tmp_path / "link.md"
    target.write_text("old", encoding="utf-8")
    target.chmod(0o640)
    link.symlink_to(target)
    outputs.write_file(link, "phase \ud800 ü")
    assert link.is_symlink() and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert target.read_text(encoding="utf-8") == "phase \\ud800 ü"


def test_a_failed_write_to_a_device_is_named_after_the_device(full_device: Path) -> None:
    with pytest.raises(OSError) as failed:
        outputs.write_file(full_device, "x")
    assert str(failed.value) == f"[Errno 28] {NO_SPACE}: {str(full_device)!r}"
    assert_still_a_device(full_device)


# --------------------------------------------------------------------- writes that fail, in a run

SUITE = """
import pytest, torch

@pytest.mark.max_memory(explain=True)
def test_a(gpumem):
    torch.ones(16)
"""


@pytest.mark.parametrize("flag", ["--gpumem-json", "--gpumem-markdown"])
def test_a_report_that_cannot_be_written_is_one_line_and_fails_the_run(
    tracker: pytest.Pytester, full_device: Path, flag: str
) -> None:
    tracker.makepyfile(test_suite=SUITE)
    result = run(tracker, f"{flag}={full_device}")
    no_traceback(result)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1)
    assert f"gpumem: {flag}: cannot write {full_device}: {NO_SPACE}" in result.stdout.lines
    assert_still_a_device(full_device)


def test_a_picture_that_cannot_be_written_is_one_line_naming_it_and_fails_the_run(
    tracker: pytest.Pytester, full_device: Path
) -> None:
    tracker.makepyfile(test_suite=SUITE)
    folder = tracker.path / "pictures"
    folder.mkdir()
    picture = folder / f"{outputs.file_stem('test_suite.py::test_a')}.html"
    picture.symlink_to(full_device)
    result = run(tracker, "--gpumem-html=pictures")
    no_traceback(result)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1)
    line = f"gpumem: --gpumem-html: cannot write the picture of test_suite.py::test_a: [Errno 28] {NO_SPACE}: "
    assert line + repr(str(picture)) in result.stdout.lines
    assert_still_a_device(full_device)


def test_json_and_markdown_on_one_path_are_refused_before_the_run(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(test_suite=SUITE)
    (tracker.path / "out.json").write_text("kept", encoding="utf-8")
    result = run(tracker, "--gpumem-json=out.json", "--gpumem-markdown=./out.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    path = tracker.path / "out.json"
    assert result.stderr.lines[0] == (
        f"ERROR: --gpumem-json={path} and --gpumem-markdown={path} are one file; give each report its own"
    )
    assert (tracker.path / "out.json").read_text(encoding="utf-8") == "kept"


# ---------------------------------------------------------------------- the picture's Markdown link

FOLDERS = ["pictures a>b", "p (1) <x>", "p#1?%20|\\", "ü 日本", "a:b"]


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_link_target_is_percent_encoded_and_decodes_to_the_path(folder: str) -> None:
    target = link_target(f"{folder}/t.html")
    assert re.fullmatch(r"[A-Za-z0-9/_.~%-]+", target), target
    assert unquote(target) == f"{folder}/t.html"


def test_a_link_target_keeps_a_folder_name_that_is_not_utf8_as_its_bytes() -> None:
    assert link_target(os.fsdecode(b"caf\xe9/t.html")) == "caf%E9/t.html"


def markdown_links(text: str) -> list[str]:
    """The destinations of the links in `text`, as a CommonMark renderer with GitHub's tables reads them."""
    markdown_it = pytest.importorskip("markdown_it")
    html = markdown_it.MarkdownIt("commonmark").enable("table").render(text)
    return re.findall(r'<a href="([^"]*)"', html)


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_picture_link_renders_as_a_link_to_the_picture(tmp_path: Path, folder: str) -> None:
    result = dataclasses.replace(result_with_phases("f"), html_path=f"{folder}/t.html")
    text = markdown([result], False, tmp_path, tmp_path / "reports")
    (href,) = markdown_links(text)
    assert unquote(href) == f"../{folder}/t.html"


def test_a_markdown_picture_link_reaches_the_picture_whatever_the_folder_name(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(test_suite=SUITE)
    (tracker.path / "reports").mkdir()
    result = run(tracker, "--gpumem-html=pictures a>b (1)", "--gpumem-markdown=reports/m.md")
    no_traceback(result)
    result.assert_outcomes(passed=1)
    text = (tracker.path / "reports" / "m.md").read_text(encoding="utf-8")
    stem = outputs.file_stem("test_suite.py::test_a")
    assert f"[picture](<../pictures%20a%3Eb%20%281%29/{stem}.html>)" in text
    (href,) = markdown_links(text)
    assert (tracker.path / "reports" / unquote(href)).resolve().is_file()


# ---------------------------------------------------------------- off-shape reports, read by the CLI

VERDICT = Verdict("t::a", BaselineStatus.OK, (PhaseComparison(None, 100, 100, 110, 0.0, BaselineStatus.OK),), (), ())


def off_shape(change: Callable[[dict[str, Any]], object]) -> str:
    """The report above with a baseline verdict, after `change(its one test)`."""
    test = json.loads(json.dumps({**TEST, "baseline": VERDICT.to_json()}))
    change(test)
    return json.dumps({"version": 1, "backend": "tracker", "device": "cpu", "commit": None, "tests": [test]})


OFF_SHAPE = [
    (lambda t: t["call"].update(peak_bytes="100"), "tests[0].call.peak_bytes must be an integer of bytes, got '100'"),
    (lambda t: t["call"].update(peak_bytes=True), "tests[0].call.peak_bytes must be an integer of bytes, got True"),
    (lambda t: t["call"].update(count=0), "tests[0].call.count must be a count of entries (1 or more), got 0"),
    (lambda t: t["phases"]["f"].update(net_bytes=1.5), "tests[0].phases.f.net_bytes must be an integer of bytes "
     "(negative where freed), got 1.5"),
    (lambda t: t.update(peak_bytes=99), "tests[0].peak_bytes is not as pytest-gpumem writes it, got 99"),
    (lambda t: t.pop("status"), 'tests[0] has no "status"'),
    (lambda t: t.update(extra=1), 'tests[0] has an unknown key "extra"'),
    (lambda t: t.update(status="fine"), "tests[0].status must be a status word as the report writes it ('ok', "),
    (lambda t: t.update(nodeid="t::\x1b[2J"), "tests[0].nodeid must be printable text (no control characters, "),
    (lambda t: t.update(detail=["a", 2]), "tests[0].detail[1] must be a string, got 2"),
    (lambda t: t["baseline"].update(failed="no"), "tests[0].baseline.failed must be true or false, got 'no'"),
    (lambda t: t["baseline"]["comparisons"][0].update(status="BAD"), "tests[0].baseline.comparisons[0].status "
     "must be one of ok, REGRESSED, IMPROVED, NEW, MISSING, CHANGED, got 'BAD'"),
    (lambda t: t.update(record={"identity": {}}), "tests[0].record: missing key 'peak_bytes'"),
    (lambda t: t.update(explanation={"phases": {"call": {"peak_bytes": "1"}}}), 'tests[0].explanation has no "format"'),
    (lambda t: t.update(advice={"rows": 3}), 'tests[0].advice has no "capacity"'),
]  # fmt: skip


@pytest.mark.parametrize(("change", "said"), OFF_SHAPE, ids=[said[:48] for _, said in OFF_SHAPE])
def test_an_off_shape_report_exits_2_naming_the_file_and_the_json_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: Callable[[dict[str, Any]], object], said: str
) -> None:
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(off_shape(lambda _: None), encoding="utf-8")
    bad.write_text(off_shape(change), encoding="utf-8")
    assert main(["compare", str(good), str(good)]) == 0
    capsys.readouterr()
    assert main(["compare", str(good), str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pytest-gpumem compare: error: {bad}: {said}") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("doc", "said"),
    [
        ('{"tests": []}', 'report has no "version"'),
        ('{"version": 2, "backend": null, "device": null, "commit": null, "tests": []}', "version must be 1 "),
        ('{"version": 1, "backend": 1, "device": null, "commit": null, "tests": []}', "backend must be a name or"),
        ('{"version": 1, "backend": null, "device": null, "commit": "HEAD", "tests": []}', 'commit must be {"sha": a '),
        (
            '{"version": 1, "backend": null, "device": null, "commit": null, "tests": {}}',
            "tests must be a list, got {}",
        ),
        ('{"version": 1, "version": 1, "tests": []}', 'cannot read a gpumem report: duplicate key "version"'),
        ('{"version": NaN, "tests": []}', "cannot read a gpumem report: NaN is not a valid JSON number"),
    ],
)
def test_an_off_shape_report_header_exits_2_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], doc: str, said: str
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(doc, encoding="utf-8")
    assert main(["merge", str(bad), "-o", str(tmp_path / "all.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pytest-gpumem merge: error: {bad}: {said}") and err.count("\n") == 1
    assert not (tmp_path / "all.json").exists()
