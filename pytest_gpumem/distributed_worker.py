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
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from pytest_gpumem.meter import GpuMem
from pytest_gpumem.results import PhaseResult

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

    from pytest_gpumem.backends.base import Backend

LOADED, READY, DONE, ERROR = "loaded", "ready", "done", "error"


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


@dataclass(frozen=True)
class RankResult:
    """What one rank measured: its whole run of the function (`call`), its phases, what it returned."""

    rank: int
    call: PhaseResult
    phases: dict[str, PhaseResult]
    value: Any = None
    info: dict[str, Any] = field(default_factory=dict)


def run_rank(rank: int, spec: RankSpec, queue: Queue[tuple[str, int, Any]]) -> None:
    """The spawned process's target: any failure becomes one `error` line naming what went wrong."""
    try:
        queue.put((DONE, rank, _run(rank, spec, queue)))
        _leave_together()
    except BaseException as exc:
        queue.put((ERROR, rank, describe(exc)))
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
    phase = GpuMem.phase_left_by(exc)
    return line if phase is None else f"{line} (in phase {phase!r})"


def _run(rank: int, spec: RankSpec, queue: Queue[tuple[str, int, Any]]) -> RankResult:
    import torch.distributed as dist

    _follow_torchrun(rank, spec.world_size)
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
    return _measured(rank, spec, backend, fn, args)


def _follow_torchrun(rank: int, world_size: int) -> None:
    """The environment torchrun gives a rank, and its one thread per rank unless OMP_NUM_THREADS says."""
    import torch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def _load(payload: bytes) -> tuple[Any, tuple[Any, ...]]:
    try:
        fn, args = pickle.loads(payload)
    except Exception as exc:
        raise RuntimeError(f"cannot load the function to run: {describe(exc)}") from None
    return fn, tuple(args)


def _backend(rank: int, spec: RankSpec) -> Backend:
    """This rank's backend, of the parent's kind: the tracker alike, or CUDA on device `rank`."""
    if spec.meter_kind == "cuda":
        import torch

        from pytest_gpumem.backends.cuda import CudaBackend

        torch.cuda.set_device(rank)
        backend: Any = CudaBackend()
    else:
        from pytest_gpumem.backends.tracker import TrackerBackend

        backend = TrackerBackend(spec.rounding, device=spec.device)
    if spec.capacity is not None:
        backend.configure(spec.capacity, origins=False, events=False)
    result: Backend = backend
    return result


def _measured(rank: int, spec: RankSpec, backend: Backend, fn: Any, args: tuple[Any, ...]) -> RankResult:
    meter = GpuMem(backend, f"{spec.nodeid} rank {rank}")
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
    return RankResult(rank, call, meter.phases, value, dict(meter.info))
