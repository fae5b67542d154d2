"""Convolutions and batch norm as a card runs them (`backends/tracker/cudnn.py`): the copies CUDA's paths make
inside the op, which ops' figures depend on cuDNN's algorithm (named in the notes), and the facts the model
rests on, read from the shared conv traces (../shared/snapshots, skipped when absent)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from builders import Reported

from cuda_allocator_model.snapshots.read import Event, read_snapshot
from pytest_gpumem.backends.base import Settings
from pytest_gpumem.backends.tracker import cudnn
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.backends.tracker.kernel_temporaries import label, temporaries

SNAPSHOTS = Path(__file__).parents[2] / "shared" / "snapshots"
CONV, CONV_BACKWARD = cudnn.CONVOLUTION, cudnn.CONVOLUTION_BACKWARD
BN, BN_BACKWARD = cudnn.BATCH_NORM, cudnn.BATCH_NORM_BACKWARD


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=dtype)


def conv_args(x: torch.Tensor, w: torch.Tensor, stride: int = 1, padding: int = 0, groups: int = 1) -> tuple[Any, ...]:
    spatial = x.dim() - 2
    return (x, w, None, [stride] * spatial, [padding] * spatial, [1] * spatial, False, [0] * spatial, groups)


def conv_backward_args(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: bool = False) -> tuple[Any, ...]:
    forward = conv_args(x, w, padding=1)
    return (grad, x, w, [w.shape[0]] if bias else None, *forward[3:9], [True, True, bias])


def no_reduction(tensor: torch.Tensor, dims: list[int]) -> list[int]:
    return []


# --- convolutions ---
#
# A (2, 4, 16, 16) float32 input is 8,192 B; with its last two dims swapped it is neither contiguous nor
# channels-last, so `_convolution` copies it (8,192 B) before cuDNN runs; a contiguous one is handed over.


def test_a_non_contiguous_input_is_copied_before_cudnn_runs() -> None:
    w = meta(8, 4, 3, 3)
    assert cudnn.temporaries(CONV, conv_args(meta(2, 4, 16, 16).transpose(2, 3), w, padding=1), {}, no_reduction) == [
        8192
    ]
    assert cudnn.temporaries(CONV, conv_args(meta(2, 4, 16, 16), w, padding=1), {}, no_reduction) == []


def test_a_channels_last_input_makes_cudnn_copy_the_weight_channels_last() -> None:
    x = meta(2, 4, 16, 16).to(memory_format=torch.channels_last)
    w = meta(8, 4, 3, 3)  # 288 floats: 1,152 B, row-major, so copied to channels-last
    assert cudnn.temporaries(CONV, conv_args(x, w, padding=1), {}, no_reduction) == [1152]


def test_depthwise_convolutions_take_cudas_kernels_and_copy_only_to_row_major() -> None:
    x = meta(2, 16, 16, 16).to(memory_format=torch.channels_last)  # 32 KiB, copied row-major
    w = meta(16, 1, 3, 3)
    args = conv_args(x, w, padding=1, groups=16)
    assert cudnn.convolution_path(args, {}) == "depthwise"
    assert cudnn.temporaries(CONV, args, {}, no_reduction) == [32768]
    assert cudnn.bound(CONV, args, {}) is None
    three_d = conv_args(meta(1, 8, 4, 8, 8), meta(8, 1, 3, 3, 3), padding=1, groups=8)
    assert cudnn.convolution_path(three_d, {}) == "depthwise"
    one_d = conv_args(meta(2, 64, 8).transpose(1, 2), meta(8, 1, 3), padding=1, groups=8)  # (B, L, C) seen as (B, C, L)
    assert cudnn.convolution_path(one_d, {}) == "depthwise"
    assert cudnn.temporaries(CONV, one_d, {}, no_reduction) == [2 * 64 * 8 * 4]


def test_float16_depthwise_with_32_channels_may_take_cudnn_and_is_noted() -> None:
    args = conv_args(meta(2, 32, 8, 8, dtype=torch.float16), meta(32, 1, 3, 3, dtype=torch.float16), 1, 1, 32)
    assert cudnn.convolution_path(args, {}) == "cudnn"
    assert cudnn.bound(CONV, args, {}) == (cudnn.WORKSPACE, f"{CONV} 3x3")


def test_only_a_pointwise_forward_is_exact_as_the_traces_show() -> None:
    x = meta(2, 4, 16, 16)
    assert cudnn.bound(CONV, conv_args(x, meta(8, 4, 1, 1)), {}) is None
    assert cudnn.bound(CONV, conv_args(x, meta(8, 4, 1, 1), stride=2), {}) == (cudnn.WORKSPACE, f"{CONV} 1x1")
    assert cudnn.bound(CONV, conv_args(x, meta(8, 4, 3, 3), padding=1), {}) == (cudnn.WORKSPACE, f"{CONV} 3x3")
    grad = meta(2, 8, 16, 16)
    assert cudnn.bound(CONV_BACKWARD, conv_backward_args(grad, x, meta(8, 4, 1, 1)), {}) == (
        cudnn.WORKSPACE,
        f"{CONV_BACKWARD} 1x1",
    )


def test_backward_copies_a_sliced_gradient_and_the_input() -> None:
    x = meta(2, 4, 16, 16).transpose(2, 3)  # 8,192 B copied for the weight's gradient
    grad = meta(2, 16, 16, 16)[:, :8]  # a slice of a concatenation's gradient: 16,384 B copied
    args = conv_backward_args(grad, x, meta(8, 4, 3, 3))
    assert cudnn.temporaries(CONV_BACKWARD, args, {}, no_reduction) == [8192, 16384]


def test_a_bias_gradient_holds_its_reduction_staging_when_larger_than_the_copies() -> None:
    grad, x = meta(64, 8, 64, 64), meta(64, 4, 64, 64)  # nothing to copy; 262,144 values per channel summed
    args = conv_backward_args(grad, x, meta(8, 4, 3, 3), bias=True)

    def summed(tensor: torch.Tensor, dims: list[int]) -> list[int]:
        return temporaries("aten.sum.dim_IntList", (tensor, dims), None, None)

    staging = summed(grad, [0, 2, 3])
    assert staging and cudnn.temporaries(CONV_BACKWARD, args, {}, summed) == staging
    assert temporaries(CONV_BACKWARD, args, {}, None) == staging  # registered with the kernel temporaries


def test_tensors_without_strides_take_no_cards_path() -> None:
    x = torch.randn(2, 4, 8, 8).to_mkldnn()
    args = conv_args(x, torch.randn(8, 4, 3, 3).to_mkldnn(), padding=1)
    assert cudnn.temporaries(CONV, args, {}, no_reduction) == [] and cudnn.bound(CONV, args, {}) is None


# --- reflect padding ---
#
# The inference trace's NCA state: 16 x 330 x 340 float32 (7,180,800 B), channels-last after `.to(device)`;
# reflect-padded by 1 it is 16 x 332 x 342 (7,266,816 B), and the kernel copies its input contiguous.


def nca_state() -> torch.Tensor:
    return meta(1, 330, 340, 16).permute(0, 3, 1, 2)


def test_a_reflect_pad_copies_a_non_contiguous_input() -> None:
    pad = "aten.reflection_pad2d.default"
    assert cudnn.temporaries(pad, (nca_state(), [1, 1, 1, 1]), {}, no_reduction) == [7_180_800]
    assert cudnn.temporaries(pad, (meta(1, 16, 330, 340), [1, 1, 1, 1]), {}, no_reduction) == []
    assert label(pad) == "reflection pad input copy"


def test_the_cards_reflect_pad_copies_its_input_after_its_output() -> None:
    events = [e for e in conv_trace("inference2_peso_oct")[:6] if e.action in ("alloc", "free_requested")]
    state, output, copy, freed = events[0], events[1], events[2], events[3]
    padded = F.pad(nca_state(), (1, 1, 1, 1), mode="reflect")
    assert (state.size, output.size) == (7_180_800, padded.numel() * 4)
    assert (copy.size, freed.action, freed.addr) == (7_180_800, "free_requested", copy.addr)


# --- batch norm ---
#
# cuDNN's batch norm copies a non-contiguous input (2 x 8 x 16 x 16 float32: 16,384 B);
# its saved mean and inverse std are the CPU's outputs too, and its reserve is 0 B (as traced).


def bn_args(x: torch.Tensor, training: bool = True, dtype: torch.dtype = torch.float32) -> tuple[Any, ...]:
    c = x.shape[1]
    return (x, meta(c, dtype=dtype), meta(c, dtype=dtype), meta(c), meta(c), training, 0.1, 1e-5)


def test_cudnn_batch_norm_copies_a_non_contiguous_input() -> None:
    x = meta(2, 8, 16, 16).transpose(2, 3)
    assert cudnn.temporaries(BN, bn_args(x), {}, no_reduction) == [16384]
    assert cudnn.temporaries(BN, bn_args(meta(2, 8, 16, 16)), {}, no_reduction) == []
    grad = meta(2, 8, 16, 16).transpose(2, 3)
    backward = (grad, meta(2, 8, 16, 16), meta(8), meta(8), meta(8), meta(8), meta(8), True, 1e-5, [True] * 3)
    assert cudnn.temporaries(BN_BACKWARD, backward, {}, no_reduction) == [16384]


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (bn_args(meta(2, 8, 16, 16, dtype=torch.bfloat16).transpose(2, 3), dtype=torch.bfloat16), "bfloat16"),
        (bn_args(meta(2, 8, 16, 16, dtype=torch.float16).transpose(2, 3), dtype=torch.float16), "half weights"),
        (bn_args(meta(880_802, 2, 1)), "batch above cuDNN's"),
        (bn_args(meta(2, 8)), "two dims"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_batch_norm_outside_cudnn_takes_nothing_modelled(args: tuple[Any, ...], why: str) -> None:
    assert not cudnn.takes_cudnn_batch_norm(args, {}), why
    assert cudnn.temporaries(BN, args, {}, no_reduction) == []


def test_a_saved_copy_and_channels_last_batch_norm_are_noted() -> None:
    x = meta(2, 8, 16, 16).transpose(2, 3).requires_grad_()
    assert cudnn.bound(BN, bn_args(x), {}) == (cudnn.SAVED_COPY, BN)
    with torch.no_grad():
        assert cudnn.bound(BN, bn_args(x), {}) is None  # freed inside the op, as the copy is here
    last = meta(2, 8, 16, 16).to(memory_format=torch.channels_last)
    assert cudnn.bound(BN, bn_args(last), {}) == (cudnn.WORKSPACE, f"{BN} channels-last")
    assert cudnn.bound(BN, bn_args(last, training=False), {}) is None


def test_only_cudnns_channels_last_batch_norm_backward_is_noted() -> None:
    def backward(dtype: torch.dtype) -> tuple[Any, ...]:
        x = meta(2, 8, 16, 16, dtype=dtype).to(memory_format=torch.channels_last)
        return (x, x, meta(8, dtype=dtype), meta(8), meta(8), meta(8), meta(8), True, 1e-5, [True] * 3)

    assert cudnn.bound(BN_BACKWARD, backward(torch.float32), {}) == (cudnn.WORKSPACE, f"{BN_BACKWARD} channels-last")
    assert cudnn.bound(BN_BACKWARD, backward(torch.bfloat16), {}) is None  # bfloat16 takes CUDA's own kernel


def test_the_notes_name_the_ops_and_count_their_calls() -> None:
    bounds = {(cudnn.WORKSPACE, f"{CONV} 3x3"): 16, (cudnn.WORKSPACE, f"{CONV} 7x7"): 1, (cudnn.SAVED_COPY, BN): 2}
    workspaces, copies = cudnn.notes(bounds)
    assert workspaces == (
        "cuDNN workspaces counted at 0 B in 17 calls (conv 3x3 x16, conv 7x7 x1): a card's vary by algorithm"
    )
    assert copies.startswith("2 calls of batch norm on non-contiguous inputs")
    assert cudnn.notes({}) == []


def test_the_workspace_note_names_the_most_called_ops_that_fit_its_width() -> None:
    """A ResNet's step: 6 kinds of call, 40 calls; those the width leaves out are counted."""
    shapes = {"1x1": 3, "3x3": 16, "7x7": 1}
    bounds = {(cudnn.WORKSPACE, f"{op} {shape}"): n for op in (CONV, CONV_BACKWARD) for shape, n in shapes.items()}
    (note,) = cudnn.notes(bounds)
    assert note == (
        "cuDNN workspaces counted at 0 B in 40 calls (conv 3x3 x16, conv backward 3x3 x16, 4 more): "
        "a card's vary by algorithm"
    )
    assert len(note) <= cudnn.NOTE_WIDTH
    (alone,) = cudnn.notes({(cudnn.WORKSPACE, f"{BN_BACKWARD} channels-last"): 1})
    assert alone.startswith("cuDNN workspaces counted at 0 B in 1 call (batch norm backward channels-last x1)")
    assert label(CONV) == "convolution copies and cuDNN workspace"


