"""Ways of measuring, and the choice among them."""

from __future__ import annotations

from pytest_gpumem.backends.base import Backend, Counters
from pytest_gpumem.errors import GpuMemError

BUILTIN = ("auto", "cuda", "accelerator", "tracker")

__all__ = ["BUILTIN", "Backend", "Counters", "make_builtin"]


def make_builtin(name: str, rounding: str = "auto", device: str = "cpu", paths: str | None = None) -> Backend | None:
    """The built-in backend called `name`, or None for a name that is not built in.

    `auto` picks cuda if a CUDA/ROCm device is available, else another accelerator with memory
    statistics, else the tracker. `rounding` applies to the tracker (allocators round by themselves), and
    so does `device="meta"` (a prediction: tensors have sizes and no data), which implies the tracker.
    `paths` (cpu or gpu) chooses the tracker's code paths; None: a GPU's on meta and with CUDA rounding.
    Raises GpuMemError when the named backend cannot run here.
    """
    if name not in BUILTIN:
        return None
    import torch

    from pytest_gpumem.backends.accelerator import AcceleratorBackend, accelerator_module
    from pytest_gpumem.backends.cuda import CudaBackend
    from pytest_gpumem.backends.tracker.backend import TrackerBackend

    if device == "meta":
        if name not in ("auto", "tracker"):
            raise GpuMemError(f"--gpumem-device=meta is measured by the tracker, not --gpumem-backend={name}")
        return TrackerBackend(rounding, device="meta", paths=paths)
    name_given = name
    if name == "auto":
        if torch.cuda.is_available():
            name = "cuda"
        elif accelerator_module() is not None:
            name = "accelerator"
        else:
            name = "tracker"
    if name == "tracker":
        return TrackerBackend(rounding, paths=paths)
    if paths is not None and name_given in ("cuda", "accelerator"):
        raise GpuMemError(
            f"--gpumem-paths={paths} chooses the tracker's code paths; --gpumem-backend={name} runs the device's own"
        )
    return CudaBackend() if name == "cuda" else AcceleratorBackend()
