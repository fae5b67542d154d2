"""A tensor and a card as a kernel's launch sees them: `Layout` (shape, strides in elements, dtype name,
storage offset) and `Gpu` (SMs, threads per SM), the terms every kernel temporaries' rule is written in."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cuda_allocator_model import Card

ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}
HALF = frozenset(("float16", "bfloat16"))
INTEGRAL = frozenset(("bool", "uint8", "int8", "int16", "int32", "int64"))
WARP = 32


def dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Layout:
    """A tensor as a kernel sees it: shape, strides (in elements), dtype name ('float32') and storage offset."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    offset: int = 0

    @classmethod
    def of(cls, tensor: Any) -> Layout:
        """The layout of a torch tensor (any object with `shape`, `stride()`, `dtype`, `storage_offset()`)."""
        shape = tuple(int(n) for n in tensor.shape)
        return cls(shape, tuple(int(s) for s in tensor.stride()), dtype_name(tensor.dtype), tensor.storage_offset())

    @classmethod
    def contiguous(cls, shape: Sequence[int], dtype: str) -> Layout:
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= size
        return cls(tuple(shape), tuple(reversed(strides)), dtype)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE.get(self.dtype, 0)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        """torch's `is_contiguous()`: row-major, dims of size 1 (and empty tensors) aside."""
        if self.numel == 0:
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if size != 1:
                if stride != expected:
                    return False
                expected *= size
        return True


@dataclass(frozen=True)
class Gpu:
    """What a launch config reads of the card: its SMs and the threads one SM holds."""

    sm_count: int
    threads_per_sm: int


DEFAULT_GPU = Gpu(108, 2048)
"""An A100's SMs: the card a prediction assumes when none is named (as for the cuBLAS workspace)."""


def gpu_of(card: Card | None) -> Gpu:
    """The launch-config figures of `card` (`DEFAULT_GPU` for None)."""
    return DEFAULT_GPU if card is None else Gpu(card.sm_count, card.threads_per_sm)
