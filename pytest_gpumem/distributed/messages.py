"""What ranks tell the parent, on one queue: `loaded` once the function is unpickled, `ready` once the
process group is formed, then `done` with the rank's results or `error` with one line.

On the queue a message is plain `(kind, rank, text, value)`: the results travel as JSON text and only
the function's returned value as a pickle, so the parent loads it (and can fail to) where it says so.
"""

from __future__ import annotations

import enum
import json
import pickle
from dataclasses import dataclass

from pytest_gpumem.errors import GpuMemError, one_line
from pytest_gpumem.measure.regions import phase_left_by
from pytest_gpumem.results.ranks import RankResult

Wire = tuple[str, int, str, bytes]


class Kind(enum.Enum):
    LOADED = "loaded"
    READY = "ready"
    DONE = "done"
    ERROR = "error"


class DistributedError(GpuMemError):
    """A rank failed (raised, died, ran past the timeout, or sent what cannot be loaded here); `rank` is the
    first one that did."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class Message:
    kind: Kind
    rank: int
    text: str = ""  # error: the one line; done: the results as JSON
    value: bytes = b""  # done: the function's returned value, pickled

    def to_wire(self) -> Wire:
        return (self.kind.value, self.rank, self.text, self.value)

    @classmethod
    def from_wire(cls, wire: Wire) -> Message:
        kind, rank, text, value = wire
        return cls(Kind(kind), rank, text, value)

    def result(self) -> RankResult:
        """The results of a `done` message, its value loaded here (which can fail: a `DistributedError`)."""
        try:
            value = pickle.loads(self.value)
        except Exception as exc:
            raise DistributedError(
                f"a rank's result cannot be loaded in the parent: {describe(exc)}", self.rank
            ) from None
        return RankResult.from_json(json.loads(self.text), value)


def done(result: RankResult) -> Message:
    """`done` with `result`; a TypeError naming why when its value cannot be sent back."""
    try:
        value = pickle.dumps(result.value)
    except Exception as exc:
        raise TypeError(f"the function returned a value that cannot be sent back: {describe(exc)}") from None
    return Message(Kind.DONE, result.rank, json.dumps(result.to_json()), value)


def describe(exc: BaseException) -> str:
    """`Type: first line` of an exception, with the phase it left when there was one."""
    line = one_line(exc)
    phase = phase_left_by(exc)
    return line if phase is None else f"{line} (in phase {phase!r})"
