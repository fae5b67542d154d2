"""--gpumem-device=meta: the same exact bytes as on CPU without data, one line for data-dependent ops,
and predictions kept apart from measured figures."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from builders import Reported

from cuda_allocator_model.cards import CUBLAS_WORKSPACE_DEFAULT as WORKSPACE
from pytest_gpumem.backends import make_builtin
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.backends.tracker.compiled_notes import COMPILED_UNFUSED
from pytest_gpumem.backends.tracker.meta_errors import cannot_run_on_meta
from pytest_gpumem.errors import GpuMemError

WORKLOAD = """
import torch


def test_step(gpumem):
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    model = model.to(gpumem.device)
    x = torch.randn(64, 512, device=gpumem.device)
    with gpumem.phase("forward"):
        loss = model(x).square().mean()
    with gpumem.phase("backward"):
        loss.backward()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    with gpumem.phase("step"):
        opt.step()
    gpumem.info["device"] = str(x.device)
"""


def _step_phases(device: str, rounding: str) -> dict[str, tuple[int, int, int, int]]:
    """Per phase of WORKLOAD's step: (peak, net) allocated and requested bytes above the phase's start."""
    backend = TrackerBackend(rounding, device=device)
    found = {}

    def phase(name: str, run: Callable[[], Any]) -> Any:
        start = backend.current()
        backend.reset_peak()
        out = run()
        peak, end = backend.peak(), backend.current()
        found[name] = (
            peak.allocated - start.allocated,
            end.allocated - start.allocated,
            peak.requested - start.requested,
            end.requested - start.requested,
        )
        return out

    backend.start()
    try:
        model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
        model = model.to(device)
        x = torch.randn(64, 512, device=device)
        loss = phase("forward", lambda: model(x).square().mean())
        phase("backward", loss.backward)
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        phase("step", opt.step)
    finally:
        backend.stop()
    return found


@pytest.mark.parametrize("rounding", ["none", "cuda"])
def test_meta_bytes_equal_cpu_bytes_but_for_the_host_memory_of_adams_step_counters(rounding: str) -> None:
    meta, cpu = _step_phases("meta", rounding), _step_phases("cpu", rounding)
    # AdamW's 4 step counters (one per parameter) are 4-byte CPU scalars: on a GPU host memory, on the cpu
    # device the device's own; made at the step's start, they are live at its peak and after it
    counters = 4 * (512 if rounding == "cuda" else 4)
    peak, net, peak_requested, net_requested = cpu.pop("step")
    assert meta.pop("step") == (peak - counters, net - counters, peak_requested - 16, net_requested - 16)
    assert meta == cpu
    # forward: the peak is ReLU's output made while the first Linear's (64 x 1024 float32 each) still
    # exists; after ReLU only its output stays (saved by ReLU and the second Linear), then 64 x 256 twice
    # and the 4-byte mean: 262,144 + 2 x 65,536 + 4 < 2 x 262,144
    if rounding == "none":
        assert meta["forward"][0] == 2 * 64 * 1024 * 4


def test_header_identity_and_report_say_prediction(tracker: pytest.Pytester, reported: Reported) -> None:
    tracker.makepyfile(WORKLOAD)
    result = tracker.runpytest("--gpumem-device=meta", "--gpumem-update", "--gpumem-json=out.json")
    result.stdout.fnmatch_lines(
        [
            "gpumem: tracker (storages created by ATen ops, served by a model of the CUDA caching allocator)",
            "  device meta (a prediction: sizes without data, nothing computed)",
            "  compiled: Inductor*s partition, unfused (an upper bound), other backends as chosen",
            "  a GPU*s code paths*",
        ]
    )
    test = reported()["test_step"]
    assert (test["device"], test["info"]) == ("meta", {"device": "meta"})
    entries = json.loads((tracker.path / "gpumem-baselines.json").read_text(encoding="utf-8"))["entries"]
    assert "tracker (meta, round cuda)" in json.dumps(entries)
    tracker.runpytest("--gpumem-update", "--gpumem-json=out.json").assert_outcomes(passed=1)  # beside, not over
    test = reported()["test_step"]
    assert (test["device"], test["info"]) == ("cpu", {"device": "cpu"})
    text = (tracker.path / "gpumem-baselines.json").read_text(encoding="utf-8")
    assert "tracker (meta, round cuda)" in text
    assert '"tracker|cpu"' in text or '"backend": "tracker"' in text


def test_data_dependent_ops_fail_in_one_line(tracker: pytest.Pytester) -> None:
    """End to end for one case (a TypeError from torch); the others are unit tests below."""
    said = "Tensor.numpy() needs values"
    tracker.makepyfile(
        """
        import torch

        def test_needs_data(gpumem):
            x = torch.ones(3, device=gpumem.device)
            x.numpy()
        """
    )
    result = tracker.runpytest("--gpumem-device=meta")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            f"*::test_needs_data: this test cannot run on the meta device (tensors without data): {said}; "
            "asked at test_*.py:5 in test_needs_data"
        ]
    )
    result.stdout.no_fnmatch_line("*Traceback*")
    result.stdout.no_fnmatch_line("*pytest_gpumem/*.py:*")
    result.stdout.no_fnmatch_line("*All traceback entries are hidden*")  # our line only, no word of frames


def test_a_value_asked_for_on_meta_names_the_library_frame_and_the_users(tracker: pytest.Pytester) -> None:
    """A library's data-dependent branch (as HF's masks on a batch above 1) names the library's line that
    asked for a value and the test's line that called it; the test's own `.item()` names its line alone."""
    library = tracker.mkdir("site-packages").joinpath("masks")
    library.mkdir()
    library.joinpath("__init__.py").write_text(
        "def packed(ids):\n    lengths = ids.ne(0).sum(-1)\n    if (lengths > 1).all():\n        return None\n"
    )
    tracker.makeconftest("import sys, os\nsys.path.insert(0, os.path.join(os.path.dirname(__file__), 'site-packages'))")
    tracker.makepyfile(
        """
        import torch, masks

        def test_library(gpumem):
            ids = torch.ones(2, 8, dtype=torch.long, device=gpumem.device)
            masks.packed(ids)

        def test_own(gpumem):
            torch.ones(3, device=gpumem.device).sum().item()
        """
    )
    result = tracker.runpytest("--gpumem-device=meta", "-p", "no:randomly")
    result.assert_outcomes(failed=2)
    item = "Tensor.item() needs a value (so do float(), int(), bool(), `if` on a tensor)"
    result.stdout.fnmatch_lines(
        [
            f"*::test_library: this test cannot run on the meta device (tensors without data): {item}; asked at "
            "masks/__init__.py:3 in packed, called from test_a_value_asked_for_on_meta_*.py:5 in test_library",
            f"*::test_own: this test cannot run on the meta device (tensors without data): {item}; asked at "
            "test_a_value_asked_for_on_meta_*.py:8 in test_own",
        ]
    )
    result.stdout.no_fnmatch_line("*Traceback*")


def test_meta_needs_the_tracker() -> None:
    said = "--gpumem-device=meta is measured by the tracker, not --gpumem-backend=cuda"
    with pytest.raises(GpuMemError, match=f"^{said}$"):
        make_builtin("cuda", device="meta")


def test_only_cpu_or_meta_is_a_device(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(WORKLOAD)
    result = tracker.runpytest("--gpumem-device=gpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gpumem-device: invalid device 'gpu' (cpu, or meta*"])


FITS = """
import pytest, torch

