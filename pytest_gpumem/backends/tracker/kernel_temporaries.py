"""Kernel temporaries: memory a CUDA kernel takes from the caching allocator and gives back inside one op,
which a dispatch mode never sees (it sees the op's outputs only), from shapes, strides and the card.

On a card these blocks show in a memory snapshot and can sit at a peak. `temporaries(name, args, kwargs,
card)` gives their sizes, in the order the kernel allocates them, all freed (in reverse order) before the op
returns; `label(name)` what they are, or None for an op with none modelled. `record` puts them in the ledger
(`StorageLedger.transient`) when it predicts a GPU. Pure functions of layouts (`Layout`: shape, strides in
elements, dtype, storage offset), so they test without torch; a tensor gives its layout with `Layout.of`.

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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pytest_gpumem import private_torch
from pytest_gpumem.backends.tracker import cudnn
from pytest_gpumem.backends.tracker.recording import op_arg

if TYPE_CHECKING:
    from cuda_allocator_model import Card
    from pytest_gpumem.backends.tracker.ledger import StorageLedger

_ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}
_HALF = frozenset(("float16", "bfloat16"))
_INTEGRAL = frozenset(("bool", "uint8", "int8", "int16", "int32", "int64"))
_INT32_MAX = 2**31 - 1
_WARP = 32
_FAKE_TENSOR = private_torch.fake_tensor_class()
_TENSOR = torch.Tensor
_is_wrapper_subclass = private_torch.wrapper_subclass_test()
_SEMAPHORE = 4  # sizeof(int)
_CUB_SINGLE_TILE_SCRATCH = 1  # what cub asks for a sort that fits one tile (and for an empty request)


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Layout:
    """A tensor as a kernel sees it: shape, strides (in elements), dtype name ('float32') and storage offset."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    offset: int = 0

    @classmethod
    def of(cls, tensor: Any) -> Layout:
        """The layout of a torch tensor (any object with `shape`, `stride()`, `dtype`, `storage_offset()`)."""
        shape = tuple(int(n) for n in tensor.shape)
        return cls(shape, tuple(int(s) for s in tensor.stride()), _dtype_name(tensor.dtype), tensor.storage_offset())

    @classmethod
    def contiguous(cls, shape: Sequence[int], dtype: str) -> Layout:
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= size
        return cls(tuple(shape), tuple(reversed(strides)), dtype)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE.get(self.dtype, 0)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        """torch's `is_contiguous()`: row-major, dims of size 1 (and empty tensors) aside."""
        if self.numel == 0:
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if size != 1:
                if stride != expected:
                    return False
                expected *= size
        return True


@dataclass(frozen=True)
class Gpu:
    """What a launch config reads of the card: its SMs and the threads one SM holds."""

    sm_count: int
    threads_per_sm: int


DEFAULT_GPU = Gpu(108, 2048)
"""An A100's SMs: the card a prediction assumes when none is named (as for the cuBLAS workspace)."""


def _gpu_of(card: Card | None) -> Gpu:
    """The launch-config figures of `card` (`DEFAULT_GPU` for None)."""
    return DEFAULT_GPU if card is None else Gpu(card.sm_count, card.threads_per_sm)


# --- reductions (Reduce.cuh) ---


@dataclass(frozen=True)
class _Reduction:
    """A reduction kernel's launch: the input, the dims it reduces, the accumulator's bytes (`arg_t`), the
    input vector width (`input_vec_size`; `vt0` is 4 for every reduction modelled here) and the most
    threads a block takes (256 for complex128, else 512)."""

    layout: Layout
    dims: frozenset[int]
    arg_size: int
    input_vec: int = 4
    max_threads: int = 512


