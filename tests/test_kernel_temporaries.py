"""Kernel temporaries: what a CUDA kernel takes from the caching allocator and gives back inside one op, which
no dispatch mode sees. Sizes derived by hand from torch's launch rules (`kernel_temporaries`' docstring), and
checked against real cards' snapshots read from ../shared/snapshots (skipped when absent): their traces show
each temporary as an alloc freed before the op's next output, with the C++ frames that made it."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from cuda_allocator_model.cards import find_card
from pytest_gpumem.backends.base import Settings
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.backends.tracker.kernel_layout import DEFAULT_GPU, Gpu, Layout
from pytest_gpumem.backends.tracker.kernel_ops import (
    bmm_temporaries,
    embedding_backward_temporaries,
    index_put_temporaries,
)
from pytest_gpumem.backends.tracker.kernel_temporaries import label, modelled, record, temporaries
from pytest_gpumem.backends.tracker.ledger import StorageLedger
from pytest_gpumem.backends.tracker.recording import Recorder

MIB = 2**20
SNAPSHOTS = Path(__file__).parents[2] / "shared" / "snapshots"
SUM = "aten.sum.dim_IntList"


def meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta")


def reduced_outermost(*shape: int) -> torch.Tensor:
    """A tensor of `shape` whose last dim is the slowest in memory (as a gradient einsum's backward leaves)."""
    return meta(shape[-1], *shape[:-1]).permute(*range(1, len(shape)), 0)


# --- reductions: the staging buffer and semaphores of gpu_reduce_kernel ---
#
# Full reduction of 2,097,152 float32 (8 MiB) to one value: the input vectorizes by 4 (524,288), a block of
# 512 x 1 threads steps 512 inputs, 4,096 values per thread; the grid is one column, so the input splits
# across ctas = max(min(SMs x 2048 / 512, 4096 / 16), 4096 / 256) blocks: 256 on an A100 (108 SMs), 80 on a
# T4 (40 SMs, 1024 threads per SM: 2 blocks each). Staging: 4 B (the float accumulator) x 1 output x ctas;
# the block reduces across its lanes, so no x block width. Semaphores: 4 B x 1 column.


@pytest.mark.parametrize(
    ("card", "expected"),
    [(None, [1024, 4]), ("A100-80GB", [1024, 4]), ("H100-80GB", [1024, 4]), ("T4", [320, 4])],
    ids=["no card: an A100", "A100", "H100", "T4: fewer SMs, fewer blocks"],
)
def test_a_full_reduction_splits_across_blocks_by_the_cards_sms(card: str | None, expected: list[int]) -> None:
    found = None if card is None else find_card(card)
    assert temporaries("aten.sum.default", (meta(8, 4096, 64),), {}, found) == expected
    assert temporaries("aten.mean.default", (meta(8, 4096, 64),), {}, found) == expected


def test_reducing_the_slowest_dim_stages_a_block_width_per_output() -> None:
    # (4, 128, 2560) laid out 2560-major, summed over 2560 to 512 outputs: the outputs are the fastest dim,
    # 4 per load, 32 lanes x 4 warps; 2560 / 4 warps = 640 values per thread; the grid has 512 / 4 / 32 = 4
    # columns, each split into min(SMs x 16 / 4, 640 / 16 = 40) = 40 blocks. Staging 4 B x 512 x 40 x 32 x 4.
    x = reduced_outermost(4, 128, 2560)
    assert temporaries(SUM, (x, [2], True), {}, None) == [10_485_760, 16]
    assert temporaries(SUM, (meta(4, 128, 2560), [2], True), {}, None) == []  # contiguous: a warp per output


def test_max_with_indices_accumulates_value_and_index_pairs() -> None:
    # 10,000 values per output, 512 outputs, vocab-major: 2,500 values per thread, min(SMs x 4, 157) blocks
    logits = reduced_outermost(4, 128, 10_000)
    assert temporaries("aten.max.dim", (logits, -1, True), {}, None) == [16 * 512 * 157 * 32 * 4, 16]
    assert temporaries(SUM, (logits, [-1], True), {}, None) == [4 * 512 * 157 * 32 * 4, 16]
    assert temporaries("aten.amax.default", (logits, [-1], True), {}, None) == [4 * 512 * 157 * 32 * 4, 16]


def test_16_bit_inputs_accumulate_in_float_and_casts_are_left_out() -> None:
    x = torch.empty(8, 4096, 64, device="meta", dtype=torch.bfloat16)
    assert temporaries("aten.sum.default", (x,), {}, None) == [1024, 4]
    assert temporaries("aten.sum.default", (x,), {"dtype": torch.float32}, None) == [1024, 4]
    assert temporaries("aten.sum.default", (meta(8, 4096, 64),), {"dtype": torch.float64}, None) == []


@pytest.mark.parametrize(
    ("args", "why"),
    [
        pytest.param((meta(100, 255), [1]), "fewer than 256 values per output", id="short"),
        pytest.param((meta(1_000_000, 16), [1]), "many outputs, each warp takes its own", id="many outputs"),
        pytest.param((meta(0, 4096),), "empty", id="empty"),
        pytest.param(
            (torch.empty(4096, 4096, device="meta", dtype=torch.int32), [1]), "int32 sums to int64", id="cast"
        ),
    ],
)
def test_small_or_wide_reductions_stage_nothing(args: tuple[Any, ...], why: str) -> None:
    assert temporaries(SUM, args, {}, None) == [], why


# --- bmm / baddbmm: prepare_batch_matrix_for_cublas ---


def test_an_expanded_operand_is_copied_for_cublas() -> None:
    # backward of (P @ V).sum(): the gradient is a 0-dim one expanded to (8, 4096, 16), strides all 0
    grad = torch.ones((), device="meta").expand(8, 4096, 16)
    assert temporaries("aten.bmm.default", (meta(8, 4096, 4096).transpose(1, 2), grad), {}, None) == [2_097_152]
    assert temporaries("aten.bmm.default", (grad, meta(8, 4096, 16).transpose(1, 2)), {}, None) == [2_097_152]


@pytest.mark.parametrize(
    ("batch1", "batch2", "copies"),
    [
        (meta(4, 64, 32), meta(4, 32, 16), []),
        (meta(4, 32, 64).transpose(1, 2), meta(4, 16, 32).transpose(1, 2), []),  # column-major: cuBLAS transposes
        (meta(4, 64, 64)[:, :, :32], meta(4, 32, 16), []),  # a leading dim larger than the rows: usable as it is
        (meta(64, 4, 32).transpose(0, 1), meta(4, 32, 16), []),  # batch-strided: only the last two strides count
        (meta(4, 64, 64)[:, ::2, ::2], meta(4, 32, 16), [4 * 32 * 32 * 4]),  # no unit stride
    ],
    ids=["contiguous", "transposed", "padded rows", "batch not outermost", "strided both ways"],
)
def test_only_operands_without_a_unit_stride_are_copied(
    batch1: torch.Tensor, batch2: torch.Tensor, copies: list[int]
) -> None:
    assert temporaries("aten.bmm.default", (batch1, batch2), {}, None) == copies
    bias = meta(batch1.shape[0], batch1.shape[1], batch2.shape[2])
    assert temporaries("aten.baddbmm.default", (bias, batch1, batch2), {}, None) == copies


def test_a_result_without_a_usable_layout_is_copied_first() -> None:
    result = Layout((4, 8, 8), (64, 16, 2), "float32")  # no unit stride: baddbmm_ clones it
    operand = Layout.contiguous((4, 8, 8), "float32")
    assert bmm_temporaries(result, operand, operand) == [4 * 8 * 8 * 4]
    assert bmm_temporaries(Layout.contiguous((4, 8, 0), "float32"), operand, operand) == []  # nothing to compute


# --- index_put_ with accumulate: index_put_with_sort_kernel ---


def test_index_put_accumulate_sorts_its_linear_index() -> None:
    # an embedding's gradient through weight[ids]: 1,000 int64 ids; linear index, sorted and original
    # positions, the sort's range (8,000 B each), then cub's 1 B of scratch
    grad = meta(10_000, 512)
    ids = torch.empty(10, 100, device="meta", dtype=torch.long)
    values = meta(10, 100, 512)
    assert temporaries("aten.index_put_.default", (grad, [ids], values, True), {}, None) == [8000] * 4 + [1]
    assert temporaries("aten.index_put_.default", (grad, [ids], values), {}, None) == []  # no accumulate: no sort


def test_index_put_copies_non_contiguous_self_and_values_and_transposes_split_indices() -> None:
    ids = Layout.contiguous((512,), "int64")
    self_ = Layout.contiguous((16, 8, 32), "float32")
    values = Layout((512, 8, 32), (1, 512 * 32, 512), "float32")  # one slice of 8 x 32 per id, not in order
    assert index_put_temporaries(self_, [ids], values) == [4096, 512 * 8 * 32 * 4, 4096, 4096, 4096, 1]
    scalar = Layout((), (), "float32")  # expanded to 512 x 8 x 32, then copied
    assert index_put_temporaries(self_, [ids], scalar)[1] == 512 * 8 * 32 * 4
    split = [ids, None, ids]  # indexed dims 0 and 2 go to the front of a transposed (copied) self
    assert index_put_temporaries(self_, split, Layout.contiguous((512, 8), "float32")) == [
        4096,
        16 * 8 * 32 * 4,
        4096,
        4096,
        4096,
        1,
    ]
    transposed = Layout((16, 8, 32), (1, 512, 16), "float32")
    assert index_put_temporaries(transposed, [ids], Layout.contiguous((512, 8, 32), "float32"))[0] == 16 * 8 * 32 * 4
    mask = Layout.contiguous((16,), "bool")
    assert index_put_temporaries(self_, [mask], scalar) == []  # a mask's positions depend on its data


# --- embedding_dense_backward ---


def test_embedding_backward_of_few_indices_needs_no_sort() -> None:
    grad, ids = Layout.contiguous((2, 1536, 64), "float32"), Layout.contiguous((2, 1536), "int64")
    assert embedding_backward_temporaries(grad, ids, 1000, False, DEFAULT_GPU) == []
    assert embedding_backward_temporaries(grad, Layout((2, 1536), (1, 2), "int64"), 1000, False, DEFAULT_GPU) == [
        3072 * 8
    ]


def test_embedding_backward_sums_partial_segments_in_two_passes_when_segments_fill_the_sms() -> None:
    # 4,096 ids into 1,000 rows of 64: sorted, original (32 KiB each), segment offsets (32 KiB), their count,
    # 1,000 partials per segment and their offsets, the partial count, 409 + 1,000 partial offsets; then
    # sum_and_scatter's grid (1,000 blocks of 64) passes 108 SMs x 4: partial sums of 1,409 x 64 floats
    grad, ids = Layout.contiguous((4, 1024, 64), "float32"), Layout.contiguous((4, 1024), "int64")
    expected = [32768, 32768, 32768, 8, 8000, 8000, 8, 11272, 1409 * 64 * 4]
    assert embedding_backward_temporaries(grad, ids, 1000, False, DEFAULT_GPU) == expected


def test_embedding_backward_takes_the_fused_path_when_few_segments_would_idle_the_sms() -> None:
    # 8 rows: sum_and_scatter would launch 8 blocks, fewer than 4 per SM, and 819 + 8 partials are more than
    # 4 x 8: the partial-to-segment map instead, and for bfloat16 a float copy of the weight's gradient
    ids = Layout.contiguous((8192,), "int64")
    grad = Layout.contiguous((8192, 64), "bfloat16")
    expected = [65536, 65536, 65536, 8, 64, 64, 8, 827 * 8, 827 * 8, 8 * 64 * 4]
    assert embedding_backward_temporaries(grad, ids, 8, False, DEFAULT_GPU) == expected
    with_counts = embedding_backward_temporaries(grad, ids, 8, True, Gpu(2, 2048))  # scale_grad_by_freq: counts
    assert with_counts[:3] == [65536] * 3 and with_counts[-1] == 827 * 64 * 4  # 2 SMs: 8 blocks fill them


def test_mse_loss_holds_its_unreduced_loss_and_the_means_staging() -> None:
    a = meta(8, 4096, 64)
    assert temporaries("aten.mse_loss.default", (a, a), {}, None) == [8_388_608, 1024, 4]
    assert temporaries("aten.mse_loss.default", (a, a, 0), {}, None) == []


def test_only_modelled_ops_have_a_label() -> None:
    assert label(SUM) == "reduction staging buffer"
    assert label("aten.bmm.default") == "operand copy for cuBLAS"
    assert label("aten.add.Tensor") is None and temporaries("aten.add.Tensor", (), {}, None) == []
    assert modelled(torch.ops.aten.sum.dim_IntList) and not modelled(torch.ops.aten.add.Tensor)


# --- the ledger: each temporary an allocation and a free through the allocator's model ---


def test_the_ledger_allocates_them_in_order_and_frees_them_in_reverse() -> None:
    ledger = StorageLedger("cuda")
    ledger.recorder = Recorder(events=True)
    ledger.op = "reduction staging buffer (aten.sum.dim_IntList)"
    seen: list[int] = []
    ledger.transient([10_485_760, 16, 0], during=lambda: seen.append(ledger.allocated))
    assert seen == [10_485_760 + 512]  # a 10 MiB segment of its own, a 512 B block of a 2 MiB one
    assert (ledger.allocated, ledger.peak_allocated) == (0, 10_485_760 + 512)
    assert (ledger.reserved, ledger.peak_reserved) == (12 * MIB, 12 * MIB)  # cached, as torch keeps them
    events = [(e["action"], e["bytes"], e["op"]) for e in ledger.recorder.trace()["events"]]
    assert events == [
        ("alloc", 10_485_760, ledger.op),
        ("alloc", 16, ledger.op),
        ("free", 16, ledger.op),
        ("free", 10_485_760, ledger.op),
    ]


def test_record_names_the_op_and_counts_only_the_predicted_devices_tensors() -> None:
    ledger = StorageLedger("cuda")
    ledger.device_type = "meta"
    ledger.recorder = Recorder(events=True)
    x = reduced_outermost(4, 128, 2560)
    record(ledger, torch.ops.aten.sum.dim_IntList, (x, [2], True), {})
    ops = {e["op"] for e in ledger.recorder.trace()["events"]}
    assert ops == {"reduction staging buffer (aten.sum.dim_IntList)"}
    assert ledger.peak_allocated == 10_485_760 + 512
    host = torch.empty(2560, 4, 128).permute(1, 2, 0)  # host memory beside the predicted GPU
    ledger.reset_peak()
    record(ledger, torch.ops.aten.sum.dim_IntList, (host, [2], True), {})
    assert ledger.peak_allocated == 0


def test_a_ledger_predicting_no_gpu_wants_none() -> None:
    assert StorageLedger("cuda").wants_temporaries
    assert not StorageLedger("none").wants_temporaries
    exact_meta = StorageLedger("none")
    exact_meta.device_type = "meta"
    assert exact_meta.wants_temporaries


# --- end to end: the tracker's mode records them (needs the dispatch mode's call of `record`) ---


@pytest.fixture
def on_meta() -> Iterator[TrackerBackend]:
    backend = TrackerBackend(device="meta")
    backend.configure(Settings(events=True))
    backend.start()
    yield backend
    backend.stop()


def made(backend: TrackerBackend, kind: str) -> list[int]:
    trace = backend.trace()
    assert trace is not None
    return [e["bytes"] for e in trace["events"] if e["action"] == "alloc" and str(e["op"]).startswith(kind)]


def test_end_to_end_a_reductions_staging_buffer_is_at_its_peak(on_meta: TrackerBackend) -> None:
    x = reduced_outermost(4, 128, 2560)  # on meta: counted from here on
    on_meta.reset_peak()
    before = on_meta.current().allocated
    y = x.sum(2, keepdim=True)  # its 2 KiB output, then 10 MiB + 16 B for the kernel
    assert on_meta.peak().allocated - before == 2048 + 10_485_760 + 512
    assert on_meta.current().allocated - before == 2048
    assert made(on_meta, "reduction staging buffer (aten.sum.dim_IntList)") == [10_485_760, 16]
    del y


def test_end_to_end_a_reduction_counted_first_without_a_gpu_still_stages_on_one() -> None:
    exact = TrackerBackend(rounding="none")  # no GPU predicted: the reduction takes the fast path
    exact.start()
    try:
        x = torch.ones(4, 128, 2560)
        before = exact.current().allocated
        y = x.sum(2, keepdim=True)  # its 2 KiB output and nothing else
        assert exact.peak().allocated - before == exact.current().allocated - before == 2048
    finally:
        exact.stop()
    on_meta = TrackerBackend(device="meta")
    on_meta.start()
    try:
        m = reduced_outermost(4, 128, 2560)
        before = on_meta.current().allocated
        on_meta.reset_peak()
        z = m.sum(2, keepdim=True)  # as in test_end_to_end_a_reductions_staging_buffer_is_at_its_peak
        assert on_meta.peak().allocated - before == 2048 + 10_485_760 + 512
    finally:
        on_meta.stop()
    del y, z


def test_end_to_end_bmms_operand_copy_is_held_while_the_workspace_is_made(on_meta: TrackerBackend) -> None:
    grad = torch.ones((), device="meta").expand(8, 4096, 16)
    p = meta(8, 4096, 4096).transpose(1, 2)
    on_meta.reset_peak()
    before = on_meta.current().allocated
    out = torch.bmm(p, grad)  # output 2 MiB, the gradient's copy 2 MiB, the workspace: one 20 MiB segment
    workspace = on_meta.workspace_bytes
    assert on_meta.peak().allocated - before == 2 * 2_097_152 + workspace
    assert made(on_meta, "operand copy for cuBLAS (aten.bmm.default)") == [2_097_152]
    del out


def test_end_to_end_index_put_and_embedding_backward(on_meta: TrackerBackend) -> None:
    weight_grad = meta(10_000, 512)
    ids = torch.zeros(10, 100, device="meta", dtype=torch.long)
    weight_grad.index_put_((ids,), meta(10, 100, 512), accumulate=True)
    assert made(on_meta, "index sort temporaries") == [8000] * 4 + [1]
    weight = torch.empty(1000, 64, device="meta", requires_grad=True)
    out = torch.nn.functional.embedding(torch.zeros(4, 1024, device="meta", dtype=torch.long), weight)
    out.backward(meta(4, 1024, 64))  # type: ignore[no-untyped-call]  # a contiguous gradient: not copied
    assert made(on_meta, "embedding backward sort temporaries") == [32768] * 3 + [8, 8000, 8000, 8, 11272, 360_704]


def test_end_to_end_the_predicted_cards_sms_size_the_staging(on_meta: TrackerBackend) -> None:
    on_meta.predict_card("T4")
    meta(8, 4096, 64).sum()
    assert made(on_meta, "reduction staging buffer") == [320, 4]


# --- real cards: the snapshots' traces show the same blocks ---


class _RefuseGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


@cache
def trace(name: str) -> list[dict[str, Any]]:
    path = SNAPSHOTS / f"{name}.pickle"
    if not path.is_file():
        pytest.skip(f"no snapshot {path}")
    with path.open("rb") as file:
        snapshot = _RefuseGlobals(file).load()
    return list(snapshot["device_traces"][0])


def transient_sizes(events: list[dict[str, Any]], first: int, count: int) -> list[int]:
    """The sizes of the `count` allocs from event `first` on, checked to be freed in reverse order before
    any other allocation (a kernel's temporaries)."""
    allocs = [e for e in events[first:] if e["action"] == "alloc"][:count]
    addresses = [e["addr"] for e in allocs]
    after = events[events.index(allocs[-1]) + 1 :]
    frees = [e["addr"] for e in after[: 2 * count] if e["action"] == "free_requested"]
    assert frees == addresses[::-1], "not freed in reverse order right away"
    return [e["size"] for e in allocs]


KKAITLYN = "kkaitlyn111__cs336-a2-systems__ctx128_fullstep"
NOTHANMIN = "notHanmin__assignment2-systems__memory_snapshot"
NIU = "NiuHuangxiaozi__assignment2-systems__train_ctx100_fp32"


@pytest.mark.parametrize(
    ("name", "event", "expected"),
    [
        # RMSNorm's divisor gradient: (4, 128, 2560) summed over 2560 into 2 KiB (the output at event 5197)
        (KKAITLYN, 5198, temporaries(SUM, (reduced_outermost(4, 128, 2560), [2], True), {}, None)),
        # the same for the 'large' model: (4, 256, 1280) into 4 KiB
        (NOTHANMIN, 6399, temporaries(SUM, (reduced_outermost(4, 256, 1280), [2], True), {}, None)),
        # cross entropy on (4, 128, 10000) logits: max over the vocab, then the sum of exponentials
        (KKAITLYN, 5088, temporaries("aten.max.dim", (reduced_outermost(4, 128, 10_000), -1, True), {}, None)),
        (KKAITLYN, 5097, temporaries(SUM, (reduced_outermost(4, 128, 10_000), [-1], True), {}, None)),
        # naive attention's loss: sum of a (8, 4096, 16) float32 output
        (
            "silmont2000__assignment2-systems__mem_snapshot",
            27,
            temporaries("aten.sum.default", (meta(8, 4096, 16),), {}, None),
        ),
        # mse_loss on (8, 4096, 64): the unreduced loss, then the mean's staging
        (
            "sungdk0822__CS336-assignment2-systems__attn_d64_s4096",
            15,
            temporaries("aten.mse_loss.default", (meta(8, 4096, 64),) * 2, {}, None),
        ),
    ],
    ids=["rmsnorm 2.7B", "rmsnorm large", "max over vocab", "sum over vocab", "sum", "mse_loss"],
)
def test_reductions_match_the_cards(name: str, event: int, expected: list[int]) -> None:
    assert expected  # each case stages something
    assert transient_sizes(trace(name), event, len(expected)) == expected


def test_bmms_copies_of_an_expanded_gradient_match_the_card() -> None:
    events = trace("silmont2000__assignment2-systems__mem_snapshot")
    grad = torch.ones((), device="meta").expand(8, 4096, 16)  # the sum's gradient, expanded
    first = temporaries("aten.bmm.default", (meta(8, 4096, 4096).transpose(1, 2), grad), {}, None)
    second = temporaries("aten.bmm.default", (grad, meta(8, 4096, 16).transpose(1, 2)), {}, None)
    assert [events[35]["size"], events[41]["size"]] == first + second == [2_097_152, 2_097_152]


@pytest.mark.parametrize(
    ("name", "event", "expected"),
    [
        # the embedding's gradient through weight[ids], ids (10, 100), values contiguous
        (
            NIU,
            2174,
            index_put_temporaries(
                Layout.contiguous((10_000, 512), "float32"),
                [Layout.contiguous((10, 100), "int64")],
                Layout.contiguous((10, 100, 512), "float32"),
            ),
        ),
        # ids (4, 128) into 10,000 x 2,560, values (4, 128, 2560) not contiguous: copied
        (
            KKAITLYN,
            17151,
            index_put_temporaries(
                Layout.contiguous((10_000, 2560), "float32"),
                [Layout.contiguous((4, 128), "int64")],
                Layout((4, 128, 2560), (128, 1, 512), "float32"),
            ),
        ),
        (
            NOTHANMIN,
            18459,
            index_put_temporaries(
                Layout.contiguous((10_000, 1280), "float32"),
                [Layout.contiguous((4, 256), "int64")],
                Layout((4, 256, 1280), (256, 1, 1024), "float32"),
            ),
        ),
    ],
    ids=["ids 10 x 100", "ids 4 x 128, values copied", "ids 4 x 256, values copied"],
)
def test_index_put_matches_the_cards(name: str, event: int, expected: list[int]) -> None:
    # from the linear index on (the index's wrapped copy before it is freed at once: left out)
    assert transient_sizes(trace(name), event, len(expected)) == expected