def step(device, batch):
    model = torch.nn.Linear(16384, 16384, device=device)  # 1 GiB of float32 weights
    x = torch.randn(batch, 16384, device=device)
    model(x).sum().backward()

@pytest.mark.max_memory(capacity="3 GiB", device="meta")
def test_batch_32_fits_in_3_gib(gpumem):
    assert gpumem.device.type == "meta"
    step(gpumem.device, 32)  # weights, bias and their gradients: just over 2 GiB

@pytest.mark.max_memory(capacity="2 GiB", device="meta")
def test_but_not_in_2_gib(gpumem):
    step(gpumem.device, 32)

def test_on_cpu(gpumem):
    assert gpumem.device.type == "cpu"

@pytest.mark.max_memory(device="cuda")
def test_not_cuda(gpumem):
    pass
"""


def test_a_marker_makes_one_test_a_prediction(tracker: pytest.Pytester, reported: Reported) -> None:
    tracker.makepyfile(FITS)
    result = tracker.runpytest("--gpumem-json=out.json", "-p", "no:randomly")
    result.assert_outcomes(passed=2, failed=2)
    # reserved but unallocated: a 2 MiB small segment and a 20 MiB large one, less the bias (64 KiB), x (2 MiB),
    # the forward's cuBLAS workspace (8 MiB + 128 KiB) and 1 KiB of scalars served from them (11.8 MiB)
    result.stdout.fnmatch_lines(
        [
            "out of memory in the call after a peak of 1.0 GiB: past max_memory(capacity='2 GiB'); "
            "a prediction on meta",
            "*Captured gpumem call*",
            "also: tried to allocate 1.0 GiB",  # 124 columns on the line
            "allocator when it ran out: 1.0 GiB reserved, 1.0 GiB allocated and 11.8 MiB reserved but unallocated",
            "*max_memory device=: only 'meta' (a prediction without data) is chosen per test, got 'cuda'",
        ]
    )
    result.stdout.no_fnmatch_line("*All traceback entries are hidden*")
    tests = reported()
    assert {name: t["device"] for name, t in tests.items() if name != "test_not_cuda"} == {
        "test_batch_32_fits_in_3_gib": "meta",
        "test_but_not_in_2_gib": "meta",
        "test_on_cpu": "cpu",
    }
    # 2 x (16384 x 16384 + 16384) x 4 B for weights, bias and gradients; the batch's few MiB on top
    assert tests["test_batch_32_fits_in_3_gib"]["peak_bytes"] >= 2 * (16384 * 16384 + 16384) * 4


# ---------------------------------------------------------------- a GPU's code paths on meta (unit)

B, H, S, D = 2, 4, 100, 64  # S is not a multiple of 32: the efficient kernel's logsumexp is padded to 128
BF16, FP32 = 2, 4


def _qkv(dtype: torch.dtype, d: int = D) -> list[torch.Tensor]:
    """q, k, v as a projection makes them: (B, S, H, D) transposed to (B, H, S, D), needing gradients."""
    return [torch.empty(B, S, H, d, device="meta", dtype=dtype).transpose(1, 2).requires_grad_() for _ in range(3)]


def _attention(paths: str | None, dtype: torch.dtype, d: int = D, **kwargs: object) -> tuple[int, int, int]:
    """(bytes the forward keeps, backward's peak above its start, bytes after backward) of SDPA on meta."""
    q, k, v = _qkv(dtype, d)
    backend = TrackerBackend(device="meta", paths=paths)
    backend.start()
    try:
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)  # type: ignore[arg-type]
        kept = backend.current().requested
        grad = torch.empty_like(out)
        backend.reset_peak()
        start = backend.current().requested
        out.backward(grad)  # type: ignore[no-untyped-call]
        del out, grad
        backward_peak = backend.peak().requested - start
        after = backend.current().requested
    finally:
        backend.stop()
    return kept, backward_peak, after


