"""Judging a measurement against its baseline: the one tolerance arithmetic, the verdicts, version warnings.

Comparison (``compare``) is one-sided. With tolerance ``t`` percent and slack ``s`` bytes, a stored peak
``b`` allows ``b + floor(b * t / 100) + s`` bytes: one byte more is ``REGRESSED`` (fails). Below
``b * (1 - t / 100) - s`` is ``IMPROVED`` (passes, "baseline can be lowered"). A change is worded in
percent up to ten times its baseline, beyond that (and from 0 B) in bytes (``change_text``). A test without a baseline
for this device is ``NEW`` (passes unless strict), but one that allocates nothing (0 B in every phase, no
gradients) needs none: it is ``OK`` against the 0 B it would store, strict or not, and is not recorded
(``allocates_nothing``). Integer arithmetic only, so the boundary is exact.

Pure data in, data out: no files (``file.py``), no pytest, no torch; the verdicts' types are
``results.baseline``'s. Typical use::

    store = file.load(path)                              # BaselineError -> pytest.UsageError
    for line in environment_warnings(store, identity, env): warn once
    verdict = compare(nodeid, current_entry, store.get(nodeid, identity), Tolerance(5, 1 << 20))
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Annotated

from cuda_allocator_model import format_size
from pytest_gpumem.baselines.schema import BaselineStore
from pytest_gpumem.constants import DEFAULT_SLACK_BYTES, DEFAULT_TOLERANCE_PERCENT
from pytest_gpumem.gradients.mismatches import compare_fingerprints
from pytest_gpumem.results.baseline import BaselineStatus, DeviceIdentity, Entry, Environment, PhaseComparison, Verdict
from pytest_gpumem.results.checks import short
from pytest_gpumem.results.codec import STORED, STORED_BYTES, read
from pytest_gpumem.results.explanation import Composition

__all__ = [
    "NOTHING_ALLOCATED",
    "Tolerance",
    "allocates_nothing",
    "change_text",
    "compare",
    "compare_peak",
    "environment_warnings",
    "passed_by_slack",
]

_SizeFormatter = Callable[[int], str]
_PERCENT_UP_TO = 10  # times its baseline: a larger change is said in bytes (104857500.0% of 8 B says nothing)


@dataclass(frozen=True, slots=True)
class Tolerance:
    """One-sided tolerance: ``percent`` of the stored value plus ``slack_bytes``.

    ``upper(b)`` is the largest passing value for a stored ``b``; ``lower(b)`` the smallest value that is
    not an improvement. Exact integer arithmetic (``percent`` is read as the decimal it prints as).
    """

    percent: float = DEFAULT_TOLERANCE_PERCENT
    slack_bytes: int = DEFAULT_SLACK_BYTES
    _num: int = field(init=False, repr=False, compare=False, default=0)
    _den: int = field(init=False, repr=False, compare=False, default=1)

    def __post_init__(self) -> None:
        if isinstance(self.percent, bool) or not isinstance(self.percent, (int, float)):
            raise ValueError(f"tolerance must be a number of percent, got {short(self.percent)}")
        if not math.isfinite(self.percent) or self.percent < 0:
            raise ValueError(f"tolerance must be a finite percentage >= 0, got {self.percent!r}")
        read(Annotated[int, STORED_BYTES], self.slack_bytes, "slack", STORED)
        ratio = _ratio(float(self.percent))
        object.__setattr__(self, "_num", ratio.numerator)
        object.__setattr__(self, "_den", ratio.denominator)

    def upper(self, stored: int) -> int:
        return stored + (stored * self._num) // self._den + self.slack_bytes

    def lower(self, stored: int) -> int:
        # ceil(stored * (1 - p) - slack)
        return -((-(stored * (self._den - self._num) - self.slack_bytes * self._den)) // self._den)

    def describe(self, fmt: _SizeFormatter = format_size) -> str:
        pct = f"{self.percent:g}%"
        return f"{pct} + {fmt(self.slack_bytes)}" if self.slack_bytes else pct


@functools.lru_cache(maxsize=64)
def _ratio(percent: float) -> Fraction:
    return Fraction(repr(percent)) / 100


def compare(
    nodeid: str,
    current: Entry,
    baseline: Entry | None,
    tolerance: Tolerance | None = None,
    *,
    strict: bool = False,
    fmt: _SizeFormatter = format_size,
    grad_rtol: float | Mapping[str, float] | None = None,
    grad_atol: float | None = None,
    record: str = "--gpumem-update",
) -> Verdict:
    """Compare a measurement with its stored baseline (``store.get(nodeid, current.identity)``).

    The whole-call peak and every phase are compared. Growth beyond ``tolerance.upper`` fails:
    ``"forward peak 20.1 MiB is 25.6% above baseline 16.0 MiB (tolerance 5% + 1.0 MiB)"``. A drop below
    ``tolerance.lower`` passes with an "improved" note. No baseline: ``NEW``, failing only when
    ``strict`` (which also fails a phase or gradients without a baseline); no baseline and nothing
    allocated (``allocates_nothing``): ``OK``, with a note. Gradients are compared when
    both sides have fingerprints (``grad_rtol``/``grad_atol`` as in ``compare_fingerprints``). ``record``
    is how the messages say to record what has no baseline.
    """
    if baseline is None and allocates_nothing(current):
        return _nothing_to_compare(nodeid, current)
    if baseline is None:
        return _without_baseline(nodeid, current, strict, record)
    tol = tolerance if tolerance is not None else _DEFAULT_TOLERANCE
    comparisons = _phase_comparisons(current, baseline, tol, fmt, record)
    problems = [c.message for c in comparisons if c.message is not None and _fails(c.status, strict)]
    notes = [c.message for c in comparisons if c.message is not None and not _fails(c.status, strict)]
    gradients = _gradient_verdict(current, baseline, strict, grad_rtol, grad_atol, record)
    problems += gradients.problems
    notes += gradients.notes
    return Verdict(
        nodeid=nodeid,
        status=_memory_status(comparisons),
        comparisons=comparisons,
        problems=tuple(problems),
        notes=tuple(notes),
        gradient_status=gradients.status,
        failed=bool(problems),
    )


NOTHING_ALLOCATED = "allocates nothing (0 B in every phase): no baseline needed"


def allocates_nothing(entry: Entry) -> bool:
    """Whether a measurement has nothing a baseline would hold: 0 B in the call and every phase, and no
    gradient fingerprints. Such a test needs no baseline, also under strict, and is not recorded."""
    return entry.peak_bytes == 0 and entry.gradients is None and not any(entry.phases.values())


def _nothing_to_compare(nodeid: str, current: Entry) -> Verdict:
    """``OK`` without a baseline: a test that allocates nothing matches the 0 B it would record."""
    peaks: list[tuple[str | None, int]] = [(None, current.peak_bytes), *current.phases.items()]
    return Verdict(
        nodeid=nodeid,
        status=BaselineStatus.OK,
        comparisons=tuple(PhaseComparison(n, None, v, None, None, BaselineStatus.OK) for n, v in peaks),
        problems=(),
        notes=(NOTHING_ALLOCATED,),
    )


def _without_baseline(nodeid: str, current: Entry, strict: bool, record: str) -> Verdict:
    """``NEW``: every peak without a baseline, the test failing only when ``strict``."""
    hint = f"no baseline for this test on {current.identity.key} (record one with {record})"
    peaks: list[tuple[str | None, int]] = [(None, current.peak_bytes), *current.phases.items()]
    return Verdict(
        nodeid=nodeid,
        status=BaselineStatus.NEW,
        comparisons=tuple(PhaseComparison(n, None, v, None, None, BaselineStatus.NEW) for n, v in peaks),
        problems=(hint,) if strict else (),
        notes=() if strict else (hint,),
        gradient_status=None if current.gradients is None else BaselineStatus.NEW,
        failed=strict,
    )


def _phase_comparisons(
    current: Entry, baseline: Entry, tol: Tolerance, fmt: _SizeFormatter, record: str
) -> tuple[PhaseComparison, ...]:
    """The whole call, then each measured phase, then each stored phase this run did not measure."""
    compared = [compare_peak(None, baseline.peak_bytes, current.peak_bytes, tol, fmt)]
    compared += [compare_peak(n, baseline.phases.get(n), v, tol, fmt, record) for n, v in current.phases.items()]
    compared += [compare_peak(n, v, None, tol, fmt) for n, v in baseline.phases.items() if n not in current.phases]
    return tuple(with_growth(c, baseline.composition, current.composition) for c in compared)


def _fails(status: BaselineStatus, strict: bool) -> bool:
    """Whether a comparison's message is a problem (else a note)."""
    return status == BaselineStatus.REGRESSED or (strict and status == BaselineStatus.NEW)


