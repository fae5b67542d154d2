"""Convolutions and batch norm as a card runs them: what CUDA's paths take from the caching allocator inside
`aten.convolution`, `aten.convolution_backward`, `aten.native_batch_norm` and its backward beyond the outputs
a dispatch mode sees. Registered with the kernel temporaries (`kernel_temporaries`), so that they go through
the allocator's model inside their op and are named in --gpumem-explain.

Read from torch's sources (`Convolution.cpp`: `_select_conv_backend`, `_convolution`, `convolution_backward`;
`cudnn/ConvShared.cpp`, `cudnn/Conv_v8.cpp`, `cudnn/BatchNorm.cpp`, `Normalization.cpp`:
`_batch_norm_impl_index`; `DepthwiseConv2d.cu`, `DepthwiseConv3d.cu`), checked against the shared conv traces
(`HugePandaCoder__octree-nca-groupeq__*`: 1x1 convolutions through `cudnn_convolution`, 2-D and 3-D depthwise
convolutions through `conv_depthwise2d` / `conv_depthwise3d`, `cudnn_batch_norm` in training, on fp32):

* A convolution's input is copied contiguous in the backend's memory format when it is not (channels-last
  when the input or the weight is; a 1-D convolution's input always row-major), and so is the weight;
  cuDNN's backward copies the gradient of the output too. The copies live until the op returns. Outputs
  are allocated as on the CPU (bias added in place).
* cuDNN's workspace: in the traces every `cudnn_convolution` (1x1, stride 1, no padding) allocates its output
  and nothing else: 0 B, as the implicit-GEMM engine needs none. For any other cuDNN convolution, and for
  every backward, the workspace is the algorithm's (heuristics by default, the fastest measured one under
  `cudnn.benchmark`) and so the card's: the figure counts 0 B and the notes name the ops. 0 B is what torch
  falls back to: when the allocator refuses a plan's workspace it tries the next plan (heuristics) or halves
  the request (benchmark, which starts from the largest cached free block), and a zero-workspace engine is
  always among them; a card with room holds more at those ops.
* Depthwise convolutions (groups = input channels, 4-D or 5-D, not transposed) run CUDA's own kernels
  (`conv_depthwise2d`, `conv_depthwise3d`: outputs only, as traced), except 4-D float16 ones with 32 or more
  channels, which cuDNN may take (its own table of shapes): those are noted like cuDNN's.
* A bias's gradient is `grad_output.sum` over all dims but the channels: its reduction's staging buffer,
  after the copies are freed (the larger of the two is held).
* A reflect-padded convolution's `F.pad` (`reflection_pad1d/2d/3d`) allocates its output, then copies a
  non-contiguous input contiguous (traced in 2-D and 3-D: a channels-last state, 7,180,800 B, copied after
  its 7,266,816 B padded output, freed before the op returns).
* Batch norm takes cuDNN (`cudnn_batch_norm`) for fp32 and fp16 inputs (fp32 weights) of 3 or more dims with
  weight and bias, at most 880,801 samples in training (65,535 in eval) and under 2^31 elements. Its input is
  copied contiguous first when it is not; in training it allocates the output, the saved mean and inverse
  std (C floats each: the CPU's outputs too) and a reserve of 0 B (no fused activation), as traced. The
  backward copies the output's gradient contiguous when it is not. A channels-last input takes cuDNN's
  persistent kernels, whose workspace and reserve are the card's: noted.

Not as on a card, noted: in training, cuDNN saves its contiguous copy of a non-contiguous input for backward
where the CPU saves the input itself, so where the input is also kept elsewhere a card holds both.
Not modelled: convolutions with `torch.backends.cudnn.enabled = False` (CUDA's im2col kernels), batch norm
outside cuDNN (bf16 inputs: CUDA's Welford kernels' staging), transposed depthwise convolutions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from pytest_gpumem.backends.tracker.recording import op_arg
from pytest_gpumem.constants import WORKSPACES_AT_ZERO

CONVOLUTION = "aten.convolution.default"
CONVOLUTION_BACKWARD = "aten.convolution_backward.default"
BATCH_NORM = "aten.native_batch_norm.default"
BATCH_NORM_BACKWARD = "aten.native_batch_norm_backward.default"

REFLECTION_PADS = frozenset(f"aten.reflection_pad{n}d.default" for n in (1, 2, 3))

LABELS = {
    **dict.fromkeys(REFLECTION_PADS, "reflection pad input copy"),
    CONVOLUTION: "convolution copies and cuDNN workspace",
    CONVOLUTION_BACKWARD: "convolution backward copies and bias reduction",
    BATCH_NORM: "cuDNN batch norm input copy",
    BATCH_NORM_BACKWARD: "cuDNN batch norm gradient copy",
}
"""What each op's temporaries are, for the kernel temporaries' labels."""

Reducer = Callable[[torch.Tensor, list[int]], list[int]]
"""The staging buffers of `aten.sum.dim_IntList` over these dims of a tensor (the kernel temporaries' model)."""

_CUDNN_BN_TRAINING_BATCH = 880_801
_CUDNN_BN_EVAL_BATCH = 65_535
_INT32_MAX = 2**31 - 1
_CUDNN_DEPTHWISE_MIN_CHANNELS = 32


def _channels_last(tensor: torch.Tensor) -> torch.memory_format | None:
    """The channels-last format `tensor` is laid out in (ATen's `suggest_memory_format`), None: none."""
    if tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if tensor.dim() == 5 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return None


def _conv_format(tensor: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """`cudnn_conv_suggest_memory_format`: channels-last when the input or the weight is."""
    return _channels_last(tensor) or _channels_last(weight) or torch.contiguous_format


def _copy(tensor: torch.Tensor | None, fmt: torch.memory_format = torch.contiguous_format) -> list[int]:
    """The bytes of `tensor.contiguous(fmt)`'s copy: none when it is already laid out so."""
    if tensor is None or tensor.is_contiguous(memory_format=fmt):
        return []
    return [tensor.numel() * tensor.element_size()]


def is_depthwise(tensor: torch.Tensor, weight: torch.Tensor, groups: int, transposed: bool) -> bool:
    """`ConvParams::is_depthwise`: one group per input channel, 4-D or 5-D (a 3-D input is viewed as 4-D
    first), not transposed."""
    channels = tensor.shape[1] if tensor.dim() > 1 else 0
    return (
        not transposed
        and tensor.dim() in (3, 4, 5)
        and groups > 1
        and channels == groups
        and weight.shape[0] % max(channels, 1) == 0
    )


def _may_take_cudnn_depthwise(tensor: torch.Tensor) -> bool:
    """`use_cudnn_depthwise`'s first conditions: 2-D (or 1-D) float16 with at least 32 channels (then a table
    of shapes decides, which is not modelled)."""
    planar = tensor.dim() in (3, 4)
    return planar and tensor.dtype == torch.float16 and tensor.shape[1] >= _CUDNN_DEPTHWISE_MIN_CHANNELS


def _is_pointwise(weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int]) -> bool:
    """A 1x1 convolution with unit stride, no padding or dilation: cuDNN's implicit GEMM, no workspace."""
    return (
        all(k == 1 for k in weight.shape[2:])
        and all(s == 1 for s in stride)
        and all(p == 0 for p in padding)
        and all(d == 1 for d in dilation)
    )


def convolution_path(args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    """Which CUDA path `aten.convolution` on these arguments (its backward: on its forward's) takes:
    'depthwise' (CUDA's kernels), 'pointwise' (cuDNN without a workspace), or 'cudnn' (a workspace the card
    picks)."""
    tensor, weight = args[0], args[1]
    stride, padding, dilation = args[3], args[4], args[5]
    transposed, groups = bool(args[6]), int(args[8])
    if is_depthwise(tensor, weight, groups, transposed):
        return "cudnn" if _may_take_cudnn_depthwise(tensor) else "depthwise"
    if not transposed and groups == 1 and _is_pointwise(weight, stride, padding, dilation):
        return "pointwise"
    return "cudnn"


def _forward(args: Sequence[Any], kwargs: dict[str, Any]) -> list[int]:
    """`_convolution`: the input's copy, then (in the backend) the weight's."""
    tensor, weight = args[0], args[1]
    if convolution_path(args, kwargs) == "depthwise":
        return _copy(tensor) + _copy(weight)
    fmt = _conv_format(tensor, weight)
    return _copy(tensor, fmt) + _copy(weight, fmt)


def _backward(args: Sequence[Any], kwargs: dict[str, Any], reduce: Reducer) -> list[int]:
    """`convolution_backward`: the input's copy (for the weight's gradient), the output gradient's and the
    weight's; then, once they are freed, the bias gradient's reduction."""
    grad, tensor, weight = args[0], args[1], args[2]
    mask = list(op_arg(args, kwargs, 10, "output_mask") or (True, True, True))
    depthwise = convolution_path(_convolution_of(args), kwargs) == "depthwise"
    fmt = torch.contiguous_format if depthwise else _conv_format(tensor, weight)
    copies = (_copy(tensor, fmt) if mask[1] else []) + _copy(grad, fmt) + (_copy(weight, fmt) if mask[0] else [])
    staging = reduce(grad, [d for d in range(grad.dim()) if d != 1]) if mask[2] and grad.numel() else []
    return copies if sum(copies) >= sum(staging) else staging


def _convolution_of(backward_args: Sequence[Any]) -> tuple[Any, ...]:
    """The forward `convolution`'s arguments of a `convolution_backward`'s (its bias left out)."""
    return (backward_args[1], backward_args[2], None, *backward_args[4:10])


def _batch_norm_of(backward_args: Sequence[Any]) -> tuple[Any, ...]:
    """The forward `native_batch_norm`'s arguments, up to `training`, of a `native_batch_norm_backward`'s
    (the weight stands in for the bias, which backward does not take)."""
    weight = backward_args[2]
    return (backward_args[1], weight, weight, backward_args[3], backward_args[4], backward_args[7])


def takes_cudnn_batch_norm(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """`_batch_norm_impl_index`'s choice of `cudnn_batch_norm` on a card (cuDNN >= 8, where any epsilon goes)."""
    tensor, weight, bias, mean, var = args[0], args[1], args[2], args[3], args[4]
    training = bool(op_arg(args, kwargs, 5, "training"))
    if weight is None or bias is None or tensor.dim() < 3:
        return False
    if torch.bfloat16 in (tensor.dtype, weight.dtype):
        return False
    if tensor.dtype == torch.float16 and weight.dtype != torch.float32:
        return False
    if (mean is None) != (var is None) or (mean is None and not training):
        return False
    limit = _CUDNN_BN_TRAINING_BATCH if training else _CUDNN_BN_EVAL_BATCH
    return int(tensor.shape[0]) <= limit and int(tensor.numel()) < _INT32_MAX


def _batch_norm(args: Sequence[Any], kwargs: dict[str, Any]) -> list[int]:
    if not takes_cudnn_batch_norm(args, kwargs):
        return []
    tensor = args[0]
    return _copy(tensor, _channels_last(tensor) or torch.contiguous_format)


def _batch_norm_backward(args: Sequence[Any], kwargs: dict[str, Any]) -> list[int]:
    grad, tensor = args[0], args[1]
    if not takes_cudnn_batch_norm(_batch_norm_of(args), {}):
        return []
    return _copy(grad, _channels_last(tensor) or torch.contiguous_format)


def lay_out_on_meta(name: str, args: Sequence[Any], kwargs: dict[str, Any], out: object) -> None:
    """On meta, a convolution's output (its backward's input gradient) takes the layout a card's backend gives
    it, `_conv_format` (torch's meta kernels make it row-major where cuDNN and the CPU keep channels-last, and
    the next op then counted a copy no card makes); CUDA's depthwise kernels write row-major."""
    if name == CONVOLUTION:
        forward, made = args, out
    elif name == CONVOLUTION_BACKWARD and isinstance(out, tuple) and out:
        forward, made = _convolution_of(args), out[0]
    else:
        return
    if not isinstance(made, torch.Tensor) or made.device.type != "meta" or not made.is_contiguous():
        return
    fmt = _conv_format(forward[0], forward[1])
    if fmt is not torch.contiguous_format and convolution_path(forward, kwargs) != "depthwise":
        made.as_strided_(made.shape, _strides(tuple(made.shape), fmt))


def _strides(shape: tuple[int, ...], fmt: torch.memory_format) -> tuple[int, ...]:
    """The strides of a dense tensor of `shape` (4-D or 5-D) laid out channels-last (`fmt`)."""
    if len(shape) != (4 if fmt is torch.channels_last else 5):
        raise ValueError(f"{fmt} does not lay out a {len(shape)}-D tensor")
    order = [1, *range(len(shape) - 1, 1, -1), 0]  # channels innermost, then the last spatial dim ... the batch
    strides = [0] * len(shape)
    step = 1
    for dim in order:
        strides[dim] = step
        step *= max(shape[dim], 1)
    return tuple(strides)


def temporaries(name: str, args: Sequence[Any], kwargs: dict[str, Any], reduce: Reducer) -> list[int]:
    """The bytes of each temporary op `name` takes on a card beyond its outputs, in allocation order (all
    freed before it returns); cuDNN's workspaces count 0 B (see the module's docstring). None for tensors
    without strides (mkldnn, sparse), which no card's path takes."""
    if not _strided(args):
        return []
    if name == CONVOLUTION:
        return _forward(args, kwargs)
    if name == CONVOLUTION_BACKWARD:
        return _backward(args, kwargs, reduce)
    if name == BATCH_NORM:
        return _batch_norm(args, kwargs)
    if name == BATCH_NORM_BACKWARD:
        return _batch_norm_backward(args, kwargs)
    if name in REFLECTION_PADS:
        return _copy(args[0])
    return []


def _strided(args: Sequence[Any]) -> bool:
    """Whether the op's first two arguments, where tensors, have strides, as a card's kernels take them."""
    return all(not isinstance(t, torch.Tensor) or t.layout == torch.strided for t in args[:2])


def _shape_text(weight: torch.Tensor) -> str:
    return "x".join(str(k) for k in weight.shape[2:]) or "1"


WORKSPACE = "workspace"
SAVED_COPY = "saved copy"


def bound(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[str, str] | None:
    """Why op `name`'s figure on these arguments is not a card's to the byte: (`WORKSPACE` or `SAVED_COPY`,
    the op and its shape: 'aten.convolution.default 3x3'), or None where it is."""
    if not _strided(args):
        return None
    if name == CONVOLUTION:
        return (WORKSPACE, f"{name} {_shape_text(args[1])}") if convolution_path(args, kwargs) == "cudnn" else None
    if name == CONVOLUTION_BACKWARD:
        depthwise = convolution_path(_convolution_of(args), kwargs) == "depthwise"
        return None if depthwise else (WORKSPACE, f"{name} {_shape_text(args[2])}")
    if name == BATCH_NORM:
        return _batch_norm_bound(name, args, kwargs)
    if name == BATCH_NORM_BACKWARD and _channels_last(args[1]) is not None:
        return (WORKSPACE, f"{name} channels-last") if takes_cudnn_batch_norm(_batch_norm_of(args), {}) else None
    return None


def _batch_norm_bound(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[str, str] | None:
    if not takes_cudnn_batch_norm(args, kwargs):
        return None
    tensor = args[0]
    if _channels_last(tensor) is not None and bool(op_arg(args, kwargs, 5, "training")):
        return WORKSPACE, f"{name} channels-last"
    if _copy(tensor) and torch.is_grad_enabled() and tensor.requires_grad:
        return SAVED_COPY, name
    return None


def notes(bounds: dict[tuple[str, str], int]) -> list[str]:
    """The sentences naming the ops whose figures are not a card's to the byte (`bounds`: what `bound` gave
    -> calls), one per kind, each within `NOTE_WIDTH` columns."""
    found = []
    workspaces = {text: calls for (kind, text), calls in bounds.items() if kind == WORKSPACE}
    if workspaces:
        found.append(_workspaces_note(workspaces))
    copies = sum(calls for (kind, _), calls in bounds.items() if kind == SAVED_COPY)
    if copies:
        found.append(
            f"{_calls(copies)} of batch norm on non-contiguous inputs: a card's cuDNN saves a contiguous copy for "
            "backward, the CPU the input"
        )
    return found


NOTE_WIDTH = 120
_WORKSPACES_END = "): a card's vary by algorithm"
_SHORT = {
    CONVOLUTION: "conv",
    CONVOLUTION_BACKWARD: "conv backward",
    BATCH_NORM: "batch norm",
    BATCH_NORM_BACKWARD: "batch norm backward",
}


def _workspaces_note(workspaces: dict[str, int]) -> str:
    """The ops whose cuDNN workspace counted 0 B, the most called first, as many as the width holds."""
    begin = f"{WORKSPACES_AT_ZERO} in {_calls(sum(workspaces.values()))} ("
    room = NOTE_WIDTH - len(begin) - len(_WORKSPACES_END)
    named = [f"{_short(text)} x{calls}" for text, calls in sorted(workspaces.items(), key=lambda kv: (-kv[1], kv[0]))]
    shown = len(named)
    while shown > 1 and len(_listed(named, shown)) > room:
        shown -= 1
    return begin + _listed(named, shown) + _WORKSPACES_END


def _listed(named: list[str], shown: int) -> str:
    more = [f"{len(named) - shown} more"] if shown < len(named) else []
    return ", ".join(named[:shown] + more)


def _short(text: str) -> str:
    """An op's text with the op in short words: `conv backward 3x3` for `aten.convolution_backward.default 3x3`."""
    op, _, rest = text.partition(" ")
    return f"{_SHORT.get(op, op)} {rest}".rstrip()


def _calls(count: int) -> str:
    return f"{count} call" + ("" if count == 1 else "s")
