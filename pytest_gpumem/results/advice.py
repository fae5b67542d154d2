"""What `gpumem.advise` found, as plain data: one row per strategy (or combination) tried on the step.

No torch here: the failure line and the report section (`report/advice_text.py`) read an Advice without
importing it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from cuda_allocator_model import capacity_bytes as card_bytes
from cuda_allocator_model import format_size, shorten
from pytest_gpumem.errors import GpuMemError, from_the_model
from pytest_gpumem.results.checks import first_difference
from pytest_gpumem.results.codec import REPORT, Spec, Wording, encode, read

AS_IS = "as-is"
NOT_CHECKED = "not checked"
WIDTH = 120  # a row's phases and gradients share a line up to this many characters


@dataclass(frozen=True)
class PhasePeak:
    """A phase's peak above what was allocated when the phase began (`peak_bytes`: what a test's
    gpumem.phase() of the same code measures), and above what was allocated when the step began
    (`above_start`: what the step holds at the phase's peak, the earlier phases' leftovers included)."""

    name: str
    peak_bytes: int
    above_start: int | None = None

    @property
    def step_peak(self) -> int:
        return self.peak_bytes if self.above_start is None else self.above_start


@dataclass(frozen=True)
class Row:
    """One strategy (or combination, `strategies` naming its parts) and what it measured: `peak_bytes`,
    the step's peak above what was allocated when it began (the absolute peak is `Advice.absolute(row)`),
    each phase's peaks, FLOPs counted over the whole step, and the gradients' check."""

    name: str
    description: str
    strategies: tuple[str, ...]
    peak_bytes: int | None = None
    phases: tuple[PhasePeak, ...] = ()
    saving_bytes: int | None = None
    flops: int | None = None
    extra_flops: int | None = None
    gradients: str = NOT_CHECKED  # "equal (...)", "differ (...)", "not checked ..."
    gradients_equal: bool | None = None
    fits: bool | None = None
    skipped: str | None = None  # why it was not measured (does not apply, or failed)
    reserved_bytes: int | None = None  # the allocator's reserved peak (absolute), where the backend has one
    precision: str | None = None  # the lower precision the run computes in ("bfloat16"); None: the step's own
    seconds: float | None = None  # the run's time: preparing it, the step and the gradients' check
    calls: int | None = None  # ops the step dispatched (kernels launched), counted over the whole step
    extra_calls: int | None = None  # against as-is: micro-batches and recomputed cheap ops cost calls, not FLOPs

    @property
    def measured(self) -> bool:
        return self.skipped is None and self.peak_bytes is not None

    def region_peak(self, name: str) -> int | None:
        """The peak of phase `name` (forward, backward, step), or of the whole step for any other name."""
        for phase in self.phases:
            if phase.name == name:
                return phase.peak_bytes
        return self.peak_bytes

    @property
    def peak_phase(self) -> str | None:
        """The phase in which the step's peak came (the first of equal ones), None without phases."""
        if not self.phases:
            return None
        return max(self.phases, key=lambda p: p.step_peak).name

    def lowers(self, base: Row, phase: str | None) -> bool:
        """Whether this row alone lowered `phase` (what the step holds at that phase's peak) against `base`,
        as-is; a phase it no longer has (a fused step has no step phase) is lowered, one `base` lacks cannot
        be judged, and None (no phase to judge) is lowered."""
        if phase is None:
            return True
        was = next((p.step_peak for p in base.phases if p.name == phase), None)
        now = next((p.step_peak for p in self.phases if p.name == phase), None)
        return was is None or now is None or now < was