def _memory_status(comparisons: Sequence[PhaseComparison]) -> BaselineStatus:
    """``REGRESSED`` if any peak regressed, else ``IMPROVED`` if any improved, else ``OK``."""
    statuses = {c.status for c in comparisons}
    for status in (BaselineStatus.REGRESSED, BaselineStatus.IMPROVED):
        if status in statuses:
            return status
    return BaselineStatus.OK


@dataclass(frozen=True, slots=True)
class _GradientVerdict:
    status: BaselineStatus | None = None  # None: no gradients compared
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def _gradient_verdict(
    current: Entry,
    baseline: Entry,
    strict: bool,
    rtol: float | Mapping[str, float] | None,
    atol: float | None,
    record: str,
) -> _GradientVerdict:
    if current.gradients is not None and baseline.gradients is not None:
        grads = compare_fingerprints(baseline.gradients, current.gradients, rtol=rtol, atol=atol)
        status = BaselineStatus.OK if grads.ok else BaselineStatus.CHANGED
        return _GradientVerdict(status, tuple(grads.messages), tuple(grads.notes))
    if current.gradients is not None:
        message = (f"gradients have no baseline (record one with {record})",)
        return _GradientVerdict(BaselineStatus.NEW, message if strict else (), () if strict else message)
    if baseline.gradients is not None:
        return _GradientVerdict(notes=("the baseline has gradient fingerprints, this run recorded none",))
    return _GradientVerdict()


