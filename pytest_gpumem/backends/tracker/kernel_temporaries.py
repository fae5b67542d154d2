"""Kernel temporaries: memory a CUDA kernel takes from the caching allocator and gives back inside one op,
which a dispatch mode never sees (it sees the op's outputs only), from shapes, strides and the card.

On a card these blocks show in a memory snapshot and can sit at a peak. `temporaries(name, args, kwargs,
card)` gives their sizes, in the order the kernel allocates them, all freed (in reverse order) before the op
returns; `label(name)` what they are, or None for an op with none modelled. `record` puts them in the ledger
(`StorageLedger.transient`) when it predicts a GPU; `may_take(func, args, kwargs)` tells the dispatch, from
shapes and arguments alone, the ops that surely take none here (a reduction with too few values per output to
split, `index_put_` without accumulate, an unreduced `mse_loss`), which then cost nothing. Pure functions of
layouts (`Layout`: shape, strides in elements, dtype, storage offset), so they test without torch; a tensor
gives its layout with `Layout.of`.

Read from torch's CUDA sources (ours, written to these rules; none of theirs is copied), at the newest copy
stored among public forks (cyyever/pytorch, 2025-2026: `Reduce.cuh` with `mnt_wrapper`, `Blas.cpp` with
`cuBlasCommonArgs.h`, `EmbeddingBackwardKernel.cu` with the fused atomic path), checked against real cards'
snapshots of torch 2.6 (the `device_traces` of `torch.cuda.memory._dump_snapshot`):

* Reductions (`Reduce.cuh`: `setReduceConfig`, `ReduceConfig::global_memory_size`, `semaphore_size`,
  `gpu_reduce_kernel`; `TensorIterator::reorder_dimensions`, `coalesce_dimensions`). When one output takes
  many inputs and few outputs leave SMs idle, the input is split across `ctas_per_output` blocks that meet in
  a global staging buffer (arg bytes x outputs x ctas, x block width x output vector when threads do not
  share an output) and a semaphore per block column (4 B x grid.x). The launch config follows the layout,
  the accumulator's size and the card (SM count, threads per SM).
* bmm / baddbmm (`Blas.cpp`: `baddbmm_out_cuda_impl`, `prepare_batch_matrix_for_cublas`): an operand
  whose two last strides give cuBLAS no leading dimension, and which is not contiguous with non-zero
  strides, is copied contiguous; so is a result with no usable layout.
* `index_put_` with accumulate (`Indexing.cu`: `index_put_with_sort_kernel`, `makeLinearIndex`): a
  contiguous copy of a non-contiguous self, the linear index, a contiguous copy of the (expanded) values,
  the transposed self's copy when the indexed dims are not adjacent, the sorted and original positions,
  the sort's range and cub's scratch (1 B: a sort of one tile, as on every card seen).
* `embedding_dense_backward` (`Embedding.cu`, `EmbeddingBackwardKernel.cu`): contiguous copies of the
  indices and the gradient; beyond 3072 indices (or with `scale_grad_by_freq`), the sorted and original
  positions, the counts, the segment offsets, partial-segment tables, and either the per-segment partial
  sums (two passes) or, when few segments would leave SMs idle, a partial-to-segment map (fused atomic
  path; a float copy of the weight's gradient for 16-bit types).
* `mse_loss` with a reduction: the unreduced loss, then its reduction's staging buffer.

Left out, as never live at the op's peak: blocks freed before the op's next allocation (an index's wrapped
copy in `makeLinearIndex`, an int32 index's int64 copy; embedding backward's sort range and sort scratch).
Not modelled: cub's scratch beyond one tile (sorts of thousands of indices ask for more than 1 B),
cub's `unique_by_key` / `exclusive_sum` scratch in embedding backward, reductions over more than 2 GiB
(split into 32-bit sub-reductions), `torch.use_deterministic_algorithms` (taken as off).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pytest_gpumem import private_torch
from pytest_gpumem.backends.tracker import cudnn
from pytest_gpumem.backends.tracker.kernel_layout import gpu_of
from pytest_gpumem.backends.tracker.kernel_ops import (
    bmm,
    embedding_backward,
    index_put,
    index_put_takes_none,
    mse_loss,
    mse_loss_takes_none,
)
from pytest_gpumem.backends.tracker.kernel_reductions import (
    INDEXED,
    SUM_LIKE,
    VALUES,
    reduction_of,
    reduction_temporaries,
    stages_nothing,
)

if TYPE_CHECKING:
    from cuda_allocator_model import Card
    from pytest_gpumem.backends.tracker.ledger import StorageLedger

_FAKE_TENSOR = private_torch.fake_tensor_class()
_TENSOR = torch.Tensor
_is_wrapper_subclass = private_torch.wrapper_subclass_test()


_LABELS = {
    **dict.fromkeys((*SUM_LIKE, *VALUES, *INDEXED), "reduction staging buffer"),
    **dict.fromkeys(("aten.bmm.default", "aten.baddbmm.default", "aten.baddbmm_.default"), "operand copy for cuBLAS"),
    **dict.fromkeys(
        ("aten.index_put_.default", "aten.index_put.default", "aten._index_put_impl_.default"),
        "index sort temporaries",
    ),
    "aten.embedding_dense_backward.default": "embedding backward sort temporaries",
    "aten.mse_loss.default": "unreduced loss and reduction staging",
    **cudnn.LABELS,
}


def label(name: str) -> str | None:
    """What op `name`'s ('aten.sum.dim_IntList') modelled temporaries are, or None: none modelled."""
    return _LABELS.get(name)


