"""The CUDA caching allocator's statistics (ROCm builds of torch answer through the same API)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pytest_gpumem.backends.base import Backend, Counters, Settings
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.private_torch import clear_cublas_workspaces, memory_snapshot, record_memory_history
from pytest_gpumem.results.baseline import DeviceIdentity

if TYPE_CHECKING:
    import torch


def counters_from_stats(stats: dict[str, Any], which: str) -> Counters:
    """Counters from a `memory_stats()` dict; `which` is 'current' or 'peak'.

    The stats are empty until the allocator is first used, hence the zero defaults; `requested_bytes`
    is missing on some builds and other accelerators, where allocated bytes stand in for it.
    """
    allocated = int(stats.get(f"allocated_bytes.all.{which}", 0))
    requested = int(stats.get(f"requested_bytes.all.{which}", allocated))
    return Counters(allocated, requested, int(stats.get(f"reserved_bytes.all.{which}", 0)))


class CudaBackend(Backend):
    """Peaks of `torch.cuda.memory_stats()` on the current CUDA (or ROCm) device."""

    name = "cuda"
    caps_the_process = True
    records_events = True

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise GpuMemError(
                f"--gpumem-backend=cuda: no CUDA device is available (torch {torch.__version__}, "
                f"built for CUDA {torch.version.cuda}, HIP {torch.version.hip})"
            )
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._capacity: int | None = None
        self._history = False
        self._recording = False
        self._fraction = 1.0

    HISTORY_ENTRIES = 100_000  # allocator events kept (bounds the history's memory and cost)

    def configure(self, settings: Settings) -> None:
        """For the next measurement: cap the process at `settings.capacity` bytes of this device
        (`set_per_process_memory_fraction`), and record the allocator's history when `events` is asked
        for (a snapshot that PyTorch's memory visualizer opens)."""
        self._capacity, self._history = settings.capacity, settings.events

    @property
    def capacity(self) -> int | None:
        return self._capacity

    @property
    def device(self) -> torch.device:
        return self._device

    def identity(self) -> DeviceIdentity:
        """The device model, compute capability and memory size: what baselines are keyed by."""
        import torch

        props = torch.cuda.get_device_properties(self._device)
        backend = "rocm" if torch.version.hip else "cuda"
        return DeviceIdentity(backend, props.name, f"{props.major}.{props.minor}", int(props.total_memory))

    def describe(self) -> str:
        import torch

        props = torch.cuda.get_device_properties(self._device)
        flavour = "ROCm" if torch.version.hip else "CUDA"
        return (
            f"cuda ({flavour} caching allocator), device {self._device} {props.name}, "
            f"{props.total_memory / 2**30:.1f} GiB"
        )

    def start(self) -> None:
        import torch

        self.clear_workspaces()  # each measured test makes its own, whatever ran before it
        if self.capacity is not None:
            total = torch.cuda.get_device_properties(self._device).total_memory
            self._fraction = torch.cuda.get_per_process_memory_fraction(self._device)
            torch.cuda.set_per_process_memory_fraction(min(self.capacity / total, 1.0), self._device)
        if self._history and not self._recording:
            # on from the first measured test: a test's snapshot is taken only if it fails
            record_memory_history(self.HISTORY_ENTRIES)
            self._recording = True

    def stop(self) -> None:
        import torch

        if self.capacity is not None:
            torch.cuda.set_per_process_memory_fraction(self._fraction, self._device)

    def snapshot(self) -> Any:
        """The allocator's memory history (its last HISTORY_ENTRIES events, the failing test's last), which
        PyTorch's memory visualizer opens."""
        return memory_snapshot() if self._recording else None

    def clear_workspaces(self) -> None:
        """Free the cuBLAS workspaces torch keeps per handle and stream (their blocks stay cached), where this
        torch can."""
        clear_cublas_workspaces()

    def empty_cache(self) -> None:
        """Give back the caching allocator's free segments."""
        import torch

        torch.cuda.empty_cache()

    def settle(self) -> None:
        import torch

        torch.cuda.synchronize(self._device)

    def current(self) -> Counters:
        import torch

        return counters_from_stats(torch.cuda.memory_stats(self._device), "current")

    def peak(self) -> Counters:
        import torch

        return counters_from_stats(torch.cuda.memory_stats(self._device), "peak")

    def reset_peak(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(self._device)
