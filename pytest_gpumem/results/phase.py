"""The figures of one phase (`PhaseResult`), a result's phases by name (`Phases`, read and written as
`PHASES`) and the names of a distributed test's per-rank phases."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated, Any, NoReturn

from cuda_allocator_model import MAX_BYTES
from pytest_gpumem.results.checks import OffShape, Unplaced
from pytest_gpumem.results.codec import BYTES, SIGNED, Spec, Wording, encode, read

RANK_SEPARATOR = "@rank"  # a distributed test's per-rank phases are named `phase@rankN`


def rank_phase(name: str, rank: int) -> str:
    """The name of phase `name` as recorded for rank `rank`: `name@rankN`."""
    return f"{name}{RANK_SEPARATOR}{rank}"


def split_rank(name: str) -> tuple[str, int | None]:
    """`name@rankN` as `rank_phase` writes it -> (name, N); any other name (`x@rank01` too) -> (name, None)."""
    base, separator, rank = name.rpartition(RANK_SEPARATOR)
    if separator and base and rank.isdigit() and rank.isascii() and str(int(rank)) == rank:
        return base, int(rank)
    return name, None


_NAMED = Spec(outside=True, absent=lambda: "call")


@dataclass(frozen=True)
class PhaseResult:
    """Bytes of one phase, as the backend counts them, above what was allocated when it began.

    `peak_bytes`: peak allocated (the allocator's rounded sizes on CUDA, or the tracker's counting);
    `requested_peak_bytes`: the same with unrounded request sizes; `reserved_peak_bytes`: the peak of
    the allocator's reserved memory (absolute, None where the backend has no cache); `net_bytes`:
    allocated at the end minus at the start (negative when the phase freed more than it kept);
    `count`: how many times the phase was entered (peaks are the maximum over entries).
    """

    name: Annotated[str, _NAMED]  # the key the figures sit under: read back, "call" until its reader names it
    peak_bytes: Annotated[int, BYTES]
    requested_peak_bytes: Annotated[int, BYTES]
    reserved_peak_bytes: Annotated[int | None, BYTES]
    net_bytes: Annotated[int, SIGNED]
    count: Annotated[int, Spec(expected="a count of entries (1 or more)", low=1, high=MAX_BYTES)] = 1
    # the distributed rank these figures are from (the worst one for a maximum)
    rank: Annotated[int | None, Spec(expected="a rank (0 or more)", low=0, high=MAX_BYTES, omit=None)] = None

    def merged(self, later: PhaseResult) -> PhaseResult:
        reserved = [r for r in (self.reserved_peak_bytes, later.reserved_peak_bytes) if r is not None]
        return PhaseResult(
            name=self.name,
            peak_bytes=max(self.peak_bytes, later.peak_bytes),
            requested_peak_bytes=max(self.requested_peak_bytes, later.requested_peak_bytes),
            reserved_peak_bytes=max(reserved) if reserved else None,
            net_bytes=later.net_bytes,
            count=self.count + later.count,
            rank=later.rank if later.peak_bytes > self.peak_bytes else self.rank,
        )

    def to_json(self) -> dict[str, Any]:
        """The phase's figures as the report writes them (its name is the key they sit under)."""
        written: dict[str, Any] = encode(self)
        return written


class Phases(dict[str, "PhaseResult"]):
    """A result's phases by name: a dict that refuses changes once made (it copies, pickles and compares as a
    dict, which a read-only view of one does not)."""

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("a result's phases are read-only: dataclasses.replace(result, phases=...) makes a new one")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __reduce__(self) -> tuple[type[Phases], tuple[dict[str, PhaseResult]]]:
        return type(self), (dict(self),)


def _read_phases(value: Any, where: str | None, wording: Wording) -> dict[str, PhaseResult]:
    """Phases by name, each named by the key it sits under (`PHASES`, a field's spec)."""
    if not isinstance(value, dict):
        raise wording.refuse(where, "an object", value)
    phases = {}
    for name, phase in value.items():
        if not name:
            raise Unplaced() if where is None else OffShape(f"{where} has a phase with no name")
        figures: PhaseResult = read(PhaseResult, phase, None if where is None else wording.member(where, name), wording)
        phases[name] = replace(figures, name=name)
    return phases


PHASES = Spec(via=(_read_phases, lambda phases: {name: phase.to_json() for name, phase in phases.items()}))
"""A field of phases by name (a result's, a rank's): each written by its `to_json`, which a hook's value of
another type is told it lacks."""
