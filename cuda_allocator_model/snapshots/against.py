"""A prediction held against a card: two snapshots of the same work (the card's, recorded on a GPU with
`torch.cuda.memory._record_memory_history()`, and ours, written by `--gpumem-torch-snapshots`), their peaks
side by side and the first requests where they part, with the card's frames and our op and line: how a
user finds out why CPU CI and the GPU runner disagree.

The requests are aligned on their sizes (`align.py`: linear where they differ in few places, difflib's runs):
equal runs are the same work; a replaced, inserted or deleted run is a difference, shown with its first
request on each side. Peaks are each file's own (`replay`), so a snapshot from any torch version compares.
Every device the card traced is compared (or `--device N`), each with the prediction's trace of the same
device, or with its only one (a prediction is of one device), and the pair is said.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from cuda_allocator_model.errors import ModelError
from cuda_allocator_model.sizes import format_size
from cuda_allocator_model.snapshots.align import MAX_EDITS, align
from cuda_allocator_model.snapshots.read import read_snapshot
from cuda_allocator_model.snapshots.records import Event, Snapshot
from cuda_allocator_model.snapshots.replay import CardFigures, replay
from cuda_allocator_model.snapshots.unpickle import collector_paused

__all__ = ["Alignment", "Difference", "Peaks", "Request", "compare", "render", "run_against", "to_json"]

_CARD_OP = re.compile(r"^at::_ops::(\w+)::")  # torch's C++ frame of an op
_OUR_OP = re.compile(r"^\w+\.\w+(\.\w+)?$")  # our op frame: "aten.mm.default", file "??"
_NOT_USER: Final = ("/torch/", "\\torch\\", "site-packages", "dist-packages", "/lib/python")
_SHOWN: Final = 5  # differences shown by default
WIDTH: Final = 100


@dataclass(frozen=True)
class Peaks:
    """One snapshot's peaks (bytes) and how many requests it made."""

    allocated: int
    reserved: int
    requested: int
    requests: int

    @classmethod
    def of(cls, figures: CardFigures) -> Peaks:
        return cls(figures.peak_allocated, figures.peak_reserved, figures.peak_requested, len(figures.requests))


@dataclass(frozen=True)
class Request:
    """One `alloc` of a trace: its number among the trace's requests, its bytes, its op and its user line."""

    index: int
    size: int
    op: str
    line: str

    @classmethod
    def of(cls, index: int, event: Event) -> Request:
        return cls(index, event.size, op_of(event), line_of(event))


@dataclass(frozen=True)
class Difference:
    """A run of requests where the two sequences part: `kind` is difflib's (replace, delete: only the card
    makes them, insert: only the prediction), with the first request of each side and the run's lengths."""

    kind: str
    card: Request | None
    ours: Request | None
    card_count: int
    our_count: int


@dataclass(frozen=True)
class Alignment:
    """The card's snapshot against the prediction's."""

    card_path: str
    ours_path: str
    card: Peaks
    ours: Peaks
    aligned: int  # requests of the card matched by ours, in order and size
    differences: tuple[Difference, ...]  # the first `shown`
    difference_count: int  # all of them
    card_device: int = 0
    our_device: int = 0
    cut: bool = False  # more than align.MAX_EDITS differences in the middle: counted as one run

    @property
    def agree(self) -> bool:
        """Every request and every peak the same."""
        return self.difference_count == 0 and (self.card.allocated, self.card.reserved, self.card.requested) == (
            self.ours.allocated,
            self.ours.reserved,
            self.ours.requested,
        )


def compare(
    card: Snapshot, ours: Snapshot, device: int = 0, shown: int = _SHOWN, our_device: int | None = None
) -> Alignment:
    """`card` (a GPU's snapshot) on `device` against `ours` (the prediction's) on `our_device` (the same)."""
    mine = device if our_device is None else our_device
    with collector_paused():
        real, predicted = replay(card, device), replay(ours, mine)
        aligned_runs = align([e.size for e in real.requests], [e.size for e in predicted.requests])
    parted = [op for op in aligned_runs.opcodes if op[0] != "equal"]
    differences = tuple(
        Difference(
            kind,
            Request.of(i1, real.requests[i1]) if i2 > i1 else None,
            Request.of(j1, predicted.requests[j1]) if j2 > j1 else None,
            i2 - i1,
            j2 - j1,
        )
        for kind, i1, i2, j1, j2 in parted[:shown]
    )
    return Alignment(
        card.path, ours.path, Peaks.of(real), Peaks.of(predicted), aligned_runs.matched, differences, len(parted),
        device, mine, aligned_runs.cut,
    )  # fmt: skip


def traced(snapshot: Snapshot) -> list[int]:
    """The devices whose trace holds a request."""
    return [d for d, trace in enumerate(snapshot.traces) if any(e.action == "alloc" for e in trace)]


def pairs(card: Snapshot, ours: Snapshot, device: int | None) -> list[tuple[int, int]]:
    """(the card's device, the prediction's) to compare: every device the card traced, or `device`."""
    theirs, mine = traced(card), traced(ours)
    if device is not None and device not in theirs:
        where = f"it traced device {', '.join(map(str, theirs))}" if theirs else "it holds no trace"
        raise ModelError(f"--device {device}: the card's snapshot has no request on device {device} ({where})")
    if not theirs:
        raise ModelError(f"{card.path}: the card's snapshot holds no trace (its final state only): nothing to compare")
    chosen = [device] if device is not None else theirs
    return [(d, d if d in mine or len(mine) != 1 else mine[0]) for d in chosen]


