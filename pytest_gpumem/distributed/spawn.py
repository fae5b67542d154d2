"""Start the ranks of a world as processes, collect their messages, end them all.

The parent starts `world_size` processes (forked from a server that imported torch once, prepared as
spawned ones: `pytest_gpumem.distributed.server`), which form a process group through a FileStore in a
fresh temporary folder (`RankSpec.store_path`): no TCP port is chosen by us, so xdist workers starting
worlds at the same time cannot collide and no port is left bound (gloo and NCCL connect their ranks over
ports the OS assigns). A rank that raises, dies or outlives the timeout
ends every rank.
"""

from __future__ import annotations

import contextlib
import queue as queues
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pytest_gpumem.constants import DEFAULT_DIST_TIMEOUT
from pytest_gpumem.distributed.messages import DistributedError, Kind, Message, Wire
from pytest_gpumem.distributed.worker import run_rank
from pytest_gpumem.results.ranks import RankResult, RankSpec

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue

    from pytest_gpumem.distributed.server import RankProcess

DEFAULT_TIMEOUT = DEFAULT_DIST_TIMEOUT
"""Seconds the ranks may run the function, once all have joined the process group."""

MIN_JOIN_TIMEOUT = 60.0
"""Seconds at least that spawning the ranks and forming the group may take (importing torch included)."""

SLOW_START = 5.0
"""Seconds of starting the ranks and forming their group after which the ranks not yet in it are named."""

_POLL = 0.05
_LAST_WORDS = 2.0  # seconds to wait for the message of a rank that has already exited
_END_GRACE = 5.0  # seconds a finished rank gets to exit before it is killed
_DEATH_NOTICE = 0.2  # seconds for the exit of a rank whose peers report a broken connection to be seen


def spawn(spec: RankSpec, limit: float, say: Callable[[str], None] | None = None) -> list[RankResult]:
    """Start every rank, wait for each (`limit` seconds once all are in the group), end them all."""
    import multiprocessing

    from pytest_gpumem.distributed.server import RankProcess, preloaded

    messages: Queue[Wire] = multiprocessing.get_context("forkserver").Queue()
    preload = preloaded(spec.meter_kind)
    processes = [
        RankProcess(
            target=run_rank, args=(rank, spec, messages), name=f"gpumem-rank{rank}", daemon=True, preload=preload
        )
        for rank in range(spec.world_size)
    ]
    grace = 0.0
    waiter = _Waiter(processes, messages, limit, spec.join_timeout, say)  # starting is part of joining
    try:
        for process in processes:
            process.start()
        results = waiter.results()
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


@dataclass
class Progress:
    """How far each rank of a world of `size` has got: its function and module loaded, in the process
    group (`ready`), finished (`done`, with its result)."""

    size: int
    loaded: set[int] = field(default_factory=set)
    ready: set[int] = field(default_factory=set)
    done: dict[int, RankResult] = field(default_factory=dict)

    def short_of(self, *stages: Collection[int]) -> list[int]:
        """The ranks in none of `stages`."""
        return [r for r in range(self.size) if not any(r in stage for stage in stages)]


class Deadlines:
    """When a world's ranks are late, from `now`: the ranks still joining are named once after
    SLOW_START seconds (to `say`); past `join` seconds of joining, or `limit` seconds once all have
    joined (`all_joined`), the late ones are named in a DistributedError."""

    def __init__(
        self, progress: Progress, limit: float, join: float, say: Callable[[str], None] | None, now: float
    ) -> None:
        self.progress, self.limit, self.join, self.say = progress, limit, join, say
        self.slow = now + SLOW_START
        self.deadline = now + join
        self.joining = True

    def all_joined(self, now: float) -> None:
        self.joining, self.deadline = False, now + self.limit

    def check(self, now: float) -> None:
        say = self.say
        if self.joining and say is not None and now >= self.slow:
            self.say = None
            joining = named_ranks(self.progress.short_of(self.progress.ready))
            say(f"gpumem: waiting for {joining} to start ({SLOW_START:g} s; each imports torch and the test module)")
        if now < self.deadline:
            return
        if self.joining:
            self._late_joining()
        late = self.progress.short_of(self.progress.done)
        raise DistributedError(
            f"{named_ranks(late)} did not finish within {self.limit:g} s (timeout=, --gpumem-dist-timeout); all ranks "
            "were ended",
            late[0],
        )

    def _late_joining(self) -> None:
        progress = self.progress
        unloaded = progress.short_of(progress.loaded, progress.ready)
        if unloaded:
            raise DistributedError(
                f"{named_ranks(unloaded)} did not start within {self.join:g} s (still loading the function and its "
                "module)",
                unloaded[0],
            )
        late = progress.short_of(progress.ready)
        raise DistributedError(f"{named_ranks(late)} did not form the process group within {self.join:g} s", late[0])


class _Waiter:
    """Reads the ranks' messages until every rank is done, one fails, or time runs out."""

    def __init__(
        self,
        processes: Sequence[RankProcess],
        messages: Queue[Wire],
        limit: float,
        join: float,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.processes, self.messages = processes, messages
        self.progress = Progress(len(processes))
        self.deadlines = Deadlines(self.progress, limit, join, say, time.monotonic())

    def results(self) -> list[RankResult]:
        done = self.progress.done
        while len(done) < len(self.processes):
            message = self._next(_POLL)
            if message is None:
                self.deadlines.check(time.monotonic())
                self._check_alive()
            else:
                self._take(message)
        return [done[rank] for rank in range(len(self.processes))]

    def _next(self, timeout: float) -> Message | None:
        try:
            return Message.from_wire(self.messages.get(timeout=timeout))
        except queues.Empty:
            return None

    def _take(self, message: Message) -> None:
        rank, progress = message.rank, self.progress
        if message.kind is Kind.ERROR:
            self._check_dead(rank)  # a rank that died makes its peers fail: the dead one is the cause
            raise DistributedError(f"rank {rank} failed: {message.text}", rank)
        if message.kind is Kind.LOADED:
            progress.loaded.add(rank)
            return
        if message.kind is Kind.DONE:
            progress.done[rank] = message.result()
        progress.ready.add(rank)
        if self.deadlines.joining and len(progress.ready) == progress.size:
            self.deadlines.all_joined(time.monotonic())

    def _check_dead(self, reporting: int) -> None:
        """The reporting rank exits right after its message; by then a peer whose death broke its
        connections has long exited too."""
        self.processes[reporting].join(_LAST_WORDS)
        time.sleep(_DEATH_NOTICE)
        for rank, process in enumerate(self.processes):
            if rank not in self.progress.done and process.exitcode not in (None, 0):
                raise DistributedError(_ended(rank, process), rank)

    def _check_alive(self) -> None:
        for rank, process in enumerate(self.processes):
            if rank in self.progress.done or process.exitcode is None:
                continue
            message = self._next(_LAST_WORDS)  # its last message may still be on the way
            if message is not None:
                self._take(message)
                return
            raise DistributedError(_ended(rank, process), rank)


def named_ranks(ranks: list[int]) -> str:
    """`rank 1`, or `ranks 0, 2`."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _ended(rank: int, process: RankProcess) -> str:
    if process.lost_its_server:
        return f"rank {rank} was killed before it finished: gpumem's fork server, which started it, died"
    assert process.exitcode is not None
    return f"rank {rank} {_exit_text(process.exitcode)} before it finished"


def _exit_text(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    import signal

    with contextlib.suppress(ValueError):
        return f"was killed by {signal.Signals(-code).name}"
    return f"was killed by signal {-code}"
