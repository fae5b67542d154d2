"""The explanation page: what `render` writes (escaping, file names, tables), and what a browser shows."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from pytest_gpumem.backends.tracker.attribution import CATEGORIES as ATTRIBUTED
from pytest_gpumem.backends.tracker.attribution import LABELS as ATTRIBUTED_LABELS
from pytest_gpumem.backends.tracker.attribution import NO_MODULE
from pytest_gpumem.report.html import byte_ticks, chart_texts, event_ticks, render
from pytest_gpumem.results.advice import AS_IS, Advice, PhasePeak, Row
from pytest_gpumem.results.explanation import Cell, Explanation, PhaseExplanation, Point, Tensor, Timeline
from pytest_gpumem.run.outputs import write_evidence, write_picture
from pytest_gpumem.sizes import format_size

CATEGORIES = list(ATTRIBUTED)
LABELS = dict(ATTRIBUTED_LABELS)
MIB = 2**20
HOSTILE = "tests/test_x.py::test[</script><script>document.body.setAttribute('data-pwned','1')</script><!--&\"'>]"
TENSOR = Tensor(2048, "float32", (16, 32), "aten.mm.default", "test_x.py:12", "encoder.0", "saved")


def explanation(
    points: list[list[Any]], peak_index: int, nodeid: str = "tests/test_x.py::test_step[cpu]"
) -> Explanation:
    """An explanation over `points` whose call peaks at `peak_index`, with a forward and a backward phase."""
    by_index = {index: values for index, values in points}
    events = points[-1][0]
    half = events // 2
    total = sum(by_index[peak_index])
    growth = dict(zip(CATEGORIES, by_index[peak_index], strict=True))
    return Explanation(
        nodeid=nodeid,
        backend="tracker",
        categories=CATEGORIES,
        labels=dict(LABELS),
        phases={
            "call": phase(total, peak_index, [(0, events)], growth),
            "forward": phase(total, peak_index, [(0, half)], growth),
            "backward": phase(0, half, [(half, events)], {}),
        },
        timeline=Timeline(events, [Point(index, list(values)) for index, values in points]),
    )


def phase(peak: int, index: int, spans: list[tuple[int, int]], growth: dict[str, int]) -> PhaseExplanation:
    return PhaseExplanation(
        peak_bytes=peak,
        categories=growth,
        modules={"encoder.0": peak // 2, NO_MODULE: peak - peak // 2},
        cells=[
            Cell("saved", "encoder.0", growth.get("saved", 0)),
            Cell("temporaries", NO_MODULE, growth.get("temporaries", 0)),
        ],
        tensors=[TENSOR],
        peak_index=index,
        spans=spans,
    )


def changed(data: Explanation, name: str, **changes: Any) -> Explanation:
    """`data` with phase `name` changed as given."""
    return replace(data, phases={**data.phases, name: replace(data.phases[name], **changes)})


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


# --- render and write_picture ---------------------------------------------------------------------------------


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
    assert Explanation.from_json(embedded(render(data))) == data


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
    categories = {"saved": 3 * MIB, "temporaries": MIB}
    data = changed(
        explanation(points, 8), "call", categories=categories, unattributed_bytes=512, peak_bytes=4 * MIB + 512
    )
    call = render(data).split('data-phase="call"')[1].split("</section>")[0]
    assert 'saved for backward</td><td class="num">3.0 MiB</td><td class="num">75%</td>' in call
    assert 'unattributed</td><td class="num">512 B</td>' in call
    assert 'peak above start</td><td class="num">4.0 MiB</td>' in call


def test_text_in_tables_is_escaped() -> None:
    points, _ = spread_peak(8, 20)
    data = changed(
        explanation(points, 8), "forward", modules={"<b>evil</b>": 1}, tensors=[replace(TENSOR, where="a<b>.py:1")]
    )
    page = render(data)
    assert "<b>" not in page.split('<script type="application/json"')[0]
    assert "&lt;b&gt;evil&lt;/b&gt;" in page and "a&lt;b&gt;.py:1" in page


def test_markup_in_every_name_stays_text_and_a_bare_storage_renders() -> None:
    points, _ = spread_peak(8, 20)
    data = explanation(points, 8, nodeid=HOSTILE)
    phases = {name: phase for name, phase in data.phases.items() if name != "forward"}
    data = replace(
        data, backend=HOSTILE, labels={**LABELS, "saved": HOSTILE}, phases={**phases, HOSTILE: data.phases["forward"]}
    )
    call = data.phases["call"]
    tensor = replace(TENSOR, op=HOSTILE, module=HOSTILE, dtype=HOSTILE, where=HOSTILE, shape=None)
    data = changed(data, "call", tensors=[tensor], cells=[replace(call.cells[0], module=HOSTILE), *call.cells[1:]])
    page = render(data)
    outside = re.sub(r'<script type="application/json" id="gpumem-[a-z]+">.*?</script>', "", page, flags=re.S)
    assert "<script><" not in outside and "</script><script>" not in outside and "<!--" not in outside
    assert outside.count("<script") == 1  # the page's own
    assert '<td class="code">a storage</td>' in page
    assert Explanation.from_json(embedded(page)) == data


def test_a_phase_without_tensors_or_cells_still_renders() -> None:
    data = explanation([[0, [0] * 6], [1, [0, 0, 0, 0, 8, 0]]], 1)
    bare = PhaseExplanation(8, categories={}, modules={}, cells=[], tensors=[], peak_index=1, spans=[(0, 1)])
    page = render(replace(data, phases={"call": bare}))
    assert "largest tensors" not in page and "peak 8 B above its start" in page


def test_the_byte_axis_steps_roundly_in_the_largest_unit_reached() -> None:
    assert [label for _, label in byte_ticks(3 * MIB)] == ["0 MiB", "1 MiB", "2 MiB", "3 MiB"]
    assert [label for _, label in byte_ticks(1000)] == ["0 B", "200 B", "400 B", "600 B", "800 B", "1000 B"]
    assert [label for _, label in byte_ticks(2048)][:3] == ["0 KiB", "0.5 KiB", "1 KiB"]


def test_the_event_axis_steps_roundly_in_whole_events() -> None:
    assert event_ticks(20) == [[0, "0"], [5, "5"], [10, "10"], [15, "15"], [20, "20"]]
    assert [label for _, label in event_ticks(5000)] == ["0", "1,000", "2,000", "3,000", "4,000", "5,000"]
    assert event_ticks(1) == [[0, "0"], [1, "1"]]


def test_the_script_gets_every_size_formatted_by_python() -> None:
    """1.25 MiB is 1.2 MiB (Python rounds half to even); the call started with 1 KiB live."""
    data = explanation([[0, [0] * 6], [1, [MIB, 0, 0, 0, MIB // 4, 0]], [5, [MIB, 0, 0, 0, 0, 0]]], 1)
    texts = chart_texts(changed(data, "call", start_bytes=1024))
    assert texts["points"][1] == [
        "1.2 MiB",
        f"{MIB + MIB // 4:,}",
        "1.2 MiB",
        ["1.0 MiB", "0 B", "0 B", "0 B", "256.0 KiB", "0 B"],
    ]
    assert texts["start"] == "1.0 KiB" and texts["unattributed"] == ""
    assert texts["contributors"] == ["temporaries of (outside modules): 256.0 KiB"]  # the call's cells that grew
    assert texts["tensors"]["call"] == [
        "[16, 32] float32 2.0 KiB saved for backward, aten.mm.default at test_x.py:12 in encoder.0"
    ]
    assert texts["x_max"] == 5 and [label for _, label in texts["x_ticks"]] == ["0", "1", "2", "3", "4", "5"]


def test_file_name_is_safe_unique_and_bounded(tmp_path: Path) -> None:
    points, _ = spread_peak(8, 20)
    names = [HOSTILE, HOSTILE + "x", "a/b.py::t[1]", "a/b.py::t[2]", "x" * 5000, "../../etc/passwd", ""]
    paths = [write_picture(tmp_path / "pages", explanation(points, 8, nodeid=nodeid)) for nodeid in names]
    assert len(set(paths)) == len(names)
    for path, nodeid in zip(paths, names, strict=True):
        assert path.parent == tmp_path / "pages" and path.is_file()
        assert re.fullmatch(r"[A-Za-z0-9_.-]+\.html", path.name) and len(path.name) <= 140
        assert embedded(path.read_text(encoding="utf-8"))["nodeid"] == nodeid


def test_file_name_matches_the_evidence_of_the_same_test(tmp_path: Path) -> None:
    points, _ = spread_peak(8, 20)
    for nodeid in ("tests/test_x.py::test_step[cpu]", HOSTILE, "x" * 500):
        evidence = write_evidence(tmp_path, nodeid, "failed", None, {"format": "pytest-gpumem trace"})
        page = write_picture(tmp_path, explanation(points, 8, nodeid=nodeid))
        assert evidence is not None and evidence.stem == page.stem and evidence.suffix == ".json"


# --- the advice table ---------------------------------------------------------------------------------------

EQUAL = "equal (error 0e+00 <= 1e-04)"
MARKUP = "needs <b>cuda</b></script><script>document.body.setAttribute('data-pwned','1')</script><!--&"


def advice(capacity: int | None = 16 * MIB) -> Advice:
    """8 MiB live at the step's start; peaks above it: as-is 10 MiB, checkpointing 9 MiB (+31% of 100
    FLOPs), the fused step 7 MiB (no extra compute: 8 + 7 = 15 MiB, the only one that fits 16 MiB with
    equal gradients), bf16 4 MiB but its gradients differ; save-on-cpu skipped."""

    def measured(name: str, forward: int, backward: int, extra: int, **rest: Any) -> Row:
        phases = (PhasePeak("forward", forward * MIB, forward * MIB), PhasePeak("backward", MIB, backward * MIB))
        peak = max(forward, backward) * MIB
        fits = None if capacity is None else 8 * MIB + peak <= capacity
        return Row(name, f"doing {name}", (name,), peak, phases, 10 * MIB - peak, 100 + extra, extra, **rest, fits=fits)

    rows = (
        measured(AS_IS, 6, 10, 0, gradients=EQUAL, gradients_equal=True),
        measured("checkpoint-blocks", 3, 9, 31, gradients=EQUAL, gradients_equal=True),
        measured("fused-step", 6, 7, 0, gradients=EQUAL, gradients_equal=True),
        measured("bf16-autocast", 3, 4, 0, gradients="differ (error 1e-01 > 6e-02)", gradients_equal=False),
        Row("save-on-cpu", "saved activations on the host", ("save-on-cpu",), skipped=MARKUP),
    )
    conflicts = ("checkpoint-blocks and <checkpoint-every-2>: both wrap the blocks' forward",)
    return Advice(rows, capacity, 8 * MIB, "tracker", "cpu", 6 * MIB, conflicts, 1.25)


class Rows(HTMLParser):
    """Each row of the tables whose class is given: its attributes and its cells' text."""

    def __init__(self, table_class: str) -> None:
        super().__init__()
        self.table_class, self.inside = table_class, False
        self.rows: list[tuple[dict[str, str | None], list[str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self.inside = dict(attrs).get("class") == self.table_class
        elif self.inside and tag == "tr":
            self.rows.append((dict(attrs), []))
        elif self.inside and tag in ("td", "th"):
            self.rows[-1][1].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self.inside = False

    def handle_data(self, data: str) -> None:
        if self.inside and self.rows and self.rows[-1][1]:
            self.rows[-1][1][-1] += data


def rows(page: str, table_class: str) -> list[tuple[dict[str, str | None], list[str]]]:
    found = Rows(table_class)
    found.feed(page)
    return found.rows


def advice_page(data: Advice | None) -> str:
    points, _ = spread_peak(8, 20)
    return render(explanation(points, 8), data)


def advice_summary(page: str) -> str:
    return element(page, "gpumem-advice-summary").text


def test_advice_table_shows_each_measured_strategy_and_marks_the_best() -> None:
    page = advice_page(advice())
    head, *table = rows(page, "advice")
    assert head[1] == [
        "strategy", "peak", "above the start", "peak in", "each phase's peak", "saves vs as-is", "extra compute",
        "gradients", "fits",
    ]  # fmt: skip
    assert [cells for _, cells in table] == [
        ["as-is" "doing as-is", "18.0 MiB", "+10.0 MiB", "backward", "forward 14.0 MiB, backward 18.0 MiB", "",
         "no extra compute", EQUAL, "no"],
        ["checkpoint-blocks" "doing checkpoint-blocks", "17.0 MiB", "+9.0 MiB", "backward",
         "forward 11.0 MiB, backward 17.0 MiB", "1.0 MiB", "+31% compute", EQUAL, "no"],
        ["fused-step" "best" "doing fused-step", "15.0 MiB", "+7.0 MiB", "backward",
         "forward 14.0 MiB, backward 15.0 MiB", "3.0 MiB", "no extra compute", EQUAL, "yes"],
        ["bf16-autocast" "doing bf16-autocast", "12.0 MiB", "+4.0 MiB", "backward",
         "forward 11.0 MiB, backward 12.0 MiB", "6.0 MiB", "no extra compute", "differ (error 1e-01 > 6e-02)", "yes"],
    ]  # fmt: skip
    assert [attrs.get("class") for attrs, _ in table] == [None, None, "best", None]
    assert f'title="{18 * MIB:,} B">18.0 MiB' in page
    summary = advice_summary(page)
    assert "the 8.0 MiB live at the step's start (6.0 MiB of it model state)" in summary
    assert "Best: fused-step, the least extra compute that fits the capacity of 16.0 MiB." in summary


def test_advice_read_back_from_its_json_is_the_same_advice() -> None:
    assert Advice.from_json(advice().to_json()) == advice()
    assert Advice.from_json(advice(None).to_json()) == advice(None)


@pytest.mark.parametrize(
    "data",
    [{}, {"rows": "x"}, {"rows": [{"name": "as-is", "peak_bytes": "lots"}]}],
    ids=["no-rows", "rows-text", "bad-row"],
)
def test_json_not_written_by_advise_is_refused(data: dict[str, Any]) -> None:
    with pytest.raises((KeyError, TypeError, ValueError)):
        Advice.from_json(data)


def test_skipped_strategies_and_conflicts_show_their_reasons_as_text() -> None:
    page = advice_page(advice())
    assert [cells for _, cells in rows(page, "skipped")] == [["strategy", "why"], ["save-on-cpu", MARKUP]]
    assert "both wrap the blocks&#39; forward" in page and "&lt;checkpoint-every-2&gt;" in page
    outside = re.sub(r'<script type="application/json" id="gpumem-[a-z]+">.*?</script>', "", page, flags=re.S)
    assert outside.count("<script") == 1 and "<b>" not in outside and "<!--" not in outside


@pytest.mark.parametrize(
    ("capacity", "best", "says"),
    [
        (None, None, "No capacity was given, so none is judged to fit."),
        (18 * MIB, AS_IS, "The step fits the capacity of 18.0 MiB as it is."),
        (14 * MIB, None, "None fits the capacity of 14.0 MiB."),  # only bf16 (12 MiB), whose gradients differ
    ],
)
def test_advice_summary_says_which_fits(capacity: int | None, best: str | None, says: str) -> None:
    page = advice_page(advice(capacity))
    marked = [attrs.get("data-strategy") for attrs, _ in rows(page, "advice") if attrs.get("class") == "best"]
    assert marked == ([] if best is None else [best])
    assert says in advice_summary(page)


def test_a_test_that_did_not_advise_shows_no_advice() -> None:
    page = advice_page(None)
    assert "gpumem-advice" not in page and 'data-phase="call"' in page


def test_an_explained_test_that_advised_shows_the_advice_and_one_not_explained_gets_no_page(
    tracker: pytest.Pytester, reported: Callable[..., dict[str, dict[str, Any]]]
) -> None:
    tracker.makepyfile(
        """
        import pytest, torch

        def advised(gpumem):
            torch.manual_seed(0)
            model = torch.nn.Linear(64, 64)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            x = torch.randn(32, 64)
            def step():
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            gpumem.advise(step, model=model, optimizer=opt, capacity="1 MiB",
                          strategies=["checkpoint-blocks", "fused-step"])
            step()

        @pytest.mark.max_memory(explain=True)
        def test_explained(gpumem):
            advised(gpumem)

        def test_not_explained(gpumem):
            advised(gpumem)
        """
    )
    result = tracker.runpytest("-p", "no:cacheprovider", "--gpumem-html=pictures", "--gpumem-json=out.json")
    result.assert_outcomes(passed=2)
    tests = reported()
    assert tests["test_not_explained"]["html"] is None and tests["test_not_explained"]["info"]["advice"]["rows"]
    (page,) = (tracker.path / "pictures").glob("*.html")
    assert tracker.path / tests["test_explained"]["html"] == page
    text = page.read_text(encoding="utf-8")
    written = tests["test_explained"]["info"]["advice"]["rows"]
    assert [r["name"] for r in written] == [AS_IS, "checkpoint-blocks", "fused-step"]
    assert [(attrs["data-strategy"], cells[1]) for attrs, cells in rows(text, "advice")[1:]] == [
        (row["name"], format_size(row["absolute_peak_bytes"])) for row in written if "skipped" not in row
    ]
    assert rows(text, "skipped")[1][1] == ["checkpoint-blocks", written[1]["skipped"]]
    assert written[1]["skipped"].startswith("no repeated blocks")


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


Case = tuple[Explanation, int, int]
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
    call = data.phases["call"]
    assert call.start_bytes + call.peak_bytes == total
    dom = shown(chromium, write_picture(tmp_path, data), tmp_path / "profile")
    peak = element(dom, "gpumem-peak")
    assert peak.attributes is not None
    assert peak.attributes.get("data-bytes") == str(total)
    assert peak.attributes.get("data-index") == str(index)
    assert f"Peak {format_size(total)} ({total:,} B) live at event {index:,} in forward" in peak.text
    assert element(dom, "gpumem-test").text == data.nodeid
    body = re.search(r"<body[^>]*>", dom)
    assert body is not None and "data-pwned" not in body[0]


def test_browser_draws_areas_bands_the_peak_label_and_unattributed(chromium: str, tmp_path: Path) -> None:
    data, total, _ = spread_case(8, 20)
    dom = shown(chromium, write_picture(tmp_path, changed(data, "call", unattributed_bytes=4096)), tmp_path / "profile")
    assert "the measured peak has 4.0 KiB more, unattributed" in element(dom, "gpumem-peak").text
    chart = dom.split('id="gpumem-chart"')[1].split("</svg>")[0]
    assert chart.count("<path") == len(CATEGORIES)
    assert ">forward</text>" in chart and ">backward</text>" in chart
    assert all(f">{index}</text>" in chart for index in (0, 5, 10, 15, 20))  # the event axis
    assert f"peak {format_size(total)} ({total:,} B) at event 8" in chart
    assert f"saved for backward of encoder.0: {format_size(193 * MIB + 3)}" in chart