def op_of(event: Event) -> str:
    """The op that asked for the memory: torch's outermost `at::_ops::` frame (and the innermost other one,
    `einsum>_to_copy`), or our op frame; '?' when the frames name none."""
    ops = [m.group(1) for m in map(_CARD_OP.match, (f.name for f in event.frames)) if m]
    if ops:
        inner = next((op for op in ops if not op.startswith("empty")), ops[-1])
        return ops[-1] if inner == ops[-1] else f"{ops[-1]}>{inner}"
    ours = [f.name for f in event.frames if f.filename == "??" and _OUR_OP.match(f.name)]
    return ours[0] if ours else "?"


def line_of(event: Event) -> str:
    """The innermost Python frame of the user's code (not torch's, not a library's): 'file.py:12 name'."""
    for frame in event.frames:
        path = frame.filename
        if path.endswith(".py") and not any(part in path for part in _NOT_USER):
            return f"{path.replace(chr(92), '/').rsplit('/', 1)[-1]}:{frame.line} {frame.name}"
    return "(no Python frame: autograd's thread)" if event.frames else "(no frames recorded)"


# ------------------------------------------------------------------------------------------ rendering


def render(comparison: Alignment, width: int = WIDTH) -> str:
    """The comparison for a terminal, every line within `width` columns."""
    c = comparison
    lines = [
        f"card:       {c.card_path} (device {c.card_device})",
        f"prediction: {c.ours_path} (device {c.our_device})",
        "",
        f"{'':<16}{'card':>14}{'prediction':>14}  difference",
    ]
    for name in ("allocated", "reserved", "requested"):
        real, ours = getattr(c.card, name), getattr(c.ours, name)
        lines.append(f"{'peak ' + name:<16}{format_size(real):>14}{format_size(ours):>14}  {_delta(real, ours)}")
    share = f"{c.aligned / c.card.requests:.1%}" if c.card.requests else "100.0%"
    lines.append(
        f"{'requests':<16}{c.card.requests:>14,}{c.ours.requests:>14,}  {c.aligned:,} aligned ({share} of the card's)"
    )
    lines.append("")
    if c.cut:
        lines.append(f"more than {MAX_EDITS} requests differ in the middle: it is counted as one run")
    if not c.difference_count:
        lines.append("every request of the card is the prediction's, in order and size")
    else:
        more = (
            f" (first {len(c.differences)} of {c.difference_count:,})"
            if c.difference_count > len(c.differences)
            else ""
        )
        lines.append(f"requests that differ{more}:")
        for number, difference in enumerate(c.differences, 1):
            lines += _difference_lines(number, difference)
    return "\n".join(line if i < 2 else _fit(line, width) for i, line in enumerate(lines))  # paths in full


def _delta(real: int, ours: int) -> str:
    if real == ours:
        return "equal"
    sign = "+" if ours > real else "-"
    share = f" ({(ours - real) / real:+.1%})" if real else ""
    return f"{sign}{format_size(abs(ours - real))}{share}"


def _difference_lines(number: int, difference: Difference) -> list[str]:
    head = f"{number:>3}. "
    card = _side("card", difference.card, difference.card_count)
    ours = _side("ours", difference.ours, difference.our_count)
    return [head + card, " " * len(head) + ours]


def _side(who: str, request: Request | None, count: int) -> str:
    if request is None:
        return f"{who}: nothing here"
    runs = f" (+{count - 1:,} more)" if count > 1 else ""
    return f"{who} #{request.index:,}: {format_size(request.size)} by {request.op} at {request.line}{runs}"


def _fit(line: str, width: int) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def to_json(comparison: Alignment) -> dict[str, Any]:
    """The comparison as plain JSON values (`--json`)."""
    c = comparison

    def peaks(p: Peaks) -> dict[str, int]:
        return {"peak_allocated": p.allocated, "peak_reserved": p.reserved, "peak_requested": p.requested,
                "requests": p.requests}  # fmt: skip

    def request(r: Request | None) -> dict[str, Any] | None:
        return None if r is None else {"index": r.index, "bytes": r.size, "op": r.op, "line": r.line}

    return {
        "card": {"path": c.card_path, "device": c.card_device, **peaks(c.card)},
        "prediction": {"path": c.ours_path, "device": c.our_device, **peaks(c.ours)},
        "aligned": c.aligned,
        "cut": c.cut,
        "agree": c.agree,
        "difference_count": c.difference_count,
        "differences": [
            {
                "kind": d.kind,
                "card": request(d.card),
                "ours": request(d.ours),
                "card_count": d.card_count,
                "our_count": d.our_count,
            }
            for d in c.differences
        ],
    }


def run_against(
    args: argparse.Namespace, card: Snapshot, write: Callable[[Path, str], None], say: Callable[[str], None]
) -> int:
    """`pytest-gpumem replay REAL --against PREDICTED [--json PATH]`: print the comparison, write its JSON."""
    what_ifs = [flag for flag in ("alloc_conf", "capacity", "html") if getattr(args, flag, None)]
    if what_ifs:
        flag = "--" + what_ifs[0].replace("_", "-")
        raise ModelError(f"--against compares two snapshots as recorded: {flag} does not apply to it")
    ours = read_snapshot(args.against)
    comparisons = [compare(card, ours, d, our_device=o) for d, o in pairs(card, ours, args.device)]
    say("\n\n".join(map(render, comparisons)))
    if args.json is not None:
        document = {"devices": [to_json(c) for c in comparisons]}
        write(args.json, json.dumps(document, indent=2, allow_nan=False) + "\n")
    return 0
