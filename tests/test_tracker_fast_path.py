"""The tracker's fast paths count what its general paths count. The mode's: every program below runs under
the tracker's mode twice, once as it runs (each op's plan decided once, then the fast path), once with every
op sent the slow way, and the ledger must see the same storages made by the same ops, in the same order, to
the byte. The ledger's: an exact ledger that only moves its counters, against one serving each event in full,
on random events."""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from builders import same_random_program

from pytest_gpumem.backends.tracker import mode as tracker_mode
from pytest_gpumem.backends.tracker.ledger import StorageLedger
from pytest_gpumem.backends.tracker.recording import Recorder
from pytest_gpumem.backends.tracker.storages import Storage


class _Logged(StorageLedger):
    """A ledger that writes down each storage it is told of: the op that made it and its bytes."""

    def __init__(self, rounding: str) -> None:
        super().__init__(rounding)
        self.log: list[tuple[str, int]] = []

    def add(self, storage: Storage) -> None:
        self.log.append((str(self.op), storage.nbytes()))
        super().add(storage)


def _dense() -> None:
    x = torch.ones(8, 16)
    y = (x * 2).sum(0)
    (y.exp() + x[0]).mean().item()
    torch.max(x, dim=1)  # two fresh outputs
    x.add_(1).t().contiguous()


def _backward() -> None:
    w = torch.ones(16, 4, requires_grad=True)
    (torch.ones(8, 16) @ w).relu().sum().backward()  # type: ignore[no-untyped-call]


def _sparse() -> None:
    s = torch.eye(6).to_sparse()
    (s + s).coalesce()
    (s * 2).to_dense()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
        torch.eye(4).to_sparse_csr().to_dense()


def _shared_names() -> None:
    """aten's and prims' sum overloads share the name `sum.default`: each must be counted as itself."""
    x = torch.ones(5, 7)
    for _ in range(3):
        x.sum()
        torch.ops.prims.sum.default(x, [0])


def _made_elsewhere_and_resized() -> None:
    torch.tensor([1.0, 2.0, 3.0])  # lift_fresh: a constant made outside any mode
    out = torch.empty(0)
    torch.add(torch.ones(4), 1, out=out)  # out=: resized
    out.resize_(32)


def _not_a_tensor() -> None:
    x = torch.ones(3, 3)
    x.tolist()
    torch.split(x, 1)  # views


PROGRAMS: dict[str, Callable[[], None]] = {
    "dense": _dense,
    "backward": _backward,
    "sparse": _sparse,
    "shared_names": _shared_names,
    "made_elsewhere_and_resized": _made_elsewhere_and_resized,
    "not_a_tensor": _not_a_tensor,
}


def _run(program: Callable[[], None], rounding: str, slow: bool) -> tuple[list[tuple[str, int]], tuple[int, ...]]:
    ledger = _Logged(rounding)
    mode: Any = tracker_mode.mode_class()(ledger)
    with mode:
        program()  # each op's plan decided (the slow path), then the program again as it runs
        ledger.forget()
        ledger.log.clear()
        ledger.recording = slow  # what a recorder sets: every op the slow way (this one tells none)
        program()
    figures = (ledger.peak_requested, ledger.peak_allocated, ledger.requested, ledger.allocated)
    return ledger.log, figures


@pytest.mark.parametrize("rounding", ["none", "cuda"])
@pytest.mark.parametrize("name", PROGRAMS)
def test_the_fast_path_counts_what_the_slow_path_counts(name: str, rounding: str) -> None:
    fast = _run(PROGRAMS[name], rounding, slow=False)
    slow = _run(PROGRAMS[name], rounding, slow=True)
    assert fast == slow
    assert fast[0], "the program made no storage: it compares nothing"


def test_the_fast_path_is_taken_by_the_ops_it_knows() -> None:
    """The comparison above means something only if the fast path runs: ops seen once are in its table, each
    under its own overload (two namespaces sharing a name keep one entry, the other op takes the slow path)."""
    _run(_shared_names, "none", slow=False)
    entry = tracker_mode._FAST[torch.ops.aten.sum.default.__name__]
    assert entry[3] in (torch.ops.aten.sum.default, torch.ops.prims.sum.default)
    assert tracker_mode._FAST[torch.ops.aten.ones.default.__name__][3] is torch.ops.aten.ones.default


def test_an_op_counted_on_the_fast_path_has_its_bytes() -> None:
    # 5 x 7 float32 ones (140 bytes), then each sum: aten's a scalar (4 bytes), prims' 7 floats (28 bytes)
    log, figures = _run(_shared_names, "none", slow=False)
    assert [nbytes for _, nbytes in log] == [140] + [4, 28] * 3
    assert figures[0] == 140 + 28  # the ones live throughout; each sum is freed before the next is made


@pytest.mark.parametrize("general", ["recorder", "capacity"])
def test_an_exact_ledger_counting_alone_keeps_the_figures_of_one_that_serves_each_event_in_full(general: str) -> None:
    """With exact bytes and nothing that refuses or reads after each event, the ledger only moves its counters
    (`_plain`); a recorder of events, or a capacity never reached, sends every event the general way."""
    plain, full = StorageLedger("none"), StorageLedger("none")
    if general == "recorder":
        full.recorder = Recorder(events=True)
    else:
        full.capacity = 1 << 62
    assert plain._plain and not full._plain
    rng = random.Random(general)
    for step, roll in same_random_program((plain, full), rng, 2000, (4096, 64 * 2**20)):
        if roll < 0.92:
            plain.reset_peak()
            full.reset_peak()
        else:
            assert _counters(plain) == _counters(full), f"read after event {step}"
    assert _counters(plain) == _counters(full)
    assert plain.peak_allocated > 0


def _counters(ledger: StorageLedger) -> tuple[Any, ...]:
    counted = {key: (ref.requested, ref.counted) for key, ref in ledger.live.items()}
    return ledger.allocated, ledger.requested, ledger.peak_allocated, ledger.peak_requested, counted
