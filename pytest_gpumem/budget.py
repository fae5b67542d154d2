"""The `max_memory` marker, read into a frozen, validated `Budget`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cuda_allocator_model import MAX_TEXT, ModelError, format_size, is_binary, parse_size, shorten
from pytest_gpumem.errors import GpuMemError, from_the_model
from pytest_gpumem.marker import MARKER as MARKER

if TYPE_CHECKING:
    from pytest_gpumem.results import PhaseResult


@dataclass(frozen=True)
class Limit:
    """One limit: bytes, and the text the user wrote (echoed in messages)."""

    bytes: int
    written: str
    binary: bool
    card: str | None = None  # a capacity that names a card: its name (`bytes` is its total less what lies outside)

    def fmt(self, n: int) -> str:
        """`n` in the limit's family of units, exact when rounding would make it look equal to the limit."""
        text = format_size(n, binary=self.binary)
        return text if text != format_size(self.bytes, binary=self.binary) else f"{text} ({n:,} B)"


@dataclass(frozen=True)
class Budget:
    """Limits on the whole call (`total`) and on named phases; `tolerance` in percent, for baselines."""

    total: Limit | None = None
    phases: Mapping[str, Limit] = field(default_factory=dict)
    tolerance: float | None = None
    capacity: Limit | None = None  # the device's size: an allocation past it raises OutOfMemoryError
    leak: Limit | None = None  # bytes the call may leave allocated after it returns
    device: str | None = None  # "meta": this test is a prediction on the meta device (tracker)
    explain: bool = False  # explain the peaks: what was alive at each, who made it

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {name: limit.bytes for name, limit in self.phases.items()}
        if self.total is not None:
            data["call"] = self.total.bytes
        if self.tolerance is not None:
            data["tolerance"] = self.tolerance
        for name in ("capacity", "leak"):
            limit = getattr(self, name)
            if limit is not None:
                data[name] = limit.bytes
        if self.device is not None:
            data["device"] = self.device
        if self.explain:
            data["explain"] = True
        return data

    def describe(self) -> str:
        parts = [] if self.total is None else [self.total.written]
        parts += [f"{name}={limit.written}" for name, limit in self.phases.items()]
        parts += [] if self.tolerance is None else [f"tolerance {self.tolerance:g}%"]
        parts += [] if self.capacity is None else [f"capacity {self.capacity.written}"]
        parts += [] if self.leak is None else [f"leak {self.leak.written}"]
        parts += [] if self.device is None else [f"on {self.device}"]
        parts += ["explained"] if self.explain else []
        return ", ".join(parts)

    def unopened(self, opened: Mapping[str, PhaseResult]) -> list[str]:
        return [name for name in self.phases if name not in opened]

    def violations(self, call: PhaseResult, phases: Mapping[str, PhaseResult]) -> list[str]:
        """One sentence for each limit exceeded, e.g. 'backward peak 41.9 MB exceeds max_memory backward=40 MB'."""
        found = []
        if self.total is not None and call.peak_bytes > self.total.bytes:
            found.append(
                f"call peak {self.total.fmt(call.peak_bytes)}{_on_rank(call)} exceeds max_memory {self.total.written}"
            )
        for name, limit in self.phases.items():
            phase = phases.get(name)
            if phase is not None and phase.peak_bytes > limit.bytes:
                peak = f"{limit.fmt(phase.peak_bytes)}{_on_rank(phase)}"
                found.append(f"{name} peak {peak} exceeds max_memory {name}={limit.written}")
        return found


def _on_rank(phase: PhaseResult) -> str:
    return "" if phase.rank is None else f" on rank {phase.rank}"


def _stricter(a: Limit | None, b: Limit | None) -> Limit | None:
    return b if a is None or (b is not None and b.bytes < a.bytes) else a


def all_of(budgets: Sequence[Budget]) -> Budget:
    """Markers on one level (stacked decorators, a parameter's marks): every limit holds, so the
    strictest of each wins."""
    total, tolerance, phases = None, None, dict[str, Limit]()
    capacity: Limit | None = None
    leak: Limit | None = None
    for budget in budgets:
        total = _stricter(total, budget.total)
        capacity, leak = _stricter(capacity, budget.capacity), _stricter(leak, budget.leak)
        if budget.tolerance is not None:
            tolerance = budget.tolerance if tolerance is None else min(tolerance, budget.tolerance)
        for name, limit in budget.phases.items():
            phases[name] = _stricter(phases.get(name), limit) or limit
    device = next((b.device for b in budgets if b.device is not None), None)
    explain = any(b.explain for b in budgets)
    return Budget(
        total=total, phases=phases, tolerance=tolerance, capacity=capacity, leak=leak, device=device, explain=explain
    )


