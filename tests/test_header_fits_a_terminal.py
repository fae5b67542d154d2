"""The session's header: what measures and on what terms, on lines of at most 100 columns where a clause allows."""

from __future__ import annotations

from pytest_gpumem.run.header import _lines


def test_a_short_header_stays_on_one_line() -> None:
    text = "gpumem: tracker (storages created by ATen ops, rounding none), device cpu"
    assert _lines(text) == [text]


def test_a_long_header_is_cut_between_clauses_never_inside_parentheses() -> None:
    text = (
        "gpumem: tracker (ops, served by a model (x; y), device-free), device meta (a prediction; nothing computed); "
        "compiled: Inductor's partition; capacity 3999 (--gpumem-capacity): an allocation past it raises"
    )
    assert _lines(text, width=60) == [
        "gpumem: tracker (ops, served by a model (x; y), device-free)",
        "  device meta (a prediction; nothing computed)",
        "  compiled: Inductor's partition",
        "  capacity 3999 (--gpumem-capacity): an allocation past it raises",
    ]


def test_clauses_that_fit_together_share_a_line() -> None:
    assert _lines("gpumem: a, device b; c; " + "d" * 30, width=22) == ["gpumem: a, device b; c", "  " + "d" * 30]
