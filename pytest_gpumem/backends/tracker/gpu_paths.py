"""The GPU's code paths on the meta device: what a prediction runs where torch would take the CPU's.

- Optimizers: torch defaults to `foreach` only for the devices `_get_foreach_kernels_supported_devices`
  names (CUDA-like ones); during a measurement the list also names cpu and meta, so a default optimizer
  takes the foreach path a GPU takes (an explicit `foreach=False` keeps the single-tensor loop).
- Attention: on meta `scaled_dot_product_attention` takes the math path, which saves the S x S
  attention weights. A GPU picks a fused kernel (flash, then memory-efficient, then math: torch's
  priority order), which saves the output and a float32 logsumexp. `attention` calls the op that CUDA's
  `scaled_dot_product_attention` calls, with the same padding of its inputs, so that torch's own meta
  kernels make (and autograd saves) what the GPU's kernels make.

Backward runs where the mode is not: `Tensor.backward` and `torch.autograd.grad` are torch functions, so
their engine runs inside the mode's handler, which torch calls with the mode off its stack, and backward
keeps that stack. The tracker puts the mode back for each engine run (`on_stack`), so that what
backward runs (a checkpoint's recomputed forward, reentrant or not; a custom Function's backward) takes
the path the forward took. `F.multi_head_attention_forward` (`nn.MultiheadAttention`) is a torch function
calling SDPA in its body: for its calls, `F.scaled_dot_product_attention` goes through the mode.

Under CUDA's autocast (`autocast`), SDPA is a lower-precision op: the kernel is picked from its inputs as
that policy casts them (flash for float32 inputs in a bf16 region), as CUDA's autocast kernel hands them
to the op on a card, and the casts are counted (backward gets their ToCopyBackward).

While torch.compile traces, the mode steps aside: the graph holds the op as written (Inductor cannot
lower the flash kernel's meta graph), so a compiled region on meta takes the path it takes on CPU.

Not modelled: the kernels' workspaces inside one call (flash backward's float32 accumulator of the
query's gradient, the memory-efficient kernel's float32 output accumulator), which are freed by the
kernel before it returns.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pytest_gpumem.private_torch import sdpa_function

if TYPE_CHECKING:
    import torch

_FLASH = "flash"
_EFFICIENT = "efficient"
MATH = "math"

_FLASH_DTYPES = ("torch.float16", "torch.bfloat16")
_EFFICIENT_DTYPES = (*_FLASH_DTYPES, "torch.float32")
_FLASH_MAX_HEAD_DIM = 256
_FLASH_HEAD_ALIGNMENT = 8  # flash pads the head dimension to a multiple of 8 (`pad_last_dim<8>`)
_MASK_ALIGNMENT = 8  # memory-efficient attention pads a mask whose strides are not multiples of 8
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None}


def _attention_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    enable_gqa: bool = False,
) -> str:
    """The kernel CUDA's `scaled_dot_product_attention` picks for these inputs on a recent GPU (Ampere
    or later): flash, efficient or math, honouring `torch.backends.cuda.*_sdp_enabled` (and so
    `torch.nn.attention.sdpa_kernel`)."""
    import torch

    flash_enabled = torch.backends.cuda.flash_sdp_enabled()  # type: ignore[no-untyped-call]
    efficient_enabled = torch.backends.cuda.mem_efficient_sdp_enabled()  # type: ignore[no-untyped-call]
    dims = (query.dim(), key.dim(), value.dim())
    dtype = str(query.dtype)
    if dims != (4, 4, 4) or any(t.is_nested or type(t) is not torch.Tensor for t in (query, key, value)):
        return MATH
    if not (query.dtype == key.dtype == value.dtype) or 0 in (query.size(-2), key.size(-2)):
        return MATH
    heads_differ = query.size(1) != key.size(1) or key.size(1) != value.size(1)
    if heads_differ and not (enable_gqa and key.size(1) == value.size(1) and query.size(1) % key.size(1) == 0):
        return MATH
    same_head_dim = query.size(-1) == key.size(-1) == value.size(-1)
    if (
        flash_enabled
        and attn_mask is None
        and dtype in _FLASH_DTYPES
        and same_head_dim
        and query.size(-1) <= _FLASH_MAX_HEAD_DIM
    ):
        return _FLASH
    alignment = 4 if dtype == "torch.float32" else 8  # 16 bytes of the head dimension
    if (
        efficient_enabled
        and not heads_differ
        and dtype in _EFFICIENT_DTYPES
        and query.size(-1) == key.size(-1)
        and query.size(-1) % alignment == 0
        and value.size(-1) % alignment == 0
    ):
        return _EFFICIENT
    return MATH


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor | None:
    """`scaled_dot_product_attention` as CUDA runs it with a fused kernel; None where CUDA would take
    the math path (the caller runs the op as it is)."""
    kernel = _attention_kernel(query, key, value, attn_mask, enable_gqa)
    if kernel == _FLASH:
        return _flash(query, key, value, dropout_p, is_causal, scale)
    if kernel == _EFFICIENT:
        return _efficient(query, key, value, attn_mask, dropout_p, is_causal, scale)
    return None


def _flash(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float, is_causal: bool, scale: float | None
) -> torch.Tensor:
    import torch
    import torch.nn.functional as F

    head_dim = query.size(-1)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)  # of the unpadded head dimension, as CUDA's composite passes it
    pad = -head_dim % _FLASH_HEAD_ALIGNMENT
    if pad:
        query, key, value = (F.pad(t, (0, pad)) for t in (query, key, value))
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        query, key, value, dropout_p, is_causal, return_debug_mask=False, scale=scale
    )[0]
    return out[..., :head_dim] if pad else out  # type: ignore[no-any-return]


def _efficient(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
) -> torch.Tensor:
    import torch

    if attn_mask is not None:
        attn_mask = _prepared_mask(attn_mask, query, key)
    log_sumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, log_sumexp, dropout_p, is_causal, scale=scale
    )[0]
    return out  # type: ignore[no-any-return]


def _prepared_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The mask as CUDA hands it to the memory-efficient kernel: a boolean one made additive in the
    query's dtype (`convert_boolean_attn_mask`), padded when its strides are not multiples of 8
    (`preprocess_mask`), broadcast to (batch, heads, queries, keys)."""
    import torch
    import torch.nn.functional as F

    if mask.dtype == torch.bool:
        zero = torch.scalar_tensor(0.0, dtype=query.dtype, device=mask.device)
        mask = torch.where(mask.logical_not(), -math.inf, zero)
    aligned = mask.stride(-1) == 1 and all(s % _MASK_ALIGNMENT == 0 for s in mask.stride()[:-1])
    if not aligned:
        last = mask.size(-1)
        mask = F.pad(mask, (0, _MASK_ALIGNMENT - last % _MASK_ALIGNMENT))[..., :last]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))


