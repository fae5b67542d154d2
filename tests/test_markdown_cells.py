"""A Markdown table cell shows its text as it is, whatever the text: a backslash before a pipe does not
end the cell, and control and format characters reach the file as escapes, never raw."""

from __future__ import annotations

import string
import unicodedata

import pytest

from pytest_gpumem.report.markdown import cell, code_span, markdown_table, prose

HOSTILE = {
    "a\\|b": "a\\|b",  # a backslash before a pipe
    "a\\\\|b": "a\\\\|b",
    "end\\": "end\\",
    "esc\x1b[31mred": "esc\\x1b[31mred",  # an escape sequence, written as Python writes it
    "nul\x00x": "nul\\x00x",
    "csi\x9bx": "csi\\x9bx",
    "rlo\u202ex": "rlo\\u202ex",  # a right-to-left override (a format character)
    "bom\ufeffx": "bom\\ufeffx",
    "two\nlines": "two lines",
    "emoji \U0001f469\u200d\U0001f4bb": "emoji \U0001f469\u200d\U0001f4bb",  # the joiner is part of the emoji
}


def read_row(line: str) -> list[str]:
    """The cells of a table row as GitHub reads them: a backslash escapes the punctuation after it (so a
    pipe after an escaped backslash ends the cell), an unescaped pipe ends a cell."""
    cells, text, escaped = [], "", False
    for char in line.strip().removeprefix("|"):
        if escaped:
            text += char if char in string.punctuation else "\\" + char
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "|":
            cells.append(text.strip())
            text = ""
        else:
            text += char
    return cells


@pytest.mark.parametrize(("text", "shown"), HOSTILE.items(), ids=ascii)
def test_a_cell_shows_its_text_as_it_is(text: str, shown: str) -> None:
    written = cell(text)
    assert read_row(f"| {written} | next |") == [shown, "next"]
    assert all(unicodedata.category(c)[0] != "C" or c == "\u200d" for c in written)


def test_every_row_of_a_table_of_hostile_names_keeps_its_columns() -> None:
    names = list(HOSTILE)
    table = markdown_table(["name | header", "peak"], [[name, "40 B"] for name in names]).splitlines()
    assert read_row(table[0]) == ["name | header", "peak"]
    assert [read_row(line) for line in table[2:]] == [[HOSTILE[name], "40 B"] for name in names]


def test_the_markdown_report_of_hostile_phase_names_keeps_its_columns(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        test_names=f"""
        import pytest, torch

        @pytest.mark.parametrize("name", {list(HOSTILE)!r})
        def test_phase(gpumem, name):
            with gpumem.phase(name):
                torch.ones(10)
        """
    )
    result = tracker.runpytest("--gpumem-markdown=m.md", "-p", "no:randomly")
    result.assert_outcomes(passed=len(HOSTILE))
    text = (tracker.path / "m.md").read_text(encoding="utf-8")
    rows = [read_row(line) for line in text.splitlines() if line.startswith("|")]
    assert {len(row) for row in rows} == {len(rows[0])}
    phases = [row[rows[0].index("phases")] for row in rows[2:]]
    assert sorted(phases) == sorted(f"{shown} 40 B" for shown in HOSTILE.values())  # 10 float32
    assert all(unicodedata.category(c)[0] != "C" or c in "\n\u200d" for c in text)


def test_a_failure_line_in_the_summary_is_text_not_markup() -> None:
    line = "blocks.* +24.0 KiB (4 blocks): saved_for *backward*, <b>[x](y)</b> `code` ~~s~~ a|b"
    assert prose(line) == (
        "blocks.\\* +24.0 KiB (4 blocks): saved\\_for \\*backward\\*, \\<b\\>\\[x\\](y)\\</b\\> \\`code\\` "
        "\\~\\~s\\~\\~ a\\|b"
    )
    markdown_it = pytest.importorskip("markdown_it")
    rendered = markdown_it.MarkdownIt("commonmark").enable("strikethrough").render(prose(line))
    assert not any(tag in rendered for tag in ("<em>", "<a ", "<code>", "<b>", "<s>")), rendered


@pytest.mark.parametrize(
    ("nodeid", "span"),
    [
        ("t.py::test_a", "`t.py::test_a`"),
        ("t.py::test[`x``]", "```t.py::test[`x``]```"),
        ("t.py::t[a`]", "``t.py::t[a`]``"),
        ("a`", "`` a` ``"),
    ],
)
def test_a_test_id_is_a_code_span_whatever_backticks_it_holds(nodeid: str, span: str) -> None:
    assert code_span(nodeid) == span


def test_the_failed_list_keeps_what_the_line_left_out_to_fit_a_terminal() -> None:
    """A failure line fits 120 columns; the clauses it left to the section's `also:` lines are the summary's
    too (a pull request's reader has no terminal to fit)."""
    from pytest_gpumem.report.markdown import failures
    from pytest_gpumem.results import Status, TestResult

    result = TestResult.of(
        "t.py::test_a", "tracker", "cpu", None, status=Status.LEAKED, message="left 525.3 kB allocated",
        detail=("also: held by an autograd graph kept alive by global KEEP", "kept: 2 tensors"),
    )  # fmt: skip
    assert failures([result]) == [
        "**Failed**\n\n- `t.py::test_a` LEAKED: left 525.3 kB allocated\n"
        "  - held by an autograd graph kept alive by global KEEP\n"
    ]
