"""The report section: one table per workload, pure functions from collected rows to text lines."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

from pytest_gpumem.sizes import format_size

COLUMNS = ("forward", "backward", "step", "total")


def _size(value: Any) -> str:
    return "-" if value is None else format_size(int(value))


def _ratio(value: Any, base: Any) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}"


def workload_table(rows: list[dict[str, Any]]) -> str:
    """Rows of one workload: peaks per phase, total vs the naive strategy's total and vs the minimum."""
    naive = {row["strategy"]: row["phases"].get("total") for row in rows}
    body = []
    for row in rows:
        phases = row["phases"]
        total = phases.get("total")
        body.append(
            [row["strategy"], *(_size(phases.get(c)) for c in COLUMNS),
             _ratio(total, naive.get(row["reference"])), _ratio(total, row["minimum_bytes"]),
             _size(row["minimum_bytes"])]
        )  # fmt: skip
    headers = ["strategy", *COLUMNS, "total/naive", "total/minimum", "minimum"]
    return tabulate(body, headers=headers, disable_numparse=True)


def report_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for workload in dict.fromkeys(row["workload"] for row in rows):
        picked = [row for row in rows if row["workload"] == workload]
        first = picked[0]
        where = first["backend"] if first.get("device", "cpu") == "cpu" else f"{first['backend']}, {first['device']}"
        lines += ["", f"workload {workload} ({where}; naive = {first['reference']}):"]
        lines += workload_table(picked).splitlines()
    return lines
