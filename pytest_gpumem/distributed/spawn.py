"""Run a function on the ranks of a torch.distributed world, each rank measured on its own backend.

The parent spawns `world_size` processes (torch.multiprocessing, spawn context), which form a process
group through a FileStore in a fresh temporary folder: no TCP port is chosen by us, so xdist workers
starting worlds at the same time cannot collide and no port is left bound (gloo and NCCL connect their
ranks over ports the OS assigns). Each rank runs `fn(rank, world_size, meter, *args)` with a `GpuMem`
of the parent's kind (the tracker with the same rounding and device, or CUDA on `cuda:rank`) and sends
its phases back on a queue. A rank that raises, dies or outlives the timeout ends every rank.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import queue as queues
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpumem.distributed.worker import DONE, ERROR, IN_RANK, LOADED, RankResult, RankSpec, describe, run_rank
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.results import PhaseResult
from pytest_gpumem.sizes import format_size, shorten

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue

    from pytest_gpumem.measure.meter import GpuMem

DEFAULT_TIMEOUT = 120.0
"""Seconds the ranks may run the function, once all have joined the process group."""

MIN_JOIN_TIMEOUT = 60.0
"""Seconds at least that spawning the ranks and forming the group may take (importing torch included)."""

SLOW_START = 5.0
"""Seconds of starting the ranks and forming their group after which the ranks not yet in it are named."""

MAX_WORLD = 64
"""The most ranks started (each is a process that imports torch); `simulate` estimates larger worlds."""

RANK_SEPARATOR = "@rank"
_POLL = 0.05
_LAST_WORDS = 2.0  # seconds to wait for the message of a rank that has already exited
_END_GRACE = 5.0  # seconds a finished rank gets to exit before it is killed
_GROUP_MARGIN = 60.0  # seconds the group's own timeout is past the parent's limits
_DEATH_NOTICE = 0.2  # seconds for the exit of a rank whose peers report a broken connection to be seen

__all__ = ["DEFAULT_TIMEOUT", "DistributedError", "RankResult", "World", "run", "simulate", "worst_call"]


class DistributedError(GpuMemError):
    """A rank failed (raised, died, or ran past the timeout); `rank` is the first one that did."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class World:
    """The ranks' results, and what the test's result records of them."""

    ranks: list[RankResult]
    process_group: str
    name: str

    def phases(self) -> list[PhaseResult]:
        """Each rank's phases as `phase@rankN`, then each phase's worst rank as `phase`, the whole run of
        the function as `name@rankN` and `name`."""
        per_rank = [_on_rank(p, r.rank, f"{p.name}{RANK_SEPARATOR}{r.rank}") for r in self.ranks for p in _all(r, self)]
        names = dict.fromkeys(p.name for r in self.ranks for p in _all(r, self))
        worst = [self.worst(name) for name in names]
        return per_rank + worst

    def worst(self, name: str) -> PhaseResult:
        """Phase `name` on the rank whose peak is highest (the lowest such rank)."""
        found = [(p.peak_bytes, -r.rank, r.rank, p) for r in self.ranks for p in _all(r, self) if p.name == name]
        _, _, rank, phase = max(found, key=lambda item: item[:3])
        return _on_rank(phase, rank, name)

    def explained(self) -> dict[str, Any] | None:
        """The ranks' explanations as one, for the test's (`explain.with_ranks`): each rank's phases as
        `phase@rankN`, each phase's worst rank as `phase`, the whole run as `name@rankN` and `name` (and as
        `call`, the test's call where it is the peak); None when no rank explained its peaks."""
        from pytest_gpumem.explain.replay import on_rank

        explained = [(r.rank, r.explanation) for r in self.ranks if r.explanation is not None]
        if not explained:
            return None
        phases: dict[str, Any] = {}
        folded: dict[str, int] = {}
        for rank, explanation in explained:
            for name, entry in explanation["phases"].items():
                phase = self.name if name == "call" else name
                phases[f"{phase}{RANK_SEPARATOR}{rank}"] = on_rank(entry, rank)
            folded.update(explanation.get("folded") or {})
        measured = {p.name for r in self.ranks for p in _all(r, self)}
        for name in dict.fromkeys(n.rpartition(RANK_SEPARATOR)[0] for n in list(phases)):
            worst = f"{name}{RANK_SEPARATOR}{self.worst(name).rank}" if name in measured else None
            if worst in phases:
                phases[name] = phases[worst]
        return {"phases": phases, "folded": folded, "call": phases.get(self.name)}

    def summary(self) -> dict[str, Any]:
        """For `gpumem.info["distributed"]`: plain JSON."""
        worst = self.worst(self.name)
        return {
            "name": self.name,
            "world_size": len(self.ranks),
            "process_group": self.process_group,
            "peak_bytes": {str(r.rank): r.call.peak_bytes for r in self.ranks},
            "worst_rank": worst.rank,
            "worst_peak": format_size(worst.peak_bytes),
        }


