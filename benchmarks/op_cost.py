"""Where the tracker's time goes on small ops: µs per op of each part, on the step overhead.py calls tiny.

    python benchmarks/op_cost.py [--json PATH] [--rounds 15] [--threads 1] [--inner 200] [--wall] [--net|--residual]
                                  [--instructions [--against DIR]]

One forward+backward step of `Linear(64)` on a batch of 8 (13 ATen ops, 5 of them making a tensor), run
`inner` times under each candidate, the candidates interleaved round by round (drift hits all alike). Each
candidate adds one part to the one above it, so the difference of their medians, over the ops of a step, is
that part's cost per op:

- the floor: a dispatch mode that does nothing (the op's kernel called, Dynamo kept out of its frames as
  the tracker keeps it): what any Python dispatch mode pays; beside it (a row marked `=`, not a part) the
  floor holding a weak reference, with a callback, to each fresh storage: the least an exact count of what
  is live costs in Python, whatever counts it;
- the tracker's mode, its ledger counting nothing (the op's plan, the fast path);
- the ledger, exact: a weak reference per storage, the counters;
- the unmoded backward (`unmoded`): the graph walked before each backward, hooks where it joins;
- the allocator's model (`--gpumem-round=cuda`), without workspaces or temporaries; beside it (a row
  marked `=`: the rows after it add to the row above it) the same with every event served at its op, as
  before the ledger held them back for the model while nothing reads it;
- cuBLAS workspaces: the two matmuls go the slow way (with the kernel temporaries' check, its model off);
- kernel temporaries: the two reductions' model (`kernel_temporaries`): the default on meta;
- a GPU's paths (the default with the allocator's model): foreach optimizers and CUDA's autocast emulation
  installed, on a step that has neither (overhead.py's `tracker + allocator model`);
- `--gpumem-explain`: the attributor (each op's module, each allocation's origin and category).

`--net` runs the same candidates on overhead.py's Net step (Linear 1024->2048->1024, batch 64; 3 steps a
run unless `--inner` says otherwise): there the floor is what any dispatch mode costs a step of large ops.
`--instructions` counts callgrind's instructions a step instead of timing (overhead.py's markers, one
child process; `--against DIR` also counts another checkout's package on the same steps).
`--residual` runs them on a residual MLP (4 blocks of Linear(64), relu and a residual, batch 8), whose
backward joins gradients at every block's input: there the unmoded backward hooks the graph.

Times are the main thread's CPU time (`time.thread_time`: on the CPU, backward runs on the calling
thread), which a machine shared with other work disturbs far less than wall time (`--wall`). It also times
the full tracker in a plain loop (one backend, every step after the first) and in overhead.py's
interleaved rounds (a fresh backend each round, MemTracker and the profiler in between), with and without
a full garbage collection before each run: the candidates here all run after one (`collect=True`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import benchlib
import torch
from torch import nn

from pytest_gpumem import private_torch
from pytest_gpumem.backends.base import Settings
from pytest_gpumem.backends.tracker import mode as tracker_mode
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.backends.tracker.ledger import StorageLedger
from pytest_gpumem.backends.tracker.storages import Storage

Step = Callable[[], None]
_CLOCK: list[Callable[[], float]] = [time.thread_time]  # --wall: time.perf_counter


def tiny_step() -> tuple[Step, int]:
    """The step, and how many ATen ops one step dispatches."""
    torch.manual_seed(0)
    model, x = nn.Linear(64, 64), torch.randn(8, 64)

    def step() -> None:
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)

    return step, _ops_in(step)


def net_step() -> tuple[Step, int]:
    """overhead.py's Net step, and how many ATen ops one step dispatches."""
    torch.manual_seed(0)
    model, x = benchlib.Net(), torch.randn(benchlib.BATCH, 1024)

    def step() -> None:
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)

    return step, _ops_in(step)


class ResidualMLP(nn.Module):
    """Blocks of Linear, relu and a residual: every block's input takes two gradients in backward."""

    def __init__(self, width: int = 64, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            hidden = hidden + torch.relu(block(hidden))
        return hidden


def residual_step() -> tuple[Step, int]:
    """A residual MLP's step (4 blocks of Linear(64), relu and a residual, batch 8), and its ATen ops."""
    torch.manual_seed(0)
    model, x = ResidualMLP(), torch.randn(8, 64)

    def step() -> None:
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)

    return step, _ops_in(step)


