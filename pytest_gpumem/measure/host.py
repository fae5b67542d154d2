"""Whether a fit may run a step at the sizes its capacity allows: on the CPU a run allocates the host's
own memory, so a capacity larger than what the host has free would end in the host allocator's error."""

from __future__ import annotations

import os

from cuda_allocator_model import format_size
from pytest_gpumem.backends.base import Backend

HOST_SHARE = 0.8
"""The share of the host's available memory a fit's runs may take."""


def host_available() -> int | None:
    """Bytes of memory the host can still give (MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def runs_refused(backend: Backend, capacity: int, available: int | None = None) -> str | None:
    """Why runs held to `capacity` cannot be made on `backend` (None: they can): on the CPU, when the
    capacity allows more than `HOST_SHARE` of the host's available memory beyond what is allocated now."""
    if backend.device.type != "cpu":
        return None  # meta allocates nothing; a device runs out on its own memory, which a run then reports
    available = host_available() if available is None else available
    more = capacity - backend.current().allocated
    if available is None or more <= available * HOST_SHARE:
        return None
    return (
        f"on the CPU the step allocates for real and the host has {format_size(available)} available, "
        f"less than the {format_size(more)} the capacity allows; fit on the meta device to run a larger card's sizes"
    )
