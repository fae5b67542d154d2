"""One device per pytest-xdist worker, chosen among the devices the caller made visible.

`--gpumem-devices=auto` spreads workers round-robin over every device the caller can see;
`--gpumem-devices=0,2` over those ordinals (numbered as the caller sees them: `cuda:0`, `cuda:2`). A worker
then sees only its device (as `cuda:0`), through `CUDA_VISIBLE_DEVICES` set before CUDA starts, written in
the caller's own terms (physical ids or UUIDs): an outer `CUDA_VISIBLE_DEVICES=2,3` keeps workers on
physical 2 and 3. With fewer than two devices, or outside xdist, nothing changes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

VISIBLE = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class Assignment:
    """The device a worker uses: `visible` goes into CUDA_VISIBLE_DEVICES; `ordinal` is its number as the
    caller sees it."""

    worker: str
    ordinal: int
    visible: str

    def describe(self) -> str:
        return f"worker {self.worker}: cuda:{self.ordinal} of the caller ({VISIBLE}={self.visible})"


def visible_devices(env: Mapping[str, str], count: Callable[[], int]) -> list[str]:
    """The caller's devices in its own terms: its CUDA_VISIBLE_DEVICES entries, else 0..count()-1."""
    given = env.get(VISIBLE)
    if given is not None:
        return [entry.strip() for entry in given.split(",") if entry.strip()]
    return [str(i) for i in range(count())]


def _worker_index(worker: str) -> int:
    match = re.fullmatch(r"gw(\d+)", worker)
    if match is None:
        raise ValueError(f"not an xdist worker id: {worker!r}")
    return int(match.group(1))


def assign(worker: str, spec: str | tuple[int, ...], visible: list[str]) -> Assignment | None:
    """The device of `worker`, or None when `auto` has nothing to spread (fewer than two devices)."""
    ordinals = list(range(len(visible))) if isinstance(spec, str) else list(spec)
    unknown = [o for o in ordinals if o >= len(visible)]
    if unknown:
        seen = ", ".join(visible) or "none"
        raise ValueError(f"--gpumem-devices names cuda:{unknown[0]}, but the caller sees {len(visible)} ({seen})")
    if isinstance(spec, str) and len(ordinals) < 2:
        return None
    ordinal = ordinals[_worker_index(worker) % len(ordinals)]
    return Assignment(worker, ordinal, visible[ordinal])