def _ops_in(step: Step) -> int:
    seen: list[object] = []

    class Counting(private_torch.TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            seen.append(func)
            return func(*args, **(kwargs or {}))

    counting: Any = Counting()  # type: ignore[no-untyped-call]
    with counting:
        step()
    return len(seen)


class _Floor(private_torch.DynamoWrapperOff, private_torch.TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A mode that does nothing but run the op, as cheaply as the tracker's fast path does."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        setter = _SET_EVAL_FRAME
        prior = None if setter is None else setter(None)
        try:
            kernel = private_torch.op_kernel(func)
            return kernel(*args, **kwargs) if kwargs else kernel(*args)
        finally:
            if setter is not None:
                setter(prior)


class _Keyed(weakref.ref):  # type: ignore[type-arg]
    __slots__ = ("key",)

    key: int


class _WeakFloor(_Floor):
    """The floor holding a weak reference, with a callback, to the storage of each op's one fresh tensor,
    dropped when it dies: the least an exact count of what is live needs in Python (a storage's key, its
    address, is reused once it is freed)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.live: dict[int, _Keyed] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if type(out) is torch.Tensor:
            storage = out.untyped_storage()
            key = private_torch.storage_key(storage)
            if key not in self.live:
                ref = self.live[key] = _Keyed(storage, self._freed)
                ref.key = key
        return out

    def _freed(self, ref: _Keyed) -> None:
        if self.live.get(ref.key) is ref:
            del self.live[ref.key]


_SET_EVAL_FRAME = private_torch.eval_frame_setter()
if _SET_EVAL_FRAME is not None:
    private_torch.hide_from_dynamo(_Floor.__torch_dispatch__)
    private_torch.hide_from_dynamo(_WeakFloor.__torch_dispatch__)


class _Uncounted(StorageLedger):
    """A ledger that follows nothing."""

    def add(self, storage: Storage) -> None:
        return None


class _NoTemporaries(StorageLedger):
    """The allocator's model without kernel temporaries (nor cuBLAS workspaces: the fast path takes the
    ops that may have either)."""

    def _decide_wants(self) -> None:
        super()._decide_wants()
        self.wants_temporaries = False


class _ServedAtEachOp(_NoTemporaries):
    """The allocator's model serving each event at its op: no event held back for a replay."""

    def _may_serve_late(self) -> bool:
        return False


_RECORD = "record_temporaries"  # the mode's name for kernel_temporaries.record


@contextlib.contextmanager
def _temporaries_unmodelled() -> Iterator[None]:
    """The ops that may take kernel temporaries go the slow way, but their model is not run."""
    original = getattr(tracker_mode, _RECORD)

    def during_only(
        ledger: Any, func: Any, args: Any, kwargs: Any, during: Callable[[], None] | None = None, **_: Any
    ) -> None:
        if during is not None:
            during()

    setattr(tracker_mode, _RECORD, during_only)
    try:
        yield
    finally:
        setattr(tracker_mode, _RECORD, original)


def _timed(step: Step, inner: int, enter: Callable[[], Any], leave: Callable[[Any], None]) -> float:
    clock = _CLOCK[0]
    start = clock()
    held = enter()
    try:
        for _ in range(inner):
            step()
    finally:
        leave(held)
    return (clock() - start) / inner


def _mode_only(ledger: Callable[[], StorageLedger]) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    def enter() -> Any:
        mode: Any = tracker_mode.mode_class()(ledger())
        mode.__enter__()
        return mode

    return enter, lambda mode: mode.__exit__(None, None, None)


def _backend(
    rounding: str, paths: str | None = None, ledger: type[StorageLedger] | None = None, explain: bool = False
) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    def enter() -> Any:
        backend = TrackerBackend(rounding, paths=paths)
        if ledger is not None:
            backend.ledger.__class__ = ledger
            backend.ledger._decide_wants()
        backend.configure(Settings(None, explain=explain))
        backend.start()
        return backend

    return enter, _read_and_stop


def _read_and_stop(backend: TrackerBackend) -> None:
    _read(backend)
    backend.stop()


def _read(backend: TrackerBackend) -> None:
    """A measured test reads its peaks before its backend stops: the events the ledger held back for the
    allocator's model are served then, and timed."""
    backend.peak()


def candidates(step: Step, inner: int) -> dict[str, Callable[[], float]]:
    """Seconds per step of each candidate, each adding one part to the one before it."""

    def run(enter: Callable[[], Any], leave: Callable[[Any], None]) -> Callable[[], float]:
        return lambda: _timed(step, inner, enter, leave)

    def floor_enter(kind: type[_Floor] = _Floor) -> Any:
        mode: Any = kind()
        mode.__enter__()
        return mode

    def unmodelled() -> float:
        with _temporaries_unmodelled():
            return _timed(step, inner, *_backend("cuda", paths="cpu"))

    return {
        "untracked": run(lambda: None, lambda _: None),
        "floor: a mode that does nothing": run(floor_enter, lambda mode: mode.__exit__(None, None, None)),
        WEAK: run(lambda: floor_enter(_WeakFloor), lambda mode: mode.__exit__(None, None, None)),
        "+ the tracker's mode (ledger counts nothing)": run(*_mode_only(lambda: _Uncounted("none"))),
        "+ the ledger (exact)": run(*_mode_only(lambda: StorageLedger("none"))),
        "+ the unmoded backward (the tracker)": run(*_backend("none")),
        "+ the allocator's model": run(*_backend("cuda", paths="cpu", ledger=_NoTemporaries)),
        BESIDE: run(*_backend("cuda", paths="cpu", ledger=_ServedAtEachOp)),
        "+ cuBLAS workspaces": unmodelled,
        "+ kernel temporaries": run(*_backend("cuda", paths="cpu")),
        "+ a GPU's paths: CUDA's autocast (tracker + allocator model)": run(*_backend("cuda")),
        "+ --gpumem-explain": run(*_backend("cuda", explain=True)),
    }


BESIDE = "= the allocator's model, each event served at its op"
WEAK = "= the floor with a weak reference per fresh storage"
"""Rows beside the one above them, not parts: their figures are to that row's."""
FULL = "+ a GPU's paths: CUDA's autocast (tracker + allocator model)"
"""overhead.py's `tracker + allocator model`: `--gpumem-round=cuda` on the CPU predicts a GPU's paths."""


def per_op_table(step: Step, ops: int, inner: int, rounds: int) -> tuple[list[list[str]], dict[str, Any]]:
    times = benchlib.interleaved(candidates(step, inner), rounds, collect=True)
    medians = {name: benchlib.median(t) for name, t in times.items()}
    base = medians["untracked"]
    rows, previous = [], base
    for name, med in medians.items():
        part = (med - previous) / ops * 1e6
        rows.append([name, f"{med * 1e6:,.1f}", f"{med / base:.3f}", f"{part:+.2f}" if name != "untracked" else ""])
        if name not in (BESIDE, WEAK):
            previous = med
    return rows, {"ops_per_step": ops, "median_s": medians, "seconds": times}


def gap(step: Step, inner: int, rounds: int) -> tuple[list[list[str]], dict[str, Any]]:
    """The full tracker in a plain loop, and in overhead.py's rounds (its five tools, one round each in
    turn) without and with a full collection before each run: the garbage collector's work in each."""
    import overhead

    def plain() -> float:
        backend = TrackerBackend("cuda")
        backend.start()
        try:
            step()  # the first step: a fresh allocator model makes its segments
            backend.peak()
            return _timed(step, inner, lambda: None, lambda _: _read(backend))
        finally:
            backend.stop()

    overhead._CLOCK[0] = _CLOCK[0]
    model, x = overhead.make_model("tiny")
    tools = overhead.candidates(model, x, inner)
    table: list[list[str]] = []
    data: dict[str, Any] = {}
    for how, run, collect in (
        ("plain loop, one backend", {"untracked": tools["untracked"], FULL_TOOL: plain}, False),
        ("overhead.py's rounds, as before", tools, False),
        ("overhead.py's rounds, each run after a full collection (now)", tools, True),
    ):
        counted = {name: _GcCounted(fn) for name, fn in run.items()}
        with _gc_watched():
            times = benchlib.interleaved(dict(counted.items()), rounds, collect=collect)
        full, base = benchlib.median(times[FULL_TOOL]), benchlib.median(times["untracked"])
        gc_work = counted[FULL_TOOL]
        per_step = gc_work.seconds / ((rounds + 2) * inner) * 1e6
        table.append([how, f"{full * 1e6:,.1f}", f"{full / base:.3f}", str(gc_work.collections), f"{per_step:.1f}"])
        data[how] = {"seconds": times, "collections": gc_work.collections, "gc_seconds": gc_work.seconds}
    return table, data


FULL_TOOL = "tracker + allocator model"  # overhead.py's name for it


class _GcCounted:
    """A candidate, with the garbage collections (and their seconds) that happen while it runs."""

    def __init__(self, run: Callable[[], float]) -> None:
        self.run, self.collections, self.seconds = run, 0, 0.0

    def __call__(self) -> float:
        _RUNNING[0] = self
        try:
            return self.run()
        finally:
            _RUNNING[0] = None


_RUNNING: list[_GcCounted | None] = [None]


@contextlib.contextmanager
def _gc_watched() -> Iterator[None]:
    started = [0.0]

    def watch(phase: str, info: dict[str, int]) -> None:
        running = _RUNNING[0]
        if phase == "start":
            started[0] = _CLOCK[0]()
        elif running is not None:
            running.collections += 1
            running.seconds += _CLOCK[0]() - started[0]

    gc.callbacks.append(watch)
    try:
        yield
    finally:
        gc.callbacks.remove(watch)


def count(step: Step, inner: int, rounds: int) -> None:
    """`--count` (run under callgrind by `instructions`): each candidate's runs in rounds, each after a full
    collection and between overhead.py's two marker calls; the candidates' names in order on stdout."""
    import overhead

    overhead.counted_rounds(candidates(step, inner), rounds)


def instructions(argv: list[str], ops: int, inner: int, against: Path | None, out: Path) -> list[list[str]]:
    """Instructions per step of each candidate, counted by callgrind in a child (`--count`), this tree's
    and, with `against`, another checkout's (its package on PYTHONPATH, this benchmark's steps)."""
    import os
    import sys

    import overhead

    rows: list[list[str]] = []
    for label, checkout in [("", None)] + ([] if against is None else [(f" @{against}", against)]):
        env = dict(os.environ) if checkout is None else {**os.environ, "PYTHONPATH": str(checkout.resolve())}
        command = [sys.executable, __file__, *argv, "--count"]
        counts, stdout, _ = overhead._callgrind(command, out / f"op_cost{'-against' if checkout else ''}", env, True)
        per_step: dict[str, list[float]] = {}
        for name, counted in zip(stdout.splitlines(), counts, strict=True):
            per_step.setdefault(name, []).append(counted / inner)
        previous = base = benchlib.median(per_step["untracked"])
        for name, runs in per_step.items():
            med = benchlib.median(runs)
            part = f"{(med - previous) / ops:+,.0f}" if name != "untracked" else ""
            rows.append([name + label, f"{med:,.0f}", f"{med - base:+,.0f}", part])
            if name not in (BESIDE, WEAK):
                previous = med
    return rows


def _chosen_step(args: argparse.Namespace) -> tuple[str, tuple[Step, int]]:
    if args.net:
        return "Net b64", net_step()
    if args.residual:
        return "residual MLP (4 blocks of Linear(64)) b8", residual_step()
    return "Linear(64) b8", tiny_step()


def _show_instructions(args: argparse.Namespace, name: str, ops: int, inner: int) -> int:
    import tempfile

    step_args = ["--net"] if args.net else ["--residual"] if args.residual else []
    child = [*step_args, "--inner", str(inner), "--rounds", str(args.rounds), "--threads", "1"]
    with tempfile.TemporaryDirectory() as out:
        rows = instructions(child, ops, inner, args.against, Path(out))
    benchlib.show(
        f"{name}, {ops} ops a step, callgrind's instructions, medians of {args.rounds} rounds of {inner}",
        ["candidate (each adds a part)", "instructions a step", "above untracked", "instructions per op of the part"],
        rows,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = benchlib.parser("µs per op of each part of the tracker, on Linear(64) b8")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    p.add_argument("--inner", type=int, default=None, help="steps per candidate and round (default 200, --net 3)")
    p.add_argument("--net", action="store_true", help="the Net step (Linear 1024->2048->1024, batch 64), no gap")
    p.add_argument(
        "--residual", action="store_true", help="a residual MLP's step (4 blocks of Linear(64), relu, +), no gap"
    )
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--skip-gap", action="store_true", help="only the per-op table")
    p.add_argument("--wall", action="store_true", help="wall time (time.perf_counter), not the thread's CPU time")
    p.add_argument("--instructions", action="store_true", help="callgrind's instructions a step, not times")
    p.add_argument("--against", type=Path, default=None, help="with --instructions, also this checkout's")
    p.add_argument("--count", action="store_true", help=argparse.SUPPRESS)
    args: argparse.Namespace = p.parse_args(argv)
    if args.wall:
        _CLOCK[0] = time.perf_counter
    torch.set_num_threads(args.threads)
    name, (step, ops) = _chosen_step(args)
    inner = args.inner or (3 if args.net else 200)
    if args.count:
        count(step, inner, args.rounds)
        return 0
    if args.instructions:
        return _show_instructions(args, name, ops, inner)
    data: dict[str, Any] = {}
    rows, data["parts"] = per_op_table(step, ops, inner, args.rounds)
    benchlib.show(
        f"{name}, {ops} ops a step, {args.threads} thread(s), "
        f"{args.rounds} interleaved rounds of {inner}, " + ("wall time" if args.wall else "CPU time"),
        ["candidate (each adds a part)", "median µs/step", "ratio", "µs per op of the part"],
        rows,
        ["the part's cost: (its median - the row above's) / ops a step"],
    )
    if not args.skip_gap and not args.net and not args.residual:
        rows, data["gap"] = gap(step, inner, args.rounds)
        benchlib.show(
            "the tracker with the allocator's model: a plain loop against overhead.py's interleaved rounds",
            ["how it runs", "median µs/step", "ratio to untracked", "collections in its runs", "gc µs per step"],
            rows,
            [
                "the collections a round triggers scan the young objects MemTracker and the profiler left before "
                "it, unless a full collection removed them first"
            ],
        )
    benchlib.write_json(args.json, {"op_cost": data})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
