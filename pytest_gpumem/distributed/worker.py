"""One rank of a measured world, in its own spawned process: join the process group, run the user's
function under a `GpuMem` on this rank's backend, and send the phases (or the error) to the parent.

Messages on the queue are `(kind, rank, body)`: `loaded` once the function is unpickled, `ready` once
the process group is formed, then `done` with a `RankResult` or `error` with one line. Imports are
kept to what a rank needs (no pytest).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from pytest_gpumem.results import PhaseResult

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

    from pytest_gpumem.backends.base import Backend

LOADED, READY, DONE, ERROR = "loaded", "ready", "done", "error"
IN_RANK = "GPUMEM_RANK_OF"  # set in a rank's environment (to the test's node id): ranks start no ranks
NOT_SHARED = (
    "ranks import only the test module; conftest.py, fixtures, module globals and torch settings made in the "
    "parent do not reach them"
)
_MISSING = (NameError, ImportError, AttributeError, KeyError)  # what a rank lacking the parent's set-up raises
GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives each of gloo's worker threads
SETTLE_LIMIT = 5.0  # seconds a phase boundary waits for gloo's worker threads to go idle
_QUIET = 0.001  # seconds a worker thread must not run, the GIL free, to count as idle


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


@dataclass(frozen=True)
class RankResult:
    """What one rank measured: its whole run of the function (`call`), its phases, what it returned."""

    rank: int
    call: PhaseResult
    phases: dict[str, PhaseResult]
    value: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    explanation: dict[str, Any] | None = None  # the rank's own (explain.explain), when the test is explained


def run_rank(rank: int, spec: RankSpec, queue: Queue[tuple[str, int, Any]]) -> None:
    """The spawned process's target: any failure becomes one `error` line naming what went wrong."""
    try:
        queue.put((DONE, rank, _run(rank, spec, queue)))
        _leave_together()
    except BaseException as exc:
        queue.put((ERROR, rank, describe(exc) + (f" ({NOT_SHARED})" if isinstance(exc, _MISSING) else "")))
    finally:
        queue.close()
        queue.join_thread()  # the message is in the pipe before the process ends
    _exit_now()


def _leave_together() -> None:
    """Wait for every rank before exiting: a rank that leaves early closes its connections while a slower
    one may still be forming the group. After an error no rank waits (its exit, after its message, ends
    the others' connections)."""
    import torch.distributed as dist

    with contextlib.suppress(Exception):  # what the parent needs was sent; a user's own teardown is fine
        dist.barrier()
        dist.destroy_process_group()