def _all(result: RankResult, world: World) -> list[PhaseResult]:
    return [*result.phases.values(), replace(result.call, name=world.name)]


def _on_rank(phase: PhaseResult, rank: int, name: str) -> PhaseResult:
    return replace(phase, name=name, rank=rank)


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


def run(
    meter: GpuMem,
    fn: Callable[..., object],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    backend: str | None = None,
    timeout: float | None = None,
    name: str = "ranks",
) -> World:
    """Start the world, wait for every rank, end them all; a failed rank raises `DistributedError`."""
    _check(fn, world_size, timeout, name)
    _check_started(world_size)
    limit = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    kind, rounding, device, capacity = _meter_kind(meter)
    group = backend if backend is not None else _default_group(kind, world_size)
    payload = _payload(fn, tuple(args))
    with tempfile.TemporaryDirectory(prefix="gpumem-dist-") as folder:
        spec = RankSpec(
            nodeid=meter.nodeid,
            world_size=world_size,
            process_group=group,
            store_path=str(Path(folder, "store")),
            meter_kind=kind,
            rounding=rounding,
            device=device,
            capacity=capacity,
            join_timeout=max(limit, MIN_JOIN_TIMEOUT),
            group_timeout=max(limit, MIN_JOIN_TIMEOUT) + limit + _GROUP_MARGIN,
            payload=payload,
            explain=meter.explain,
        )
        ranks = _spawn(spec, limit, meter.say)
    meter.notes.extend(f"rank {r.rank}: {note}" for r in ranks for note in r.notes)
    return World(ranks, group, name)


def simulate(
    meter: GpuMem, fn: Callable[..., object], world_size: int, *, rank: int = 0, args: Sequence[Any] = ()
) -> Any:
    """Run `fn(rank, world_size, meter, *args)` here, as rank `rank` of a world that only exists in this
    process: torch's fake process group, whose collectives move no data. Allocations are the rank's own,
    so its phases are an estimate of that rank's peaks at any world size, without starting the ranks."""
    _check(fn, world_size, None, "ranks")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise GpuMemError(f"gpumem.simulate_rank(rank=...) must be an int in 0..{world_size - 1}, got {shorten(rank)}")
    import torch.distributed as dist

    if dist.is_initialized():
        raise GpuMemError("gpumem.simulate_rank(): this process already has a process group; it cannot be simulated")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        return fn(rank, world_size, meter, *args)
    finally:
        dist.destroy_process_group()