def _sdpa_arguments(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """The arguments of a `scaled_dot_product_attention` call by name; None for a call that does not
    bind (the op itself then says what is wrong)."""
    if len(args) > len(_SDPA_ARGS):
        return None
    bound = dict(zip(_SDPA_ARGS, args, strict=False))
    for name, value in (kwargs or {}).items():
        if name not in _SDPA_ARGS or name in bound:
            return None
        bound[name] = value
    if not all(name in bound for name in _SDPA_ARGS[:3]):
        return None
    return {**_SDPA_DEFAULTS, "enable_gqa": False, **bound}


def fused_attention_mode() -> Any:
    """A `TorchFunctionMode` that runs `scaled_dot_product_attention` on meta tensors as `attention`."""
    return _fused_attention_class()()


@functools.cache
def _fused_attention_class() -> type[Any]:
    """One class for every measurement: torch.compile guards on the types on the mode stack, and a new
    type per measurement would recompile a compiled function in each, until Dynamo's recompile limit
    makes it run eagerly (different figures in later tests)."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    from pytest_gpumem.backends.tracker.autocast import lower_precision

    sdpa = sdpa_function()
    multi_head = F.multi_head_attention_forward

    class FusedAttention(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            __tracebackhide__ = True
            if func is sdpa and not torch.compiler.is_compiling():
                bound = _sdpa_arguments(args, kwargs)
                query = None if bound is None else bound["query"]
                if isinstance(query, torch.Tensor) and query.device.type == "meta":
                    out = attention(**lower_precision(bound))  # type: ignore[arg-type]
                    if out is not None:
                        return out
            if func is multi_head and F.scaled_dot_product_attention is sdpa:
                # a torch function itself, so its body runs with the mode off the stack: the SDPA it
                # calls (by the module's global name) is sent through the mode for the call
                F.scaled_dot_product_attention = self.fused
                try:
                    return func(*args, **(kwargs or {}))
                finally:
                    F.scaled_dot_product_attention = sdpa
            return func(*args, **(kwargs or {}))

        def fused(self, *args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            return self.__torch_function__(sdpa, (), args, kwargs)

    return FusedAttention


@contextlib.contextmanager
def on_stack(mode: Any) -> Iterator[None]:
    """Within the block, `mode` is on this thread's torch-function mode stack (pushed if it is not)."""
    from pytest_gpumem.private_torch import function_mode_stack

    if mode in function_mode_stack():
        yield
        return
    mode.__enter__()
    try:
        yield
    finally:
        leave_function_mode(mode)


def leave_function_mode(mode: Any) -> None:
    """Take `mode` off this thread's torch-function mode stack, with any the test left above it."""
    from pytest_gpumem.private_torch import function_mode_stack, pop_function_mode

    if mode not in function_mode_stack():
        return
    while function_mode_stack()[-1] is not mode:
        pop_function_mode()
    mode.__exit__(None, None, None)