# --- end to end on meta ---


def test_end_to_end_the_copy_is_held_with_the_output_and_the_notes_name_the_op() -> None:
    backend = TrackerBackend(device="meta")
    backend.configure(Settings(events=True))
    x, w = meta(2, 4, 16, 16), meta(8, 4, 3, 3)  # made before: not counted
    backend.start()
    try:
        y = F.conv2d(x.transpose(2, 3), w, padding=1)  # output 16,384 B, the input's copy 8,192 B
        assert (backend.peak().allocated, backend.current().allocated) == (16384 + 8192, 16384)
        trace = backend.trace()
        assert trace is not None
        ops = [e["op"] for e in trace["events"] if e["action"] == "alloc"]
        assert ops[1] == f"convolution copies and cuDNN workspace ({CONV})"
        z = F.conv2d(y, meta(8, 8, 1, 1))  # pointwise: exact, not noted
        del y, z
    finally:
        backend.stop()
    (note,) = backend.notes()
    assert note.startswith("cuDNN workspaces counted at 0 B in 1 call (conv 3x3 x1)")


def test_on_meta_a_channels_last_convolution_keeps_its_layout_and_the_next_copies_nothing() -> None:
    last = torch.channels_last
    x = meta(2, 4, 16, 16).to(memory_format=last)  # made before: not counted
    w1, w2 = meta(8, 4, 3, 3).to(memory_format=last), meta(8, 8, 3, 3).to(memory_format=last)
    backend = TrackerBackend(device="meta")
    backend.start()
    try:
        y = F.conv2d(x, w1, padding=1)  # 2 x 8 x 16 x 16 float32: 16,384 B
        z = F.conv2d(y, w2, padding=1)  # another 16,384 B; a row-major y was copied first (16,384 B more)
        layouts = y.is_contiguous(memory_format=last), z.is_contiguous(memory_format=last)
        peak = backend.peak().allocated
        del y, z
    finally:
        backend.stop()
    assert (layouts, peak) == ((True, True), 2 * 16384)


