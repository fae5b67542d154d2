"""`pytest-gpumem history --html`: one self-contained page, a chart per top grower with its steps named,
a table of the rest; on scratch git repositories with fixed dates (the helpers of test_history)."""

from __future__ import annotations

import base64
import hashlib
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from test_history import FILE, baselines, commit, creep, make_repo

from pytest_gpumem.cli import main


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return make_repo(tmp_path, monkeypatch)


def page(path: Path) -> ET.Element:
    """The page parsed as XML: it must be well-formed (every element closed, every text escaped)."""
    return ET.fromstring(path.read_text(encoding="utf-8").removeprefix("<!DOCTYPE html>\n"))


def test_the_page_is_well_formed_and_loads_nothing(repo: Path) -> None:
    creep(repo)
    assert main(["history", "--html", "history.html"]) == 0
    text = (repo / "history.html").read_text(encoding="utf-8")
    root = page(repo / "history.html")
    assert re.findall(r"https?://", text) == []
    assert [e.tag for e in root.iter() if e.tag in ("script", "link", "img", "iframe", "object")] == []
    assert not [e for e in root.iter() if "style" in e.attrib or any(a.startswith("on") for a in e.attrib)]
    policy = root.find("head/meta[@http-equiv='Content-Security-Policy']")
    style = root.find("head/style")
    assert policy is not None and style is not None and style.text is not None
    digest = base64.b64encode(hashlib.sha256(style.text.encode()).digest()).decode()
    assert policy.get("content") == f"default-src 'none'; style-src 'sha256-{digest}'"


def test_a_chart_per_top_grower_with_its_steps_named_and_a_table_of_the_rest(repo: Path) -> None:
    shorts = []
    for day in range(1, 6):  # test_k grows by k% of 100 kB in each commit after the first; test_0 never does
        peaks = {f"t.py::test_{k}": 100_000 + (day - 1) * k * 1000 for k in range(5)}
        shorts.append(commit(repo, baselines(peaks), f"change {day}", day))
    assert main(["history", "--html", "history.html", "--top", "2"]) == 0
    root = page(repo / "history.html")
    charts = root.findall(".//section[@class='test']")
    assert [c.findtext("h2/span[@class='code']") for c in charts] == ["t.py::test_4", "t.py::test_3"]
    panels = charts[0].findall(".//figure")
    assert [p.findtext("figcaption/b") for p in panels] == ["call", "forward"]
    assert "".join(panels[0].itertext()).startswith("call 97.7 KiB -> 113.3 KiB (+16.0%, 4 steps)")
    steps = [g.findtext("title") for g in panels[0].findall(".//g[@class='step']")]
    assert steps == [f"{s} 2026-11-0{d} change {d}\ncall: {a} -> {b} (+3.9 KiB)" for s, d, a, b in [
        (shorts[1], 2, "97.7 KiB", "101.6 KiB"), (shorts[2], 3, "101.6 KiB", "105.5 KiB"),
        (shorts[3], 4, "105.5 KiB", "109.4 KiB"), (shorts[4], 5, "109.4 KiB", "113.3 KiB")]]  # fmt: skip
    labels = [g.findtext("text") for g in panels[0].findall(".//g[@class='commit']")]
    assert labels[0] == shorts[0] and set(labels) <= set(shorts)
    table = charts[0].findall(".//details/table/tr")[1:]
    assert ["".join(td.itertext()) for td in table[0]] == [
        shorts[1],
        "2026-11-02",
        "change 2",
        "call +3.9 KiB, forward +2.0 KiB",
    ]
    rest = root.findall(".//section[@class='rest']/table/tr")[1:]
    assert [tr[0].text for tr in rest] == ["t.py::test_2", "t.py::test_1", "t.py::test_0"]


def test_a_test_over_the_gate_says_so_on_the_page(repo: Path) -> None:
    creep(repo)
    assert main(["history", "--html", "history.html", "--max-growth", "20", "--slack", "0"]) == 1
    badge = page(repo / "history.html").find(".//section[@class='test']/h2/span[@class='over']")
    assert badge is not None and badge.text == "grew more than 20%: call, forward"


def test_html_that_cannot_be_written_is_one_line_and_exit_2(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    creep(repo)
    assert main(["history", "--html", "missing/history.html"]) == 2
    assert capsys.readouterr().err == (
        "pytest-gpumem history: error: missing/history.html: cannot write: No such file or directory\n"
    )
    assert main(["history", "--html", "."]) == 2
    assert capsys.readouterr().err == "pytest-gpumem history: error: .: cannot write: Is a directory\n"


@pytest.mark.parametrize("flag", ["--html", "--json", "--markdown"])
def test_an_output_aimed_at_the_baseline_file_is_refused(
    repo: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    creep(repo)
    before = (repo / FILE).read_bytes()
    assert main(["history", flag, f"./{FILE}"]) == 2
    assert capsys.readouterr() == ("", (
        f"pytest-gpumem history: error: {flag} {FILE} is the baseline file history reads; write the output elsewhere\n"
    ))  # fmt: skip
    assert (repo / FILE).read_bytes() == before
