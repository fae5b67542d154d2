"""The report section: one table per workload, pure functions from collected rows to text lines."""

from __future__ import annotations

from typing import Any

from pytest_gpumem import format_size

COLUMNS = ("forward", "backward", "step", "total")


def _size(value: Any) -> str:
    return "-" if value is None else format_size(int(value))


def _ratio(value: Any, base: Any) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}"


def workload_table(rows: list[dict[str, Any]]) -> str:
    """Rows of one workload: peaks per phase, total vs the naive strategy's total and vs the minimum, the
    total's reserved memory vs the naive one's (with the allocator's model: what a card holds for the
    step), and (explained runs) which category of the total peak the difference from the naive one
    comes from."""
    naive = {row["strategy"]: row["phases"].get("total") for row in rows}
    naive_reserved = {row["strategy"]: row.get("reserved") for row in rows}
    compositions = {row["strategy"]: row.get("composition") for row in rows}
    explained = any(compositions.values())
    reserved = any(row.get("reserved") is not None for row in rows)
    body = []
    for row in rows:
        phases = row["phases"]
        total = phases.get("total")
        cells = [row["strategy"], *(_size(phases.get(c)) for c in COLUMNS),
                 _ratio(total, naive.get(row["reference"])), _ratio(total, row["minimum_bytes"]),
                 _size(row["minimum_bytes"])]  # fmt: skip
        if reserved:  # what a card holds for the step: the allocator's segments (--gpumem-round=cuda)
            ratio = _ratio(row.get("reserved"), naive_reserved.get(row["reference"]))
            cells.append(ratio if ratio == "-" else f"{ratio}x")
        if explained:
            cells.append(difference(compositions.get(row["reference"]), row.get("composition"), row))
        body.append(cells)
    headers = ["strategy", *COLUMNS, "total/naive", "total/minimum", "minimum"]
    headers += ["reserved"] if reserved else []
    headers += ["vs naive, comes from"] if explained else []
    return table(headers, body)


def table(headers: list[str], body: list[list[str]]) -> str:
    """Columns as wide as their widest cell or header, two spaces apart, a rule of dashes under the
    headers (tabulate's simple format without the two columns it adds to each header: 95 columns where
    that took 105)."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *body, strict=True)]
    rows = [headers, ["-" * width for width in widths], *body]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def difference(naive: Composition | None, own: Composition | None, row: dict[str, Any]) -> str:
    """Where the strategy differs most from the naive one: the phase whose peak changed most (relative to
    the naive peak, savings first) and the category that made most of it, e.g. "forward: temporaries
    -100%" (relative to the naive strategy's bytes in that category)."""
    if naive is None or own is None or row["strategy"] == row["reference"]:
        return "-"
    changes = {p: _growth(naive[p], own[p]) for p in COLUMNS if p in naive and p in own}
    moved = {p: sum(c.values()) / max(sum(v for v in naive[p].values() if v > 0), 1) for p, c in changes.items()}
    if not any(moved.values()):
        return "no change"
    phase = min(moved, key=lambda p: moved[p]) if min(moved.values()) < 0 else max(moved, key=lambda p: moved[p])
    change = changes[phase]
    category = (min if moved[phase] < 0 else max)(change, key=lambda c: change[c])
    label = row.get("labels", {}).get(category, category)
    return f"{phase}: {label} {_relative(change[category], naive[phase].get(category, 0))}"


Composition = dict[str, dict[str, int]]


def _growth(naive: dict[str, int], own: dict[str, int]) -> dict[str, int]:
    """`own - naive` for each category of either side, the categories that did not change left out."""
    grown = {category: own.get(category, 0) - naive.get(category, 0) for category in dict.fromkeys([*own, *naive])}
    return {category: value for category, value in grown.items() if value}


def _relative(change: int, before: int) -> str:
    if before <= 0:
        return ("+" if change > 0 else "-") + format_size(abs(change))
    percent = change * 100 / before
    return f"{percent:+.0f}%" if abs(percent) >= 1 else f"{percent:+.2g}%"


RESERVED_NOTE = "reserved: the total's reserved memory (the allocator's model) against the naive strategy's"


def report_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = [RESERVED_NOTE] if any(row.get("reserved") is not None for row in rows) else []
    for workload in dict.fromkeys(row["workload"] for row in rows):
        picked = [row for row in rows if row["workload"] == workload]
        first = picked[0]
        where = first["backend"] if first.get("device", "cpu") == "cpu" else f"{first['backend']}, {first['device']}"
        lines += ["", f"workload {workload} ({where}; naive = {first['reference']}):"]
        lines += workload_table(picked).splitlines()
        lines += [f"{row['strategy']}: {row['autocast']}" for row in picked if row.get("autocast")]
    return lines
