"""The worlds a test's meter runs (`Measurement.worlds`, given where the fixture is made): the arguments of
`gpumem.distributed()` checked, the parent's backend copied into a `RankSpec`, the ranks started and
their results gathered into a `World`; or one rank simulated in this process (`gpumem.simulate_rank()`).

Each rank runs `fn(rank, world_size, meter, *args)` with a `GpuMem` of the parent's kind (the tracker
with the same rounding and device, or CUDA on `cuda:rank`).
"""

from __future__ import annotations

import math
import pickle
import re
import tempfile
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cuda_allocator_model import shorten
from pytest_gpumem.distributed.spawn import DEFAULT_TIMEOUT, MIN_JOIN_TIMEOUT, spawn
from pytest_gpumem.distributed.worker import rank_snapshot_path
from pytest_gpumem.errors import GpuMemError, one_line
from pytest_gpumem.results import RANK_SEPARATOR
from pytest_gpumem.results.ranks import RankResult, RankSpec, World

if TYPE_CHECKING:
    from pytest_gpumem.measure.measurement import Measurement
    from pytest_gpumem.results.explanation import RanksExplanation

_MAX_WORLD = 64
"""The most ranks started (each is a process that imports torch); `simulate` estimates larger worlds."""

_GROUP_MARGIN = 60.0  # seconds the group's own timeout is past the parent's limits
_NAME_IN_FILES = 40  # characters of a world's name kept in its ranks' file names


@dataclass(frozen=True)
class RankSnapshot:
    """One rank's torch memory snapshot (--gpumem-torch-snapshots): the pickle it left, or None where it left
    none (ended before it finished, when another rank failed or time ran out)."""

    world: str  # the world's name as file names may hold it, numbered from its second world in the test
    rank: int
    world_size: int
    data: bytes | None

    def file_suffix(self) -> str:
        """What follows the test's own file stem: `.ranks.rank0.pickle` (`rank00` in a world of 11 or more), so
        that a world's files sort together and in rank order."""
        width = len(str(self.world_size - 1))
        return f".{self.world}.rank{self.rank:0{width}d}.pickle"


@dataclass(frozen=True)
class Worlds:
    """Starts worlds for one test: `timeout` (--gpumem-dist-timeout) unless the call gives its own, and
    `say` for a line to the terminal (the ranks slow to start), None when quiet; `snapshots`, where given,
    gathers each rank's torch memory snapshot, world after world (the ranks record none where it is None)."""

    timeout: float = DEFAULT_TIMEOUT
    say: Callable[[str], None] | None = None
    snapshots: list[RankSnapshot] | None = None

    def run(
        self,
        measured: Measurement,
        fn: Callable[..., object],
        world_size: int,
        *,
        args: Sequence[Any] = (),
        backend: str | None = None,
        timeout: float | None = None,
        name: str = "ranks",
    ) -> World:
        """Start the world, wait for every rank, end them all; a failed rank raises `DistributedError`."""
        check_call(fn, world_size, timeout, name)
        check_started(world_size)
        limit = self.timeout if timeout is None else float(timeout)
        kind, rounding, device, capacity = _meter_kind(measured)
        paths = getattr(measured.backend, "paths", None) if kind == "tracker" else None
        workspace = getattr(measured.backend, "workspace_bytes", None) if kind == "tracker" else None
        group = backend if backend is not None else _default_group(kind, world_size)
        payload = _payload(fn, tuple(args))
        join = max(limit, MIN_JOIN_TIMEOUT)
        with tempfile.TemporaryDirectory(prefix="gpumem-dist-") as folder:
            spec = RankSpec(
                nodeid=measured.nodeid,
                world_size=world_size,
                process_group=group,
                store_path=str(Path(folder, "store")),
                meter_kind=kind,
                rounding=rounding,
                device=device,
                capacity=capacity,
                join_timeout=join,
                group_timeout=join + limit + _GROUP_MARGIN,
                payload=payload,
                explain=measured.explain,
                paths=paths,
                cublas_workspace=workspace,
                snapshots=None if self.snapshots is None else folder,
            )
            try:
                ranks = spawn(spec, limit, self.say)
            finally:  # a failed world's ranks that finished, or raised, leave theirs too
                self._gather_snapshots(folder, name, world_size)
        check_phase_names(ranks, name)
        measured.add_notes(f"rank {r.rank}: {note}" for r in ranks for note in r.notes)
        world = World(ranks, group, name)
        return World(ranks, group, name, explained(world))

    def _gather_snapshots(self, folder: str, name: str, world_size: int) -> None:
        gathered = self.snapshots
        if gathered is None:
            return
        world = file_name_of_world(name, {snapshot.world for snapshot in gathered})
        for rank in range(world_size):
            gathered.append(RankSnapshot(world, rank, world_size, _read(rank_snapshot_path(folder, rank))))

    def simulate(
        self,
        meter: object,
        fn: Callable[..., object],
        world_size: int,
        *,
        rank: int = 0,
        args: Sequence[Any] = (),
    ) -> Any:
        """Run `fn(rank, world_size, meter, *args)` here, as rank `rank` of a world that only exists in this
        process: torch's fake process group, whose collectives move no data. Allocations are the rank's own,
        so its phases are an estimate of that rank's peaks at any world size, without starting the ranks."""
        check_call(fn, world_size, None, "ranks")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise GpuMemError(
                f"gpumem.simulate_rank(rank=...) must be an int in 0..{world_size - 1}, got {shorten(rank)}"
            )
        import torch.distributed as dist

        if dist.is_initialized():
            raise GpuMemError(
                "gpumem.simulate_rank(): this process already has a process group; it cannot be simulated"
            )
        from pytest_gpumem.private_torch import fake_store

        dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
        try:
            return fn(rank, world_size, meter, *args)
        finally:
            if dist.is_initialized():  # the function may have torn its group down itself
                dist.destroy_process_group()


