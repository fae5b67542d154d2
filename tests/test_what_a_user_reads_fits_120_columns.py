"""What a user reads first fits a terminal of 120 columns: measured on the docs' examples, which
test_docs_examples runs and checks as real output (a failure's line under its test's header, each line of a
fit's description with the file name `pytest -s` prints before it, the section's `also:` lines and its
explanation); the reference suite's tables fit 100."""

from __future__ import annotations

import re

from test_docs_examples import PAGES, ROOT, blocks

COLUMNS = 120
HEADER = re.compile(r"_+ \S+ _+")  # pytest's header above a failure
FIT = re.compile(r"\S+\.py (largest batch that fits|no batch fits) ")
WORKLOAD = re.compile(r"workload \S+ \(.*\):")  # a table of reference_losses' report section


def read_first() -> dict[str, list[tuple[str, str]]]:
    """The lines, by kind, each with where it is shown."""
    found: dict[str, list[tuple[str, str]]] = {"failure": [], "fit": [], "also": [], "explained": [], "workload": []}
    for page in PAGES:
        for block in (b for b in blocks(page) if b.lang == "console"):
            lines = block.body.splitlines()
            where = f"{page.relative_to(ROOT)}:{block.line}"
            in_fit = in_workload = in_explained = False
            for before, line in zip(["", *lines], lines, strict=False):
                in_fit = bool(FIT.match(line)) or (in_fit and line.startswith("  "))
                in_workload = WORKLOAD.fullmatch(before) is not None or (in_workload and bool(line.strip()))
                kind = "failure" if HEADER.fullmatch(before) else "fit" if in_fit else ""
                kind = "workload" if in_workload else kind
                in_explained = line.startswith("peak explained (") or (in_explained and line.startswith("  "))
                kind = "explained" if in_explained else kind
                kind = "also" if line.startswith("also: ") else kind
                if kind:
                    found[kind].append((where, line))
    return found


def test_failure_lines_fit_descriptions_and_also_lines_fit_120_columns() -> None:
    found = {kind: lines for kind, lines in read_first().items() if kind != "workload"}
    assert len(found["explained"]) > 20  # the explain guide's sections
    # the fit guide's three fits (4, 6 and 9 lines), the failures of the guides that show one
    assert (len(found["fit"]), len(found["failure"]) >= 8, len(found["also"]) >= 6) == (19, True, True)
    wide = [
        f"{where} ({len(line)}): {line}" for lines in found.values() for where, line in lines if len(line) > COLUMNS
    ]
    assert wide == []


def test_the_reference_suites_tables_fit_100_columns() -> None:
    tables = read_first()["workload"]
    assert len(tables) > 50  # the reference guide's 11 tables, rules and rows
    assert [f"{where} ({len(line)}): {line}" for where, line in tables if len(line) > 100] == []