def temporaries(name: str, args: Sequence[Any], kwargs: dict[str, Any] | None, card: Card | None) -> list[int]:
    """The bytes each kernel temporary of op `name` takes on `card` (None: `DEFAULT_GPU`), in allocation
    order; all are freed, in reverse order, before the op returns. Empty for an op with none modelled."""
    kwargs = kwargs or {}
    if name not in _LABELS:
        return []
    gpu = gpu_of(card)
    if name.startswith(("aten.bmm", "aten.baddbmm")):
        return bmm(name, args, kwargs)
    if "index_put" in name:
        return index_put(args, kwargs)
    if name == "aten.embedding_dense_backward.default":
        return embedding_backward(args, kwargs, gpu)
    if name == "aten.mse_loss.default":
        return mse_loss(args, kwargs, gpu)
    if name in cudnn.LABELS:
        return cudnn.temporaries(
            name, args, kwargs, lambda t, dims: temporaries("aten.sum.dim_IntList", (t, dims), None, card)
        )
    red = reduction_of(name, args, kwargs)
    return [] if red is None else reduction_temporaries(red, gpu)


_Test = Callable[[Sequence[Any], dict[str, Any]], bool]


def _holds_nothing(name: str) -> _Test | None:
    """A test, cheaper than the layouts' key, that op `name`'s arguments surely take no temporaries (its
    rule's own first refusal); None where there is none."""
    if name in _REDUCTIONS:
        return functools.partial(stages_nothing, name)
    if "index_put" in name:
        return index_put_takes_none
    if name == "aten.mse_loss.default":
        return mse_loss_takes_none
    return None


_REDUCTIONS = SUM_LIKE | VALUES | INDEXED
_KNOWN: dict[int, tuple[object, str, str | None, _Test | None]] = {}
"""Each op overload's, on its first call, by its id (an overload hashes in Python: 1,200 instructions), the
overload kept to be compared by identity."""


def _known(func: object) -> tuple[object, str, str | None, _Test | None]:
    """Op overload `func`, its name, its temporaries' label (None: none modelled) and `_holds_nothing`."""
    found = _KNOWN.get(id(func))
    if found is None or found[0] is not func:
        name = str(func)
        found = _KNOWN[id(func)] = (func, name, label(name), _holds_nothing(name))
    return found


