"""The terms a measured test runs on (`Terms`), beside its budget's peaks: the device's capacity, the bytes it
may leak, whether its trace is kept as evidence and whether its peaks are explained. A value: the
measurement sets itself and its backend up from it (`Measurement.set_up`), the judge holds the call to its
leak limit and names its capacity when the call runs out of memory."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pytest_gpumem.backends.base import Settings

if TYPE_CHECKING:
    from pytest_gpumem.budget import Budget, Limit


@dataclass(frozen=True)
class Terms:
    """What a measured test runs on beyond its peaks: the device's `capacity`, the bytes it may `leak`,
    whether its trace is kept for `evidence`, whether its peaks are explained (`explain`)."""

    capacity: Limit | None
    leak: Limit | None
    evidence: bool
    explain: bool = False

    @classmethod
    def of(
        cls, budget: Budget | None, capacity: Limit | None, leak: Limit | None, evidence: bool, explain: bool = False
    ) -> Terms:
        """The test's own marker values first, then the run's options."""
        if budget is not None:
            capacity = budget.capacity or capacity
            leak = budget.leak if budget.leak is not None else leak
            explain = explain or budget.explain
        return cls(capacity, leak, evidence, explain)

    @property
    def card(self) -> str | None:
        """The card the capacity names, whose cuBLAS workspaces the backend predicts (None: no card)."""
        return None if self.capacity is None else self.capacity.card

    def explaining(self, explain: bool) -> Terms:
        """These terms, explaining the call also when `explain` says so (a stored composition)."""
        return self if not explain or self.explain else dataclasses.replace(self, explain=True)

    def settings(self) -> Settings:
        """The backend's settings for a call on these terms (origins kept where a leak or evidence needs
        them, events where evidence does)."""
        capacity = None if self.capacity is None else self.capacity.bytes
        origins = self.leak is not None or self.evidence
        return Settings(capacity, origins=origins, events=self.evidence, explain=self.explain)
