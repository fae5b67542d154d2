"""Kernel temporaries cost nothing on ops they do not touch: `may_take` decides from an op's shapes and
arguments alone (no layout, no key) that a reduction, an `index_put_` without accumulate or an unreduced
`mse_loss` takes none, and the dispatch then takes its fast path. These tests fail if that early decision
ever says "none" where the full rule (`temporaries`) finds a temporary, or if any figure changes with it."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cuda_allocator_model.cards import find_card
from pytest_gpumem.backends.base import Settings
from pytest_gpumem.backends.tracker import kernel_temporaries
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.backends.tracker.kernel_reductions import INDEXED, SUM_LIKE, VALUES, fewest_split
from pytest_gpumem.backends.tracker.kernel_temporaries import may_take, temporaries

aten = torch.ops.aten
SUM = aten.sum.dim_IntList
CARDS = [None, find_card("T4"), find_card("H100-80GB")]


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=dtype)


def staged(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> list[list[int]]:
    """The full rule's temporaries of `func` on each card."""
    return [temporaries(str(func), args, kwargs, card) for card in CARDS]


# (1021, 128) float32 summed over dim 0: the outputs are the fastest dim, 4 a load, a block 32 lanes wide and
# 512 / 4 / 32 = 4 rows high, each thread ceil(1021 / 4) = 256 values: split into min(SMs x 16, 256 / 16 = 16)
# = 16 blocks of one column. Staging 4 B x 128 outputs x 16 x 32 x 4 = 1 MiB, a semaphore of 4 B. One row
# fewer: 255 values a thread, no split, on any card. complex128 takes blocks of 256 threads, 2 rows high.


def test_a_split_starts_at_the_fewest_values_per_output_and_the_early_test_knows_it() -> None:
    assert fewest_split(512) == 1021
    assert staged(SUM, (meta(1021, 128), [0])) == [[1_048_576, 4]] * 3
    assert may_take(SUM, (meta(1021, 128), [0]), None)
    assert staged(SUM, (meta(1020, 128), [0])) == [[]] * 3
    assert not may_take(SUM, (meta(1020, 128), [0]), None)


def test_complex128_splits_from_fewer_values_per_output() -> None:
    assert fewest_split(256) == 511
    wide = meta(511, 128, dtype=torch.complex128)
    assert staged(SUM, (wide, [0])) == [[16 * 128 * 16 * 32 * 4, 4]] * 3
    assert may_take(SUM, (wide, [0]), None)
    assert not may_take(SUM, (meta(510, 128, dtype=torch.complex128), [0]), None)
    assert not may_take(SUM, (meta(1020, 128, dtype=torch.complex64), [0]), None)  # 8 B: blocks of 512


def test_a_single_output_splits_from_255_values_a_lane_of_one_block_row() -> None:
    # every value to one output: one row of 512 lanes (256 for complex128), each lane 256 values or more;
    # 130,561 float32 split into min(SMs x 4, 256 / 16) = 16 blocks: staging 4 B x 16, a semaphore
    assert fewest_split(512, one_output=True) == 130_561
    assert staged(aten.sum.default, (meta(130_561),)) == [[64, 4]] * 3
    assert may_take(aten.sum.default, (meta(130_561),), None)
    assert may_take(aten.amax.default, (meta(1, 130_561), [1]), None)
    for func, args in [
        (aten.sum.default, (meta(130_560),)),
        (aten.sum.default, (meta(64, 1024),)),  # Net b64's loss
        (aten.mean.dim, (meta(1, 130_560, 1), [1])),  # dims of size 1 kept: still one output
        (aten.amax.default, (meta(8, 16_320), [0, 1])),
        (aten.sum.default, (meta(65_280, dtype=torch.complex128),)),
    ]:
        assert staged(func, args) == [[]] * 3
        assert not may_take(func, args, None)
    assert may_take(aten.sum.default, (meta(65_281, dtype=torch.complex128),), None)
    # two outputs, the reduced dim outermost: 2 a load, a block 1 lane wide and 256 rows high, 274 values a
    # thread: split into min(SMs x 8, 274 / 16) = 18 blocks. Staging 4 B x 2 x 18 x 2, fewer values than one
    assert staged(SUM, (meta(70_000, 2), [0])) == [[288, 4]] * 3
    assert may_take(SUM, (meta(70_000, 2), [0]), None)


def _dims(rng: random.Random, ndim: int) -> Any:
    """A `dim` argument: None, empty, one dim (maybe negative) or several."""
    choice = rng.randrange(4)
    if choice == 0 or ndim == 0:
        return rng.choice([None, []])
    named = rng.sample(range(ndim), rng.randint(1, ndim)) if choice == 3 else [rng.randrange(ndim)]
    return [d - ndim if rng.random() < 0.3 else d for d in named]


_SIZES = (1, 2, 3, 8, 31, 64, 128, 255, 256, 511, 512, 1020, 1021, 1024, 4096, 8160, 8161, 20_000, 70_000)
_THRESHOLDS = (510, 511, 1020, 1021, 8161, 65_280, 65_281, 130_560, 130_561)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.complex128, torch.int64)


def _random_input(rng: random.Random) -> torch.Tensor:
    """A meta tensor of up to 3 dims (near the split's thresholds), permuted, sliced or expanded."""
    shape = [rng.choice(_SIZES) for _ in range(rng.randint(0, 3))]
    if shape and rng.random() < 0.5:
        shape[rng.randrange(len(shape))] = rng.choice(_THRESHOLDS)
    x = meta(*shape, dtype=rng.choice(_DTYPES))
    if x.dim() >= 2 and rng.random() < 0.5:
        x = x.permute(*rng.sample(range(x.dim()), x.dim()))
    if x.dim() >= 1 and x.shape[-1] > 2 and rng.random() < 0.3:
        x = x[..., 1::2]  # an offset and a stride of 2
    if x.dim() >= 1 and rng.random() < 0.15:
        x = x.unsqueeze(0).expand(3, *x.shape)  # a stride of 0
    return x