def test_flash_attention_on_meta_keeps_output_logsumexp_and_rng_state() -> None:
    # bf16, no mask: flash. Output like q (B*H*S*D bf16), logsumexp (B, H, S) fp32, the philox seed
    # (2 uint64) and offset (1 uint64): 102,400 + 3,200 + 24; no S x S matrix
    kept, backward_peak, after = _attention(None, torch.bfloat16, is_causal=True)
    assert kept == B * H * S * D * BF16 + B * H * S * FP32 + 3 * 8 == 105_624
    # backward: the gradients of q, k, v (3 x 102,400), made while everything forward kept is alive; the
    # forward's output and logsumexp go when backward has run
    assert backward_peak == 3 * B * H * S * D * BF16
    assert after == 3 * B * H * S * D * BF16


def test_efficient_attention_on_meta_pads_logsumexp_to_32_queries() -> None:
    # fp32 (flash takes only half precision): memory-efficient. Output 204,800 B, logsumexp (B, H, 128)
    # fp32 = 4,096 B (S = 100 rounded up to a multiple of 32), seed and offset int64 (16 B)
    kept, backward_peak, _ = _attention(None, torch.float32)
    assert kept == B * H * S * D * FP32 + B * H * 128 * FP32 + 2 * 8 == 208_912
    assert backward_peak == 3 * B * H * S * D * FP32


