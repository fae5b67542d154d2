"""The explanation page: what `render` writes (escaping, file names, tables), and what a browser shows."""

from __future__ import annotations

import base64
import hashlib
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
from builders import Reported

from cuda_allocator_model.sizes import format_size
from pytest_gpumem.backends.tracker.allocation import NO_MODULE
from pytest_gpumem.report.html import chart_texts, render
from pytest_gpumem.report.html_axis import event_axis, event_ticks
from pytest_gpumem.results.advice import AS_IS, Advice, PhasePeak, Row
from pytest_gpumem.results.categories import CATEGORIES as ATTRIBUTED
from pytest_gpumem.results.categories import LABELS as ATTRIBUTED_LABELS
from pytest_gpumem.results.codec import decode, encode
from pytest_gpumem.results.explanation import (
    Cell,
    Explanation,
    PhaseExplanation,
    Point,
    SampledTimeline,
    Tensor,
    UnmeasuredSpan,
)
from pytest_gpumem.run.outputs import write_evidence, write_picture

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
        timeline=SampledTimeline(events, [Point(index, list(values)) for index, values in points]),
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
        live=growth,
        entries=len(spans),
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
    page = render(explanation(points, 8)).replace("<wbr>", "")  # the places a name may break
    assert re.findall(r'<section class="phase" data-phase="([^"]+)"', page) == ["call", "forward", "backward"]
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
    assert "&lt;b&gt;evil&lt;/<wbr>b&gt;" in page and "a&lt;b&gt;.<wbr>py:1" in page


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
    bare = PhaseExplanation(8, {}, {}, [], [], live={}, entries=1, peak_index=1, spans=[(0, 1)])
    page = render(replace(data, phases={"call": bare}))
    assert "largest tensors" not in page and "peak 8 B above its start" in page


def test_the_event_axis_steps_roundly_in_whole_events() -> None:
    assert event_ticks(event_axis(20)) == [[0, "0"], [5, "5"], [10, "10"], [15, "15"], [20, "20"]]
    assert [label for _, label in event_ticks(event_axis(5000))] == ["0", "1,000", "2,000", "3,000", "4,000", "5,000"]
    assert event_ticks(event_axis(1)) == [[0, "0"], [1, "1"]]


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
    tracker: pytest.Pytester, reported: Reported
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
    assert tests["test_not_explained"]["html"] is None and tests["test_not_explained"]["advice"]["rows"]
    (page,) = (tracker.path / "pictures").glob("*.html")
    assert tracker.path / tests["test_explained"]["html"] == page
    text = page.read_text(encoding="utf-8")
    written = tests["test_explained"]["advice"]["rows"]
    assert [r["name"] for r in written] == [AS_IS, "checkpoint-blocks", "fused-step"]
    assert [(attrs["data-strategy"], cells[1]) for attrs, cells in rows(text, "advice")[1:]] == [
        (row["name"], format_size(row["absolute_peak_bytes"])) for row in written if "skipped" not in row
    ]
    assert rows(text, "skipped")[1][1] == ["checkpoint-blocks", written[1]["skipped"]]
    assert written[1]["skipped"].startswith("no repeated blocks")


# --- what advise and check_gradients ran: folded on the event axis --------------------------------------------

UNMEASURED = [UnmeasuredSpan("gpumem.advise", 100, 800), UnmeasuredSpan("gpumem.check_gradients", 900, 960)]


def unmeasured_case(peak_index: int | None = 60) -> Explanation:
    """1,000 events: forward (0-100) peaks at event 60 with 3 MiB; advise runs 100-800 and reaches 5 MiB at
    event 400; backward (800-900); check_gradients (900-960) reaches 4 MiB at 930; step (960-1000)."""
    live = {0: 0, 60: 3, 100: 1, 400: 5, 800: 1, 850: 2, 930: 4, 960: 1, 1000: 0}
    points = [Point(index, [0, 0, 0, 0, mib * MIB, 0]) for index, mib in live.items()]
    call = phase(3 * MIB, 60, [(0, 1000)], {"temporaries": 3 * MIB})
    return Explanation(
        nodeid="tests/test_x.py::test_advised",
        backend="tracker",
        categories=CATEGORIES,
        labels=dict(LABELS),
        phases={
            "call": replace(call, peak_index=peak_index),
            "forward": phase(3 * MIB, 60, [(0, 100)], {"temporaries": 3 * MIB}),
            "backward": phase(MIB, 850, [(800, 900)], {"temporaries": MIB}),
            "step": phase(0, 960, [(960, 1000)], {}),
        },
        timeline=SampledTimeline(1000, points, list(UNMEASURED)),
    )


