"""One rank of a measured world, in its own spawned process: join the process group, run the user's
function under a `GpuMem` on this rank's backend, and send its results (or the error) to the parent
(`pytest_gpumem.distributed.messages`). Imports are kept to what a rank needs (no pytest)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from pytest_gpumem.advise.run import advise
from pytest_gpumem.distributed.gloo import SettledBoundaries, wait_for_gloo_after_calls
from pytest_gpumem.distributed.messages import Kind, Message, describe, done
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.files import replace_atomically
from pytest_gpumem.measure.measurement import Measurement
from pytest_gpumem.measure.measuring import measuring
from pytest_gpumem.results.ranks import RankResult, RankSpec

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

    from pytest_gpumem.backends.base import Backend
    from pytest_gpumem.backends.tracker.torch_snapshot import RecordedModel
    from pytest_gpumem.distributed.messages import Wire

_IN_RANK = "GPUMEM_RANK_OF"  # set in a rank's environment (to the test's node id): ranks start no ranks
_NOT_SHARED = (
    "ranks import only the test module; conftest.py, fixtures, module globals and torch settings made in the "
    "parent do not reach them"
)
_MISSING = (NameError, ImportError, AttributeError, KeyError)  # what a rank lacking the parent's set-up raises


def run_rank(rank: int, spec: RankSpec, queue: Queue[Wire]) -> None:
    """The spawned process's target: any failure becomes one `error` line naming what went wrong."""
    try:
        queue.put(done(_run(rank, spec, queue)).to_wire())
        _leave_together()
    except BaseException as exc:
        line = describe(exc) + (f" ({_NOT_SHARED})" if isinstance(exc, _MISSING) else "")
        queue.put(Message(Kind.ERROR, rank, line).to_wire())
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


def _run(rank: int, spec: RankSpec, queue: Queue[Wire]) -> RankResult:
    import torch.distributed as dist

    _follow_torchrun(rank, spec.world_size, spec.nodeid)
    fn, args = _load(spec.payload)
    backend = rank_backend(rank, spec)
    queue.put(Message(Kind.LOADED, rank).to_wire())
    dist.init_process_group(
        spec.process_group,
        init_method=f"file://{spec.store_path}",
        rank=rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.group_timeout),
    )
    queue.put(Message(Kind.READY, rank).to_wire())
    if spec.process_group == "gloo":
        wait_for_gloo_after_calls(dist)
    return measure_rank(rank, spec, backend, fn, args)


def _follow_torchrun(rank: int, world_size: int, nodeid: str) -> None:
    """The environment torchrun gives a rank, and its one thread per rank unless OMP_NUM_THREADS says."""
    import torch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), **{_IN_RANK: nodeid})
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def _load(payload: bytes) -> tuple[Any, tuple[Any, ...]]:
    try:
        fn, args = pickle.loads(payload)
    except Exception as exc:
        hint = f" ({_NOT_SHARED})" if isinstance(exc, _MISSING) else ""
        raise RuntimeError(f"cannot load the function to run: {describe(exc)}{hint}") from None
    return fn, tuple(args)


def rank_backend(rank: int, spec: RankSpec) -> Backend:
    """This rank's backend, of the parent's kind: the tracker alike, or CUDA on device `rank`."""
    if spec.meter_kind == "cuda":
        import torch

        from pytest_gpumem.backends.cuda import CudaBackend

        torch.cuda.set_device(rank)
        backend: Any = CudaBackend()
    else:
        from pytest_gpumem.backends.tracker.backend import TrackerBackend

        backend = TrackerBackend(spec.rounding, device=spec.device, paths=spec.paths)
        if spec.cublas_workspace is not None:  # the card the parent predicts
            backend.workspace_bytes = spec.cublas_workspace
    from pytest_gpumem.backends.base import Settings

    backend.configure(Settings(spec.capacity, explain=spec.explain))
    result: Backend = backend
    return result