def test_efficient_attention_with_a_boolean_mask_keeps_the_additive_mask() -> None:
    # a (S, S) boolean mask (10,000 B, made before) becomes additive in the query's dtype (S x S fp32,
    # 40,000 B) whose row stride 100 is not a multiple of 8: padded to (S, 104), 41,600 B, kept for backward
    q, k, v = _qkv(torch.float32)
    mask = torch.empty(S, S, dtype=torch.bool, device="meta")
    backend = TrackerBackend(device="meta")
    backend.start()
    try:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        kept = backend.current().requested
        del out
    finally:
        backend.stop()
    assert kept == B * H * S * D * FP32 + B * H * 128 * FP32 + 2 * 8 + S * 104 * FP32


def test_flash_pads_a_head_dimension_that_is_not_a_multiple_of_8() -> None:
    # D = 60: q, k, v are padded to 64 (copies kept for backward, 3 x B*H*S*64 bf16), the padded output
    # (B*H*S*64 bf16) is kept and sliced, logsumexp and RNG state as before
    kept, _, _ = _attention(None, torch.bfloat16, d=60)
    assert kept == 4 * B * H * S * 64 * BF16 + B * H * S * FP32 + 3 * 8


def test_cpu_paths_keep_the_math_path_and_its_s_by_s_weights() -> None:
    gpu, _, _ = _attention("gpu", torch.bfloat16, is_causal=True)
    cpu, _, _ = _attention("cpu", torch.bfloat16, is_causal=True)
    assert cpu - gpu > B * H * S * S * FP32  # the fp32 softmax the math path saves, at least


def test_sdpa_kernel_choice_is_honoured() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        math, _, _ = _attention(None, torch.bfloat16, is_causal=True)
    assert math == _attention("cpu", torch.bfloat16, is_causal=True)[0]


