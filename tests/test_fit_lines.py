"""A step's timeline as one line per event: the peak at any size is the highest line, wherever it moves."""

from __future__ import annotations

from fractions import Fraction

from pytest_gpumem.backends.timeline import FREED, Timeline, TimelineRecorder
from pytest_gpumem.measure.lines import MAX_BATCH, fit_lines


def timeline(*events: tuple[str, int]) -> Timeline:
    return Timeline(tuple(op for op, _ in events), tuple(total for _, total in events), (None,) * len(events))


def step_at(n: int) -> Timeline:
    """Parameters and state (1,000 B) live; the backward holds 100 n + 200 B, then frees it; the optimizer
    step holds a constant 5,000 B of temporaries. The highest event is the step's below n = 48 (where both
    hold 6,000 B), the backward's above."""
    return timeline(("aten.mm", 1200 + 100 * n), (FREED, 1000), ("aten.sqrt", 6000), (FREED, 1000))


def test_the_peak_moves_from_the_optimizer_step_to_the_backward() -> None:
    lines = fit_lines([1, 2, 4], [step_at(1), step_at(2), step_at(4)])
    assert lines.exact and lines.grows
    assert (lines.peak(1), lines.peak(48), lines.peak(49)) == (6000, 6000, 6100)
    assert (lines.top(47), lines.top(49)) == (2, 0)  # the sqrt, then the mm
    # 1,200 + 100 n <= 10,000  ->  n <= 88; the constant 6,000 B is within it
    assert lines.largest_within(10_000) == 88
    assert lines.largest_within(6_099) == 48
    assert lines.largest_within(5_999) is None  # the optimizer step alone needs 6,000 B


def test_a_size_off_its_line_gives_the_residual() -> None:
    bent = timeline(("aten.mm", 1200 + 100 * 2 + 7), (FREED, 1000), ("aten.sqrt", 6000), (FREED, 1000))
    lines = fit_lines([1, 2, 4], [step_at(1), bent, step_at(4)])
    assert lines.residual == 7 and not lines.exact


def test_two_sizes_fit_lines_unchecked() -> None:
    lines = fit_lines([3, 1], [step_at(3), step_at(1)])
    assert (lines.low, lines.span, lines.residual, lines.exact) == (1, 2, 0, False)
    assert lines.at(10) == Fraction(6000)
    assert lines.peak(100) == 1200 + 100 * 100


def test_an_event_that_does_not_grow_is_no_answer() -> None:
    flat = fit_lines([1, 2, 3], [timeline(("aten.ones", 4000))] * 3)
    assert not flat.grows


def test_a_tiny_growth_answers_the_largest_size_fit_measures() -> None:
    lines = fit_lines([1, 2], [timeline(("aten.ones", 4001)), timeline(("aten.ones", 4002))])
    assert lines.largest_within(2**40) == MAX_BATCH


def test_a_shrinking_event_above_the_capacity_means_none_fits() -> None:
    # one event grows (n B), another shrinks (10,000 - n B): at 9,000 B only n <= 9,000 and n >= 1,000 fit
    lines = fit_lines([1, 2], [timeline(("a", 1), ("b", 9999)), timeline(("a", 2), ("b", 9998))])
    assert lines.largest_within(9000) == 9000
    assert lines.largest_within(4000) is None  # n <= 4,000 for a, n >= 6,000 for b


def test_the_recorder_names_each_event() -> None:
    recorder = TimelineRecorder(str, lambda: "test_x.py:3")
    recorder.allocated("aten.mm.default", 4096)
    recorder.changed(FREED, 0)
    recorded = recorder.timeline()
    assert (recorded.ops, recorded.allocated, recorded.where) == (
        ("aten.mm.default", FREED),
        (4096, 0),
        ("test_x.py:3", None),
    )
    assert recorded.place(0) == "aten.mm.default (test_x.py:3)" and recorded.peak() == 4096


def test_the_first_difference_of_two_timelines() -> None:
    a = timeline(("aten.mm", 1), ("aten.add", 2))
    b = timeline(("aten.mm", 1), ("aten.clone", 2), ("aten.add", 3))
    assert a.first_difference(b) == 1 and not a.same_ops(b)
    assert a.first_difference(timeline(("aten.mm", 5))) == 1