def closest_first(levels: Sequence[Budget]) -> Budget:
    """Markers on several levels (function, class, module), closest first: each limit and the
    tolerance come from the closest level that sets them, as a function's marker overrides its module's."""
    total, tolerance, phases = None, None, dict[str, Limit]()
    capacity: Limit | None = None
    leak: Limit | None = None
    device: str | None = None
    for budget in reversed(levels):
        total = budget.total or total
        device = budget.device or device
        capacity, leak = budget.capacity or capacity, budget.leak or leak
        tolerance = budget.tolerance if budget.tolerance is not None else tolerance
        phases.update(budget.phases)
    explain = any(b.explain for b in levels)
    return Budget(
        total=total, phases=phases, tolerance=tolerance, capacity=capacity, leak=leak, device=device, explain=explain
    )


def _limit(value: object, what: str, zero: bool = False) -> Limit:
    try:
        size = parse_size(value)
    except ModelError as exc:
        raise GpuMemError(f"{what}: {exc}") from None
    if size == 0 and not zero:
        raise GpuMemError(f"{what}: a limit must be above zero, got {shorten(value)}")
    written = value if isinstance(value, str) else f"{value} B"
    return Limit(size, written.strip(), is_binary(value))


def capacity_limit(value: object, what: str = "") -> Limit:
    """A capacity: a size (the allocator's limit) or a card (`cuda_allocator_model.cards.parse_capacity`), named
    `what` in its one-line error."""
    from cuda_allocator_model import parse_capacity

    prefix = f"{what}: " if what else ""
    with from_the_model():
        capacity = parse_capacity(value, what)
    if capacity.bytes == 0:
        raise GpuMemError(f"{prefix}a limit must be above zero, got {shorten(value)}")
    written = value if isinstance(value, str) else f"{value} B"
    card = None if capacity.card is None else capacity.card.name
    binary = capacity.on_a_card or is_binary(value)
    return Limit(capacity.bytes, written.strip(), binary, card)


def _tolerance(value: object) -> float:
    if isinstance(value, str) and len(value) > MAX_TEXT:
        raise GpuMemError(f"max_memory tolerance: text must be at most {MAX_TEXT} characters, got {shorten(value)}")
    text = value.strip().removesuffix("%").strip() if isinstance(value, str) else value
    try:
        if isinstance(text, bool) or not isinstance(text, (int, float, str)):
            raise ValueError
        percent = float(text)
    except ValueError:
        raise GpuMemError(f"max_memory tolerance: must be a percentage like 5 or '5%', got {shorten(value)}") from None
    except OverflowError:  # an int too large for a float
        percent = math.inf
    if not 0 <= percent < 1000:
        raise GpuMemError(f"max_memory tolerance: must be between 0 and 1000 percent, got {shorten(value)}")
    return percent


def budget_from_marker(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Budget:
    """Read `max_memory(limit=None, *, tolerance=None, **phase_limits)`; GpuMemError names the bad value."""
    kwargs = dict(kwargs)
    if len(args) > 1:
        raise GpuMemError(f"max_memory takes one positional limit, got {len(args)}: {shorten(args)}")
    if args and "limit" in kwargs:
        raise GpuMemError("max_memory got the limit both positionally and as limit=")
    if "call" in kwargs:
        raise GpuMemError("max_memory: 'call' is the whole test call; give its limit positionally: max_memory('1 GiB')")
    total = args[0] if args else kwargs.pop("limit", None)
    tolerance = kwargs.pop("tolerance", None)
    capacity, leak, device = kwargs.pop("capacity", None), kwargs.pop("leak", None), kwargs.pop("device", None)
    explain = kwargs.pop("explain", False)
    if not isinstance(explain, bool):
        raise GpuMemError(f"max_memory explain=: must be True or False, got {shorten(explain)}")
    if device is not None and device != "meta":
        raise GpuMemError(
            f"max_memory device=: only 'meta' (a prediction without data) is chosen per test, got {shorten(device)}"
        )
    if not (explain or kwargs or any(v is not None for v in (total, tolerance, capacity, leak, device))):
        raise GpuMemError(
            "max_memory needs a limit or a tolerance: max_memory('64 MiB'), max_memory(forward='20 MB') "
            "or max_memory(tolerance=10)"
        )
    return Budget(
        total=None if total is None else _limit(total, "max_memory limit"),
        phases={name: _limit(value, f"max_memory {name}=") for name, value in kwargs.items()},
        tolerance=None if tolerance is None else _tolerance(tolerance),
        capacity=None if capacity is None else capacity_limit(capacity, "max_memory capacity="),
        leak=None if leak is None else _limit(leak, "max_memory leak=", zero=True),
        device=device,
        explain=explain,
    )