def test_multihead_attention_takes_the_fused_path() -> None:
    # E = 256 in 4 heads of 64, (2, 100, 256) bf16, q = k = v: the packed projection (2, 100, 768) made
    # contiguous per head (307,200 B; the linear's own output goes), flash's output, logsumexp and RNG state
    # (102,400 + 3,200 + 24), its output made contiguous for out_proj (102,400) and out_proj's (102,400); and
    # the test thread's cuBLAS workspace (8 MiB + 128 KiB), made by the projection's matmul and kept
    attn = torch.nn.MultiheadAttention(H * D, H, batch_first=True, device="meta", dtype=torch.bfloat16)
    x = torch.empty(B, S, H * D, device="meta", dtype=torch.bfloat16)
    backend = TrackerBackend(device="meta")
    backend.start()
    try:
        out = attn(x, x, x, need_weights=False)[0]
        kept = backend.current().requested
        del out
    finally:
        backend.stop()
    flash = B * H * S * D * BF16 + B * H * S * FP32 + 3 * 8
    assert kept == 3 * B * S * H * D * BF16 + flash + 2 * B * S * H * D * BF16 + WORKSPACE
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _checkpointed(paths: str | None, reentrant: bool, grad_api: bool = False) -> tuple[int, int, int]:
    """(bytes the checkpointed forward keeps, backward's peak above its start, bytes after backward) of
    causal SDPA in bf16 on meta inside `torch.utils.checkpoint`."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = _qkv(torch.bfloat16)
    backend = TrackerBackend(device="meta", paths=paths)
    backend.start()
    try:
        out = checkpoint(_causal_attention, q, k, v, use_reentrant=reentrant)
        kept = backend.current().requested
        grad = torch.empty_like(out)
        backend.reset_peak()
        start = backend.current().requested
        if grad_api:
            grads = torch.autograd.grad(out, (q, k, v), grad)
        else:
            out.backward(grad)
        del out, grad
        backward_peak = backend.peak().requested - start
        after = backend.current().requested
    finally:
        backend.stop()
    if grad_api:
        del grads
    return kept, backward_peak, after


@pytest.mark.parametrize(
    ("reentrant", "grad_api"),
    [(False, False), (True, False), (False, True)],
    ids=["non-reentrant", "reentrant", "autograd.grad"],
)
def test_checkpoint_recomputes_attention_on_the_fused_path(reentrant: bool, grad_api: bool) -> None:
    # forward keeps only the output (102,400 B); backward recomputes it with flash, which keeps its output,
    # logsumexp and RNG state (102,400 + 3,200 + 24, the same as un-checkpointed), then makes the gradients
    # of q, k, v (3 x 102,400) while all of it is alive; the math path would keep S x S weights instead
    kept, backward_peak, after = _checkpointed(None, reentrant, grad_api)
    assert kept == B * H * S * D * BF16 == 102_400
    assert backward_peak == (B * H * S * D * BF16 + B * H * S * FP32 + 3 * 8) + 3 * B * H * S * D * BF16 == 412_824
    assert after == 3 * B * H * S * D * BF16  # the gradients (in .grad or returned by autograd.grad)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_with_cpu_paths_recomputes_the_math_path(reentrant: bool) -> None:
    # the math path's matmuls make the test thread's cuBLAS workspace in forward and, recomputed in
    # backward, the autograd thread's (8 MiB + 128 KiB each, kept); the fused path makes none
    kept, backward_peak, after = _checkpointed("cpu", reentrant)
    assert kept == B * H * S * D * BF16 + WORKSPACE
    assert (
        backward_peak - _checkpointed(None, reentrant)[1] >= B * H * S * S * FP32 + WORKSPACE
    )  # fp32 softmax at least
    assert after == 3 * B * H * S * D * BF16 + 2 * WORKSPACE


def test_the_autograd_engine_is_restored_after_the_measurement() -> None:
    import torch.autograd.graph

    def engine_entries() -> tuple[object, object]:
        return (torch.autograd.graph._engine_run_backward, torch.autograd._engine_run_backward)  # type: ignore[attr-defined]

    before = engine_entries()
    _checkpointed(None, reentrant=False)
    assert engine_entries() == before


@pytest.mark.slow
def test_compiled_attention_on_meta_is_traced_as_written() -> None:
    # the graph is traced to ATen at compile time without the interception (Inductor cannot lower the
    # flash kernel's meta graph): a compiled region takes the math path, whatever the paths
    compiled = torch.compile(_causal_attention)
    kept = {}
    for paths in (None, "cpu"):
        q, k, v = _qkv(torch.bfloat16)
        backend = TrackerBackend(device="meta", paths=paths)
        backend.start()
        try:
            out = compiled(q, k, v)
            kept[paths] = backend.current().requested
            del out
        finally:
            backend.stop()
        assert backend.notes() == [COMPILED_UNFUSED]
    assert kept[None] == kept["cpu"] > B * H * S * S * FP32


def _adamw_step_peak(paths: str | None, foreach: bool | None = None) -> int:
    """Peak bytes of a warmed-up AdamW step on meta over 4 x Linear(256, 256, bias=False) fp32."""
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256, bias=False) for _ in range(4))).to("meta")
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=foreach)
    optimizer.step()
    backend = TrackerBackend(device="meta", paths=paths)
    backend.start()
    try:
        optimizer.step()
        return backend.peak().requested
    finally:
        backend.stop()


WEIGHT = 256 * 256 * FP32


def test_on_meta_only_meta_tensors_count_and_on_cpu_every_tensor() -> None:
    """AdamW's step counter is a CPU scalar (not capturable, not fused): on meta, host memory beside the GPU."""
    found = {}
    for device in ("meta", "cpu"):
        backend = TrackerBackend(device=device)
        param = torch.nn.Parameter(torch.ones(1024, device=device))
        param.grad = torch.ones(1024, device=device)
        optimizer = torch.optim.AdamW([param])
        backend.start()
        try:
            optimizer.step()
            found[device] = backend.current()
        finally:
            backend.stop()
        assert optimizer.state[param]["step"].device.type == "cpu"
    # exp_avg and exp_avg_sq: 1024 float32 each, rounded to 512-byte blocks on meta; the 4-byte step on cpu
    assert (found["meta"].allocated, found["meta"].requested) == (2 * 4096, 2 * 4096)
    assert (found["cpu"].allocated, found["cpu"].requested) == (2 * 4096 + 4, 2 * 4096 + 4)