def _check(fn: object, world_size: object, timeout: object, name: object) -> None:
    if not callable(fn):
        raise GpuMemError(f"gpumem.distributed() needs a function fn(rank, world_size, meter), got {shorten(fn)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise GpuMemError(f"gpumem.distributed(world_size=...) must be an int >= 1, got {shorten(world_size)}")
    if timeout is not None and not _seconds(timeout):
        raise GpuMemError(f"gpumem.distributed(timeout=...) must be a number of seconds > 0, got {shorten(timeout)}")
    if not isinstance(name, str) or not name or name == "call" or RANK_SEPARATOR in name:
        raise GpuMemError(f"gpumem.distributed(name=...) must be a phase name other than 'call', got {shorten(name)}")


def _check_started(world_size: int) -> None:
    """Refusals that only concern started ranks (not simulated ones)."""
    import os

    if world_size > MAX_WORLD:
        raise GpuMemError(
            f"gpumem.distributed(world_size=...) starts at most {MAX_WORLD} ranks (each a process that imports "
            f"torch; gpumem.simulate_rank() estimates one rank of a larger world), got {world_size}"
        )
    if IN_RANK in os.environ:
        raise GpuMemError(
            f"gpumem.distributed() was called inside a rank of {os.environ[IN_RANK]}: ranks cannot start ranks"
        )


def _seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _meter_kind(meter: GpuMem) -> tuple[str, str, str, int | None]:
    """(kind, rounding, tracker device, capacity) of the parent's backend, for the ranks to copy."""
    backend: Any = meter.backend
    if backend.name == "tracker":
        device = str(backend.device)
        return "tracker", str(backend.rounding), device, backend.ledger.capacity
    if backend.name == "cuda":
        return "cuda", "none", "cuda", getattr(backend, "_capacity", None)
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
            f"(define the function at module level, not a lambda or a local function): {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None


def _spawn(spec: RankSpec, limit: float, say: Callable[[str], None] | None = None) -> list[RankResult]:
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    messages: Queue[tuple[str, int, Any]] = context.Queue()
    processes = [
        context.Process(target=run_rank, args=(rank, spec, messages), name=f"gpumem-rank{rank}", daemon=True)
        for rank in range(spec.world_size)
    ]
    grace = 0.0
    try:
        for process in processes:
            process.start()
        results = _Waiter(processes, messages, limit, spec.join_timeout, say).results()
        grace = _END_GRACE
        return results
    finally:
        _end(processes, grace)
        messages.close()
        messages.join_thread()


def _end(processes: Sequence[BaseProcess], grace: float) -> None:
    """Every rank has exited when this returns: finished ones on their own (within `grace` seconds),
    the others killed."""
    deadline = time.monotonic() + grace
    for process in processes:
        if process.pid is not None:
            process.join(max(deadline - time.monotonic(), 0))
    for process in processes:
        if process.pid is not None and process.exitcode is None:
            process.kill()
            process.join()
    for process in processes:
        with contextlib.suppress(ValueError):
            process.close()


class _Waiter:
    """Reads the ranks' messages until every rank is done, one fails, or time runs out."""

    def __init__(
        self,
        processes: Sequence[BaseProcess],
        messages: Queue[tuple[str, int, Any]],
        limit: float,
        join: float,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.processes, self.messages, self.limit, self.join, self.say = processes, messages, limit, join, say
        self.loaded: set[int] = set()
        self.ready: set[int] = set()
        self.done: dict[int, RankResult] = {}
        self.slow = time.monotonic() + SLOW_START  # when the ranks still joining are named, once
        self.deadline = time.monotonic() + join
        self.joining = True

    def results(self) -> list[RankResult]:
        while len(self.done) < len(self.processes):
            message = self._next(_POLL)
            if message is None:
                self._check_time()
                self._check_alive()
            else:
                self._take(message)
        return [self.done[rank] for rank in range(len(self.processes))]

    def _next(self, timeout: float) -> tuple[str, int, Any] | None:
        try:
            return self.messages.get(timeout=timeout)
        except queues.Empty:
            return None
        except Exception as exc:  # a rank's value that pickles there but does not load here
            raise DistributedError(f"a rank's result cannot be loaded in the parent: {describe(exc)}") from None

    def _take(self, message: tuple[str, int, Any]) -> None:
        kind, rank, body = message
        if kind == ERROR:
            self._check_dead(rank)  # a rank that died makes its peers fail: the dead one is the cause
            raise DistributedError(f"rank {rank} failed: {body}", rank)
        if kind == LOADED:
            self.loaded.add(rank)
            return
        if kind == DONE:
            self.done[rank] = body
        self.ready.add(rank)
        if self.joining and len(self.ready) == len(self.processes):
            self.joining, self.deadline = False, time.monotonic() + self.limit

    def _check_time(self) -> None:
        now = time.monotonic()
        say = self.say
        if self.joining and say is not None and now >= self.slow:
            self.say = None
            joining = _ranks([r for r in range(len(self.processes)) if r not in self.ready])
            say(f"gpumem: waiting for {joining} to start ({SLOW_START:g} s; each imports torch and the test module)")
        if now < self.deadline:
            return
        if self.joining:
            self._late_joining()
        late = [r for r in range(len(self.processes)) if r not in self.done]
        raise DistributedError(
            f"{_ranks(late)} did not finish within {self.limit:g} s (timeout=, --gpumem-dist-timeout); all ranks "
            "were ended",
            late[0],
        )

    def _late_joining(self) -> None:
        ranks = range(len(self.processes))
        unloaded = [r for r in ranks if r not in self.loaded and r not in self.ready]
        if unloaded:
            raise DistributedError(
                f"{_ranks(unloaded)} did not start within {self.join:g} s (still loading the function and its module)",
                unloaded[0],
            )
        late = [r for r in ranks if r not in self.ready]
        raise DistributedError(f"{_ranks(late)} did not form the process group within {self.join:g} s", late[0])

    def _check_dead(self, reporting: int) -> None:
        """The reporting rank exits right after its message; by then a peer whose death broke its
        connections has long exited too."""
        self.processes[reporting].join(_LAST_WORDS)
        time.sleep(_DEATH_NOTICE)
        for rank, process in enumerate(self.processes):
            if rank not in self.done and process.exitcode not in (None, 0):
                raise DistributedError(f"rank {rank} {_exit_text(process.exitcode)} before it finished", rank)

    def _check_alive(self) -> None:
        for rank, process in enumerate(self.processes):
            if rank in self.done or process.exitcode is None:
                continue
            message = self._next(_LAST_WORDS)  # its last message may still be on the way
            if message is not None:
                self._take(message)
                return
            raise DistributedError(f"rank {rank} {_exit_text(process.exitcode)} before it finished", rank)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _exit_text(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    import signal

    with contextlib.suppress(ValueError):
        return f"was killed by {signal.Signals(-code).name}"
    return f"was killed by signal {-code}"
