"""The explanation page: what `render` writes (escaping, file names, tables), and what a browser shows."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from pytest_gpumem.backends.attribution import CATEGORIES as ATTRIBUTED
from pytest_gpumem.backends.attribution import LABELS as ATTRIBUTED_LABELS
from pytest_gpumem.failures import write_evidence
from pytest_gpumem.html import file_stem, render, write_html
from pytest_gpumem.sizes import format_size

CATEGORIES = list(ATTRIBUTED)
LABELS = dict(ATTRIBUTED_LABELS)
MIB = 2**20
HOSTILE = "tests/test_x.py::test[</script><script>document.body.setAttribute('data-pwned','1')</script><!--&\"'>]"


def explanation(
    points: list[list[Any]], peak_index: int, nodeid: str = "tests/test_x.py::test_step[cpu]"
) -> dict[str, Any]:
    """An explanation over `points` whose call peaks at `peak_index`, with a forward and a backward phase."""
    by_index = {index: values for index, values in points}
    events = points[-1][0]
    half = events // 2
    total = sum(by_index[peak_index])
    growth = dict(zip(CATEGORIES, by_index[peak_index], strict=True))
    call = phase(total, peak_index, [[0, events]], growth)
    return {
        "format": "pytest-gpumem explanation 1",
        "nodeid": nodeid,
        "backend": "tracker",
        "categories": CATEGORIES,
        "labels": LABELS,
        "phases": {
            "call": call,
            "forward": phase(total, peak_index, [[0, half]], growth),
            "backward": phase(0, half, [[half, events]], {}),
        },
        "timeline": {"events": events, "points": points},
    }


def phase(peak: int, index: int, spans: list[list[int]], growth: dict[str, int]) -> dict[str, Any]:
    return {
        "peak_bytes": peak,
        "start_bytes": 0,
        "peak_index": index,
        "spans": spans,
        "categories": growth,
        "modules": {"encoder.0": peak // 2, "(no module)": peak - peak // 2},
        "cells": [
            {"category": "saved", "module": "encoder.0", "bytes": growth.get("saved", 0)},
            {"category": "temporaries", "module": "(no module)", "bytes": growth.get("temporaries", 0)},
        ],
        "tensors": [
            {
                "bytes": 2048,
                "dtype": "float32",
                "shape": [16, 32],
                "op": "aten.mm.default",
                "where": "test_x.py:12",
                "module": "encoder.0",
                "category": "saved",
            }
        ],
    }


def spread_peak(index: int, events: int) -> tuple[list[list[Any]], int]:
    """Points where each category alone reaches 1000 MiB somewhere, but the largest stack (a little over
    1100 MiB, odd bytes included) is at `index` and needs all six categories: summing any five, the top
    one only, or taking the largest single category picks another point. Returns (points, the peak)."""
    spread = [(190 + c) * MIB + c for c in range(len(CATEGORIES))]
    points: list[list[Any]] = []
    for i in range(events + 1):
        values = [0] * len(CATEGORIES)
        values[i % len(CATEGORIES)] = 1000 * MIB - (i % 7)
        points.append([i, spread if i == index else values])
    points[-1][1] = [0, 0, 0, 0, 0, 4096]
    return points, sum(spread)


class Element(HTMLParser):
    """The attributes and text of the element with a given id (one holding text only)."""

    def __init__(self, element_id: str) -> None:
        super().__init__()
        self.element_id = element_id
        self.attributes: dict[str, str | None] | None = None
        self.text = ""
        self.inside = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if dict(attrs).get("id") == self.element_id:
            self.attributes, self.inside = dict(attrs), True

    def handle_endtag(self, tag: str) -> None:
        self.inside = False

    def handle_data(self, data: str) -> None:
        if self.inside:
            self.text += data


def element(page: str, element_id: str) -> Element:
    found = Element(element_id)
    found.feed(page)
    assert found.attributes is not None, f"no element #{element_id}"
    return found


def embedded(page: str) -> Any:
    match = re.search(r'<script type="application/json" id="gpumem-data">(.*?)</script>', page, re.S)
    assert match is not None
    return json.loads(match[1])


# --- render and write_html ---------------------------------------------------------------------------------


def test_page_is_one_document_that_loads_nothing() -> None:
    points, _ = spread_peak(8, 20)
    page = render(explanation(points, 8))
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    for loader in ("src=", "href=", "url(", "@import", "<link", "<img", "<iframe"):
        assert loader not in page


def test_hostile_nodeid_stays_text_and_data() -> None:
    points, _ = spread_peak(8, 20)
    page = render(explanation(points, 8, nodeid=HOSTILE))
    assert page.count("<script") == 3 and page.count("</script>") == 3
    assert "<!--" not in page
    assert element(page, "gpumem-test").text == HOSTILE
    assert embedded(page)["nodeid"] == HOSTILE


def test_embedded_data_is_the_explanation() -> None:
    points, _ = spread_peak(8, 20)
    data = explanation(points, 8)
    assert embedded(render(data)) == data


def test_peak_element_is_left_for_the_script() -> None:
    points, _ = spread_peak(8, 20)
    peak = element(render(explanation(points, 8)), "gpumem-peak")
    assert peak.attributes is not None and "data-bytes" not in peak.attributes
    assert "JavaScript" in peak.text


def test_legend_names_every_category_by_its_label() -> None:
    points, _ = spread_peak(8, 20)
    legend = re.search(r'<div id="gpumem-legend">(.*?)</div>', render(explanation(points, 8)), re.S)
    assert legend is not None
    names = re.findall(r"</span>([^<]+)</span>", legend[1])
    assert names == [LABELS[category] for category in reversed(CATEGORIES)]


def test_each_phase_has_a_section_call_first() -> None:
    points, total = spread_peak(8, 20)
    page = render(explanation(points, 8))
    assert re.findall(r'<section class="phase" data-phase="([^"]+)">', page) == ["call", "forward", "backward"]
    call = page.split('data-phase="call"')[1].split("</section>")[0]
    assert f"peak {format_size(total)} above its start" in call
    assert "saved for backward" in call and "encoder.0" in call
    assert '<td class="code">[16, 32]</td>' in call and "aten.mm.default" in call and "test_x.py:12" in call


def test_category_table_adds_up_and_shows_unattributed() -> None:
    points, _ = spread_peak(8, 20)
    data = explanation(points, 8)
    data["phases"]["call"]["categories"] = {"saved": 3 * MIB, "temporaries": MIB}
    data["phases"]["call"]["unattributed_bytes"] = 512
    data["phases"]["call"]["peak_bytes"] = 4 * MIB + 512
    call = render(data).split('data-phase="call"')[1].split("</section>")[0]
    assert 'saved for backward</td><td class="num">3.0 MiB</td><td class="num">75%</td>' in call
    assert 'unattributed</td><td class="num">512 B</td>' in call
    assert 'peak above start</td><td class="num">4.0 MiB</td>' in call


def test_text_in_tables_is_escaped() -> None:
    points, _ = spread_peak(8, 20)
    data = explanation(points, 8)
    data["phases"]["forward"]["modules"] = {"<b>evil</b>": 1}
    data["phases"]["forward"]["tensors"][0]["where"] = "a<b>.py:1"
    page = render(data)
    assert "<b>" not in page.split('<script type="application/json"')[0]
    assert "&lt;b&gt;evil&lt;/b&gt;" in page and "a&lt;b&gt;.py:1" in page


def test_markup_in_every_name_stays_text_and_a_bare_storage_renders() -> None:
    points, _ = spread_peak(8, 20)
    data = explanation(points, 8, nodeid=HOSTILE)
    data["backend"] = data["labels"]["saved"] = HOSTILE
    data["phases"][HOSTILE] = data["phases"].pop("forward")
    tensor = data["phases"]["call"]["tensors"][0]
    tensor.update(op=HOSTILE, module=HOSTILE, dtype=HOSTILE, where=HOSTILE, shape=None)
    data["phases"]["call"]["cells"][0]["module"] = HOSTILE
    page = render(data)
    outside = re.sub(r'<script type="application/json" id="gpumem-[a-z]+">.*?</script>', "", page, flags=re.S)
    assert "<script><" not in outside and "</script><script>" not in outside and "<!--" not in outside
    assert outside.count("<script") == 1  # the page's own
    assert '<td class="code">a storage</td>' in page
    assert embedded(page) == data


def test_a_phase_without_tensors_or_cells_still_renders() -> None:
    data = explanation([[0, [0] * 6], [1, [0, 0, 0, 0, 8, 0]]], 1)
    data["phases"] = {"call": {"peak_bytes": 8, "start_bytes": 0, "peak_index": 1, "spans": [[0, 1]]}}
    page = render(data)
    assert "largest tensors" not in page and "peak 8 B above its start" in page


def test_file_name_is_safe_unique_and_bounded(tmp_path: Path) -> None:
    points, _ = spread_peak(8, 20)
    names = [HOSTILE, HOSTILE + "x", "a/b.py::t[1]", "a/b.py::t[2]", "x" * 5000, "../../etc/passwd", ""]
    paths = [write_html(tmp_path / "pages", explanation(points, 8, nodeid=nodeid)) for nodeid in names]
    assert len(set(paths)) == len(names)
    for path, nodeid in zip(paths, names, strict=True):
        assert path.parent == tmp_path / "pages" and path.is_file()
        assert re.fullmatch(r"[A-Za-z0-9_.-]+\.html", path.name) and len(path.name) <= 140
        assert path.name == file_stem(nodeid) + ".html"
        assert embedded(path.read_text(encoding="utf-8"))["nodeid"] == nodeid


def test_file_name_matches_the_evidence_of_the_same_test(tmp_path: Path) -> None:
    for nodeid in ("tests/test_x.py::test_step[cpu]", HOSTILE, "x" * 500):
        evidence = write_evidence(tmp_path, nodeid, "failed", None, {"format": "pytest-gpumem trace"})
        assert evidence is not None and evidence.stem == file_stem(nodeid)


# --- in a browser ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("needs headless Chromium: apt-get install chromium (the Debian package 'chromium')")
    return path


def shown(chromium: str, page: Path, profile: Path) -> str:
    """The DOM after the page's script ran, as headless Chromium saw it."""
    command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}"]
    result = subprocess.run(
        [*command, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


Case = tuple[dict[str, Any], int, int]
"""An explanation, its peak (the largest stacked total) and the event index where it is reached."""


def spread_case(index: int, events: int, nodeid: str = "tests/test_x.py::test_step[cpu]") -> Case:
    points, total = spread_peak(index, events)
    return explanation(points, index, nodeid), total, index


def half_even_case() -> Case:
    """1.25 MiB: Python prints 1.2 MiB (round half to even), JavaScript's toFixed would print 1.3 MiB."""
    size = MIB + MIB // 4
    points = [[0, [0] * 6], [1, [MIB, 0, 0, 0, MIB // 4, 0]], [5, [MIB, 0, 0, 0, 0, 0]]]
    return explanation(points, 1), size, 1


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(lambda: spread_case(8, 20), id="spread"),
        pytest.param(lambda: spread_case(1217, 5000), id="5000-points"),
        pytest.param(lambda: spread_case(8, 20, HOSTILE), id="hostile-nodeid"),
        pytest.param(half_even_case, id="half-even"),
    ],
)
def test_browser_shows_the_measured_peak(chromium: str, tmp_path: Path, case: Callable[[], Case]) -> None:
    data, total, index = case()
    call = data["phases"]["call"]
    assert call["start_bytes"] + call["peak_bytes"] == total
    dom = shown(chromium, write_html(tmp_path, data), tmp_path / "profile")
    peak = element(dom, "gpumem-peak")
    assert peak.attributes is not None
    assert peak.attributes.get("data-bytes") == str(total)
    assert peak.attributes.get("data-index") == str(index)
    assert f"Peak {format_size(total)} ({total:,} B) live at event {index:,} in forward" in peak.text
    assert element(dom, "gpumem-test").text == data["nodeid"]
    body = re.search(r"<body[^>]*>", dom)
    assert body is not None and "data-pwned" not in body[0]


def test_browser_draws_areas_bands_the_peak_label_and_unattributed(chromium: str, tmp_path: Path) -> None:
    data, total, _ = spread_case(8, 20)
    data["phases"]["call"]["unattributed_bytes"] = 4096
    dom = shown(chromium, write_html(tmp_path, data), tmp_path / "profile")
    assert "the measured peak has 4.0 KiB more, unattributed" in element(dom, "gpumem-peak").text
    chart = dom.split('id="gpumem-chart"')[1].split("</svg>")[0]
    assert chart.count("<path") == len(CATEGORIES)
    assert ">forward</text>" in chart and ">backward</text>" in chart
    assert f"peak {format_size(total)} ({total:,} B) at event 8" in chart
    assert f"saved for backward of encoder.0: {format_size(193 * MIB + 3)}" in chart
