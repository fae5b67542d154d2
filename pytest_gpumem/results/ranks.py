"""The plain results of a measured world: what each rank is given (`RankSpec`), what one rank measured
(`RankResult`), the world of them (`World`) and the test's call made of the parent's and the worst rank's."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Annotated, Any

from cuda_allocator_model import format_size
from pytest_gpumem.results import PHASES, PhaseResult, rank_phase
from pytest_gpumem.results.codec import Spec, decode, encode
from pytest_gpumem.results.explanation import Explanation, RanksExplanation


@dataclass(frozen=True)
class RankSpec:
    """What every rank is given (plain and picklable): where to meet, how to measure, what to run."""

    nodeid: str
    world_size: int
    process_group: str  # gloo or nccl
    store_path: str  # the FileStore that forms the process group
    meter_kind: str  # tracker or cuda
    rounding: str
    device: str  # the tracker's device: cpu or meta
    capacity: int | None
    join_timeout: float  # the parent's limit on starting and forming the group
    group_timeout: float  # the group's own (longer: the parent ends the ranks first and names the late one)
    payload: bytes  # pickle of (fn, args)
    explain: bool = False  # record what each phase's peak is made of (the test is explained)
    paths: str | None = None  # the tracker's code paths (cpu or gpu; None: its default for the device)
    cublas_workspace: int | None = None  # bytes of each cuBLAS workspace the tracker models (a card's)
    snapshots: str | None = None  # the folder where each rank leaves its torch memory snapshot; None: none


@dataclass(frozen=True)
class RankResult:
    """What one rank measured: its whole run of the function (`call`), its phases, what it returned."""

    rank: int
    call: PhaseResult
    phases: Annotated[dict[str, PhaseResult], PHASES]
    value: Annotated[Any, Spec(outside=True, absent=lambda: None)] = None  # travels pickled, beside the JSON
    info: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    explanation: Explanation | None = None  # the rank's own (explain.composition.explain), when the test is explained

    def to_json(self) -> dict[str, Any]:
        """Everything but `value` (the function's own object, which travels pickled)."""
        written: dict[str, Any] = encode(self)
        return written

    @classmethod
    def from_json(cls, data: object, value: Any = None) -> RankResult:
        """What `to_json` wrote, with the `value` that travelled beside it; `OffShape` names what is not."""
        return replace(decode(cls, data, "rank result"), value=value)


@dataclass(frozen=True)
class World:
    """The ranks' results, and what the test's result records of them; `explanation` is the ranks'
    explanations as one (each phase under its recorded name), None when no rank explained its peaks."""

    ranks: list[RankResult]
    process_group: str
    name: str
    explanation: RanksExplanation | None = None

    def measured(self, result: RankResult) -> list[PhaseResult]:
        """A rank's phases, then its whole run of the function as phase `name`."""
        return [*result.phases.values(), replace(result.call, name=self.name)]

    def phases(self) -> list[PhaseResult]:
        """Each rank's phases as `phase@rankN`, then each phase's worst rank as `phase`, the whole run of
        the function as `name@rankN` and `name`."""
        per_rank = [on_rank(p, r.rank) for r in self.ranks for p in self.measured(r)]
        names = dict.fromkeys(p.name for r in self.ranks for p in self.measured(r))
        return per_rank + [self.worst(name) for name in names]

    def worst(self, name: str) -> PhaseResult:
        """Phase `name` on the rank whose peak is highest (the lowest such rank)."""
        rank, phase = self._worst(name)
        return replace(phase, rank=rank)

    def _worst(self, name: str) -> tuple[int, PhaseResult]:
        found = [(p.peak_bytes, -r.rank, r.rank, p) for r in self.ranks for p in self.measured(r) if p.name == name]
        _, _, rank, phase = max(found, key=lambda item: item[:3])
        return rank, phase

    def worst_ranks(self) -> dict[str, int]:
        """Each phase's worst rank (`worst`), by name."""
        names = dict.fromkeys(p.name for r in self.ranks for p in self.measured(r))
        return {name: self._worst(name)[0] for name in names}

    def summary(self) -> dict[str, Any]:
        """For the test result's `distributed`: plain JSON."""
        worst = self.worst(self.name)
        return {
            "name": self.name,
            "world_size": len(self.ranks),
            "process_group": self.process_group,
            "peak_bytes": {str(r.rank): r.call.peak_bytes for r in self.ranks},
            "worst_rank": worst.rank,
            "worst_peak": format_size(worst.peak_bytes),
        }


def on_rank(phase: PhaseResult, rank: int) -> PhaseResult:
    """`phase` as recorded for rank `rank`: named `phase@rankN`."""
    return replace(phase, name=rank_phase(phase.name, rank), rank=rank)


def worst_call(call: PhaseResult, ranks: PhaseResult | None) -> PhaseResult:
    """The test's call: the parent's own, or the worst rank's whole run where that is higher."""
    if ranks is None or ranks.peak_bytes <= call.peak_bytes:
        return call
    return replace(
        call,
        peak_bytes=ranks.peak_bytes,
        requested_peak_bytes=max(call.requested_peak_bytes, ranks.requested_peak_bytes),
        reserved_peak_bytes=ranks.reserved_peak_bytes,
        rank=ranks.rank,
    )
