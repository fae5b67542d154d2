"""What the tracker's ledger counts: storages (read through `Storage`) and workspaces, the memory the
allocator hands out that no tensor holds, each at the bytes a rounding counts for it (`ROUNDERS`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

_MIB = 1024 * 1024
_SMALL_REQUEST = _MIB  # the CUDA allocator's small-pool limit (kSmallSize)
_LARGE_SEGMENT_LIMIT = 10 * _MIB  # below this, large requests come from 20 MiB segments
_SEGMENT_ROUND = 2 * _MIB


def cuda_block_size(nbytes: int) -> int:
    """Bytes the CUDA caching allocator counts as allocated for a request served by a fresh segment.

    Requests round up to 512 bytes. Small ones (<= 1 MiB) and those under 10 MiB are split off larger
    segments, so they count as rounded. From 10 MiB a segment of the request rounded up to 2 MiB is
    made, and it is split only if more than 1 MiB would remain; otherwise the whole segment counts.
    """
    if nbytes == 0:
        return 0
    rounded = -(-nbytes // 512) * 512
    if rounded <= _SMALL_REQUEST or rounded < _LARGE_SEGMENT_LIMIT:
        return rounded
    segment = -(-rounded // _SEGMENT_ROUND) * _SEGMENT_ROUND
    return rounded if segment - rounded > _SMALL_REQUEST else segment


def _exact(nbytes: int) -> int:
    return nbytes


ROUNDERS: dict[str, Callable[[int], int]] = {"none": _exact, "cuda": cuda_block_size}
"""Counted bytes for requested bytes, by the name of the rounding (`--gpumem-round`)."""


class Storage(Protocol):
    """What the ledger reads of a storage (`torch.UntypedStorage`): its identity (`storage_key`), size and
    device."""

    def nbytes(self) -> int: ...

    @property
    def device(self) -> torch.device: ...


_WORKSPACE_KEYS = itertools.count(-1, -1)  # below every storage's key (an address), never reused


class Workspace:
    """Memory the allocator hands out that no tensor holds, a storage of `size` bytes: a cuBLAS workspace,
    or a kernel's temporary."""

    __slots__ = ("__weakref__", "key", "size")

    def __init__(self, size: int) -> None:
        self.key = next(_WORKSPACE_KEYS)
        self.size = size

    def nbytes(self) -> int:
        return self.size
