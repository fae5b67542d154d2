"""A measured test leaves nothing behind that changes the next one."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters

from pytest_gpumem.backends.base import Settings
from pytest_gpumem.backends.tracker.backend import TrackerBackend


def test_an_inner_run_that_compiles_leaves_torch_compile_working(pytester: pytest.Pytester) -> None:
    # first in the file, before this process compiles: pytester drops the modules an in-process run
    # imported first; torch.compile's are imported by the conftest, or importing them again registers
    # torch's cache artifacts twice (an AssertionError)
    pytester.makepyfile(
        """
        import torch

        def test_compiles():
            assert torch.compile(torch.sin, backend="aot_eager")(torch.zeros(2)).tolist() == [0.0, 0.0]
        """
    )
    pytester.runpytest("-p", "no:gpumem").assert_outcomes(passed=1)
    assert torch.compile(torch.cos, backend="aot_eager")(torch.zeros(2)).tolist() == [1.0, 1.0]


def _global_state() -> dict[str, Any]:
    """Every global a measurement patches or could change, by identity or value."""
    import torch.autograd.graph
    import torch.jit._trace
    import torch.optim.optimizer as optimizer
    from torch.nn.modules import module
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return {
        "foreach devices": optimizer._get_foreach_kernels_supported_devices,  # type: ignore[attr-defined]
        "sdpa": F.scaled_dot_product_attention,
        "multi-head attention": F.multi_head_attention_forward,
        "engine": torch.autograd.graph._engine_run_backward,
        "autograd's engine": torch.autograd._engine_run_backward,  # type: ignore[attr-defined]
        "function modes": list(_get_current_function_mode_stack()),  # type: ignore[no-untyped-call]
        "dispatch modes": list(_get_current_dispatch_mode_stack()),
        "resize_": torch.UntypedStorage.__dict__.get("resize_"),
        "jit": (torch.jit.trace, torch.jit._trace.trace, torch.jit._trace.trace_module),
        "profile": (threading.getprofile(), sys.getprofile()),
        "module hooks": (dict(module._global_forward_pre_hooks), dict(module._global_forward_hooks)),
        "optimizer hooks": (dict(optimizer._global_optimizer_pre_hooks), dict(optimizer._global_optimizer_post_hooks)),
        "dynamo config": torch._dynamo.config.get_config_copy(),
        "defaults": (torch.get_default_dtype(), torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled()),
        "rng": torch.get_rng_state().tolist(),
    }


def _attention_training_step() -> None:
    q = torch.empty(1, 2, 16, 8, device="meta", dtype=torch.bfloat16, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()  # type: ignore[no-untyped-call]
    attn = torch.nn.MultiheadAttention(16, 2, batch_first=True, device="meta")
    x = torch.empty(1, 4, 16, device="meta")
    attn(x, x, x, need_weights=False)[0].sum().backward()
    torch.optim.AdamW(attn.parameters()).step()


def test_a_measurement_on_meta_puts_back_every_global_it_touched() -> None:
    before = _global_state()
    backend = TrackerBackend(device="meta")  # a GPU's paths: foreach optimizers, fused attention
    backend.configure(Settings(None, origins=True, events=True, explain=True))
    backend.start()
    try:
        _attention_training_step()
    finally:
        backend.stop()
    assert _global_state() == before


def _causal(q: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, q, q, is_causal=True).sum()


def test_a_compiled_function_keeps_its_program_across_measurements_on_meta() -> None:
    # torch.compile guards on the types on the torch-function mode stack: one type of attention mode for
    # every measurement compiles once, where a type per measurement recompiled in each until Dynamo's
    # limit (2 here, 8 by default) ran the function eagerly, on the fused path: other figures
    compiled = torch.compile(_causal, backend="aot_eager")
    q = torch.empty(1, 2, 16, 8, device="meta", dtype=torch.bfloat16)
    graphs = counters["stats"]["unique_graphs"]
    peaks = []
    with torch._dynamo.config.patch(recompile_limit=2):
        for _ in range(3):
            backend = TrackerBackend(device="meta")
            backend.start()
            try:
                compiled(q)
                peaks.append(backend.peak().requested)
            finally:
                backend.stop()
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert peaks == [peaks[0]] * 3


def test_inner_runs_see_no_terminal_width_of_the_caller() -> None:
    # the report fits COLUMNS: a suite run from a 90-column terminal would narrow every inner report
    assert "COLUMNS" not in os.environ


def test_the_plugins_a_run_registers_leave_with_it(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import pytest

        NAMES = ("gpumem-session", "gpumem-baselines", "gpumem-xdist")

        def pytest_sessionfinish(session):
            registered = [name for name in NAMES if session.config.pluginmanager.has_plugin(name)]
            (session.config.rootpath / "during.txt").write_text(" ".join(registered))

        @pytest.hookimpl(trylast=True)
        def pytest_unconfigure(config):
            left = [name for name in NAMES if config.pluginmanager.has_plugin(name)]
            (config.rootpath / "after.txt").write_text(" ".join(left))
        """
    )
    pytester.makepyfile("def test_one(gpumem):\n    pass\n")
    pytester.runpytest("-p", "xdist", "--gpumem-update=all").assert_outcomes(passed=1)
    # xdist's hand-over is registered only on the controller of a distributed run (test_xdist.py), not here
    assert (pytester.path / "during.txt").read_text() == "gpumem-session gpumem-baselines"
    assert (pytester.path / "after.txt").read_text() == ""
