"""CUDA's autocast and GradScaler where the tracker predicts a GPU: casts, cache, bytes and the op table."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from builders import Reported
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from pytest_gpumem.backends.tracker import autocast_lists
from pytest_gpumem.backends.tracker.autocast import CudaAutocast, op_overload
from pytest_gpumem.backends.tracker.autocast_lists import CUDA_AUTOCAST_POLICIES, REGISTERED_AT
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.private_torch import ops_with_cuda_autocast, registered_at

BF16, FP32 = 2, 4
N, D = 8, 64  # a batch of 8 through Linear(64, 64)


@pytest.fixture
def meta() -> Iterator[TrackerBackend]:
    """A tracker measuring on meta (a GPU predicted), started for the test's body; no allocator model (so
    no cuBLAS workspace among the figures)."""
    backend = TrackerBackend("none", device="meta")
    backend.start()
    try:
        yield backend
    finally:
        backend.stop()


def _cuda_autocast(**kwargs: Any) -> torch.autocast:
    return torch.autocast("cuda", **{"dtype": torch.bfloat16, **kwargs})


# --- the table is the installed torch's -------------------------------------------------------------


def test_every_op_with_a_cuda_autocast_kernel_has_a_policy_in_our_table() -> None:
    installed = ops_with_cuda_autocast()
    assert installed == set(CUDA_AUTOCAST_POLICIES), (
        f"torch {torch.__version__} changed CUDA's autocast lists: update autocast_lists.py "
        f"(new: {sorted(installed - set(CUDA_AUTOCAST_POLICIES))}, "
        f"gone: {sorted(set(CUDA_AUTOCAST_POLICIES) - installed)})"
    )
    places = {name: registered_at(name) for name in installed}
    assert {place for place in places.values() if not (place or "").endswith(REGISTERED_AT)} == set(), (
        f"torch {torch.__version__} registers CUDA's autocast kernels elsewhere than {REGISTERED_AT}: "
        "re-read its autocast_mode.cpp/.h"
    )


class _Stop(Exception):
    pass


class _Probe(torch.Tensor):
    """A tensor that says it is on CUDA, so that torch's own C++ AutocastCUDA kernels cast it; it records
    the casts and the op autocast hands it to, then stops (no kernel runs)."""

    seen: ClassVar[list[tuple[str, ...]]] = []

    @staticmethod
    def __new__(cls, dtype: torch.dtype) -> _Probe:
        return torch.Tensor._make_wrapper_subclass(cls, (4, 4), dtype=dtype, device=torch.device("cuda"))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            cls.seen.append(("cast", str(args[0].dtype), str(kwargs.get("dtype"))))
            return _Probe(kwargs.get("dtype", args[0].dtype))
        dtypes = tuple(str(t.dtype) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        cls.seen.append((str(func), *dtypes, str(kwargs.get("dtype"))))
        raise _Stop


def _argument(arg: Any, dtype: torch.dtype) -> Any:
    kind = str(arg.type)
    if "Tensor" in kind:
        return [_Probe(dtype), _Probe(dtype)] if kind.startswith("List") or kind.endswith("[]") else _Probe(dtype)
    simple: dict[str, Any] = {"Scalar": 2.0, "number": 2.0, "int": 0, "SymInt": 0, "bool": False, "float": 1.0}
    if kind in simple:
        return simple[kind]
    if kind.startswith("Optional"):
        return None
    if kind == "str":
        return "fro" if "ord" in arg.name else "ij"
    return [1]  # int lists


def _trace(op: Any, dtype: torch.dtype) -> list[tuple[str, ...]] | str:
    """What CUDA autocast does with `op` called on probes of `dtype` in a bf16 region: the casts and the
    call it makes, or the error it raises."""
    args, kwargs = [], {}
    for arg in op._schema.arguments:
        if arg.default_value is not None and "Tensor" not in str(arg.type):
            continue
        if arg.kwarg_only:
            kwargs[arg.name] = _argument(arg, dtype)
        else:
            args.append(_argument(arg, dtype))
    _Probe.seen = []
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    try:
        op(*args, **kwargs)
    except _Stop:
        pass
    except Exception as error:  # shapes the probe cannot give: the error must be the same too
        return f"{type(error).__name__}: {error}"
    finally:
        torch.set_autocast_enabled("cuda", False)
        torch.set_autocast_dtype("cuda", torch.float16)
    return list(_Probe.seen)


def _traces() -> dict[tuple[str, torch.dtype], list[tuple[str, ...]] | str]:
    dtypes = (torch.float32, torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            (name, dtype): _trace(op_overload(name), dtype) for name in ops_with_cuda_autocast() for dtype in dtypes
        }


def test_our_kernels_cast_every_op_as_the_installed_torchs_own_cuda_kernels() -> None:
    """Differential: each op, called on probes of fp32 and of bf16, through torch's C++ AutocastCUDA kernel
    and then through ours: the same casts, the same call (dtype argument included), the same errors."""
    theirs = _traces()
    emulation = CudaAutocast("meta", [])
    emulation.register_kernels()
    try:
        ours = _traces()
    finally:
        emulation.undo()
    assert {key for key in theirs if theirs[key] != ours[key]} == set()
    called = {name for (name, _), trace in theirs.items() if not isinstance(trace, str)}
    assert len(called) >= 100  # the rest need shapes the probe lacks (same error from both)
    assert registered_at("aten::mm") == f"/__w/pytorch/pytorch/{REGISTERED_AT}"  # torch's own kernel is back


# --- casts and bytes on meta ------------------------------------------------------------------------


def _linear() -> tuple[torch.nn.Linear, torch.Tensor]:
    return torch.nn.Linear(D, D, device="meta"), torch.empty(N, D, device="meta")


def _above(backend: TrackerBackend, start: int) -> int:
    return backend.current().requested - start


def _made(backend: TrackerBackend) -> int:
    """Bytes allocated so far (the test's inputs); from now on, peaks count from here."""
    backend.reset_peak()
    return backend.current().requested


WEIGHT_CAST, BIAS_CAST = D * D * BF16, D * BF16  # cached while the outermost region lasts
X_CAST, OUT = N * D * BF16, N * D * BF16  # made for each call (addmm keeps x's cast for the weight's grad)


def test_a_linear_casts_its_weight_once_across_calls_and_frees_it_at_the_outermost_exit(meta: TrackerBackend) -> None:
    lin, x = _linear()
    start = _made(meta)
    with _cuda_autocast():
        assert (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")) == (True, torch.bfloat16)
        first = lin(x)
        assert _above(meta, start) == WEIGHT_CAST + BIAS_CAST + X_CAST + OUT == 10_368
        second = lin(x)
        assert _above(meta, start) == WEIGHT_CAST + BIAS_CAST + 2 * (X_CAST + OUT) == 12_416
    assert _above(meta, start) == 2 * (X_CAST + OUT) == 4_096
    assert (first.dtype, second.dtype, torch.is_autocast_enabled("cuda")) == (torch.bfloat16, torch.bfloat16, False)


def test_without_the_cache_each_call_casts_the_weight_again(meta: TrackerBackend) -> None:
    lin, x = _linear()
    start = _made(meta)
    with _cuda_autocast(cache_enabled=False):
        kept = lin(x), lin(x)
        assert _above(meta, start) == 2 * (X_CAST + OUT)  # each call's weight cast is gone after its call
    assert meta.peak().requested - start == X_CAST + OUT + WEIGHT_CAST + BIAS_CAST + X_CAST + OUT
    assert all(t.dtype == torch.bfloat16 for t in kept)


def test_backward_goes_through_the_casts_and_the_weight_gradient_is_fp32(meta: TrackerBackend) -> None:
    lin, x = _linear()
    with _cuda_autocast():
        out = lin(x)
    assert "ToCopyBackward0" in {type(f).__name__ for f, _ in out.grad_fn.next_functions if f is not None}
    out.float().sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.float32


def test_nested_regions_keep_the_cache_and_a_disabled_region_runs_fp32(meta: TrackerBackend) -> None:
    lin, x = _linear()
    start = _made(meta)
    with _cuda_autocast():
        kept = [lin(x)]
        with torch.autocast("cuda", enabled=False):
            assert not torch.is_autocast_enabled("cuda")
            assert torch.mm(x, x.T).dtype == torch.float32
        with _cuda_autocast():
            kept.append(lin(x))
        assert torch.is_autocast_enabled("cuda")
        kept.append(lin(x))
        assert _above(meta, start) == WEIGHT_CAST + BIAS_CAST + 3 * (X_CAST + OUT)
    assert _above(meta, start) == 3 * (X_CAST + OUT)  # one weight cast for the three calls, now gone


def test_exp_is_an_fp32_op_and_softmax_an_fp32_set_opt_dtype_op(meta: TrackerBackend) -> None:
    half = torch.empty(N, D, device="meta", dtype=torch.bfloat16)
    start = _made(meta)
    with _cuda_autocast():
        out = torch.exp(half)
        assert meta.peak().requested - start == 2 * N * D * FP32  # the fp32 copy of the input, exp's output
        assert _above(meta, start) == N * D * FP32
        assert (out.dtype, torch.softmax(half, -1).dtype, half.sum().dtype) == (torch.float32,) * 3
        assert torch.mm(half, half.T).dtype == torch.bfloat16


def test_a_promote_op_computes_in_the_widest_input_type(meta: TrackerBackend) -> None:
    half = torch.empty(N, D, device="meta", dtype=torch.bfloat16)
    full = torch.empty(N, D, device="meta")
    start = _made(meta)
    with _cuda_autocast():
        out = torch.addcmul(half, full, half)
        assert meta.peak().requested - start == 3 * N * D * FP32  # two fp32 copies of the bf16 inputs, the output
        assert (out.dtype, torch.addcmul(half, half, half).dtype) == (torch.float32, torch.bfloat16)


def test_meta_names_cuda_autocast_and_so_does_the_old_api(meta: TrackerBackend) -> None:
    lin, x = _linear()
    with torch.autocast("meta", dtype=torch.bfloat16):
        assert lin(x).dtype == torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.cuda.amp is deprecated
        with torch.cuda.amp.autocast(dtype=torch.bfloat16):
            assert lin(x).dtype == torch.bfloat16
    with torch.amp.autocast("cuda"):
        assert lin(x).dtype == torch.float16  # CUDA's default
    with pytest.raises(RuntimeError, match="unsafe to autocast"), _cuda_autocast():
        F.binary_cross_entropy(torch.empty(3, device="meta"), torch.empty(3, device="meta"))


def test_attention_takes_flash_on_the_cast_inputs(meta: TrackerBackend) -> None:
    q = torch.empty(2, 4, 128, D, device="meta", requires_grad=True)  # fp32: efficient attention without autocast
    with _cuda_autocast():
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert out.dtype == torch.bfloat16
    assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionBackward0"


def test_checkpoint_recomputes_under_cuda_autocast(meta: TrackerBackend) -> None:
    lin, x = _linear()
    seen: list[torch.dtype] = []
    lin.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    with _cuda_autocast():
        out = checkpoint(lambda t: lin(lin(t).relu()), x, use_reentrant=False)
    assert isinstance(out, torch.Tensor)
    out.float().sum().backward()  # type: ignore[no-untyped-call]
    assert seen == [torch.bfloat16] * 3  # the forward's two calls, then the first's recomputation in backward


def test_grad_scaler_acts_as_on_a_card(meta: TrackerBackend) -> None:
    lin, x = _linear()
    optimizer = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    with _cuda_autocast():
        loss = lin(x).float().sum()
    start = _made(meta)
    scaled = scaler.scale(loss)
    assert _above(meta, start) == FP32 + 4 + FP32  # the scale (fp32), the growth tracker (int32), the product
    scaled.backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.is_enabled()
    assert len(optimizer.state) == 2  # stepped: a momentum buffer per parameter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert torch.cuda.amp.GradScaler().is_enabled()


def test_an_op_without_a_known_policy_runs_uncast_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(autocast_lists.CUDA_AUTOCAST_POLICIES, "aten::exp")
    backend = TrackerBackend(device="meta")
    backend.start()
    try:
        with _cuda_autocast():
            out = torch.exp(torch.empty(3, device="meta", dtype=torch.bfloat16))
    finally:
        backend.stop()
    assert out.dtype == torch.bfloat16
    assert backend.notes() == [
        "aten::exp has a CUDA autocast kernel this tracker has no cast policy for: it ran uncast"
    ]


def test_cpu_tensors_stand_for_the_gpus_with_cuda_rounding() -> None:
    backend = TrackerBackend("cuda", device="cpu")
    backend.start()
    try:
        with _cuda_autocast():
            out = torch.nn.Linear(4, 4)(torch.ones(2, 4))
    finally:
        backend.stop()
    assert out.dtype == torch.bfloat16


def test_a_checkpoint_of_cpu_tensors_recomputes_under_cuda_autocast() -> None:
    backend = TrackerBackend("cuda", device="cpu")
    backend.start()
    try:
        lin = torch.nn.Linear(4, 4)
        seen: list[torch.dtype] = []
        lin.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
        with _cuda_autocast():
            out = checkpoint(lambda t: lin(lin(t).relu()), torch.ones(2, 4), use_reentrant=False)
        assert isinstance(out, torch.Tensor)
        out.float().sum().backward()  # type: ignore[no-untyped-call]
    finally:
        backend.stop()
    assert seen == [torch.bfloat16] * 3


def test_everything_is_undone_after_the_measurement() -> None:
    backend = TrackerBackend(device="meta")
    backend.start()
    backend.stop()
    with pytest.warns(UserWarning, match="CUDA is not available"), torch.autocast("cuda"):
        assert not torch.is_autocast_enabled("cuda")
    with pytest.raises(RuntimeError, match="unsupported"):
        torch.autocast("meta")
    assert not torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.AutocastCUDA)
    assert registered_at("aten::mm") == f"/__w/pytorch/pytorch/{REGISTERED_AT}"


def test_cpu_paths_keep_cpu_autocast() -> None:
    backend = TrackerBackend(device="meta", paths="cpu")
    backend.start()
    try:
        with pytest.raises(RuntimeError, match="unsupported"):
            torch.autocast("meta")
    finally:
        backend.stop()


# --- as a user meets it -----------------------------------------------------------------------------

AUTOCAST_TEST = """
import torch


def test_bf16(gpumem):
    model = torch.nn.Linear(1024, 1024).to(gpumem.device)
    x = torch.randn(256, 1024, device=gpumem.device)
    with gpumem.phase("forward"), torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.bfloat16
"""


def test_a_bf16_test_on_meta_gets_bf16_figures(tracker: pytest.Pytester, reported: Reported) -> None:
    tracker.makepyfile(AUTOCAST_TEST)
    result = tracker.runpytest(
        "-p", "no:randomly", "--gpumem-device=meta", "--gpumem-round=none", "--gpumem-json=out.json"
    )
    result.assert_outcomes(passed=1)
    forward = reported()["test_bf16"]["phases"]["forward"]
    # the bf16 casts of the weight, the bias and x, and the bf16 output (without autocast: the fp32 output, 1 MiB)
    assert forward["requested_peak_bytes"] == 1024 * 1024 * BF16 + 1024 * BF16 + 2 * 256 * 1024 * BF16 == 3_147_776


def test_a_cuda_autocast_region_left_open_is_closed_when_the_measurement_ends() -> None:
    backend = TrackerBackend(device="meta")
    backend.start()
    try:
        torch.autocast("cuda", dtype=torch.bfloat16).__enter__()  # type: ignore[no-untyped-call]
        assert torch.is_autocast_enabled("cuda")
    finally:
        backend.stop()
    assert not torch.is_autocast_enabled("cuda")
    assert backend.notes() == ["a CUDA autocast region the test entered was still open when it ended: closed"]


def test_an_error_in_a_cast_op_or_in_backward_shows_no_frame_of_the_plugin(tracker: pytest.Pytester) -> None:
    """The user's traceback holds the test's frames and torch's, as unmeasured: not the emulation's casts
    nor the wrapper that runs backward under the GPU's paths."""
    tracker.makepyfile(
        """
        import torch

        class Boom(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2

            @staticmethod
            def backward(ctx, grad):
                raise ValueError("boom in backward")

        def test_backward(gpumem):
            Boom.apply(torch.ones(3, device=gpumem.device, requires_grad=True)).sum().backward()

        def test_cast_op(gpumem):
            with torch.autocast("cuda", dtype=torch.float16):
                torch.mm(torch.ones(3, 4, device=gpumem.device), torch.ones(5, 6, device=gpumem.device))

        def test_banned(gpumem):
            with torch.autocast("cuda", dtype=torch.float16):
                x = torch.ones(3, device=gpumem.device)
                torch.nn.functional.binary_cross_entropy(x, x)
        """
    )
    result = tracker.runpytest("--gpumem-device=meta", "-p", "no:randomly")
    result.assert_outcomes(failed=3)
    said = ["E * boom in backward", "E * must have same reduction dim*", "E * unsafe to autocast*"]
    result.stdout.fnmatch_lines(said)
    result.stdout.no_fnmatch_line("*pytest_gpumem*.py:*")