def test_on_meta_a_convolutions_input_gradient_takes_the_cards_layout() -> None:
    x, w = meta(2, 4, 16, 16), meta(8, 4, 3, 3).to(memory_format=torch.channels_last)
    grads = torch.ops.aten.convolution_backward(
        meta(2, 8, 16, 16), x, w, None, *conv_args(x, w, padding=1)[3:], [True, True, False]
    )
    cudnn.lay_out_on_meta(CONV_BACKWARD, conv_backward_args(grads[0], x, w), {}, grads)
    assert grads[0].is_contiguous(memory_format=torch.channels_last)  # the weight is: cuDNN's format
    depthwise = meta(2, 8, 16, 16)
    out = meta(2, 8, 14, 14)
    cudnn.lay_out_on_meta(
        CONV, conv_args(depthwise, meta(8, 1, 3, 3).to(memory_format=torch.channels_last), groups=8), {}, out
    )
    assert out.is_contiguous()  # CUDA's depthwise kernels write row-major


def test_a_conv_test_on_meta_says_which_convolutions_a_card_may_exceed(
    tracker: pytest.Pytester, reported: Reported
) -> None:
    tracker.makepyfile(
        """
        import pytest, torch

        def test_conv(gpumem):
            conv = torch.nn.Conv2d(4, 8, 3, padding=1, bias=False).to(gpumem.device)
            x = torch.randn(2, 4, 16, 16, device=gpumem.device).transpose(2, 3)
            with gpumem.phase("forward"):
                y = conv(x)  # its output 16,384 B and the input's copy 8,192 B
            del y

        @pytest.mark.max_memory(forward="16 KiB")
        def test_conv_over(gpumem):
            test_conv(gpumem)
        """
    )
    result = tracker.runpytest("--gpumem-device=meta", "--gpumem-json=out.json")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(  # the failing figure says it is low by what a card's algorithm adds
        [
            "forward peak 24.0 KiB exceeds max_memory forward=16 KiB, with cuDNN workspaces counted at 0 B",
            "*Captured gpumem call*",
            "also: see what made it with --gpumem-explain or max_memory(explain=True)",  # 136 columns on the line
        ]
    )
    test = reported()["test_conv"]
    assert test["phases"]["forward"]["peak_bytes"] == 16384 + 8192
    assert [note.split(":")[0] for note in test["notes"]] == ["cuDNN workspaces counted at 0 B in 1 call (conv 3x3 x1)"]