def with_growth(
    comparison: PhaseComparison, stored: Composition | None, current: Composition | None
) -> PhaseComparison:
    """A regression's message, with what grew most when both sides have a composition (`explain.growth`)."""
    if comparison.status != BaselineStatus.REGRESSED or comparison.message is None:
        return comparison
    from pytest_gpumem.explain.growth import what_grew

    grew = what_grew(stored, current, comparison.label)
    return comparison if grew is None else replace(comparison, message=f"{comparison.message}: {grew}")


def compare_peak(
    phase: str | None,
    stored: int | None,
    current: int | None,
    tol: Tolerance,
    fmt: _SizeFormatter,
    record: str = "--gpumem-update",
) -> PhaseComparison:
    """One peak (``phase``; ``None``: the whole call) against its stored value; either may be missing.
    The only place that decides ``REGRESSED`` and ``IMPROVED`` (also for ``pytest-gpumem compare``)."""
    label = "call" if phase is None else phase
    if stored is None:
        assert current is not None
        message = f"{label} peak {fmt(current)} has no baseline (record one with {record})"
        return PhaseComparison(phase, None, current, None, None, BaselineStatus.NEW, message)
    if current is None:
        message = f"{label} has a baseline ({fmt(stored)}) but was not measured in this run"
        return PhaseComparison(phase, stored, None, None, None, BaselineStatus.MISSING, message)
    allowed = tol.upper(stored)
    change = (current - stored) * 100 / stored if stored else None
    if current > allowed:
        by = _amount(stored, current, tol.percent, fmt)
        message = f"{label} peak {fmt(current)} is {by} above baseline {fmt(stored)} (tolerance {tol.describe(fmt)})"
        return PhaseComparison(phase, stored, current, allowed, change, BaselineStatus.REGRESSED, message)
    if current < stored and current < tol.lower(stored):  # lower(b) <= b: skip the arithmetic
        message = (
            f"{label} peak {fmt(current)} is {_amount(stored, current, tol.percent, fmt)} below baseline "
            f"{fmt(stored)} (tolerance {tol.describe(fmt)}): improved, baseline can be lowered (--gpumem-update)"
        )
        return PhaseComparison(phase, stored, current, allowed, change, BaselineStatus.IMPROVED, message)
    return PhaseComparison(phase, stored, current, allowed, change, BaselineStatus.OK)


