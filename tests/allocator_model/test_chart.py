"""The byte axes and plot areas the three pages that chart memory share (explanation, history, replay)."""

from __future__ import annotations

from cuda_allocator_model import PlotArea, byte_range, byte_ticks, nice_step

MIB = 1 << 20


def test_a_step_is_one_two_or_five_times_a_power_of_ten_at_least_the_one_asked() -> None:
    assert [nice_step(raw) for raw in (0.3, 1, 1.01, 3, 7, 2000, 2001)] == [0.5, 1, 2, 5, 10, 2000, 5000]


def test_an_axis_from_zero_steps_roundly_in_the_largest_unit_reached() -> None:
    assert [label for _, label in byte_ticks(3 * MIB)] == ["0 MiB", "1 MiB", "2 MiB", "3 MiB"]
    assert [label for _, label in byte_ticks(1000)] == ["0 B", "200 B", "400 B", "600 B", "800 B", "1000 B"]
    assert byte_ticks(2048)[:3] == [[0.0, "0 KiB"], [512.0, "0.5 KiB"], [1024.0, "1 KiB"]]


def test_an_axis_around_figures_has_round_marks_a_step_outside_them() -> None:
    assert byte_range(8 * MIB, 21 * MIB // 2) == (7 * MIB, 11 * MIB, [(n * MIB, f"{n} MiB") for n in range(7, 12)])
    low, high, marks = byte_range(500, 540)  # 40 B apart: steps of 10 B, one below and one above
    assert (low, high) == (490, 550) and [text for _, text in marks] == [f"{n} B" for n in range(490, 551, 10)]
    assert byte_range(0, 3 * MIB)[0] == 0  # never below 0


def test_an_axis_around_a_change_of_a_few_bytes_spans_a_twentieth_of_the_top_figure() -> None:
    low, high, _ = byte_range(56 * 1024, 56 * 1024 + 20)
    assert high - low >= (56 * 1024 + 20) / 20


def test_a_plot_area_puts_a_share_across_and_a_value_up_its_axis() -> None:
    area = PlotArea(left=80, right=890, top=10, bottom=296)
    assert (area.x(0), area.x(0.5), area.x(1)) == (80, 485, 890)
    assert (area.y(0, 0, 4 * MIB), area.y(MIB, 0, 4 * MIB), area.y(4 * MIB, 0, 4 * MIB)) == (296, 224.5, 10)
