"""The largest batch that fits: what a fit measured and answered (`BatchFit`), its answer in one line.

The peaks are absolute: the bytes allocated at the step's peak, everything live when it began
(parameters, gradients, optimizer state) included, as the backend counts them (the tracker: what the
test's call made; CUDA: the device's allocated bytes). A batch fits when a training loop of `LOOP_STEPS`
steps at that size runs held to the capacity. How the answer is found is
`pytest_gpumem.measure.fit_search`'s: guessed from the lines through the sampled timelines where the ops
are the same at every size (`pytest_gpumem.measure.lines`), else from the sampled peaks extrapolated, and
shown by loops held to the capacity where a run is cheap.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from cuda_allocator_model import Capacity, format_size, is_binary
from pytest_gpumem.backends.timeline import Timeline
from pytest_gpumem.measure.lines import MAX_BATCH, Lines

__all__ = ["LOOP_STEPS", "MAX_BATCH", "BatchFit", "Check", "Found", "Measure", "Sample"]

LOOP_STEPS = 3
"""The steps in a row a size's loop runs: the second starts on the cache the first left, with the
optimizer state the first made among its activations; the third shows that the cache holds steady."""

_ORDINALS = {1: "1st", 2: "2nd", 3: "3rd"}

FIRST_LINE = 100
"""Columns of `describe`'s first line: a test file's name before it (what `pytest -s` prints) still fits 120."""
WIDTH = 120
"""Columns of each of its other lines."""


@dataclass(frozen=True)
class Sample:
    """One run of the step, in bytes allocated as the backend counts them: when it began, at its peak and
    when it returned; `out_of_memory` when it raised OutOfMemoryError (the peak is then the one reached);
    `held` when the backend held it to a capacity; its `timeline` where the backend records one. The peak
    is of `reserved` bytes where the backend has an allocator's cache (what a card runs out on)."""

    start: int
    peak: int
    end: int
    out_of_memory: bool = False
    held: bool = False
    timeline: Timeline | None = None
    reserved: bool = False

    @property
    def left(self) -> int:
        """Bytes the run left allocated (state it created and kept: optimizer state, caches)."""
        return self.end - self.start

    def place(self) -> str | None:
        """What made the run's peak ('aten.mm.default (test_x.py:12)'), where it has a timeline."""
        timeline = self.timeline
        if timeline is None or not len(timeline):
            return None
        return timeline.place(max(range(len(timeline)), key=timeline.allocated.__getitem__))


class Measure(Protocol):
    """Runs a callable once and returns its `Sample`; with `limit`, allocations past that many bytes
    raise OutOfMemoryError where the backend can enforce it (the sample then says out_of_memory)."""

    def __call__(self, fn: Callable[[], object], limit: int | None = None) -> Sample: ...


class Found(str, Enum):
    """How an answer was found."""

    TIMELINE = "timeline"  # from the lines through the sampled timelines
    SEARCH = "search"  # by runs held to the capacity


@dataclass(frozen=True)
class Check:
    """A loop of the step at a batch size held to the capacity, to confirm or search an answer."""

    size: int
    peak: int  # bytes allocated at the loop's peak (the peak reached before it ran out, if it did)
    out_of_memory: bool
    enforced: bool  # whether the backend held the run to the capacity (else the peak is compared with it)
    at: str | None = None  # what made its peak, where the backend records a timeline
    steps: int = 1  # the steps it ran, the last the one that ran out where it did

    def fits(self, capacity: int) -> bool:
        return not self.out_of_memory and self.peak <= capacity


