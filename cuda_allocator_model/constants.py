"""The fixed sizes of torch 2.13's CUDA caching allocator (`c10/cuda/CUDACachingAllocator.cpp`'s `k...`
constants) and its pool ids, which the model, its settings and the snapshot reader share."""

from __future__ import annotations

from typing import Final

__all__ = [
    "DEFAULT_POOL",
    "INTERVALS",
    "LARGE_SEGMENT",
    "MIN_BLOCK",
    "MIN_LARGE_ALLOC",
    "ONE_EXABYTE",
    "ROUND_LARGE",
    "SMALL_BUFFER",
    "SMALL_SIZE",
    "UNLIMITED",
    "MiB",
    "PoolId",
]

MiB: Final = 1 << 20
MIN_BLOCK: Final = 512  # kMinBlockSize
SMALL_SIZE: Final = MiB  # kSmallSize: the largest small-pool request
SMALL_BUFFER: Final = 2 * MiB  # kSmallBuffer: a small-pool segment, and an expandable small page
MIN_LARGE_ALLOC: Final = 10 * MiB  # kMinLargeAlloc: below it a large request gets a whole large segment
ROUND_LARGE: Final = 2 * MiB  # kRoundLarge
LARGE_SEGMENT: Final = 20 * MiB  # kLargeBuffer: the default large_segment_size
INTERVALS: Final = 16  # kRoundUpPowerOfTwoIntervals: [1 MiB, 2 MiB) ... [32 GiB, ...)
ONE_EXABYTE: Final = 1 << 60
PoolId = tuple[int, int]  # MempoolId_t: (graph's id, 0) for a CUDA graph's pool, (0, n) for the n-th MemPool
DEFAULT_POOL: Final[PoolId] = (0, 0)
UNLIMITED: Final = (1 << 64) - 1  # SIZE_MAX: max_split_size when unset
