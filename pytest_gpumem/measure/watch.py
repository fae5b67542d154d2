"""What a measured test is held to beyond its peaks (`Watch`): the device's capacity, the bytes it may
leak, evidence, explanation. The lines it fails with are in `report/failures.py`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pytest_gpumem.backends.base import Settings
from pytest_gpumem.errors import GpuMemError

if TYPE_CHECKING:
    from pytest_gpumem.backends.base import Backend
    from pytest_gpumem.budget import Budget, Limit
    from pytest_gpumem.measure.measurement import Measurement


@dataclass(frozen=True)
class Watch:
    """What a measured test is held to beyond its peaks: the device's capacity, the bytes it may leak,
    and whether its trace is kept for evidence."""

    capacity: Limit | None
    leak: Limit | None
    evidence: bool
    explain: bool = False

    @classmethod
    def of(
        cls, budget: Budget | None, capacity: Limit | None, leak: Limit | None, evidence: bool, explain: bool = False
    ) -> Watch:
        """The test's own marker values first, then the run's options."""
        if budget is not None:
            capacity = budget.capacity or capacity
            leak = budget.leak if budget.leak is not None else leak
            explain = explain or budget.explain
        return cls(capacity, leak, evidence, explain)

    def predict_card(self, backend: Backend) -> None:
        """From the next allocation on, the backend predicts the capacity's card (its cuBLAS workspaces), or
        no card: before the test's baseline is looked up, as the card is part of the backend's identity."""
        backend.predict_card(None if self.capacity is None else self.capacity.card)

    def explaining(self, explain: bool) -> Watch:
        """This watch, explaining the call also when `explain` says so (a stored composition)."""
        return self if not explain or self.explain else dataclasses.replace(self, explain=True)

    def apply(self, backend: Backend, measured: Measurement) -> None:
        """Set up the backend for the next call (every measured test: nothing carries over), once the card
        is predicted (`predict_card`)."""
        measured.hold_to(leak_check=self.leak is not None, explain=self.explain)
        capacity = None if self.capacity is None else self.capacity.bytes
        origins = self.leak is not None or self.evidence
        if self.capacity is not None and not backend.caps_the_process:  # a test held to one must not run without
            raise GpuMemError(f"capacity {self.capacity.written}: the {backend.name} backend cannot set a capacity")
        backend.configure(Settings(capacity, origins=origins, events=self.evidence, explain=self.explain))
