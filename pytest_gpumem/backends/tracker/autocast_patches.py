"""Torch's functions as CUDA's autocast emulation wraps them while a measurement predicts a GPU: CUDA's AMP
available, meta taken as CUDA by autocast and checkpoint, CPU inputs' checkpoint device as CUDA, and
GradScaler's step on meta (`autocast`'s docstring says why each is needed)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from pytest_gpumem.private_torch import amp_availability


@contextlib.contextmanager
def cuda_amp_available() -> Iterator[None]:
    """Within the block, autocast and GradScaler find CUDA's AMP available and bf16 supported (as on an
    Ampere or later card)."""
    import torch

    common, name = amp_availability()
    saved = getattr(common, name), torch.cuda.is_bf16_supported
    setattr(common, name, lambda: False)
    torch.cuda.is_bf16_supported = lambda *args, **kwargs: True
    try:
        yield
    finally:
        setattr(common, name, saved[0])
        torch.cuda.is_bf16_supported = saved[1]


def meta_available(original: Callable[[str], bool]) -> Callable[[str], bool]:
    @functools.wraps(original)
    def is_autocast_available(device_type: str) -> bool:
        return device_type == "meta" or original(device_type)

    return is_autocast_available


def meta_as_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
    """checkpoint's autocast state of meta inputs: CUDA's (torch has none for meta)."""

    @functools.wraps(original)
    def get_autocast_kwargs(device_type: str = "cuda") -> Any:
        return original("cuda" if device_type == "meta" else device_type)

    return get_autocast_kwargs


def cpu_as_cuda(original: Callable[..., str]) -> Callable[..., str]:
    """checkpoint's device of CPU inputs that stand for the GPU's: CUDA (its autocast state is saved and
    restored for the recompute; no CUDA RNG state exists to save)."""

    @functools.wraps(original)
    def infer_device_type(*args: Any) -> str:
        found = original(*args)
        return "cuda" if found == "cpu" else found

    return infer_device_type


def stepping_on_meta(original: Callable[..., Any]) -> Callable[..., Any]:
    """GradScaler's step on meta: no gradient can be read as inf there, so the optimizer steps."""
    import torch

    @functools.wraps(original)
    def _maybe_opt_step(scaler: Any, optimizer: Any, state: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        found = state["found_inf_per_device"].values()
        if any(isinstance(f, torch.Tensor) and f.device.type == "meta" for f in found):
            return optimizer.step(*args, **kwargs)
        return original(scaler, optimizer, state, *args, **kwargs)

    return _maybe_opt_step
