"""Start the ranks of a world as processes, collect their messages, end them all.

The parent spawns `world_size` processes (torch.multiprocessing, spawn context), which form a process
group through a FileStore in a fresh temporary folder (`RankSpec.store_path`): no TCP port is chosen by
us, so xdist workers starting worlds at the same time cannot collide and no port is left bound (gloo and
NCCL connect their ranks over ports the OS assigns). A rank that raises, dies or outlives the timeout
ends every rank.
"""

from __future__ import annotations

import contextlib
import queue as queues
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pytest_gpumem.constants import DEFAULT_DIST_TIMEOUT
from pytest_gpumem.distributed.messages import DistributedError, Kind, Message, Wire
from pytest_gpumem.distributed.worker import run_rank
from pytest_gpumem.results.ranks import RankResult, RankSpec

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue

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
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    messages: Queue[Wire] = context.Queue()
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
        messages: Queue[Wire],
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

    def _next(self, timeout: float) -> Message | None:
        try:
            return Message.from_wire(self.messages.get(timeout=timeout))
        except queues.Empty:
            return None

    def _take(self, message: Message) -> None:
        rank = message.rank
        if message.kind is Kind.ERROR:
            self._check_dead(rank)  # a rank that died makes its peers fail: the dead one is the cause
            raise DistributedError(f"rank {rank} failed: {message.text}", rank)
        if message.kind is Kind.LOADED:
            self.loaded.add(rank)
            return
        if message.kind is Kind.DONE:
            self.done[rank] = message.result()
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