def _random_reduction(rng: random.Random) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    x = _random_input(rng)
    name = rng.choice(sorted(SUM_LIKE | VALUES | INDEXED))
    func = getattr(getattr(aten, name.split(".")[1]), name.split(".")[2])
    if name in SUM_LIKE:
        args: tuple[Any, ...] = (x,) if name.endswith(".default") else (x, _dims(rng, x.dim()), rng.random() < 0.5)
        kwargs = {"dtype": torch.float32} if x.dtype in (torch.float16, torch.bfloat16) and rng.random() < 0.5 else {}
        return func, args, kwargs
    if name in VALUES:
        return func, (x, _dims(rng, x.dim()) or []), {}
    dim = rng.randrange(x.dim()) if x.dim() and rng.random() < 0.8 else None
    return func, (x, dim) if dim is not None or name.startswith("aten.arg") else (x, 0), {}


def test_no_reduction_the_early_test_refuses_takes_a_temporary() -> None:
    rng = random.Random(50)
    refused = split = 0
    for _ in range(2500):
        func, args, kwargs = _random_reduction(rng)
        found = staged(func, args, kwargs)
        if not may_take(func, args, kwargs):
            refused += 1
            assert found == [[]] * 3, (func, args, kwargs)
        split += any(found)
    assert refused > 1000  # the early test decides most of them
    assert split > 50  # and the cases that split are there to be refused wrongly


@pytest.mark.parametrize(
    ("func", "args", "kwargs", "takes"),
    [
        (aten.index_put_.default, ("self", "ids", "values"), {}, False),
        (aten.index_put_.default, ("self", "ids", "values", False), {}, False),
        (aten.index_put_.default, ("self", "ids", "values"), {"accumulate": True}, True),
        (aten.index_put.default, ("self", "ids", "values", True), {}, True),
        (aten._index_put_impl_.default, ("self", "ids", "values", True, False), {}, True),
        (aten.mse_loss.default, ("self", "self", 0), {}, False),
        (aten.mse_loss.default, ("self", "self"), {"reduction": 0}, False),
        (aten.mse_loss.default, ("self", "self"), {}, True),
    ],
    ids=[
        "index_put_",
        "no accumulate",
        "accumulate by name",
        "index_put",
        "_index_put_impl_",
        "mse none",
        "mse none by name",
        "mse mean",
    ],
)
def test_index_put_without_accumulate_and_an_unreduced_mse_loss_take_none(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], takes: bool
) -> None:
    given = {
        "self": meta(1000, 64),
        "ids": [torch.zeros(5000, dtype=torch.long, device="meta")],
        "values": meta(5000, 64),
    }
    real = tuple(given.get(a, a) if isinstance(a, str) else a for a in args)
    assert may_take(func, real, kwargs) is takes
    assert any(staged(func, real, kwargs)) is takes


def test_arguments_the_early_test_cannot_read_go_to_the_full_rule() -> None:
    assert may_take(SUM, (meta(4, 4), [7]), None)  # a dim out of range: not decided early
    assert may_take(aten.sum.default, (torch.nn.Parameter(meta(4, 4)),), None)  # a subclass: not read early
    assert not may_take(aten.relu.default, (meta(4, 4),), None)  # nothing modelled


def _workload(x: torch.Tensor) -> list[Callable[[], Any]]:
    """Reductions (and what lowers to them) on `x`, forward and backward."""
    target = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    return [
        lambda: x.sum(),
        lambda: x.sum(0),
        lambda: x.transpose(0, 1).sum(-1),
        lambda: x.amax(-1),
        lambda: x.max(dim=0).values,
        lambda: x.norm(dim=-1),
        lambda: x.softmax(0).sum(),
        lambda: x.to(torch.bfloat16).sum(0),
        lambda: F.cross_entropy(x, target),
        lambda: F.mse_loss(x, x * 2),
        lambda: x.clone().index_put_((target[:3],), x[:3], accumulate=True),
    ]


def _figures_op_by_op(device: str, card: str | None) -> list[tuple[Any, ...]]:
    """Each op's peak and what is left after it, on a backend with no recorder (the fast path open)."""
    backend = TrackerBackend(rounding="cuda", device=device)
    backend.predict_card(card)
    backend.configure(Settings(None))
    backend.start()
    figures = []
    try:
        shapes = ((8, 64), (1020, 128), (1021, 128), (64, 9000)) if device == "meta" else ((8, 64), (1021, 128))
        for shape in shapes:
            x = (meta(*shape) if device == "meta" else torch.ones(shape)).requires_grad_()
            for op in _workload(x):
                backend.reset_peak()
                out = op()
                if out.requires_grad:
                    out.float().sum().backward()
                del out
                figures.append((shape, backend.peak(), backend.current(), backend.largest_kernel_temporaries))
    finally:
        backend.stop()
    return figures


@pytest.mark.parametrize(("device", "card"), [("meta", "T4"), ("meta", None), ("cpu", None)])
def test_every_figure_is_the_same_with_the_early_decision_as_without_it(
    device: str, card: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    early = _figures_op_by_op(device, card)
    monkeypatch.setattr(kernel_temporaries, "_surely_none", lambda *_: False)  # every op to the full rule
    late = _figures_op_by_op(device, card)
    assert early == late
    assert len({f[1] for f in early}) > 10  # the peaks differ op by op: the comparison sees each
