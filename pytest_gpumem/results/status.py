"""What became of a measured test (`Status`) and which of two statuses a test has (`PRECEDENCE`)."""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from pytest_gpumem.errors import GpuMemError


class Status(str, Enum):
    """What became of a measured test; the value is the word in the report, the JSON and JUnit."""

    OK = "ok"
    NEW = "NEW"  # passed; no baseline to compare with
    IMPROVED = "IMPROVED"  # passed; below its baseline by more than the tolerance
    OVER_BUDGET = "OVER BUDGET"
    OUT_OF_MEMORY = "OUT OF MEMORY"
    LEAKED = "LEAKED"
    REGRESSED = "REGRESSED"
    GRADIENTS_CHANGED = "GRADIENTS CHANGED"
    MISSING_BASELINE = "MISSING BASELINE"  # no baseline, and the run requires one
    ERROR = "error"  # unmeasurable, or failed for a reason the measurement did not see
    XFAILED = "xfailed"
    XPASS = "XPASS"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of(cls, value: object) -> Status:
        """`value` as a status: a `Status`, or its word (what a hook or a backend may set as a plain string)."""
        try:
            return cls(value)
        except ValueError:
            words = ", ".join(status.value for status in cls)
            raise GpuMemError(f"result.status: {value!r} is not a status (one of: {words})") from None

    @property
    def passing(self) -> bool:
        """Whether the test passed as far as the measurement knows."""
        return self in (Status.OK, Status.NEW, Status.IMPROVED)

    @property
    def leaves_evidence(self) -> bool:
        """Whether the test leaves its memory trace in --gpumem-snapshot-dir."""
        return self in (Status.OUT_OF_MEMORY, Status.LEAKED, Status.OVER_BUDGET, Status.REGRESSED)


PRECEDENCE = (
    Status.OUT_OF_MEMORY,
    Status.OVER_BUDGET,
    Status.LEAKED,
    Status.REGRESSED,
    Status.GRADIENTS_CHANGED,
    Status.MISSING_BASELINE,
    Status.ERROR,
    Status.XPASS,
    Status.XFAILED,
    Status.IMPROVED,
    Status.NEW,
    Status.OK,
)
"""The statuses, the worst first: of two that apply to a test, the earlier is its status."""


def first_of(statuses: Iterable[Status]) -> Status:
    """The worst of `statuses` (`PRECEDENCE`), OK when there is none."""
    return min(statuses, key=PRECEDENCE.index, default=Status.OK)