def _iteration(red: _Reduction) -> tuple[list[int], list[int], int]:
    """TensorIterator's shape and input strides (bytes) for the reduction, fastest dim first, reduced dims
    in front, with adjacent dims merged; and how many dims are reduced."""
    layout = red.layout
    dims = [d for d, size in enumerate(layout.shape) if size != 1]
    kept = [d for d in dims if d not in red.dims]
    out = {d: 0 for d in dims}
    for i, d in enumerate(kept):  # a new output is contiguous over the kept dims
        out[d] = math.prod(layout.shape[e] for e in kept[i + 1 :])
    inp = {d: layout.strides[d] * layout.itemsize for d in dims}
    order = _reordered(dims[::-1], layout.shape, out, inp)
    return _coalesced(order, layout.shape, out, inp)


def _reordered(perm: list[int], shape: tuple[int, ...], out: dict[int, int], inp: dict[int, int]) -> list[int]:
    """`reorder_dimensions`: an insertion sort that tolerates undecided pairs (`_order`)."""
    for i in range(1, len(perm)):
        moving = i
        for before in range(i - 1, -1, -1):
            decision = _order(perm[before], perm[moving], shape, out, inp)
            if decision > 0:
                perm[before], perm[moving] = perm[moving], perm[before]
                moving = before
            elif decision < 0:
                break
    return perm


def _order(a: int, b: int, shape: tuple[int, ...], out: dict[int, int], inp: dict[int, int]) -> int:
    """1 if dim `a` goes after `b`, -1 if before, 0 undecided: the output puts reduced dims first; then
    smaller strides first (the output's, then the input's), the smaller dim first on a tie."""
    if (out[a] == 0) != (out[b] == 0):
        return 1 if out[b] == 0 else -1
    for strides in (out, inp):
        first, second = strides[a], strides[b]
        if first == 0 or second == 0:
            continue
        if first != second:
            return -1 if first < second else 1
        if shape[a] > shape[b]:
            return 1
    return 0


def _coalesced(
    order: list[int], shape: tuple[int, ...], out: dict[int, int], inp: dict[int, int]
) -> tuple[list[int], list[int], int]:
    sizes: list[int] = []
    outs: list[int] = []
    ins: list[int] = []
    for d in order:
        if sizes and outs[-1] * sizes[-1] == out[d] and ins[-1] * sizes[-1] == inp[d]:
            sizes[-1] *= shape[d]
        else:
            sizes.append(shape[d])
            outs.append(out[d])
            ins.append(inp[d])
    return sizes, ins, sum(1 for s in outs if s == 0)


def _last_pow2(n: int) -> int:
    return max(1, 1 << (n.bit_length() - 1)) if n > 0 else 1


