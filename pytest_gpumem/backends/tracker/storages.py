"""What the tracker's ledger counts: storages (read through `Storage`) and workspaces, the memory the
allocator hands out that no tensor holds, each at the bytes a rounding counts for it (`ROUNDERS`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from cuda_allocator_model import CachingAllocatorModel

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


class HoldingWithoutTensors:
    """The ledger's memory that no tensor holds (`StorageLedger` derives from it): cuBLAS workspaces, kernels'
    temporaries, and the ops whose figure is not a card's. What it reads of the ledger is declared here."""

    _model: CachingAllocatorModel | None
    device_type: str | None
    workspace_bytes: int
    workspaces: dict[object, Workspace]
    workspaces_ready: set[object]  # the handles in `workspaces` whose workspace has `workspace_bytes` or more
    largest_temporaries: int
    bounds: dict[tuple[str, str], int]
    # read on every matmul and reduction: plain attributes, set by `_decide_wants` whenever the allocator's
    # model, the workspace's size or the device counted changes
    wants_workspaces = False
    """Whether a matmul's first use of a cuBLAS handle allocates a workspace (the allocator's model)."""
    wants_temporaries = False
    """Whether ops' kernel temporaries are counted: only where the ledger predicts a GPU (the allocator's
    model, or the meta device)."""

    def _follow(self, storage: object, key: int, requested: int, base: int = 0) -> None:
        raise NotImplementedError

    def _decide_wants(self) -> None:
        self.wants_workspaces = self._model is not None and self.workspace_bytes > 0
        self.wants_temporaries = self._model is not None or self.device_type == "meta"

    def workspace(self, handle: object) -> None:
        """A matmul ran on cuBLAS `handle`: on its first use (or when the workspace size grew since, as
        `torch.backends.cuda.cublas_workspace_size(n)` makes it) allocate it a workspace, kept from then on;
        a smaller one it had is freed after the new one is made, as torch replaces it."""
        held = self.workspaces.get(handle)
        if held is not None and held.size >= self.workspace_bytes:
            return
        made = Workspace(self.workspace_bytes)
        self._follow(made, made.key, made.size)  # the device's own memory, wherever the ledger counts
        self.workspaces[handle] = made
        self.workspaces_ready.add(handle)
        del held  # the smaller one, if any: freed now

    def transient(self, sizes: Sequence[int], during: Callable[[], None] | None = None) -> None:
        """An op's kernel allocated blocks of `sizes` bytes in this order and freed them, in reverse order,
        before returning; `during` (if given) runs while they are all held. Each goes through the allocator's
        model, attributed to the ledger's `op`. A size of 0 takes nothing (torch hands out a null pointer)."""
        held: list[Workspace] = []
        self.largest_temporaries = max(self.largest_temporaries, sum(sizes))
        try:
            for size in sizes:
                if size > 0:
                    held.append(self._hold(size))
            if during is not None:
                during()
        finally:
            while held:
                held.pop()  # its last reference: freed now

    def note_bound(self, reason: tuple[str, str] | None) -> None:
        """An op ran whose figure is not a card's to the byte, for `reason` (`cudnn.bound`); None: it is."""
        if reason is not None:
            self.bounds[reason] = self.bounds.get(reason, 0) + 1

    def _hold(self, size: int) -> Workspace:
        made = Workspace(size)
        self._follow(made, made.key, size)
        return made

    def clear_workspaces(self) -> None:
        """`private_torch.clear_cublas_workspaces()`: every workspace is freed (its blocks cached)."""
        self.workspaces.clear()
        self.workspaces_ready.clear()