class InRank:
    """The worlds of a rank's own meter: none (ranks start no ranks; a rank's process group is real)."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid

    def run(self, measured: Measurement, fn: Any, world_size: int, **options: Any) -> NoReturn:
        raise GpuMemError(f"gpumem.distributed() was called inside a rank of {self.nodeid}: ranks cannot start ranks")

    def simulate(self, meter: object, fn: Any, world_size: int, **options: Any) -> NoReturn:
        raise GpuMemError("gpumem.simulate_rank(): this process already has a process group; it cannot be simulated")


def measure_rank(rank: int, spec: RankSpec, backend: Backend, fn: Any, args: tuple[Any, ...]) -> RankResult:
    """Rank `rank`'s run of `fn`, measured on `backend` (and left as a torch memory snapshot where `spec` asks)."""
    boundaries = SettledBoundaries(backend)
    setattr(backend, "settle", boundaries)  # noqa: B010  (this rank's own backend, for its lifetime)
    measured = Measurement(backend, f"{spec.nodeid} rank {rank}", InRank(spec.nodeid))
    measured.hold_to(leak_check=False, explain=spec.explain)
    recorded: RecordedModel | None = None
    try:
        with measuring(measured, advise) as call:
            recorded = _recorded(backend) if spec.snapshots is not None else None
            value = fn(rank, spec.world_size, call.meter, *args)
    finally:
        if recorded is not None and spec.snapshots is not None:  # a rank that raised leaves one too
            _leave_snapshot(recorded, rank_snapshot_path(spec.snapshots, rank))
    record = call.record
    notes = [*record.notes, *boundaries.notes()]
    phases = dict(record.phases)
    return RankResult(rank, record.call, phases, value, sendable_info(record.info), notes, record.explanation)


def _recorded(backend: Backend) -> RecordedModel | None:
    """The allocator's model of this rank's backend, recording a torch memory snapshot from here on."""
    from pytest_gpumem.backends.tracker.torch_snapshot import record_backend

    return record_backend(backend)


def rank_snapshot_path(folder: str, rank: int) -> Path:
    """Where rank `rank` leaves its torch memory snapshot, in the world's own temporary `folder`."""
    return Path(folder, f"snapshot-{rank}.pickle")


def _leave_snapshot(recorded: RecordedModel, path: Path) -> None:
    """The rank's run as a torch memory snapshot, written whole or not at all (the parent may end the
    rank at any moment once another has failed)."""
    from pytest_gpumem.backends.tracker.torch_snapshot import snapshot_bytes, snapshot_of

    data = snapshot_bytes(snapshot_of(recorded, os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")))
    with contextlib.suppress(OSError):  # the test's outcome stands; the parent notes the rank left none
        replace_atomically(path, data)


def sendable_info(info: object) -> dict[str, Any]:
    """The rank's `gpumem.info`, which travels to the parent as JSON; a TypeError in one line naming what
    in it cannot (not the encoder's words, which name no key)."""
    if not isinstance(info, dict):
        raise TypeError(f"gpumem.info was set to a {type(info).__name__}, not a dict, on a rank")
    try:
        json.dumps(info)
    except (TypeError, ValueError, RecursionError) as exc:
        found = json_problem(info, "gpumem.info", nan_ok=True) or f"gpumem.info cannot be written as JSON ({exc})"
        raise TypeError(f"{found}, so the rank cannot send it to the parent") from None
    return dict(info)


_JSON_SCALARS = (str, int, float, type(None))  # bool is an int
_DEEPEST = 100  # levels of lists and dicts followed before a value is called too deep


def json_problem(value: object, where: str, nan_ok: bool = False, _within: tuple[int, ...] = ()) -> str | None:
    """Where in `value` (named `where`) is the first thing JSON cannot hold, as a clause (`result.info['s']
    is a set, which JSON cannot hold`), or None when there is none; `nan_ok`: NaN and infinities pass, as
    `json.dumps` lets them by default. Pure and without pytest: the ranks check what they send with it."""
    if isinstance(value, float) and not math.isfinite(value) and not nan_ok:
        return f"{where} is {value!r}, which JSON cannot hold"
    if isinstance(value, _JSON_SCALARS):
        return None  # a finite float, or NaN where `nan_ok`
    if not isinstance(value, (dict, list, tuple)):
        return f"{where} is {_a(type(value).__name__)}, which JSON cannot hold"
    if id(value) in _within:
        return f"{where} holds itself, which JSON cannot hold"
    if len(_within) >= _DEEPEST:
        return f"{where} is nested more than {_DEEPEST} levels deep, which JSON cannot hold"
    within = (*_within, id(value))
    if isinstance(value, dict):
        for key, member in value.items():
            if not isinstance(key, _JSON_SCALARS):
                return f"{where} has a key that is {_a(type(key).__name__)}, which JSON cannot hold"
            found = json_problem(member, f"{where}[{_key_text(key)}]", nan_ok, within)
            if found:
                return found
        return None
    found_in = (json_problem(member, f"{where}[{i}]", nan_ok, within) for i, member in enumerate(value))
    return next(filter(None, found_in), None)


def _key_text(key: str | float | None) -> str:
    """A dict key as it is written in Python, cut to a readable length (its own `__repr__` is not trusted)."""
    text = str.__repr__(key) if isinstance(key, str) else repr(key)
    return text if len(text) <= 60 else text[:57] + "..."


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"
