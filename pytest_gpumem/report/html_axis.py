"""The chart's event axis: where each event of the call lies across the chart's width.

What a test runs that no phase measures (gpumem.advise's runs of the step, gpumem.check_gradients'
fingerprints) can be most of a call's events. Each such span is folded to a narrow part of the axis,
labeled with what ran, so that the test's own phases get the width; the measured events share the rest
in proportion. The script maps an event through `segments` (each a stretch of events and the part of
the width it takes, in order) and draws the ticks chosen here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cuda_allocator_model import nice_step
from pytest_gpumem.results.explanation import UnmeasuredSpan

_FOLD_SHARE = 0.08  # the most of the chart's width one folded span takes
_FOLDED_SHARE = 0.24  # the most all folded spans take together
_TICKS = 8  # about how many ticks the event axis has
_TICK_GAP = 0.05  # the least distance between two ticks, as a share of the width


@dataclass(frozen=True)
class AxisSpan:
    """Events `start` to `end` drawn from `left` to `right` (shares of the chart's width)."""

    start: int
    end: int
    left: float
    right: float
    by: str | None = None  # what ran in a folded span; None where the events are measured

    def to_json(self) -> list[Any]:
        return [self.start, self.end, round(self.left, 6), round(self.right, 6)]


@dataclass(frozen=True)
class Axis:
    """The event axis up to event `top`: its segments, in order, from event 0 to `top`."""

    top: int
    segments: tuple[AxisSpan, ...]

    @property
    def folds(self) -> list[AxisSpan]:
        return [segment for segment in self.segments if segment.by is not None]

    def position(self, event: float) -> float:
        """Where `event` lies, as a share of the chart's width."""
        for part in self.segments:
            if event <= part.end:
                if part.end == part.start:
                    return part.left
                return part.left + (max(event, part.start) - part.start) / (part.end - part.start) * (
                    part.right - part.left
                )
        return 1.0

    def fold_at(self, event: int) -> AxisSpan | None:
        """The folded span that moment `event` lies inside (its edges are the measured moments around it)."""
        return next((part for part in self.folds if part.start < event < part.end), None)


def event_axis(top: int, unmeasured: Sequence[UnmeasuredSpan] = ()) -> Axis:
    """The axis of a call of `top` events whose `unmeasured` spans are folded."""
    spans = _spans(top, unmeasured)
    measured = top - sum(end - start for _, start, end in spans)
    shares = [(end - start) / top for _, start, end in spans]
    widths = [min(share, _FOLD_SHARE) for share in shares] if measured > 0 else shares
    if sum(widths) > _FOLDED_SHARE and measured > 0:
        widths = [width * _FOLDED_SHARE / sum(widths) for width in widths]
    room = 1.0 - sum(widths)
    segments: list[AxisSpan] = []
    cursor, x = 0, 0.0
    for (by, start, end), width in zip(spans, widths, strict=True):
        if start > cursor:
            step = room * (start - cursor) / measured
            segments.append(AxisSpan(cursor, start, x, x + step))
            x += step
        segments.append(AxisSpan(start, end, x, x + width, by))
        cursor, x = end, x + width
    if cursor < top or not segments:
        segments.append(AxisSpan(cursor, top, x, 1.0))
    return Axis(top, tuple(segments))


def _spans(top: int, unmeasured: Sequence[UnmeasuredSpan]) -> list[tuple[str, int, int]]:
    """The unmeasured spans inside [0, top], in order, overlapping ones joined."""
    spans: list[tuple[str, int, int]] = []
    for span in sorted(unmeasured, key=lambda span: span.start):
        start, end = max(0, span.start), min(top, span.end)
        if end <= start:
            continue
        if spans and start < spans[-1][2]:
            by, first, last = spans.pop()
            spans.append((by if span.by in by.split(" + ") else f"{by} + {span.by}", first, max(last, end)))
        else:
            spans.append((span.by or "unmeasured", start, end))
    return spans


def event_ticks(axis: Axis) -> list[list[Any]]:
    """About `_TICKS` round steps of whole events over the measured segments, none inside a folded span
    and none crowding the one before."""
    measured = [part for part in axis.segments if part.by is None]
    count = sum(part.end - part.start for part in measured) or axis.top
    step = max(1, int(nice_step(max(count, 1) / _TICKS)))
    candidates = sorted(
        {0, *(e for part in measured for e in range(-(-part.start // step) * step, part.end + 1, step))}
    )
    kept: list[int] = []
    for event in candidates:
        if axis.fold_at(event) is None and (not kept or axis.position(event) - axis.position(kept[-1]) >= _TICK_GAP):
            kept.append(event)
    return [[event, f"{event:,}"] for event in kept]