def capacity_bytes(value: object, where: str) -> int:
    """`value` (bytes, a size such as "80 GiB" or a card such as "H100-80GB", see `cuda_allocator_model.cards`) in the
    bytes the allocator is held to; anything else refused in one line naming `where`."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise GpuMemError(f"{where} must be an int (bytes), a size such as '80 GiB' or a card, got {shorten(value)}")
    with from_the_model():
        return card_bytes(value, where)


def held_bytes(absolute: int, reserved: int | None) -> int:
    """What a step holds of a card at its peak: the allocator's reserved bytes where they were measured
    (a card runs out on them), else its absolute peak (what was live when it began + its peak above)."""
    return absolute if reserved is None else max(reserved, absolute)


@dataclass(frozen=True)
class Advice:
    """The rows (as-is first), the capacity they were judged against (None: not judged), and which
    strategies cannot be combined. `live_bytes`: what was allocated when the step began, as the backend
    counts it, plus the model's state it did not see allocated (parameters made before it observed);
    a row's absolute peak, judged against the capacity, is `live_bytes` + its peak above the start (as
    `pytest_gpumem.measure.fit` judges a batch). `resident_bytes`: the part of it that is the model's
    parameters, buffers, gradients and optimizer state."""

    rows: tuple[Row, ...]
    capacity: int | None
    live_bytes: int
    backend: str
    device: str
    resident_bytes: int = 0
    conflicts: tuple[str, ...] = ()
    seconds: float = 0.0

    @property
    def as_is(self) -> Row:
        return self.rows[0]

    def row(self, name: str) -> Row:
        for row in self.rows:
            if row.name == name:
                return row
        raise GpuMemError(f"advice has no row {shorten(name)} (rows: {', '.join(r.name for r in self.rows)})")

    def absolute(self, row: Row) -> int:
        """The row's absolute peak: what was live when the step began + the step's peak above that."""
        if row.peak_bytes is None:
            raise GpuMemError(f"advice row {row.name!r} was not measured: {row.skipped}")
        return self.live_bytes + row.peak_bytes

    def held(self, row: Row) -> int:
        """What the row holds of a card at its peak (`held_bytes`)."""
        return held_bytes(self.absolute(row), row.reserved_bytes)

    def fits(self, row: Row, capacity: int) -> bool:
        return row.peak_bytes is not None and self.held(row) <= capacity

    def best(self, capacity: int | str | None = None) -> Row | None:
        """The cheapest row (`cheapest`: the step's own precision first, then the least extra compute,
        then the lowest peak) whose absolute peak is within `capacity` (default: the one given to advise)
        and whose gradients were not found to differ; None if none fits. The as-is row is a candidate:
        when it fits, nothing needs to change."""
        limit = self.capacity if capacity is None else capacity_bytes(capacity, "Advice.best(capacity=...)")
        if limit is None:
            raise GpuMemError("Advice.best() needs a capacity (none was given to gpumem.advise)")
        return cheapest([r for r in self.usable() if self.fits(r, limit)])

    def best_within(self, limits: Mapping[str, int], observed: Mapping[str, int]) -> tuple[Row, dict[str, int]] | None:
        """The cheapest strategy (not as-is) that keeps every region within its limit, with the figures
        predicted for those regions: what the test measured, moved by the row's change of that region's
        peak against as-is (`observed[region] - as_is + row`)."""
        base = self.as_is
        fitting = []
        for row in self.usable():
            if row.name == AS_IS:
                continue
            predicted = {region: _moved(observed[region], base, row, region) for region in limits}
            if all(value <= limits[region] for region, value in predicted.items()):
                fitting.append((row, predicted))
        if not fitting:
            return None
        chosen = cheapest([row for row, _ in fitting])
        return next(pair for pair in fitting if pair[0] is chosen)

    def usable(self) -> list[Row]:
        return [r for r in self.rows if r.measured and r.gradients_equal is not False]

    def compute(self, row: Row) -> str:
        """'+31% compute' (extra FLOPs against as-is), 'no extra compute', or '+N FLOPs'; where the row
        dispatched more ops than as-is, the FLOPs and those calls: 'no extra FLOPs, +300% op calls'
        (micro-batches run every op once per slice; selective recompute runs cheap ops again)."""
        extra, base = row.extra_flops, self.as_is.flops
        if extra is None:
            return "compute unknown"
        calls = self._calls(row)
        if calls is None:
            return "no extra compute" if extra == 0 else _flops(extra, base, "compute")
        return f"{'no extra FLOPs' if extra == 0 else _flops(extra, base, 'FLOPs')}, {calls}"

    def _calls(self, row: Row) -> str | None:
        """'+300% op calls' where the row dispatched more ops than as-is, else None."""
        extra, base = row.extra_calls, self.as_is.calls
        if extra is None or extra <= 0:
            return None
        return f"{extra / base:+.0%} op calls" if base else f"{extra:+,} op calls"

    def lines(self) -> list[str]:
        """The report section: two lines per measured row (absolute peaks), then the skipped ones and
        the conflicts."""
        cap = "" if self.capacity is None else f"; capacity {format_size(self.capacity)}"
        found = [
            f"advice ({self.backend} on {self.device}, {self.seconds:.1f} s{cap}): absolute peaks; "
            f"{format_size(self.live_bytes)} live at the step's start, {format_size(self.resident_bytes)} of it "
            "model state"
        ]
        for row in self.rows:
            if not row.measured:
                continue
            assert row.peak_bytes is not None
            saving = "" if row.name == AS_IS else f", saves {format_size(row.saving_bytes or 0)}"
            judged = "" if self.capacity is None else format_size(self.capacity)
            fits = "" if row.fits is None else (f"; fits {judged}" if row.fits else f"; does not fit {judged}")
            where = "" if row.peak_phase is None else f" in {row.peak_phase}"
            reserved = "" if row.reserved_bytes is None else f", {format_size(row.reserved_bytes)} reserved"
            precision = "" if row.precision is None else f"; in {row.precision}"
            found.append(
                f"  {row.name}: peak {format_size(self.absolute(row))}{where} = {format_size(self.live_bytes)} at "
                f"the start + {format_size(row.peak_bytes)}{reserved}{saving}; {self.compute(row)}{precision}{fits}"
            )
            phases = ", ".join(f"{p.name} {format_size(self.live_bytes + p.step_peak)}" for p in row.phases)
            second = f"    {'absolute: ' + phases + '; ' if phases else ''}gradients {row.gradients}"
            if len(second) > WIDTH and phases:
                found += [f"    absolute: {phases}", f"    gradients {row.gradients}"]
            else:
                found.append(second)
        found += [f"  skipped {row.name}: {row.skipped}" for row in self.rows if row.skipped is not None]
        found += [f"  conflict: {text}" for text in self.conflicts]
        timing = self.timing()
        return found + ([f"  time: {timing}"] if timing else [])

    def timing(self) -> str | None:
        """Where advise's time went: 'as-is 0.42 s; the 9 other runs 1.0-1.4x it, the slowest micro-batch-4
        0.59 s' (None for advice written before rows were timed)."""
        base = self.as_is.seconds
        timed = [r for r in self.rows[1:] if r.seconds is not None]
        if base is None:
            return None
        text = f"as-is {base:.2f} s"
        if not timed or base <= 0:
            return text
        ratios = [(r.seconds or 0.0) / base for r in timed]
        slowest = max(timed, key=lambda r: r.seconds or 0.0)
        runs = f"the {len(timed)} other runs" if len(timed) > 1 else "the other run"
        return (
            f"{text}; {runs} {min(ratios):.1f}-{max(ratios):.1f}x it, the slowest {slowest.name} "
            f"{slowest.seconds:.2f} s"
        )

    def to_json(self) -> dict[str, Any]:
        """The advice as a report holds it: each measured row's absolute peaks beside its own."""
        rows = tuple(_stored_row(row, self.live_bytes) for row in self.rows)
        stored = _StoredAdvice(
            self.capacity, self.live_bytes, self.resident_bytes, self.backend, self.device, round(self.seconds, 3),
            rows, self.conflicts,
        )  # fmt: skip
        written: dict[str, Any] = encode(stored)
        return written

    @classmethod
    def from_json(cls, data: object, where: str = "advice") -> Advice:
        """The advice `to_json` wrote (a test's `advice` in the report); raises `OffShape` naming the first
        value at or below `where` that is not as written: a missing or unknown key, a value of another type,
        a figure the advice would not write (an absolute peak that is not the start plus the row's)."""
        stored: _StoredAdvice = read(_StoredAdvice, data, where)
        live = stored.live_bytes
        rows = tuple(_row_of(row, live) for row in stored.rows)
        advice = cls(
            rows, stored.capacity, live, stored.backend, stored.device, stored.resident_bytes, stored.conflicts,
            stored.seconds,
        )  # fmt: skip
        found = first_difference(data, advice.to_json(), where)
        if found is not None:
            raise REPORT.not_as_written(*found)
        return advice


