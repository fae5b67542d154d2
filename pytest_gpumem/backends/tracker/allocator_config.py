"""The allocator model's settings, read from `PYTORCH_CUDA_ALLOC_CONF` as torch 2.13 reads it, and its constants."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from pytest_gpumem.errors import GpuMemError

__all__ = ["AllocatorSettings"]

MiB: Final = 1 << 20
MIN_BLOCK: Final = 512  # kMinBlockSize
SMALL_SIZE: Final = MiB  # kSmallSize: the largest small-pool request
SMALL_BUFFER: Final = 2 * MiB  # kSmallBuffer: a small-pool segment, and an expandable small page
MIN_LARGE_ALLOC: Final = 10 * MiB  # kMinLargeAlloc: below it a large request gets a whole large segment
ROUND_LARGE: Final = 2 * MiB  # kRoundLarge
LARGE_SEGMENT: Final = 20 * MiB  # kLargeBuffer: the default large_segment_size
INTERVALS: Final = 16  # kRoundUpPowerOfTwoIntervals: [1 MiB, 2 MiB) ... [32 GiB, ...)
ONE_EXABYTE: Final = 1 << 60
UNLIMITED: Final = (1 << 64) - 1  # SIZE_MAX: max_split_size when unset
ENV: Final = "PYTORCH_CUDA_ALLOC_CONF"

# Keys torch 2.13 accepts (AcceleratorAllocatorConfig::getKeys and CUDAAllocatorConfig::getKeys) that do
# not change the device allocator's figures here: accepted, validated as torch validates them, reported
# in `AllocatorSettings.ignored`.
_BOOL_KEYS: Final = frozenset(
    {
        "pinned_use_background_threads",
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "graph_capture_record_stream_reuse",
        "pinned_free_catch_all",
        "throw_on_cudamalloc_oom",
    }
)
_SIZE_KEYS: Final = frozenset({"pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"})


# ------------------------------------------------------------------------------------------- settings


def _canonical_divisions(values: tuple[int, ...]) -> tuple[int, ...]:
    """() when no interval rounds, (d,) when all intervals use d, else all 16 values."""
    if len(values) > INTERVALS:
        raise GpuMemError(f"roundup_power2_divisions: at most {INTERVALS} intervals, got {len(values)}")
    for value in values:
        if value < 0 or (value & (value - 1)):
            raise GpuMemError(f"roundup_power2_divisions: {value} is not 0 or a power of 2")
    if not values:
        return ()
    full = values + (values[-1],) * (INTERVALS - len(values))
    if all(v <= 1 for v in full):  # 0 and 1 both mean "no power-of-two rounding" (round_size)
        return ()
    return (full[0],) if len(set(full)) == 1 else full


@dataclass(frozen=True)
class AllocatorSettings:
    """The settings of the caching allocator that change its figures, as `PYTORCH_CUDA_ALLOC_CONF` gives them.

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

    def __post_init__(self) -> None:
        object.__setattr__(self, "roundup_power2_divisions", _canonical_divisions(tuple(self.roundup_power2_divisions)))
        if self.max_split_size is not None and self.max_split_size <= 0:
            raise GpuMemError(f"max_split_size must be a positive number of bytes, got {self.max_split_size}")
        if self.large_segment_size <= 0:
            raise GpuMemError(f"large_segment_size must be a positive number of bytes, got {self.large_segment_size}")

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
    def parse(cls, text: str | None) -> AllocatorSettings:
        """Settings from a `PYTORCH_CUDA_ALLOC_CONF` value, read as torch 2.13 reads it (None or "": defaults).

        Keys torch accepts but the model does not use are kept in `ignored`; a malformed value, a key torch
        does not know or `backend:cudaMallocAsync` raise GpuMemError with one line.
        """
        if not text or not text.strip():
            return cls()
        return _Parser(text).settings()

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> AllocatorSettings:
        """The settings a process with `environ` gets: `PYTORCH_CUDA_ALLOC_CONF`, else `PYTORCH_ALLOC_CONF`
        (torch 2.13 reads the first that is set); errors name the variable read."""
        for variable in (ENV, "PYTORCH_ALLOC_CONF"):
            text = environ.get(variable)
            if text is not None:
                return cls() if not text.strip() else _Parser(text, variable).settings()
        return cls()

    def describe(self) -> str:
        """The settings that change figures, e.g. "max_split_size_mb:128, expandable_segments"; "" for the defaults."""
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
        return ", ".join(parts)