def modelled(func: object) -> bool:
    """Whether op overload `func` has temporaries modelled (cached per overload: the dispatch's hot path)."""
    return _known(func)[2] is not None


def may_take(func: object, args: Sequence[Any], kwargs: dict[str, Any] | None) -> bool:
    """Whether op overload `func` may take temporaries on these arguments; False where it has none modelled
    or a test cheaper than the layouts shows it takes none here (the dispatch's fast path)."""
    _, _, kind, holds_nothing = _known(func)
    return kind is not None and not _surely_none(holds_nothing, args, kwargs)


def record(
    ledger: StorageLedger,
    func: object,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    during: Callable[[], None] | None = None,
    out: object = None,
) -> None:
    """Op `func` ran on these arguments: its kernel temporaries go through `ledger` (allocated, `during` run,
    freed), attributed to '<label> (<op>)'; only those of tensors on the device the ledger counts. On meta
    a convolution's output `out` takes a card's layout (`cudnn.lay_out_on_meta`)."""
    _, name, kind, holds_nothing = _known(func)
    sizes: list[int] = []
    if (
        kind is not None
        and not _surely_none(holds_nothing, args, kwargs)
        and _on_counted_device(ledger, args)
        and _holds_memory(args[0])
    ):
        sizes = _sizes(func, name, args, kwargs, ledger.card)
        if name in cudnn.LABELS:
            ledger.note_bound(cudnn.bound(name, args, kwargs or {}))
            cudnn.lay_out_on_meta(name, args, kwargs or {}, out)
    if not sizes:  # most calls: nothing held, only `during` run
        if during is not None:
            during()
        return
    ledger.out, ledger.op = None, f"{kind} ({name})"
    ledger.transient(sizes, during)


def _surely_none(holds_nothing: _Test | None, args: Sequence[Any], kwargs: dict[str, Any] | None) -> bool:
    """Whether the op's `_holds_nothing` test shows these arguments take no temporaries; False where it
    has none or cannot read them (the layouts' key decides)."""
    if holds_nothing is None or not args or type(args[0]) is not _TENSOR:  # a subclass' shape may be symbolic
        return False
    try:
        return holds_nothing(args, kwargs or {})
    except Exception:  # what the test cannot read: the layouts' key decides
        return False


_SIZES: dict[tuple[Any, ...], list[int]] = {}  # temporaries by op, card and arguments' layouts: the hot path
_SIZES_KEPT = 4096


def _sizes(func: object, name: str, args: Sequence[Any], kwargs: dict[str, Any] | None, card: Card | None) -> list[int]:
    """`temporaries`, computed once for each op, card and layout of its arguments."""
    key = (func, card, *map(_signature, args))
    if kwargs:
        key += tuple((k, _signature(v)) for k, v in kwargs.items())
    try:
        return _SIZES[key]
    except KeyError:
        pass
    except TypeError:  # an argument that cannot be a key
        return temporaries(name, args, kwargs, card)
    if len(_SIZES) >= _SIZES_KEPT:
        _SIZES.clear()
    found = _SIZES[key] = temporaries(name, args, kwargs, card)
    return found


def _signature(value: Any) -> Any:
    """What the temporaries depend on: a tensor's shape, strides, offset and dtype; other values as they are."""
    if isinstance(value, _TENSOR):
        return (value.shape, value.stride(), value.storage_offset(), value.dtype)  # a torch.Size is a tuple
    if isinstance(value, list):
        return tuple(map(_signature, value))
    return value


def _holds_memory(tensor: Any) -> bool:
    """A plain tensor: not a fake one (FakeTensorMode: no memory) nor a wrapper subclass (its inner tensors'
    ops come through the mode themselves)."""
    return not isinstance(tensor, _FAKE_TENSOR) and not _is_wrapper_subclass(tensor)


def _on_counted_device(ledger: StorageLedger, args: Sequence[Any]) -> bool:
    device = getattr(args[0] if args else None, "device", None)
    return ledger.device_type is None or getattr(device, "type", None) == ledger.device_type