def test_advise_and_check_gradients_take_a_narrow_labeled_part_of_the_event_axis() -> None:
    """Shares 0.7 and 0.06 of the events fold to 0.08 and 0.06 of the width; the 240 measured events share
    the other 0.86: 100 of them 0.86 * 100 / 240 = 0.3583."""
    axis = event_axis(1000, UNMEASURED)
    assert [(part.start, part.end, part.by) for part in axis.segments] == [
        (0, 100, None), (100, 800, "gpumem.advise"), (800, 900, None), (900, 960, "gpumem.check_gradients"),
        (960, 1000, None),
    ]  # fmt: skip
    widths = [part.right - part.left for part in axis.segments]
    assert widths == pytest.approx([0.86 * 100 / 240, 0.08, 0.86 * 100 / 240, 0.06, 0.86 * 40 / 240])
    assert axis.position(450) == pytest.approx(0.86 * 100 / 240 + 0.04)  # halfway through advise's runs
    assert axis.fold_at(400) == axis.segments[1] and axis.fold_at(800) is None  # an edge is measured
    # 240 measured events: a tick every 50, none inside a fold
    assert [event for event, _ in event_ticks(axis)] == [0, 50, 100, 800, 850, 900, 1000]


def test_many_folds_share_at_most_a_quarter_of_the_width_and_an_unmeasured_call_is_not_folded() -> None:
    many = [UnmeasuredSpan("gpumem.check_gradients", 100 * i + 10, 100 * i + 90) for i in range(10)]
    axis = event_axis(1000, many)
    assert sum(part.right - part.left for part in axis.folds) == pytest.approx(0.24)
    assert len(axis.folds) == 10 and axis.position(1000) == 1.0
    whole = event_axis(100, [UnmeasuredSpan("gpumem.advise", 0, 100)])
    assert [(part.left, part.right) for part in whole.segments] == [(0.0, 1.0)]


def test_the_marked_peak_is_the_calls_as_its_table_says_not_a_higher_moment_of_advise() -> None:
    data = unmeasured_case()
    texts = chart_texts(data)
    assert data.timeline.points[texts["peak"]].index == 60  # advise's 5 MiB at event 400 is not the peak
    page = render(data)
    call = re.search(
        r'<section class="phase" data-phase="call" data-peak-index="(\d+)">.*?reached at event ([\d,]+)', page, re.S
    )
    assert call is not None and call[1] == "60" and call[2] == "60"
    # an explanation without the call's moment: the largest point outside the folds (not 400, not 930)
    assert chart_texts(unmeasured_case(peak_index=None))["peak"] == 1


def test_the_page_lists_what_ran_unmeasured_and_the_script_gets_the_folds() -> None:
    page = render(unmeasured_case())
    folded = re.findall(
        r'<span class="fold" data-by="([^"]+)" data-runs="(\d+)" data-events="(\d+)">([^<]+)</span>', page
    )
    assert folded == [
        ("gpumem.advise", "1", "700", "gpumem.advise: 700 events (events 100 to 800)"),
        ("gpumem.check_gradients", "1", "60", "gpumem.check_gradients: 60 events (events 900 to 960)"),
    ]
    view = json.loads(re.findall(r'id="gpumem-view">(.*?)</script>', page, re.S)[0])
    assert [(fold["label"], fold["start"], fold["end"]) for fold in view["folds"]] == [
        ("gpumem.advise", 100, 800),
        ("gpumem.check_gradients", 900, 960),
    ]
    assert 'id="gpumem-folded"' not in render(replace(unmeasured_case(), timeline=SampledTimeline(1000, [], [])))


def test_unmeasured_spans_round_trip_and_an_old_timeline_reads_without_them() -> None:
    data = unmeasured_case()
    assert Explanation.from_json(data.to_json()) == data
    old = SampledTimeline(5, [Point(5, [0] * 6)])
    assert (
        "unmeasured" not in encode(old) and decode(SampledTimeline, {"events": 5, "points": [[5, [0] * 6]]}, "t") == old
    )


VOID = {"meta", "col", "wbr", "br", "img", "input", "link", "hr"}


class Balance(HTMLParser):
    """Every element closed in the order it was opened (void elements excepted)."""

    def __init__(self) -> None:
        super().__init__()
        self.open: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in VOID:
            self.open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.open or self.open[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.open[-1:] or 'nothing'} at {self.getpos()}")
        else:
            self.open.pop()


def test_the_page_of_an_advised_test_is_well_formed() -> None:
    data = replace(unmeasured_case(), nodeid=HOSTILE)
    long = replace(TENSOR, where="/" + "/".join(["site-packages"] * 12) + "/modeling.py:7", module="m." * 80 + "x")
    data = changed(data, "call", tensors=[long, TENSOR], modules={"<b>" * 30: 1, "a" * 300: 2})
    balance = Balance()
    balance.feed(render(data, advice()))
    balance.close()
    assert balance.errors == [] and balance.open == []