def _output_vec(red: _Reduction, sizes: list[int], strides: list[int], reduced: int) -> int:
    """`get_output_vec_size`: 4, halved until it divides the input's address (in elements), the fastest
    output dim and every other input stride."""
    vec = 4
    itemsize = red.layout.itemsize
    for n in (red.layout.offset, sizes[reduced], *(s // itemsize for i, s in enumerate(strides) if i != reduced)):
        while n % vec:
            vec //= 2
    return vec


def _reduction_temporaries(red: _Reduction, gpu: Gpu) -> list[int]:
    """The staging buffer and semaphores `gpu_reduce_kernel` allocates for `red` on `gpu` (none when the
    launch needs no global reduction)."""
    outputs = math.prod(n for d, n in enumerate(red.layout.shape) if d not in red.dims)
    per_output = red.layout.numel // outputs if outputs else 0
    if per_output < 256 or not _fits_32bit(red.layout):  # fewer values per thread than a split needs
        return []
    sizes, strides, reduced = _iteration(red)
    config = _config(red, sizes, strides, reduced, outputs, per_output, gpu)
    return [] if config is None else list(config)


def _fits_32bit(layout: Layout) -> bool:
    last = sum((n - 1) * abs(s) for n, s in zip(layout.shape, layout.strides, strict=True))
    return layout.numel <= _INT32_MAX and (last + 1) * layout.itemsize <= _INT32_MAX


def _config(
    red: _Reduction, sizes: list[int], strides: list[int], reduced: int, outputs: int, per_output: int, gpu: Gpu
) -> tuple[int, int] | None:
    """`setReduceConfig` as far as it decides the global reduction: (staging bytes, semaphore bytes) or None."""
    itemsize = red.layout.itemsize
    fastest = reduced == len(sizes) or strides[0] < strides[reduced]
    dim0, dim1 = (per_output, outputs) if fastest else (outputs, per_output)
    moving = strides[0] if fastest else strides[reduced]
    vec = 1
    if moving == itemsize:
        if fastest and dim0 > 128 and reduced == 1 and red.input_vec <= 4:  # vt0 >= input_vec_size
            dim0 //= red.input_vec
        elif not fastest:
            vec = _output_vec(red, sizes, strides, reduced)
            dim0 //= vec
    width, height = _block(dim0, dim1, red.max_threads // vec)
    step_in, step_out = (width, 1) if fastest else (1, width)
    if -(-per_output // step_in) < min(height * 16, 256):
        return None  # each warp takes its own outputs: no split across warps, none across blocks
    step_in *= height
    per_thread = -(-per_output // step_in)
    grid = -(-(outputs // vec) // step_out)
    target = gpu.sm_count * (gpu.threads_per_sm // (width * height))
    if per_thread < 256 or grid > target:
        return None
    ctas = max(min(-(-target // grid), -(-per_thread // 16)), -(-per_thread // 256))
    if ctas <= 1:
        return None
    staging = red.arg_size * outputs * ctas * (1 if fastest else width * vec)
    return staging, _SEMAPHORE * grid


def _block(dim0: int, dim1: int, max_threads: int) -> tuple[int, int]:
    """`ReduceConfig::set_block_dimension`: the block's width and height."""
    pow0 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    pow1 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(pow0, _WARP)
    height = min(pow1, max_threads // width)
    return min(pow0, max_threads // height), height


# --- which reduction an op launches ---

_SUM_LIKE = frozenset(("aten.sum.default", "aten.sum.dim_IntList", "aten.mean.default", "aten.mean.dim"))
_VALUES = frozenset(("aten.amax.default", "aten.amin.default"))
_INDEXED = frozenset(("aten.max.dim", "aten.min.dim", "aten.argmax.default", "aten.argmin.default"))
_PAIR = 16  # thrust::pair<value, int64_t>: the accumulator of max/min with indices and argmax/argmin


def _reduced_dims(dim: Any, ndim: int) -> frozenset[int]:
    """The dims a `dim` argument names (None or empty: all), made non-negative."""
    if dim is None:
        return frozenset(range(ndim))
    named = [dim] if isinstance(dim, int) else list(dim)
    return frozenset(d % max(ndim, 1) for d in named) if named else frozenset(range(ndim))


def _sum_like(layout: Layout, out_dtype: str | None, dims: frozenset[int]) -> _Reduction | None:
    """sum and mean: the accumulator is float for 16-bit inputs (read 8 at a time), else the input's type;
    an output type other than the input's (or float for 16-bit inputs) casts the input first: not modelled."""
    out = out_dtype or ("int64" if layout.dtype in _INTEGRAL else layout.dtype)  # integers sum to int64
    half = layout.dtype in _HALF
    if out != layout.dtype and not (half and out == "float32"):
        return None
    if layout.dtype == "bool" or layout.itemsize == 0:
        return None
    arg = 4 if half else layout.itemsize
    return _Reduction(layout, dims, arg, 8 if half else 4, 256 if layout.dtype == "complex128" else 512)


def _reduction_of(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> _Reduction | None:
    """The reduction kernel op `name` launches on these arguments (None: none modelled)."""
    layout = Layout.of(args[0])
    ndim = len(layout.shape)
    if layout.numel == 0 or layout.itemsize == 0:
        return None
    if name in _SUM_LIKE:
        dim = None if name.endswith(".default") else op_arg(args, kwargs, 1, "dim")
        dtype = kwargs.get("dtype")
        return _sum_like(layout, None if dtype is None else _dtype_name(dtype), _reduced_dims(dim, ndim))
    if name in _VALUES:
        return _Reduction(layout, _reduced_dims(op_arg(args, kwargs, 1, "dim", ()), ndim), layout.itemsize)
    if name in _INDEXED:
        dim = op_arg(args, kwargs, 1, "dim")
        return None if dim is None or ndim == 0 else _Reduction(layout, _reduced_dims(dim, ndim), _PAIR)
    return None


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


def _bmm(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> list[int]:
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


def _index_put(args: Sequence[Any], kwargs: dict[str, Any]) -> list[int]:
    if not op_arg(args, kwargs, 3, "accumulate", False):
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
    warped = -(-width // _WARP) * _WARP
    scatter_grid = -(-(segments * warped) // min(warped, _MAX_BLOCK))
    if scatter_grid < gpu.sm_count * _ATOMIC_BLOCKS_PER_SM and partials > scatter_grid * 4:
        made.append(partials * index_size)  # partial-to-segment map of the fused atomic path
        if grad.dtype in _HALF:
            made.append(num_weights * width * 4)  # float accumulator of the weight's gradient
        return made
    accumulator = 8 if grad.dtype == "float64" else 4
    return [*made, partials * width * accumulator]


def _embedding_backward(args: Sequence[Any], kwargs: dict[str, Any], gpu: Gpu) -> list[int]:
    grad, indices = Layout.of(args[0]), Layout.of(op_arg(args, kwargs, 1, "indices"))
    num_weights = int(op_arg(args, kwargs, 2, "num_weights"))
    scale = bool(op_arg(args, kwargs, 4, "scale_grad_by_freq", False))
    return embedding_backward_temporaries(grad, indices, num_weights, scale, gpu)


# --- mse_loss ---


def _mse_loss(args: Sequence[Any], kwargs: dict[str, Any], gpu: Gpu) -> list[int]:
    """`mse_loss_out`: the unreduced loss (the inputs' broadcast shape), then its mean's or sum's staging."""
    if op_arg(args, kwargs, 2, "reduction", 1) == 0:
        return []
    first, second = Layout.of(args[0]), Layout.of(op_arg(args, kwargs, 1, "target"))
    loss = Layout.contiguous(_broadcast([first.shape, second.shape]), first.dtype)
    if loss.numel == 0:
        return []
    flat = Layout((loss.numel,), (1,), loss.dtype)
    red = _sum_like(flat, None, frozenset((0,)))
    return [loss.nbytes, *([] if red is None else _reduction_temporaries(red, gpu))]


# --- the ops ---

_LABELS = {
    **dict.fromkeys((*_SUM_LIKE, *_VALUES, *_INDEXED), "reduction staging buffer"),
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
    gpu = _gpu_of(card)
    if name.startswith(("aten.bmm", "aten.baddbmm")):
        return _bmm(name, args, kwargs)
    if "index_put" in name:
        return _index_put(args, kwargs)
    if name == "aten.embedding_dense_backward.default":
        return _embedding_backward(args, kwargs, gpu)
    if name == "aten.mse_loss.default":
        return _mse_loss(args, kwargs, gpu)
    if name in cudnn.LABELS:
        return cudnn.temporaries(
            name, args, kwargs, lambda t, dims: temporaries("aten.sum.dim_IntList", (t, dims), None, card)
        )
    red = _reduction_of(name, args, kwargs)
    return [] if red is None else _reduction_temporaries(red, gpu)


_KNOWN: dict[object, tuple[str, str | None]] = {}  # each op overload's name and label, on its first call


def _known(func: object) -> tuple[str, str | None]:
    try:
        return _KNOWN[func]
    except KeyError:
        name = str(func)
        found = _KNOWN[func] = (name, label(name))
        return found


def modelled(func: object) -> bool:
    """Whether op overload `func` has temporaries modelled (cached per overload: the dispatch's hot path)."""
    return _known(func)[1] is not None


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
    name, kind = _known(func)
    sizes: list[int] = []
    if kind is not None and _on_counted_device(ledger, args) and _holds_memory(args[0]):
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