def _exit_now() -> None:
    """End the process without the interpreter's teardown (about a second with torch loaded, per rank):
    everything the parent needs was sent."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def describe(exc: BaseException) -> str:
    """`Type: first line` of an exception, with the phase it left when there was one."""
    try:
        text = str(exc).strip()
    except Exception:
        text = f"<{type(exc).__name__}.__str__ raised>"
    line = f"{type(exc).__name__}: {text}".splitlines()[0] if text else type(exc).__name__
    from pytest_gpumem.measure.meter import GpuMem

    phase = GpuMem.phase_left_by(exc)
    return line if phase is None else f"{line} (in phase {phase!r})"


def _run(rank: int, spec: RankSpec, queue: Queue[tuple[str, int, Any]]) -> RankResult:
    import torch.distributed as dist

    _follow_torchrun(rank, spec.world_size, spec.nodeid)
    fn, args = _load(spec.payload)
    backend = _backend(rank, spec)
    queue.put((LOADED, rank, None))
    dist.init_process_group(
        spec.process_group,
        init_method=f"file://{spec.store_path}",
        rank=rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.group_timeout),
    )
    queue.put((READY, rank, None))
    if spec.process_group == "gloo":
        _settle_after_calls(dist)
    return _measured(rank, spec, backend, fn, args)


def _follow_torchrun(rank: int, world_size: int, nodeid: str) -> None:
    """The environment torchrun gives a rank, and its one thread per rank unless OMP_NUM_THREADS says."""
    import torch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), **{IN_RANK: nodeid})
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def _load(payload: bytes) -> tuple[Any, tuple[Any, ...]]:
    try:
        fn, args = pickle.loads(payload)
    except Exception as exc:
        hint = f" ({NOT_SHARED})" if isinstance(exc, _MISSING) else ""
        raise RuntimeError(f"cannot load the function to run: {describe(exc)}{hint}") from None
    return fn, tuple(args)


def _backend(rank: int, spec: RankSpec) -> Backend:
    """This rank's backend, of the parent's kind: the tracker alike, or CUDA on device `rank`."""
    if spec.meter_kind == "cuda":
        import torch

        from pytest_gpumem.backends.cuda import CudaBackend

        torch.cuda.set_device(rank)
        backend: Any = CudaBackend()
    else:
        from pytest_gpumem.backends.tracker.backend import TrackerBackend

        backend = TrackerBackend(spec.rounding, device=spec.device)
    if spec.explain and callable(getattr(backend, "attribution", None)):  # it explains its own peaks
        backend.configure(spec.capacity, origins=False, events=False, explain=True)
    elif spec.capacity is not None:
        backend.configure(spec.capacity, origins=False, events=False)
    result: Backend = backend
    return result


def _gloo_workers() -> dict[str, tuple[str, str]]:
    """Each gloo worker thread of this process: its state (R: running or runnable) and its time on a CPU."""
    found: dict[str, tuple[str, str]] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            task = f"/proc/self/task/{tid}"
            with contextlib.suppress(OSError, IndexError):
                with open(f"{task}/comm") as comm:
                    if comm.read().strip() != GLOO_WORKER:
                        continue
                with open(f"{task}/stat") as stat:
                    state = stat.read().rpartition(")")[2].split()[0]
                with open(f"{task}/schedstat") as sched:
                    ran = sched.read().split()[0]
                found[tid] = (state, ran)
    return found


def collectives_settled(limit: float = SETTLE_LIMIT) -> bool:
    """Wait until gloo's worker threads are idle: none is running, and none ran while this thread slept
    without the GIL. A worker lets go of a finished collective's tensors (the last reference to an
    all-gather or broadcast buffer, often) after the collective has completed, at a moment its thread's
    scheduling decides; once it is idle, those tensors are freed. False if a worker was still busy after
    `limit` seconds."""
    before = _gloo_workers()
    if not before:
        return True
    deadline = time.monotonic() + limit
    while True:
        time.sleep(_QUIET)
        now = _gloo_workers()
        if now == before and all(state != "R" for state, _ in now.values()):
            return True
        if time.monotonic() > deadline:
            return False
        before = now


SETTLED_CALLS = ("_broadcast_coalesced", "_verify_params_across_processes")
"""torch.distributed's calls that drop their own buffers as they return (DDP's `init_sync` broadcast and
its check of the parameters' shapes), while gloo's worker may still hold them."""


def _settle_after_calls(dist: Any) -> None:
    """Each of `SETTLED_CALLS` waits for gloo's worker before returning: its buffers are then gone before the
    caller's next allocation (in DDP, the reducer's gradient buckets), whatever the threads' scheduling."""
    for name in SETTLED_CALLS:
        call = getattr(dist, name, None)
        if callable(call):
            setattr(dist, name, _settled(call))


def _settled(call: Callable[..., Any]) -> Callable[..., Any]:
    def settled(*args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        finally:
            collectives_settled()

    return settled


class _SettledBoundaries:
    """A backend's `settle`, followed by waiting for gloo's worker threads (at every phase boundary and
    at the call's start and end), counting the boundaries where they stayed busy."""

    def __init__(self, backend: Backend) -> None:
        self.settle, self.busy = backend.settle, 0

    def __call__(self) -> None:
        self.settle()
        if not collectives_settled():
            self.busy += 1

    def notes(self) -> list[str]:
        if not self.busy:
            return []
        return [
            f"gloo's worker threads were still busy {SETTLE_LIMIT:g} s after {self.busy} phase boundaries: when "
            "they let go of a collective's buffers varies, and so may this rank's figures"
        ]


def _measured(rank: int, spec: RankSpec, backend: Backend, fn: Any, args: tuple[Any, ...]) -> RankResult:
    from pytest_gpumem.measure.meter import GpuMem

    boundaries = _SettledBoundaries(backend)
    setattr(backend, "settle", boundaries)  # noqa: B010  (this rank's own backend, for its lifetime)
    meter = GpuMem(backend, f"{spec.nodeid} rank {rank}")
    meter.explain = spec.explain
    meter.begin_call()
    try:
        value = fn(rank, spec.world_size, meter, *args)
        call = meter.end_call()
    finally:
        meter.end_call_if_running()
    try:
        pickle.dumps(value)
    except Exception as exc:
        raise TypeError(f"the function returned a value that cannot be sent back: {describe(exc)}") from None
    notes = [*meter.notes, *boundaries.notes()]
    return RankResult(rank, call, meter.phases, value, dict(meter.info), notes, meter.explanation)
