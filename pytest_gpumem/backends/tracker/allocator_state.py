"""The allocator model's state kept and restored: a copy of the model (on a thread with a deep stack) and
the bytes each live storage was counted with then."""

from __future__ import annotations

import copy
import dataclasses
import sys
import threading
from typing import Any

COPY_THREAD = "gpumem-allocator-copy"  # the tracker's own thread: not one the test started


def copied(model: Any) -> Any:
    """A deep copy of the allocator model, made on a thread of its own with a deep stack: its blocks are
    linked lists, which `copy.deepcopy` follows one recursive call after another."""
    copies: list[Any] = []

    def run() -> None:
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, _COPY_DEPTH))
        try:
            copies.append(copy.deepcopy(model))
        finally:
            sys.setrecursionlimit(limit)

    stack = threading.stack_size(_COPY_STACK)
    try:
        worker = threading.Thread(target=run, name=COPY_THREAD)
        worker.start()
    finally:
        threading.stack_size(stack)
    worker.join()
    if not copies:
        raise RuntimeError("the allocator model could not be copied")
    return copies[0]


_COPY_DEPTH = 2_000_000  # Python frames: some ten per block of the model
_COPY_STACK = 1 << 30  # bytes of the copying thread's stack (reserved, not used until needed)


@dataclasses.dataclass(frozen=True)
class SavedAllocator:
    """The allocator model at one moment and the bytes each live storage was counted with then."""

    model: Any
    counted: dict[int, int]