def test_optimizers_default_to_foreach_on_meta() -> None:
    # foreach: _foreach_sqrt(exp_avg_sqs) makes one temporary per parameter, all alive at once (4 x 262,144);
    # single-tensor: sqrt and its division by the bias correction (the denominator), made while the previous
    # parameter's denominator is still bound to the loop's variable: three of one parameter's size
    assert _adamw_step_peak(None) == 4 * WEIGHT
    assert _adamw_step_peak("cpu") == 3 * WEIGHT
    assert _adamw_step_peak(None, foreach=False) == 3 * WEIGHT  # an explicit choice stays


def test_foreach_default_is_restored_after_the_measurement() -> None:
    from torch.optim.optimizer import _default_to_fused_or_foreach

    params = [torch.empty(3, device="meta")]
    assert _default_to_fused_or_foreach(params, differentiable=False) == (False, False)
    _adamw_step_peak(None)
    assert _default_to_fused_or_foreach(params, differentiable=False) == (False, False)


def test_identity_names_paths_only_when_not_the_default() -> None:
    # on meta the allocator's model serves the tensors by default: its figures are a GPU's, not requested bytes
    assert TrackerBackend(device="meta").identity().backend == "tracker (meta, round cuda)"
    assert TrackerBackend("none", device="meta").identity().backend == "tracker (meta)"
    assert TrackerBackend(device="meta", paths="cpu").identity().backend == "tracker (meta, round cuda, cpu paths)"
    assert TrackerBackend("cuda").paths == "gpu"
    assert TrackerBackend().paths == "cpu"


@pytest.mark.parametrize(
    ("code", "said"),
    [
        ("x.numpy()", "Tensor.numpy() needs values"),
        ("float(x.sum())", "Tensor.item() needs a value (so do float(), int(), bool(), `if` on a tensor)"),
        ("x.tolist()", "copying out of a meta tensor (.cpu(), .to(), .tolist(), copy_()) needs values"),
        ("x[x > 0]", "torch.nonzero's output size depends on the values (boolean masks, nonzero, where(cond))"),
        ("torch.unique(x)", "aten::_unique2 has no meta kernel (its output depends on the values, or is not *"),
        ("torch.Generator(device='meta')", "there is no torch.Generator on meta (random ops there need none)"),
        ("x + torch.ones(3)", "an op got a cpu tensor among meta tensors (put every tensor on gpumem.device)"),
        ("torch.utils.dlpack.to_dlpack(x)", "to_dlpack needs the tensor's memory"),
    ],
)
def test_what_needs_values_is_named_in_one_line(code: str, said: str) -> None:
    import fnmatch

    with pytest.raises(BaseException) as caught:
        exec(code, {"torch": torch, "x": torch.ones(3, device="meta")})
    reason = cannot_run_on_meta(caught.value)
    assert reason is not None and fnmatch.fnmatchcase(reason, said), reason


def test_other_errors_are_not_blamed_on_meta() -> None:
    assert cannot_run_on_meta(ValueError("bad")) is None
    assert cannot_run_on_meta(RuntimeError("shape mismatch")) is None