def passed_by_slack(comparison: PhaseComparison, slack: int) -> bool:
    """Whether a peak that passed grew past its tolerance's percent and passed only by the slack's bytes
    (`Tolerance.upper` less the slack): growth a tiny config's CI would miss under the 1 MiB default."""
    stored, current, allowed = comparison.baseline, comparison.current, comparison.allowed
    if comparison.status != BaselineStatus.OK or not stored or current is None or allowed is None:
        return False
    return current > allowed - slack


def _in_percent(stored: int, current: int) -> bool:
    """Whether the change from `stored` to `current` bytes is worded in percent: where the baseline is not
    0 B and the change at most `_PERCENT_UP_TO` times it; else in bytes."""
    return stored > 0 and abs(current - stored) <= _PERCENT_UP_TO * stored


def change_text(stored: int, current: int) -> str:
    """A change as the report's and `pytest-gpumem compare`'s change column show it: '+25.6%', '-3.0%', or
    in bytes where a percent would say nothing ('+8.0 MiB' over a baseline of 8 B, `_in_percent`)."""
    if _in_percent(stored, current):
        return f"{(current - stored) * 100 / stored:+.1f}%"
    return ("+" if current >= stored else "") + format_size(current - stored)


def _amount(stored: int, current: int, tolerance: float, fmt: _SizeFormatter) -> str:
    """How far `current` is from `stored`, unsigned, for a message: '25.6%' or '8.0 MiB' (`_in_percent`)."""
    if _in_percent(stored, current):
        return f"{_pct(abs(current - stored) * 100 / stored, tolerance)}%"
    return fmt(abs(current - stored))


def _pct(change: float, tolerance: float) -> str:
    """One decimal, or more where one would hide that the change exceeds the tolerance (5.0% vs 5%)."""
    text = f"{change:.1f}"
    return text if float(text) > tolerance else f"{change:.6g}"


def environment_warnings(store: BaselineStore, identity: DeviceIdentity, env: Environment) -> list[str]:
    """Warnings to show once per run: baselines recorded with other torch/CUDA versions, or for other
    devices only. Empty when everything matches (or the store is empty)."""
    key = identity.key
    mine = 0
    others: dict[str, int] = {}
    versions: dict[Environment, int] = {}
    for per_device in store.entries.values():
        for k, entry in per_device.items():
            if k == key:
                mine += 1
                if entry.torch != env.torch or entry.cuda != env.cuda:
                    e = entry.environment
                    versions[e] = versions.get(e, 0) + 1
            else:
                others[k] = others.get(k, 0) + 1
    warnings: list[str] = []
    if mine == 0 and others:
        listed = ", ".join(f"{k} ({n})" for k, n in sorted(others.items(), key=lambda kv: (-kv[1], kv[0]))[:3])
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        warnings.append(f"{store.path} has no baselines for this device ({key}); it has baselines for {listed}{more}")
    if versions:
        n = sum(versions.values())
        ranked = sorted(versions.items(), key=lambda kv: (-kv[1], kv[0].describe()))
        listed = ", ".join(f"{e.describe()} ({c})" for e, c in ranked[:3])
        more = f" and {len(ranked) - 3} more" if len(ranked) > 3 else ""
        warnings.append(
            f"{n} of {mine} baselines in {store.path} for {key} were recorded with {listed}{more}; "
            f"this run uses {env.describe()}: peaks can differ between versions "
            "(refresh with --gpumem-update)"
        )
    return warnings


_DEFAULT_TOLERANCE = Tolerance()