def _mb(nbytes: int) -> str:
    return str(nbytes // MiB) if nbytes % MiB == 0 else f"{nbytes / MiB:g}"


class _Parser:
    """`PYTORCH_CUDA_ALLOC_CONF` in torch's tokens (ConfigTokenizer): keys, values and , : [ ] ; blanks dropped."""

    def __init__(self, text: str, variable: str = ENV) -> None:
        self.variable = variable
        self.tokens: list[str] = []
        buffer = ""
        for ch in text:
            if ch in ",:[]":
                if buffer:
                    self.tokens.append(buffer)
                    buffer = ""
                self.tokens.append(ch)
            elif not ch.isspace():
                buffer += ch
        if buffer:
            self.tokens.append(buffer)
        self.max_split: int | None = None
        self.non_split_rounding: int | None = None
        self.rounded: tuple[int, ...] = ()
        self.expandable = False
        self.ignored: list[str] = []

    # -- token helpers
    def fail(self, message: str) -> GpuMemError:
        return GpuMemError(f"{self.variable}: {message}")

    def bad(self, key: str, value: str, why: str) -> GpuMemError:
        return self.fail(f"invalid value {value!r} for {key} ({why})")

    def token(self, i: int, key: str) -> str:
        if i >= len(self.tokens):
            raise self.fail(f"{key} has no value")
        return self.tokens[i]

    def colon(self, i: int, key: str) -> None:
        if i >= len(self.tokens) or self.tokens[i] != ":":
            raise self.fail(f"expected ':' after {key}")

    def integer(self, key: str, value: str) -> int:
        if not value.isdigit():
            raise self.bad(key, value, "expected a whole number")
        return int(value)

    def boolean(self, key: str, value: str) -> bool:
        if value not in ("True", "False"):
            raise self.bad(key, value, "expected True or False")
        return value == "True"

    def number(self, key: str, value: str) -> float:
        try:
            result = float(value)
        except ValueError:
            raise self.bad(key, value, "expected a number") from None
        if result != result or result in (float("inf"), float("-inf")):
            raise self.bad(key, value, "expected a finite number")
        return result

    def settings(self) -> AllocatorSettings:
        tokens = self.tokens
        large = self.large_segment()
        i = 0
        while i < len(tokens):
            key = tokens[i]
            if key in ",:[]":
                raise self.fail(f"expected a key at {''.join(tokens[i:])!r}")
            self.colon(i + 1, key)
            i += 2
            value = self.token(i, key)
            if key == "roundup_power2_divisions":
                self.rounded, i = self.divisions(i)
            elif key == "expandable_segments":
                self.expandable = self.boolean(key, value)
            elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):
                self.limit(key, value, large)
            elif key != "large_segment_size_mb":  # read first, by large_segment()
                self.accepted(key, value)
            i += 1
            if i < len(tokens):
                if tokens[i] != ",":
                    raise self.fail(f"expected ',' after {key}:{value}, got {tokens[i]!r}")
                i += 1  # a trailing ',' is accepted, as torch accepts it
        return AllocatorSettings(
            max_split_size=self.max_split,
            roundup_power2_divisions=self.rounded,
            expandable_segments=self.expandable,
            ignored=tuple(self.ignored),
            large_segment_size=large,
            max_non_split_rounding_size=self.non_split_rounding,
        )

    def large_segment(self) -> int:
        """large_segment_size_mb in bytes, read before the other keys: the limits of max_split_size_mb and
        max_non_split_rounding_mb depend on it (AcceleratorAllocatorConfig::parseArgs)."""
        tokens = self.tokens
        large = LARGE_SEGMENT
        for i, token in enumerate(tokens):
            if token == "large_segment_size_mb" and (i == 0 or tokens[i - 1] == ","):
                self.colon(i + 1, token)
                value = self.token(i + 2, token)
                mb = self.integer(token, value)
                if mb <= MIN_LARGE_ALLOC // MiB:
                    raise self.bad(token, value, f"must be more than {MIN_LARGE_ALLOC // MiB} MiB")
                large = mb * MiB
        return large

    def limit(self, key: str, value: str, large: int) -> None:
        """max_split_size_mb or max_non_split_rounding_mb: whole MiB, at least the large segment size."""
        mb = self.integer(key, value)
        if mb < large // MiB:
            raise self.bad(key, value, f"must be at least {large // MiB} MiB, the large segment size")
        if key == "max_split_size_mb":
            self.max_split = mb * MiB
        else:
            self.non_split_rounding = mb * MiB

    def accepted(self, key: str, value: str) -> None:
        """A key torch accepts that changes no figure here: validated as torch validates it, kept in `ignored`."""
        if key == "backend":
            if value in ("cudaMallocAsync", "hipMallocAsync"):
                raise self.fail(
                    f"backend:{value} (the driver's stream-ordered allocator) is not modelled; only the "
                    "native caching allocator is"
                )
            if value != "native":
                raise self.bad(key, value, "torch knows native and cudaMallocAsync")
        elif key == "garbage_collection_threshold":
            if not 0.0 < self.number(key, value) < 1.0:
                raise self.bad(key, value, "must be in (0.0, 1.0)")
        elif key == "per_process_memory_fraction":
            if not 0.0 <= self.number(key, value) <= 1.0:
                raise self.bad(key, value, "must be in [0.0, 1.0]")
        elif key in _BOOL_KEYS:
            self.boolean(key, value)
        elif key in _SIZE_KEYS:
            self.integer(key, value)
        elif key == "pinned_num_register_threads":
            threads = self.integer(key, value)
            if threads == 0 or threads & (threads - 1) or threads > 128:
                raise self.bad(key, value, "must be a power of 2 up to 128")
        elif key == "pinned_reserve_segment_size_mb":
            if self.integer(key, value) == 0:
                raise self.bad(key, value, "must be more than 0")
        else:
            raise self.fail(f"unrecognized key {key!r} (torch 2.13 rejects it too)")
        self.ignored.append(key)

    def divisions(self, i: int) -> tuple[tuple[int, ...], int]:
        """roundup_power2_divisions from token i: one value for all intervals, or [MiB:d,...,>:d]."""
        key = "roundup_power2_divisions"
        tokens = self.tokens
        if tokens[i] != "[":
            value = tokens[i]
            d = self.integer(key, value)
            if d == 0 or d & (d - 1):
                raise self.bad(key, value, "the divisions must be a power of 2")
            return (d,) * INTERVALS, i
        table = [0] * INTERVALS
        first = True
        last = 0
        i += 1
        while True:
            boundary = self.token(i, key)
            if boundary == "]":
                return tuple(table), i
            self.colon(i + 1, f"{key} interval {boundary}")
            value = self.token(i + 2, key)
            d = self.integer(key, value)
            if d & (d - 1):
                raise self.bad(key, value, "the divisions must be a power of 2, or 0 for none")
            if boundary == ">":
                table[last + 1 :] = [d] * (INTERVALS - last - 1)
            else:
                mb = self.integer(key, boundary)
                if mb == 0 or mb & (mb - 1):
                    raise self.bad(key, boundary, "the interval must be a power of 2 MiB")
                index = min(mb.bit_length() - 1, INTERVALS - 1)
                if first:
                    table[:index] = [d] * index
                    first = False
                table[index] = d
                last = index
            i += 3
            closing = self.token(i, key)
            if closing == ",":
                i += 1
            elif closing != "]":
                raise self.fail(f"expected ',' or ']' in {key}, got {closing!r}")