@dataclass(frozen=True)
class _StoredRow:
    """The keys every row of an advice's JSON starts with."""

    name: str
    description: str
    strategies: tuple[str, ...]
    seconds: Annotated[float | None, Spec(omit=None)] = None


@dataclass(frozen=True, kw_only=True)
class _SkippedRow(_StoredRow):
    skipped: str


@dataclass(frozen=True, kw_only=True)
class _MeasuredRow(_StoredRow):
    """A measured row's JSON: its peaks, and the absolute ones (what was live at the step's start + them)."""

    absolute_peak_bytes: int
    peak_bytes: int
    peak_phase: str | None
    phases: Mapping[str, int]
    absolute_phases: Mapping[str, int]
    saving_bytes: int | None
    flops: int | None
    extra_flops: int | None
    calls: int | None
    extra_calls: int | None
    gradients: str
    gradients_equal: bool | None
    fits: bool | None
    reserved_peak_bytes: int | None
    precision: str | None


def _read_row(value: Any, where: str | None, wording: Wording) -> _StoredRow:
    skipped = isinstance(value, dict) and "skipped" in value
    return read(_SkippedRow if skipped else _MeasuredRow, value, where, wording)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class _StoredAdvice:
    capacity: int | None
    live_bytes: int
    resident_bytes: int
    backend: str
    device: str
    seconds: float
    rows: tuple[Annotated[_StoredRow, Spec(via=(_read_row, encode))], ...]
    conflicts: tuple[str, ...]