# --- the cards: what the shared conv traces show ---


@cache
def conv_trace(name: str) -> tuple[Event, ...]:
    path = SNAPSHOTS / f"HugePandaCoder__octree-nca-groupeq__{name}.pickle"
    if not path.is_file():
        pytest.skip(f"no snapshot {path}")
    return read_snapshot(path).trace(0)


def made_inside(events: tuple[Event, ...], kernel: str) -> list[tuple[int, bool]]:
    """Each alloc made inside C++ frame `kernel`: (bytes, whether it is freed before the kernel's op returns)."""
    found: list[tuple[int, bool]] = []
    open_: dict[int, int] = {}
    for event in events:
        inside = any(frame.name.startswith(kernel) for frame in event.frames)
        if event.action == "alloc" and inside:
            open_[event.addr] = len(found)
            found.append((event.size, False))
        elif event.action == "free_requested" and event.addr in open_ and inside:
            index = open_.pop(event.addr)
            found[index] = (found[index][0], True)
    return found


@pytest.mark.parametrize("name", ["traditional_single_step", "inference2_peso_oct"])
def test_the_cards_pointwise_cudnn_convolutions_allocate_their_outputs_only(name: str) -> None:
    made = made_inside(conv_trace(name), "at::native::cudnn_convolution(")
    assert made and not any(freed for _, freed in made)  # no workspace: nothing freed inside the op


def test_the_cards_depthwise_convolutions_allocate_their_outputs_only() -> None:
    kernels = {"traditional_single_step": "conv_depthwise2d_cuda", "octree3d_train_e67173f": "conv_depthwise3d_cuda"}
    for name, kernel in kernels.items():
        made = made_inside(conv_trace(name), f"at::native::{kernel}")
        assert made and not any(freed for _, freed in made)


def test_the_cards_cudnn_batch_norm_makes_output_mean_and_inverse_std_and_no_reserve() -> None:
    events = conv_trace("octree3d_train_e67173f")
    made = made_inside(events, "at::native::cudnn_batch_norm(")
    assert [size for size, _ in made[:3]] == [3_686_400, 256, 256]  # the output, 64 floats twice
    assert len(made) % 3 == 0 and all(made[i + 1][0] == made[i + 2][0] == 256 for i in range(0, len(made), 3))
    copies = made_inside(events, "at::native::_batch_norm_impl_index(")
    assert copies[0][0] == 3_686_400  # the non-contiguous input copied contiguous before cuDNN runs
