"""The allocator model's settings: those of `PYTORCH_CUDA_ALLOC_CONF` that change its figures or limit its
memory (`alloc_conf.py` reads the variable as torch 2.13 reads it), and the card they are applied on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from cuda_allocator_model.alloc_conf import CUDA_VARIABLES, ENV, GENERIC_VARIABLES, ConfParser
from cuda_allocator_model.constants import DEFAULT_POOL, INTERVALS, LARGE_SEGMENT, MiB, PoolId
from cuda_allocator_model.errors import ModelError

__all__ = ["DEFAULT_POOL", "INTERVALS", "AllocatorSettings", "PoolId"]


def _canonical_divisions(values: tuple[int, ...]) -> tuple[int, ...]:
    """() when no interval rounds, (d,) when all intervals use d, else all 16 values."""
    if len(values) > INTERVALS:
        raise ModelError(f"roundup_power2_divisions: at most {INTERVALS} intervals, got {len(values)}")
    for value in values:
        if value < 0 or (value & (value - 1)):
            raise ModelError(f"roundup_power2_divisions: {value} is not 0 or a power of 2")
    if not values:
        return ()
    full = values + (values[-1],) * (INTERVALS - len(values))
    if all(v <= 1 for v in full):  # 0 and 1 both mean "no power-of-two rounding" (round_size)
        return ()
    return (full[0],) if len(set(full)) == 1 else full


@dataclass(frozen=True)
class AllocatorSettings:
    """The settings of the caching allocator that change its figures or limit its memory, as
    `PYTORCH_CUDA_ALLOC_CONF` gives them, and the total memory of the card predicted (`on_card`).

    `roundup_power2_divisions` holds the divisions per power-of-two interval as torch stores them (16
    intervals from 1 MiB, the last open); a shorter tuple repeats its last value, so `(4,)` applies 4 to
    all; it is kept canonical: `()` for none, `(d,)` when uniform, else 16 values.
    """

    max_split_size: int | None = None  # bytes; None: unlimited (max_split_size_mb)
    roundup_power2_divisions: tuple[int, ...] = ()
    expandable_segments: bool = False
    ignored: tuple[str, ...] = ()  # keys torch accepts that the model does not use, in the order given
    large_segment_size: int = LARGE_SEGMENT  # bytes (large_segment_size_mb)
    max_non_split_rounding_size: int | None = None  # bytes; None: the large segment size (max_non_split_rounding_mb)
    per_process_memory_fraction: float = 1.0  # of the card's total memory; 1.0: no limit
    card_total: int | None = None  # the predicted card's total memory (totalGlobalMem); None: no card named

    def __post_init__(self) -> None:
        object.__setattr__(self, "roundup_power2_divisions", _canonical_divisions(tuple(self.roundup_power2_divisions)))
        if self.max_split_size is not None and self.max_split_size <= 0:
            raise ModelError(f"max_split_size must be a positive number of bytes, got {self.max_split_size}")
        if self.large_segment_size <= 0:
            raise ModelError(f"large_segment_size must be a positive number of bytes, got {self.large_segment_size}")
        if not 0.0 <= self.per_process_memory_fraction <= 1.0:
            raise ModelError(f"per_process_memory_fraction must be in [0, 1], got {self.per_process_memory_fraction}")

    @property
    def fraction_limit(self) -> int | None:
        """The reserved bytes past which torch refuses a new segment with `per_process_memory_fraction`: the
        fraction of the card's total (setMemoryFraction, truncated as torch truncates it); None: no limit, or
        no card named to take a fraction of."""
        if self.per_process_memory_fraction >= 1.0 or self.card_total is None:
            return None
        return int(self.per_process_memory_fraction * float(self.card_total))

    def on_card(self, total: int | None) -> AllocatorSettings:
        """The settings on a card of `total` bytes (None: no card named)."""
        return self if total == self.card_total else dataclasses.replace(self, card_total=total)

    @property
    def non_split_rounding(self) -> int:
        """How much bigger than an oversize request a cached oversize block may be and still serve it."""
        return self.large_segment_size if self.max_non_split_rounding_size is None else self.max_non_split_rounding_size

    def divisions_for(self, size: int) -> int:
        """The power-of-two divisions for a request of `size` bytes (roundup_power2_divisions(size))."""
        divisions = self.roundup_power2_divisions
        if not divisions:
            return 0
        if len(divisions) == 1:
            return divisions[0]
        index = min(max(size.bit_length() - 1 - 20, 0), INTERVALS - 1)
        return divisions[index]

    @classmethod
    def parse(cls, text: str | None, variable: str = ENV) -> AllocatorSettings:
        """Settings from a `PYTORCH_CUDA_ALLOC_CONF` value, read as torch 2.13 reads it (None or "": defaults).

        Keys torch accepts but the model does not use are kept in `ignored`; a value torch refuses, a key it
        does not know or `backend:cudaMallocAsync` raise ModelError in one line naming `variable`.
        """
        return _settings(ConfParser(text or "", variable).read(generic=True, cuda=True))

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> AllocatorSettings:
        """The settings a process with `environ` gets: the generic keys from the first of `GENERIC_VARIABLES`
        set, the CUDA keys from the first of `CUDA_VARIABLES` (torch 2.13 reads them so); errors name the
        variable read."""
        generic = next((v for v in GENERIC_VARIABLES if v in environ), ENV)
        cuda = next((v for v in CUDA_VARIABLES if v in environ), ENV)
        if generic == cuda:
            return cls.parse(environ.get(generic), generic)
        read = ConfParser(environ.get(generic, ""), generic).read(generic=True, cuda=False)
        return _settings(read, ConfParser(environ.get(cuda, ""), cuda).read(generic=False, cuda=True))

    def describe(self, limits: bool = False) -> str:
        """The settings that change figures, e.g. "max_split_size_mb:128, expandable_segments"; "" for the
        defaults; with `limits`, also those that only limit memory (per_process_memory_fraction)."""
        parts: list[str] = []
        if self.large_segment_size != LARGE_SEGMENT:
            parts.append(f"large_segment_size_mb:{_mb(self.large_segment_size)}")
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{_mb(self.max_split_size)}")
        if self.max_non_split_rounding_size is not None and self.max_non_split_rounding_size != self.large_segment_size:
            parts.append(f"max_non_split_rounding_mb:{_mb(self.max_non_split_rounding_size)}")
        if len(self.roundup_power2_divisions) == 1:
            parts.append(f"roundup_power2_divisions:{self.roundup_power2_divisions[0]}")
        elif self.roundup_power2_divisions:
            parts.append(f"roundup_power2_divisions:[{','.join(map(str, self.roundup_power2_divisions))}]")
        if self.expandable_segments:
            parts.append("expandable_segments")
        if limits and self.per_process_memory_fraction < 1.0:
            parts.append(
                f"per_process_memory_fraction:{self.per_process_memory_fraction!r} (applied where a card is named, "
                "to its total memory; not applied where none is)"
            )
        return ", ".join(parts)


def _mb(nbytes: int) -> str:
    return str(nbytes // MiB) if nbytes % MiB == 0 else f"{nbytes / MiB:g}"


def _settings(read: ConfParser, cuda: ConfParser | None = None) -> AllocatorSettings:
    """The settings `read` gives, the CUDA keys from `cuda` where another variable gave them."""
    cuda = cuda or read
    return AllocatorSettings(
        max_split_size=read.max_split,
        roundup_power2_divisions=tuple(read.divisions),
        expandable_segments=read.expandable,
        ignored=tuple(read.ignored + (cuda.ignored if cuda is not read else [])),
        large_segment_size=read.large,
        max_non_split_rounding_size=read.non_split_rounding,
        per_process_memory_fraction=cuda.fraction,
    )