_SAME = (
    "saving_bytes",
    "flops",
    "extra_flops",
    "calls",
    "extra_calls",
    "gradients",
    "gradients_equal",
    "fits",
    "precision",
)
"""A measured row's fields written under their own names, as they are."""


def _stored_row(row: Row, live: int) -> _StoredRow:
    head = (row.name, row.description, row.strategies, None if row.seconds is None else round(row.seconds, 3))
    if row.skipped is not None:
        return _SkippedRow(*head, skipped=row.skipped)
    assert row.peak_bytes is not None
    return _MeasuredRow(
        *head,
        absolute_peak_bytes=live + row.peak_bytes,
        peak_bytes=row.peak_bytes,
        peak_phase=row.peak_phase,
        phases={p.name: p.peak_bytes for p in row.phases},
        absolute_phases={p.name: live + p.step_peak for p in row.phases},
        reserved_peak_bytes=row.reserved_bytes,
        **{key: getattr(row, key) for key in _SAME},
    )


def _row_of(stored: _StoredRow, live: int) -> Row:
    """The row `stored` is the JSON of (a phase's step peak read back from its absolute peak)."""
    head = (stored.name, stored.description, stored.strategies)
    if isinstance(stored, _SkippedRow):
        return Row(*head, skipped=stored.skipped, seconds=stored.seconds)
    assert isinstance(stored, _MeasuredRow)
    absolute = stored.absolute_phases
    return Row(
        *head,
        peak_bytes=stored.peak_bytes,
        phases=tuple(PhasePeak(name, peak, absolute[name] - live if name in absolute else None)
                     for name, peak in stored.phases.items()),
        reserved_bytes=stored.reserved_peak_bytes,
        seconds=stored.seconds,
        **{key: getattr(stored, key) for key in _SAME},
    )  # fmt: skip


def _flops(extra: int, base: int | None, unit: str) -> str:
    return f"{extra / base:+.0%} {unit}" if base else f"{extra:+,} FLOPs"


def _moved(observed: int, base: Row, row: Row, region: str) -> int:
    before, after = base.region_peak(region), row.region_peak(region)
    if before is None or after is None:
        return observed
    return max(0, observed - before + after)


def cheapest(rows: list[Row]) -> Row | None:
    """The row that costs least: one that keeps the step's precision before one that lowers it (a change
    of the numbers computed, however small the gradients' error), then the least extra compute: FLOPs,
    then op calls (as-is first on a tie), then the lowest peak."""
    if not rows:
        return None
    return min(rows, key=_cost)


def _cost(row: Row) -> tuple[bool, float, int, bool, int]:
    extra = math.inf if row.extra_flops is None else row.extra_flops
    calls = max(0, row.extra_calls or 0)
    return (row.precision is not None, extra, calls, row.name != AS_IS, row.peak_bytes or 0)