def _read(path: Path) -> bytes | None:
    """The file's bytes; None where the rank left none (its failure must not hide the world's own)."""
    try:
        return path.read_bytes()
    except OSError:
        return None


def file_name_of_world(name: str, taken: Collection[str]) -> str:
    """A world's name as its ranks' file names hold it: safe characters, cut short, and numbered (`ranks-2`)
    where an earlier world of the test took it."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:_NAME_IN_FILES]
    number = 2
    found = safe
    while found in taken:
        found, number = f"{safe}-{number}", number + 1
    return found


def check_call(fn: object, world_size: object, timeout: object, name: object) -> None:
    """The arguments of a world, started or simulated."""
    if not callable(fn):
        raise GpuMemError(f"gpumem.distributed() needs a function fn(rank, world_size, meter), got {shorten(fn)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise GpuMemError(f"gpumem.distributed(world_size=...) must be an int >= 1, got {shorten(world_size)}")
    if timeout is not None and not _seconds(timeout):
        raise GpuMemError(f"gpumem.distributed(timeout=...) must be a number of seconds > 0, got {shorten(timeout)}")
    if not isinstance(name, str) or not name or name == "call" or RANK_SEPARATOR in name:
        raise GpuMemError(f"gpumem.distributed(name=...) must be a phase name other than 'call', got {shorten(name)}")


def check_started(world_size: int) -> None:
    """Refusals that only concern started ranks (not simulated ones; a rank's own meter refuses any)."""
    if world_size > _MAX_WORLD:
        raise GpuMemError(
            f"gpumem.distributed(world_size=...) starts at most {_MAX_WORLD} ranks (each a process that imports "
            f"torch; gpumem.simulate_rank() estimates one rank of a larger world), got {world_size}"
        )


def _seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def check_phase_names(ranks: Sequence[RankResult], name: str) -> None:
    """A rank's phase may not take the name its whole run is recorded under: one would hide the other."""
    for result in ranks:
        if name in result.phases:
            raise GpuMemError(
                f"rank {result.rank} measured a phase named {name!r}, the name gpumem.distributed() gives each "
                f"rank's whole run: rename the phase or pass name= another name"
            )


def _meter_kind(measured: Measurement) -> tuple[str, str, str, int | None]:
    """(kind, rounding, tracker device, capacity) of the parent's backend, for the ranks to copy."""
    backend = measured.backend
    capacity = backend.capacity
    if backend.name == "tracker":
        return "tracker", backend.rounding, str(backend.device), capacity
    if backend.name == "cuda":
        return "cuda", "none", "cuda", capacity
    raise GpuMemError(f"gpumem.distributed() measures ranks with the tracker or cuda backend, not {backend.name!r}")


def _default_group(kind: str, world_size: int) -> str:
    """gloo for the tracker; NCCL with one GPU per rank for CUDA."""
    if kind != "cuda":
        return "gloo"
    import torch

    visible = torch.cuda.device_count()
    if visible < world_size:
        raise GpuMemError(
            f"gpumem.distributed(world_size={world_size}) on CUDA needs one device per rank, {visible} visible"
        )
    return "nccl"


def _payload(fn: Callable[..., object], args: tuple[Any, ...]) -> bytes:
    """(fn, args) pickled for the spawned ranks, which import fn by its module and name."""
    try:
        return pickle.dumps((fn, args))
    except Exception as exc:
        what = getattr(fn, "__qualname__", None) or type(fn).__name__
        raise GpuMemError(
            f"gpumem.distributed(): {what} and its args must be picklable to reach the ranks "
            f"(define the function at module level, not a lambda or a local function): {one_line(exc)}"
        ) from None


def explained(world: World) -> RanksExplanation | None:
    """The ranks' explanations as one, for the test's (`explain.composition.of_ranks`)."""
    from pytest_gpumem.explain.composition import of_ranks

    found = [(r.rank, r.explanation) for r in world.ranks if r.explanation is not None]
    return of_ranks(found, world.name, world.worst_ranks())