def test_a_long_source_path_keeps_its_last_parts_and_the_whole_in_its_title() -> None:
    where = "../../.venv/lib/python3.11/site-packages/transformers/models/gpt2/modeling_gpt2.py:341"
    page = render(changed(unmeasured_case(), "call", tensors=[replace(TENSOR, where=where)]))
    assert f'<td class="code" title="{where}">…/<wbr>gpt2/<wbr>modeling_<wbr>gpt2.<wbr>py:341</td>' in page
    assert '<td class="code">test_<wbr>x.<wbr>py:12</td>' in render(unmeasured_case())  # short: whole


ADVISED = """
import pytest, torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))

    def forward(self, x):
        return x + self.mlp(x)

@pytest.mark.max_memory(explain=True)
def test_advised(gpumem):
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 32)
    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    gpumem.advise(step, model=model, optimizer=opt, strategies=["checkpoint-blocks"])
    with gpumem.phase("forward"):
        loss = model(x).square().mean()
    with gpumem.phase("backward"):
        loss.backward()
    gpumem.check_gradients(model)
    with gpumem.phase("step"):
        opt.step()
"""


def test_the_page_of_an_advised_test_marks_the_calls_peak_and_folds_advise_and_check_gradients(
    tracker: pytest.Pytester, reported: Reported
) -> None:
    tracker.makepyfile(test_advised=ADVISED)
    result = tracker.runpytest("-p", "no:cacheprovider", "--gpumem-html=pictures", "--gpumem-json=out.json")
    result.assert_outcomes(passed=1)
    test = reported()["test_advised"]
    timeline = test["explanation"]["timeline"]
    assert [span["by"] for span in timeline["unmeasured"]] == ["gpumem.advise", "gpumem.check_gradients"]
    page = (tracker.path / test["html"]).read_text(encoding="utf-8")
    view = json.loads(re.findall(r'id="gpumem-view">(.*?)</script>', page, re.S)[0])
    marked = timeline["points"][view["peak"]][0]
    call = test["explanation"]["phases"]["call"]
    assert marked == call["peak_index"] and f'data-phase="call" data-peak-index="{marked}"' in page
    assert [fold["label"] for fold in view["folds"]] == ["gpumem.advise", "gpumem.check_gradients"]
    advise = timeline["unmeasured"][0]
    assert not advise["start"] < marked < advise["end"]


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


def test_browser_marks_the_calls_peak_and_labels_the_folds(chromium: str, tmp_path: Path) -> None:
    dom = shown(chromium, write_picture(tmp_path, unmeasured_case()), tmp_path / "profile")
    peak = element(dom, "gpumem-peak")
    assert peak.attributes is not None and peak.attributes.get("data-index") == "60"  # not advise's 400
    assert "Peak 3.0 MiB (3,145,728 B) live at event 60 in forward" in peak.text
    chart = dom.split('id="gpumem-chart"')[1].split("</svg>")[0]
    assert (
        '<g class="fold" data-by="gpumem.advise">' in chart
        and '<g class="fold" data-by="gpumem.check_gradients">' in chart
    )
    assert ">gpumem.advise</text>" in chart and ">gpumem.check_gradients</text>" in chart
    assert "; grey: folded, measured by no phase</text>" in chart
    assert all(f">{index}</text>" in chart for index in (0, 50, 100, 800, 850, 900, "1,000"))


MEASURE = (
    "document.body.setAttribute('data-width', String(document.documentElement.scrollWidth));"
    "document.body.setAttribute('data-tables', Array.from(document.querySelectorAll('table'), "
    "t => Math.ceil(t.getBoundingClientRect().right)).join(','));"
)


def measured(page: str) -> str:
    """`page` with a script of the test's own allowed to run after the page's: it writes the page's width
    and each table's right edge, in pixels, on the body."""
    digest = base64.b64encode(hashlib.sha256(MEASURE.encode()).digest()).decode()
    page = page.replace("script-src 'sha256-", f"script-src 'sha256-{digest}' 'sha256-", 1)
    return page.replace("</body>", f"<script>{MEASURE}</script></body>", 1)


def test_browser_fits_long_names_in_a_1280_pixel_window(chromium: str, tmp_path: Path) -> None:
    where = "/".join(["site-packages_with_a_long_name"] * 8) + "/modeling_a_model_with_a_long_name.py:341"
    module = ".".join(["transformer_layers_with_long_names"] * 6)
    tensor = replace(TENSOR, where=where, module=module, op="aten._scaled_dot_product_efficient_attention.default")
    data = changed(unmeasured_case(), "call", tensors=[tensor] * 3, modules={module: MIB, "x" * 200: MIB})
    path = tmp_path / "page.html"
    path.write_text(measured(render(data, advice())), encoding="utf-8")
    command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    result = subprocess.run(
        [*command, "--window-size=1280,1600", "--dump-dom", path.as_uri()],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    body = re.search(r"<body([^>]*)>", result.stdout)
    assert body is not None
    width = re.search(r'data-width="(\d+)"', body[1])
    tables = re.search(r'data-tables="([\d,]+)"', body[1])
    assert width is not None and tables is not None, body[0]
    assert int(width[1]) <= 1280 and max(map(int, tables[1].split(","))) <= 1280