@dataclass(frozen=True)
class BatchFit:
    """The largest batch size whose absolute peak fits `capacity`, how it was found and what showed it."""

    sizes: tuple[int, ...]  # the sizes sampled, in the order they ran (larger ones added where none grew)
    peaks: tuple[int, ...]  # bytes allocated at each sampled size's peak, what was live before it included
    capacity: int
    largest: int | None  # None: not even batch 1 fits
    peak_bytes: int  # the peak at `largest` (at 1 if None): measured where it ran, else the lines' prediction
    found: Found
    confirmed: bool  # the answer ran within the capacity and the next size did not (or 1 did not)
    live: int = 0  # bytes allocated when the fit began
    left: tuple[int, ...] = ()  # bytes each size left allocated after it returned
    capacity_text: str | None = None
    checks: tuple[Check, ...] = ()  # the loops held to the capacity, in order
    at: str | None = None  # what made the peak at `largest` ('aten.mm.default (test_x.py:12)')
    warm_up: int = 0  # bytes the first run left allocated (optimizer state), after which it ran again
    note: str = ""  # why it was searched, or which sizes the lines left out
    unconfirmed: str = ""  # why it was not confirmed
    lines: Lines | None = None
    reserved: bool = False  # the peaks are of reserved bytes (the allocator's segments), as a card judges them
    card: Capacity | None = None  # the card the capacity names: `capacity` is its total less what lies outside
    expandable: int | None = None  # the answer with expandable segments, where the allocator's model had none
    expandable_checks: tuple[Check, ...] = ()  # the loops that found it

    @property
    def exact(self) -> bool:
        """Whether the answer follows from lines that three or more sampled sizes lie on exactly."""
        return self.found is Found.TIMELINE and self.lines is not None and self.lines.exact

    @property
    def binary(self) -> bool:
        return self.capacity_text is None or self.card is not None or is_binary(self.capacity_text)

    def size(self, n: int) -> str:
        """Bytes in the unit family the capacity was written in."""
        return format_size(n, binary=self.binary)

    def predict(self, n: int) -> int | None:
        """The peak at batch size `n` from the timelines' lines (rounded up), where they were fitted."""
        return None if self.lines is None else self.lines.peak(n)

    def describe(self) -> str:
        """The answer in its first line: the largest batch, its peak and what made it (`FIRST_LINE` columns
        at most, where it was made a line of its own past them); then a line each, indented, for what was live,
        the card, how it was found and shown, the warm-up and fragmentation (wrapped at `WIDTH`)."""
        at = f" at {self.at}" if self.at else ""
        peak = self.size(self.peak_bytes) + (" reserved" if self.reserved else "")
        if self.largest is None:
            ran_out = self.found is Found.SEARCH and any(c.size == 1 and c.out_of_memory for c in self.checks)
            head = f"no batch fits {self._cap}: batch 1 needs {'more than ' if ran_out else ''}{peak}"
        else:
            head = f"largest batch that fits {self._cap}: {self.largest:,}, peak {peak}"
        head, made = (head + at, "") if len(head + at) <= FIRST_LINE else (head, f"peak{at}")
        kept = "optimizer state, cuBLAS workspaces?" if self.reserved else "optimizer state?"
        details = [
            made,
            f"of which {self.size(self.live)} was live when the fit began",
            self._on_card(),
            self._how(),
            self._shown(),
            f"the first run left {self.size(self.warm_up)} allocated ({kept}) and ran again as a warm-up"
            if self.warm_up
            else "",
            self._fragmentation(),
        ]
        return "\n".join([head, *(_indented(detail) for detail in details if detail)])

    @property
    def fragmented(self) -> bool:
        """Whether fragmentation decided the answer: with expandable segments it differs."""
        return bool(self.expandable_checks) and self.expandable != self.largest

    def _fragmentation(self) -> str:
        if not self.fragmented:
            return ""
        with_ = "none" if self.expandable is None else f"{self.expandable:,}"
        without = "none" if self.largest is None else f"{self.largest:,}"
        return f"fragmentation decides it: with expandable segments: {with_}; without: {without}"

    def _on_card(self) -> str:
        """What a card's capacity judges: the allocator's reserved bytes within its total less what lies
        outside the allocator."""
        if self.card is None:
            return ""
        judged = "reserved" if self.reserved else "allocated"
        return f"judged on {judged} memory plus what lies outside the allocator: {self.card.describe()}"

    @property
    def _cap(self) -> str:
        return self.capacity_text or f"{self.capacity:,} B"

    def _how(self) -> str:
        if self.found is Found.SEARCH or self.lines is None:
            loops = f"loops of {LOOP_STEPS} steps at {len(self.checks)} sizes held to the capacity"
            return f"searched by {loops} ({self.note})"
        lines = self.lines
        if self.exact:
            quality = "exactly"
        elif len(set(lines.sizes)) < 3:
            quality = "unchecked (2 sizes)"
        else:
            quality = f"within {self.size(lines.residual)}"
        note = f" ({self.note})" if self.note else ""
        return f"found {quality} from the timelines of sizes {integers(lines.sizes)}{note}"

    def _shown(self) -> str:
        if not self.confirmed:
            return f"not confirmed: {self.unconfirmed}" if self.unconfirmed else ""
        if self.largest is None:
            return f"confirmed: batch 1 {self._ran(1)}"
        shown = f"confirmed: {self.largest:,} {self._ran(self.largest)}"
        return shown if self.largest == MAX_BATCH else f"{shown}, {self.largest + 1:,} {self._ran(self.largest + 1)}"

    def _ran(self, n: int) -> str:
        check = next((c for c in reversed(self.checks) if c.size == n), None)
        if check is None:
            return "was not run"
        if check.out_of_memory:
            step = _ORDINALS.get(check.steps, f"{check.steps}th")
            return f"ran out of memory in its {step} step after {self.size(check.peak)}"
        steps = f"{check.steps} steps"
        if check.fits(self.capacity):
            return f"ran {steps} within {self._cap}" if check.enforced else f"ran {steps}, peak {self.size(check.peak)}"
        return f"ran {steps}, peaked at {self.size(check.peak)}"


def _indented(detail: str) -> str:
    """A detail line of `describe`: indented, and wrapped between words past `WIDTH` columns (never between
    a figure and its unit)."""
    kept = _FIGURE.sub("\\1\N{NO-BREAK SPACE}", detail)
    wrapped = textwrap.wrap(
        kept, WIDTH, initial_indent="  ", subsequent_indent="    ", break_long_words=False, break_on_hyphens=False
    )
    return "\n".join(wrapped).replace("\N{NO-BREAK SPACE}", " ")


_FIGURE = re.compile(r"(\d) (?=(?:[kMGTP]i?)?B\b)")


def integers(values: Sequence[int]) -> str:
    """'1, 2, 4,096': sizes and bytes as a fit's messages list them."""
    return ", ".join(f"{v:,}" for v in values)
