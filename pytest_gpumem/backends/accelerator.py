"""`torch.accelerator` memory statistics (XPU and other devices), where the running torch has them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pytest_gpumem.backends.base import Backend, Counters
from pytest_gpumem.backends.cuda import counters_from_stats
from pytest_gpumem.errors import GpuMemError

if TYPE_CHECKING:
    import torch

_NEEDED = (
    "is_available",
    "current_accelerator",
    "current_device_index",
    "synchronize",
    "memory_stats",
    "reset_peak_memory_stats",
)


def accelerator_module() -> Any | None:
    """`torch.accelerator` if it has every function this backend uses and a device is present."""
    import torch

    module = getattr(torch, "accelerator", None)
    if module is None or not all(hasattr(module, fn) for fn in _NEEDED):
        return None
    return module if module.is_available() else None


class AcceleratorBackend(Backend):
    """Peaks of `torch.accelerator.memory_stats()` on the current accelerator."""

    name = "accelerator"

    def __init__(self) -> None:
        import torch

        module = accelerator_module()
        if module is None:
            raise GpuMemError(
                f"--gpumem-backend=accelerator: torch {torch.__version__} has no torch.accelerator "
                "memory statistics or no accelerator is available"
            )
        self._module = module
        kind = module.current_accelerator().type
        self._device = torch.device(kind, module.current_device_index())

    @property
    def device(self) -> torch.device:
        return self._device

    def describe(self) -> str:
        return f"accelerator (torch.accelerator memory statistics), device {self._device}"

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def settle(self) -> None:
        self._module.synchronize(self._device)

    def current(self) -> Counters:
        return counters_from_stats(self._module.memory_stats(self._device), "current")

    def peak(self) -> Counters:
        return counters_from_stats(self._module.memory_stats(self._device), "peak")

    def reset_peak(self) -> None:
        self._module.reset_peak_memory_stats(self._device)
