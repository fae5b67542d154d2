"""Why a measured test failed, as small frozen values: `outcome.judge()` returns them with the test's status,
and `report/failures.py` turns each into the test's one line and its report section."""

from __future__ import annotations

from dataclasses import dataclass

from pytest_gpumem.budget import Limit
from pytest_gpumem.results import Status


@dataclass(frozen=True)
class OverBudget:
    """Peaks past the budget's limits, each as the budget says it, the first limit exceeded first."""

    violations: tuple[str, ...]


@dataclass(frozen=True)
class Leaked:
    """The call left `net` bytes allocated, more than `limit` allows."""

    net: int
    limit: Limit


@dataclass(frozen=True)
class Regressed:
    """The baseline's comparison failed the test with `status` (a peak grew, gradients changed, a baseline
    is missing): `problems`, each a line of its own, `message` its whole line and `how` what the line adds
    after the problems (how to learn what grew)."""

    status: Status
    problems: tuple[str, ...]
    message: str
    how: str


@dataclass(frozen=True)
class AllocatorState:
    """What the CUDA allocator (or its model) held when a request did not fit, in bytes."""

    reserved: int
    allocated: int
    requested: int


@dataclass(frozen=True)
class OutOfMemory:
    """The call ran out of memory: in `phase` (None: the call itself), asking for `tried` (the allocator's
    own words, when it said), under `capacity` (None: the device's own memory), the allocator's state when
    its model saw it."""

    phase: str | None
    tried: str | None
    capacity: Limit | None
    state: AllocatorState | None


@dataclass(frozen=True)
class Unmeasurable:
    """Test `nodeid` cannot be measured, or its measurement cannot be kept, for the reason `why`."""

    nodeid: str
    why: str


@dataclass(frozen=True)
class Raised:
    """The test failed on its own: its exception, in one line."""

    line: str


Reason = OverBudget | Leaked | Regressed | OutOfMemory | Unmeasurable | Raised
