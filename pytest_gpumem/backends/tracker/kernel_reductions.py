"""Reductions' kernel temporaries (`Reduce.cuh`): the staging buffer and semaphores of a reduction split
across blocks, from the input's layout, the dims reduced and the card; and which reduction an op launches."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pytest_gpumem.backends.tracker.kernel_layout import HALF, INTEGRAL, WARP, Gpu, Layout, dtype_name
from pytest_gpumem.backends.tracker.recording import op_arg

_INT32_MAX = 2**31 - 1
_SEMAPHORE = 4  # sizeof(int)


@dataclass(frozen=True)
class Reduction:
    """A reduction kernel's launch: the input, the dims it reduces, the accumulator's bytes (`arg_t`), the
    input vector width (`input_vec_size`; `vt0` is 4 for every reduction modelled here) and the most
    threads a block takes (256 for complex128, else 512)."""

    layout: Layout
    dims: frozenset[int]
    arg_size: int
    input_vec: int = 4
    max_threads: int = 512


def _iteration(red: Reduction) -> tuple[list[int], list[int], int]:
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


def _output_vec(red: Reduction, sizes: list[int], strides: list[int], reduced: int) -> int:
    """`get_output_vec_size`: 4, halved until it divides the input's address (in elements), the fastest
    output dim and every other input stride."""
    vec = 4
    itemsize = red.layout.itemsize
    for n in (red.layout.offset, sizes[reduced], *(s // itemsize for i, s in enumerate(strides) if i != reduced)):
        while n % vec:
            vec //= 2
    return vec


def reduction_temporaries(red: Reduction, gpu: Gpu) -> list[int]:
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
    red: Reduction, sizes: list[int], strides: list[int], reduced: int, outputs: int, per_output: int, gpu: Gpu
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
    width = min(pow0, WARP)
    height = min(pow1, max_threads // width)
    return min(pow0, max_threads // height), height


# --- which reduction an op launches ---

SUM_LIKE = frozenset(("aten.sum.default", "aten.sum.dim_IntList", "aten.mean.default", "aten.mean.dim"))
VALUES = frozenset(("aten.amax.default", "aten.amin.default"))
INDEXED = frozenset(("aten.max.dim", "aten.min.dim", "aten.argmax.default", "aten.argmin.default"))
_PAIR = 16  # thrust::pair<value, int64_t>: the accumulator of max/min with indices and argmax/argmin


def _reduced_dims(dim: Any, ndim: int) -> frozenset[int]:
    """The dims a `dim` argument names (None or empty: all), made non-negative."""
    if dim is None:
        return frozenset(range(ndim))
    named = [dim] if isinstance(dim, int) else list(dim)
    return frozenset(d % max(ndim, 1) for d in named) if named else frozenset(range(ndim))


def sum_like(layout: Layout, out_dtype: str | None, dims: frozenset[int]) -> Reduction | None:
    """sum and mean: the accumulator is float for 16-bit inputs (read 8 at a time), else the input's type;
    an output type other than the input's (or float for 16-bit inputs) casts the input first: not modelled."""
    out = out_dtype or ("int64" if layout.dtype in INTEGRAL else layout.dtype)  # integers sum to int64
    half = layout.dtype in HALF
    if out != layout.dtype and not (half and out == "float32"):
        return None
    if layout.dtype == "bool" or layout.itemsize == 0:
        return None
    arg = 4 if half else layout.itemsize
    return Reduction(layout, dims, arg, 8 if half else 4, 256 if layout.dtype == "complex128" else 512)


def fewest_split(max_threads: int, one_output: bool = False) -> int:
    """The fewest values per output that `_config` splits across blocks, whatever the layout and the card: a
    thread then takes at least 256 values, all of one output's. A single output's block is one row of
    `max_threads` lanes; else the block is at least `max_threads` / 4 (the output vector) / 32 (the warp)
    rows high where the reduced dim is not the fastest, and at least a warp wide where it is (8,161)."""
    return 255 * (max_threads if one_output else max_threads // 4 // WARP) + 1


_FEWEST_SPLIT = fewest_split(512)  # 1,021
_FEWEST_SPLIT_ANY = fewest_split(256)  # 511: complex128's sums take blocks of 256 threads
_FEWEST_SPLIT_ONE = fewest_split(512, one_output=True)  # 130,561
_FEWEST_SPLIT_ONE_ANY = fewest_split(256, one_output=True)  # 65,281


def stages_nothing(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether reduction op `name` surely stages nothing on these arguments, from the input's shape, the
    dims reduced and its item's size alone (`reduction_of` and `reduction_temporaries` without the
    layout): too few values per output to split."""
    tensor = args[0]
    dim = _dim_arg(name, args, kwargs)
    if dim is None and name in INDEXED:  # an index over all the values: no reduction modelled
        return True
    per_output = _values_per_output(tensor, dim)
    if per_output < _FEWEST_SPLIT_ANY:
        return True
    wide = tensor.element_size() >= 16  # complex128: blocks of 256 threads
    if per_output == tensor.numel():  # one output
        return per_output < (_FEWEST_SPLIT_ONE_ANY if wide else _FEWEST_SPLIT_ONE)
    return per_output < _FEWEST_SPLIT and not wide


def _dim_arg(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Reduction op `name`'s `dim` argument (None or empty: every dim; for INDEXED, None: an index over all)."""
    if name in SUM_LIKE:
        return None if name.endswith(".default") else op_arg(args, kwargs, 1, "dim")
    return op_arg(args, kwargs, 1, "dim", () if name in VALUES else None)


def _values_per_output(tensor: Any, dim: Any) -> int:
    """How many values each output reduces, at least: the product of the sizes of the dims `dim` names
    (None or none: all). A dim named twice counts twice (more, never fewer); one out of range raises."""
    if isinstance(dim, int):
        return tensor.shape[dim] if tensor.dim() else 1
    if not dim:
        values: int = tensor.numel()
        return values
    shape = tensor.shape
    if not shape:
        return 1
    values = 1
    for d in dim:
        values *= shape[d]
    return values


def reduction_of(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Reduction | None:
    """The reduction kernel op `name` launches on these arguments (None: none modelled)."""
    layout = Layout.of(args[0])
    ndim = len(layout.shape)
    if layout.numel == 0 or layout.itemsize == 0:
        return None
    dim = _dim_arg(name, args, kwargs)
    if name in SUM_LIKE:
        dtype = kwargs.get("dtype")
        return sum_like(layout, None if dtype is None else dtype_name(dtype), _reduced_dims(dim, ndim))
    if name in VALUES:
        return Reduction(layout, _reduced_dims(dim, ndim), layout.itemsize)
    if name in INDEXED:
        return None if dim is None or ndim == 0 else Reduction(layout, _reduced_dims(dim, ndim), _PAIR)
    return None
