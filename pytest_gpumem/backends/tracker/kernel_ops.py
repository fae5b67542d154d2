"""The kernel temporaries of bmm / baddbmm (`Blas.cpp`), `index_put_` with accumulate (`Indexing.cu`),
embedding backward (`Embedding.cu`, `EmbeddingBackwardKernel.cu`) and `mse_loss`: the copies, sort buffers
and tables each kernel holds at its peak, in allocation order."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pytest_gpumem.backends.tracker.kernel_layout import HALF, WARP, Gpu, Layout
from pytest_gpumem.backends.tracker.kernel_reductions import reduction_temporaries, sum_like
from pytest_gpumem.backends.tracker.recording import op_arg

_CUB_SINGLE_TILE_SCRATCH = 1  # what cub asks for a sort that fits one tile (and for an empty request)


# --- bmm / baddbmm (Blas.cpp) ---


def _needs_copy(operand: Layout, transposed: bool, rows: int, cols: int) -> bool:
    """`prepare_batch_matrix_for_cublas`: whether the operand is copied contiguous."""
    fast, lead = (2, 1) if transposed else (1, 2)
    strides = operand.strides
    if strides[fast] == 1 and strides[lead] >= max(1, rows):
        return False
    if strides[lead] == 1 and strides[fast] >= max(1, cols):
        return False
    return not (operand.is_contiguous and strides[1] != 0 and strides[2] != 0)


def bmm_temporaries(result: Layout, batch1: Layout, batch2: Layout) -> list[int]:
    """The copies `baddbmm_out_cuda_impl` makes: the result's (when no layout of it suits cuBLAS), then each
    operand's that `prepare_batch_matrix_for_cublas` cannot hand over as it is."""
    if result.numel == 0 or batch1.shape[2] == 0:
        return []
    rows, cols = result.shape[1], result.shape[2]
    strides = result.strides
    copies = []
    if strides[1] == 1 and (cols == 1 or strides[2] >= max(1, rows)):
        transposed = False
    elif strides[2] == 1 and (rows == 1 or strides[1] >= max(1, cols)):
        transposed = True
    else:
        transposed = False
        copies.append(result.nbytes)
    m, n = (cols, rows) if transposed else (rows, cols)
    k = (batch2 if transposed else batch1).shape[1 if transposed else 2]
    first, second = (batch2, batch1) if transposed else (batch1, batch2)
    copies += [t.nbytes for t, r, c in ((first, m, k), (second, k, n)) if _needs_copy(t, transposed, r, c)]
    return copies


def bmm(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> list[int]:
    if name == "aten.bmm.default":
        batch1, batch2 = Layout.of(args[0]), Layout.of(op_arg(args, kwargs, 1, "mat2"))
        result = Layout.contiguous((batch1.shape[0], batch1.shape[1], batch2.shape[2]), batch1.dtype)
    else:
        batch1, batch2 = Layout.of(op_arg(args, kwargs, 1, "batch1")), Layout.of(op_arg(args, kwargs, 2, "batch2"))
        shape = (batch1.shape[0], batch1.shape[1], batch2.shape[2])
        result = Layout.of(args[0]) if name == "aten.baddbmm_.default" else Layout.contiguous(shape, batch1.dtype)
    return bmm_temporaries(result, batch1, batch2)


# --- index_put_ with accumulate (Indexing.cu) ---


def _broadcast(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    ndim = max((len(s) for s in shapes), default=0)
    padded = [(1,) * (ndim - len(s)) + s for s in shapes]
    return tuple(max(sizes) if min(sizes) != 0 else 0 for sizes in zip(*padded, strict=True))


def index_put_temporaries(self_: Layout, indices: Sequence[Layout | None], value: Layout) -> list[int]:
    """What `index_put_with_sort_kernel` holds at its peak, in allocation order (integer indices only: a
    boolean mask's positions depend on its data)."""
    defined = [(d, i) for d, i in enumerate(indices) if i is not None]
    if not defined or any(i.dtype in ("bool", "uint8") for _, i in defined):
        return []
    count = math.prod(_broadcast([i.shape for _, i in defined]))
    dims = [d for d, _ in defined]
    adjacent = dims == list(range(dims[0], dims[-1] + 1))
    shape = self_.shape
    rest = [n for d, n in enumerate(shape) if d not in dims]
    before = math.prod(shape[: dims[0]]) if adjacent else 1
    slice_size = math.prod(shape[dims[-1] + 1 :]) if adjacent else math.prod(rest)
    made = [] if self_.is_contiguous else [self_.nbytes]
    made.append(count * 8)  # the linear index (int64)
    needed = count * before * slice_size
    if value.numel < needed or not value.is_contiguous:
        made.append(needed * value.itemsize)
    if count == 0 or slice_size == 0:
        return [n for n in made if n]
    if not adjacent and not _front_is_contiguous(shape, dims):
        made.append(self_.nbytes)  # the self transposed to put the indexed dims first, made contiguous
    return [*made, count * 8, count * 8, count * 8, _CUB_SINGLE_TILE_SCRATCH]  # sorted, original, range, scratch


def _front_is_contiguous(shape: tuple[int, ...], dims: list[int]) -> bool:
    perm = dims + [d for d in range(len(shape)) if d not in dims]
    base = Layout.contiguous(shape, "float32")
    moved = Layout(tuple(shape[d] for d in perm), tuple(base.strides[d] for d in perm), "float32")
    return moved.is_contiguous


def index_put(args: Sequence[Any], kwargs: dict[str, Any]) -> list[int]:
    if index_put_takes_none(args, kwargs):
        return []
    indices = [None if i is None else Layout.of(i) for i in op_arg(args, kwargs, 1, "indices")]
    return index_put_temporaries(Layout.of(args[0]), indices, Layout.of(op_arg(args, kwargs, 2, "values")))


# --- embedding backward (Embedding.cu, EmbeddingBackwardKernel.cu) ---

_SMALL_EMBEDDING_BACKWARD = 3072  # at most this many indices (without scale_grad_by_freq): one kernel, no sort
_ROWS_PER_THREAD = 10  # NROWS_PER_THREAD
_MAX_BLOCK = 1024
_ATOMIC_BLOCKS_PER_SM = 4  # MAX_ATOMIC_ACCUM_BLOCKS_PER_SM


def embedding_backward_temporaries(
    grad: Layout, indices: Layout, num_weights: int, scale_grad_by_freq: bool, gpu: Gpu
) -> list[int]:
    """What `embedding_dense_backward_cuda` holds at its peak besides its output, in allocation order."""
    n, index_size, width = indices.numel, indices.itemsize, grad.shape[-1] if grad.shape else 1
    made = [] if indices.is_contiguous else [n * index_size]
    if not grad.is_contiguous:
        made.append(grad.nbytes)
    if n <= _SMALL_EMBEDDING_BACKWARD and not scale_grad_by_freq:
        return made
    made += [n * index_size] * (3 if scale_grad_by_freq else 2)  # sorted, original positions (, counts)
    segments = min(n, num_weights)
    partials = n // _ROWS_PER_THREAD + segments
    made += [n * index_size, 8, segments * index_size, segments * index_size, 8, partials * index_size]
    warped = -(-width // WARP) * WARP
    scatter_grid = -(-(segments * warped) // min(warped, _MAX_BLOCK))
    if scatter_grid < gpu.sm_count * _ATOMIC_BLOCKS_PER_SM and partials > scatter_grid * 4:
        made.append(partials * index_size)  # partial-to-segment map of the fused atomic path
        if grad.dtype in HALF:
            made.append(num_weights * width * 4)  # float accumulator of the weight's gradient
        return made
    accumulator = 8 if grad.dtype == "float64" else 4
    return [*made, partials * width * accumulator]


def embedding_backward(args: Sequence[Any], kwargs: dict[str, Any], gpu: Gpu) -> list[int]:
    grad, indices = Layout.of(args[0]), Layout.of(op_arg(args, kwargs, 1, "indices"))
    num_weights = int(op_arg(args, kwargs, 2, "num_weights"))
    scale = bool(op_arg(args, kwargs, 4, "scale_grad_by_freq", False))
    return embedding_backward_temporaries(grad, indices, num_weights, scale, gpu)


def index_put_takes_none(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Without accumulate, `index_put_` writes in place with no temporaries."""
    return not op_arg(args, kwargs, 3, "accumulate", False)


# --- mse_loss ---


def mse_loss(args: Sequence[Any], kwargs: dict[str, Any], gpu: Gpu) -> list[int]:
    """`mse_loss_out`: the unreduced loss (the inputs' broadcast shape), then its mean's or sum's staging."""
    if mse_loss_takes_none(args, kwargs):
        return []
    first, second = Layout.of(args[0]), Layout.of(op_arg(args, kwargs, 1, "target"))
    loss = Layout.contiguous(_broadcast([first.shape, second.shape]), first.dtype)
    if loss.numel == 0:
        return []
    flat = Layout((loss.numel,), (1,), loss.dtype)
    red = sum_like(flat, None, frozenset((0,)))
    return [loss.nbytes, *([] if red is None else reduction_temporaries(red, gpu))]


def mse_loss_takes_none(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Unreduced (`reduction=0`), `mse_loss` writes its output with no temporaries."""
    return bool(op_arg(args, kwargs, 2, "reduction", 1) == 0)
