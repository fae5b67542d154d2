"""The allocator model's settings, read from `PYTORCH_CUDA_ALLOC_CONF` as torch 2.13 reads it, and its constants.

Read as a CUDA build of torch 2.13 reads it (`c10/core/AllocatorConfig.{h,cpp}`: `ConfigTokenizer` and
`AcceleratorAllocatorConfig::parseArgs`; `c10/cuda/CUDAAllocatorConfig.{h,cpp}`: `CUDAAllocatorConfig::parseArgs`):
tokens split at `, : [ ]` with C blanks dropped; a key's value is the token two after it and the next key two
after that, whatever separates them (torch checks only that a token is there); numbers are `std::stoull`
(`_whole`) and `std::stod` (`_real`); a size in MiB is clamped to SIZE_MAX / 1 MiB; with the CUDA parser
loaded every key outside the two key lists is an error. A value torch refuses raises ModelError, one line.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from cuda_allocator_model.errors import ModelError
from cuda_allocator_model.sizes import shorten

__all__ = ["DEFAULT_POOL", "AllocatorSettings", "PoolId"]

MiB: Final = 1 << 20
MIN_BLOCK: Final = 512  # kMinBlockSize
SMALL_SIZE: Final = MiB  # kSmallSize: the largest small-pool request
SMALL_BUFFER: Final = 2 * MiB  # kSmallBuffer: a small-pool segment, and an expandable small page
MIN_LARGE_ALLOC: Final = 10 * MiB  # kMinLargeAlloc: below it a large request gets a whole large segment
ROUND_LARGE: Final = 2 * MiB  # kRoundLarge
_LARGE_SEGMENT: Final = 20 * MiB  # kLargeBuffer: the default large_segment_size
INTERVALS: Final = 16  # kRoundUpPowerOfTwoIntervals: [1 MiB, 2 MiB) ... [32 GiB, ...)
ONE_EXABYTE: Final = 1 << 60
PoolId = tuple[int, int]  # MempoolId_t: (graph's id, 0) for a CUDA graph's pool, (0, n) for the n-th MemPool
DEFAULT_POOL: Final[PoolId] = (0, 0)
UNLIMITED: Final = (1 << 64) - 1  # SIZE_MAX: max_split_size when unset
_MAX_MB: Final = UNLIMITED // MiB  # a size in MiB is clamped to it (max_allowed_split_size_mb)
ENV: Final = "PYTORCH_CUDA_ALLOC_CONF"
# AcceleratorAllocatorConfig::instance reads the first of these that is set (the generic keys) ...
_GENERIC_VARIABLES: Final = (ENV, "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# ... and a CUDA build's CUDAAllocatorConfig::instance the first of these (backend, per_process_memory_fraction)
_CUDA_VARIABLES: Final = (ENV, "PYTORCH_ALLOC_CONF")

# Keys torch 2.13 accepts (AcceleratorAllocatorConfig::getKeys and CUDAAllocatorConfig::getKeys) that do
# not change the device allocator's figures here: accepted, validated as torch validates them, reported
# in `AllocatorSettings.ignored`.
_GENERIC_BOOLS: Final = frozenset({"pinned_use_background_threads"})
_GENERIC_SIZES: Final = frozenset({"pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"})
_CUDA_BOOLS: Final = frozenset(
    {
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "graph_capture_record_stream_reuse",
        "pinned_free_catch_all",
        "throw_on_cudamalloc_oom",
    }
)
_GENERIC_KEYS: Final = (
    _GENERIC_BOOLS
    | _GENERIC_SIZES
    | {
        "large_segment_size_mb",
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "garbage_collection_threshold",
        "roundup_power2_divisions",
        "expandable_segments",
    }
)
_CUDA_KEYS: Final = _CUDA_BOOLS | {
    "backend",
    "pinned_reserve_segment_size_mb",
    "pinned_num_register_threads",
    "per_process_memory_fraction",
}
_BLANKS: Final = frozenset(" \t\n\v\f\r")  # std::isspace in the C locale: no other character is dropped
_WHOLE: Final = re.compile(r"([+-]?)([0-9]+)")
_REAL: Final = re.compile(
    r"[+-]?(?:0[xX](?P<hex>(?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+))(?:[pP][+-]?[0-9]+)?"
    r"|(?P<dec>[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
    r"|[iI][nN][fF](?:[iI][nN][iI][tT][yY])?|[nN][aA][nN](?:\([0-9A-Za-z_]*\))?)"
)


# ------------------------------------------------------------------------------------------- settings


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
    large_segment_size: int = _LARGE_SEGMENT  # bytes (large_segment_size_mb)
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
        return _Parser(text or "", variable).read(generic=True, cuda=True).settings()

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> AllocatorSettings:
        """The settings a process with `environ` gets: the generic keys from the first of `_GENERIC_VARIABLES`
        set, the CUDA keys from the first of `_CUDA_VARIABLES` (torch 2.13 reads them so); errors name the
        variable read."""
        generic = next((v for v in _GENERIC_VARIABLES if v in environ), ENV)
        cuda = next((v for v in _CUDA_VARIABLES if v in environ), ENV)
        if generic == cuda:
            return cls.parse(environ.get(generic), generic)
        read = _Parser(environ.get(generic, ""), generic).read(generic=True, cuda=False)
        return read.settings(_Parser(environ.get(cuda, ""), cuda).read(generic=False, cuda=True))

    def describe(self, limits: bool = False) -> str:
        """The settings that change figures, e.g. "max_split_size_mb:128, expandable_segments"; "" for the
        defaults; with `limits`, also those that only limit memory (per_process_memory_fraction)."""
        parts: list[str] = []
        if self.large_segment_size != _LARGE_SEGMENT:
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


class _Refused(Exception):
    """A value torch refuses: why, in words."""


def _whole(token: str) -> int:
    """`std::stoull(token)`: the longest prefix of ASCII digits after an optional sign; a minus wraps around
    2**64; none, or past 2**64 - 1, refused."""
    match = _WHOLE.match(token)
    if match is None:
        raise _Refused("expected a whole number")
    sign, digits = match.groups()
    digits = digits.lstrip("0") or "0"
    if len(digits) > 20 or int(digits) > UNLIMITED:
        raise _Refused("past 2**64 - 1, which std::stoull refuses")
    return -int(digits) % (1 << 64) if sign == "-" else int(digits)


def _real(token: str) -> float:
    """`std::stod(token)`: the longest prefix strtod reads (decimal, hexadecimal, inf, nan); none, or a
    value that overflows or underflows a double, refused."""
    match = _REAL.match(token)
    if match is None:
        raise _Refused("expected a number")
    text, hexadecimal, decimal = match.group(0), match.group("hex"), match.group("dec")
    try:
        value = float.fromhex(text) if hexadecimal is not None else float(text)
    except OverflowError:
        value = float("inf")
    mantissa = hexadecimal if hexadecimal is not None else decimal
    nonzero = mantissa is not None and mantissa.strip("0.") != ""
    if nonzero and not sys.float_info.min <= abs(value) < float("inf"):
        raise _Refused("out of range of a double, which std::stod refuses")
    return value


def _power_of_two(value: int) -> bool:
    return value != 0 and value & (value - 1) == 0


class _Parser:
    """`PYTORCH_CUDA_ALLOC_CONF` read as torch's parsers read it: the generic keys
    (AcceleratorAllocatorConfig::parseArgs), the CUDA keys (CUDAAllocatorConfig::parseArgs), or both."""

    def __init__(self, text: str, variable: str) -> None:
        self.variable = variable
        self.tokens: list[str] = []  # ConfigTokenizer
        buffer = ""
        for ch in text:
            if ch in ",:[]":
                if buffer:
                    self.tokens.append(buffer)
                    buffer = ""
                self.tokens.append(ch)
            elif ch not in _BLANKS:
                buffer += ch
        if buffer:
            self.tokens.append(buffer)
        self.large = _LARGE_SEGMENT
        self.max_split: int | None = None
        self.non_split_rounding: int | None = None
        self.divisions = [0] * INTERVALS
        self.expandable = False
        self.fraction = 1.0
        self.ignored: list[str] = []

    def read(self, generic: bool, cuda: bool) -> _Parser:
        """Walk the tokens, applying the generic keys, the CUDA keys or both; ModelError where torch refuses."""
        try:
            if generic:
                self._large_segment_first()
            i = 0
            while i < len(self.tokens):
                i = self._key(i, generic, cuda)
                i += 2 if i + 1 < len(self.tokens) else 1  # whatever token follows is taken as the ','
        except _Refused as refused:
            raise ModelError(f"{self.variable}: {refused}") from None
        return self

    def settings(self, cuda: _Parser | None = None) -> AllocatorSettings:
        """The settings read, the CUDA keys from `cuda` where another variable gave them."""
        cuda = cuda or self
        return AllocatorSettings(
            max_split_size=self.max_split,
            roundup_power2_divisions=tuple(self.divisions),
            expandable_segments=self.expandable,
            ignored=tuple(self.ignored + (cuda.ignored if cuda is not self else [])),
            large_segment_size=self.large,
            max_non_split_rounding_size=self.non_split_rounding,
            per_process_memory_fraction=cuda.fraction,
        )

    # -- tokens
    def _at(self, i: int, key: str, colon: bool = False) -> str:
        """Token i, which torch asserts is there (Index out of bounds in ConfigTokenizer)."""
        if i >= len(self.tokens):
            raise _Refused(f"expected ':' after {key}" if colon else f"{key} has no value")
        return self.tokens[i]

    def _value(self, i: int, key: str) -> str:
        """The value of the key at token i: the token two after it (the one between is not checked)."""
        self._at(i + 1, key, colon=True)
        return self._at(i + 2, key)

    def _bad(self, key: str, value: str, why: str) -> _Refused:
        return _Refused(f"invalid value {shorten(value)} for {key} ({why})")

    def _whole(self, key: str, value: str) -> int:
        try:
            return _whole(value)
        except _Refused as refused:
            raise self._bad(key, value, str(refused)) from None

    def _real(self, key: str, value: str) -> float:
        try:
            return _real(value)
        except _Refused as refused:
            raise self._bad(key, value, str(refused)) from None

    # -- keys
    def _key(self, i: int, generic: bool, cuda: bool) -> int:
        """Read the key at token i; the index of its value's last token."""
        key = self.tokens[i]
        if key not in _GENERIC_KEYS and key not in _CUDA_KEYS:
            raise _Refused(f"unrecognized key {shorten(key)} (torch 2.13 rejects it too)")
        if key == "large_segment_size_mb" or (key in _GENERIC_KEYS and not generic) or (key in _CUDA_KEYS and not cuda):
            return self._skip(i, key)
        if key == "roundup_power2_divisions":
            return self._divisions(i, key)
        value = self._value(i, key)
        if key in _CUDA_KEYS:
            self._cuda(key, value)
        else:
            self._generic(key, value)
        return i + 2

    def _skip(self, i: int, key: str) -> int:
        """ConfigTokenizer::skipKey: the value, or a list to its ']'."""
        if self._value(i, key) != "[":
            return i + 2
        end = i + 3
        while end < len(self.tokens) and self.tokens[end] != "]":
            end += 1
        if end == len(self.tokens):
            raise _Refused(f"the list of {key} has no ']'")
        return end

    def _large_segment_first(self) -> None:
        """large_segment_size_mb, read before the rest wherever it stands: the limits of max_split_size_mb
        and max_non_split_rounding_mb depend on it."""
        key, i = "large_segment_size_mb", 0
        while i < len(self.tokens):
            if self.tokens[i] == key:
                value = self._value(i, key)
                mb = self._whole(key, value)
                if mb <= MIN_LARGE_ALLOC // MiB:
                    raise self._bad(key, value, f"must be more than {MIN_LARGE_ALLOC // MiB} MiB")
                self.large = min(mb, _MAX_MB) * MiB
                i += 2
            i += 1

    def _generic(self, key: str, value: str) -> None:
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            mb = self._whole(key, value)
            if mb < self.large // MiB:
                raise self._bad(key, value, f"must be at least {self.large // MiB} MiB, the large segment size")
            if key == "max_split_size_mb":
                self.max_split = min(mb, _MAX_MB) * MiB
            else:
                self.non_split_rounding = min(mb, _MAX_MB) * MiB
            return
        if key == "expandable_segments":
            self.expandable = self._boolean(key, value)
            return
        if key == "garbage_collection_threshold":
            if not 0.0 < self._real(key, value) < 1.0:
                raise self._bad(key, value, "must be in (0.0, 1.0)")
        elif key in _GENERIC_BOOLS:
            self._boolean(key, value)
        else:
            self._whole(key, value)
        self.ignored.append(key)

    def _cuda(self, key: str, value: str) -> None:
        if key == "per_process_memory_fraction":
            fraction = self._real(key, value)
            if not 0.0 <= fraction <= 1.0:
                raise self._bad(key, value, "must be in [0.0, 1.0]")
            self.fraction = fraction
            return
        if key == "backend":
            if value in ("cudaMallocAsync", "hipMallocAsync"):
                raise _Refused(
                    f"backend:{value} (the driver's stream-ordered allocator) is not modelled; only the native "
                    "caching allocator is"
                )
            if value != "native":
                raise self._bad(key, value, "torch knows native and cudaMallocAsync")
        elif key in _CUDA_BOOLS:
            self._boolean(key, value)
        elif key == "pinned_num_register_threads":
            threads = self._whole(key, value)
            if not _power_of_two(threads) or threads > 128:
                raise self._bad(key, value, "must be a power of 2 up to 128")
        elif self._whole(key, value) == 0:  # pinned_reserve_segment_size_mb
            raise self._bad(key, value, "must be more than 0")
        self.ignored.append(key)

    def _boolean(self, key: str, value: str) -> bool:
        if value not in ("True", "False"):
            raise self._bad(key, value, "expected True or False")
        return value == "True"

    def _divisions(self, i: int, key: str) -> int:
        """roundup_power2_divisions: one value for every interval, or [MiB:d,...,>:d]; the index of its end."""
        value = self._value(i, key)
        i += 2
        if value != "[":
            d = self._whole(key, value)
            if not _power_of_two(d):
                raise self._bad(key, value, "the divisions must be a power of 2")
            self.divisions = [d] * INTERVALS
            return i
        first, last = True, 0
        while True:
            i += 1
            if i >= len(self.tokens):
                raise _Refused(f"the list of {key} has no ']'")
            if self.tokens[i] == "]":
                return i
            boundary = self.tokens[i]
            value = self._value(i, key)
            i += 2
            d = self._whole(key, value)
            if d != 0 and not _power_of_two(d):
                raise self._bad(key, value, "the divisions must be a power of 2, or 0 for none")
            if boundary == ">":
                self.divisions[last + 1 :] = [d] * (INTERVALS - last - 1)
            else:
                last = self._interval(key, boundary, d, first)
                first = False
            if i + 1 == len(self.tokens):
                raise _Refused(f"the list of {key} has no ']'")
            if self.tokens[i + 1] != "]":
                i += 1  # the ',' after an entry: not checked

    def _interval(self, key: str, boundary: str, d: int, first: bool) -> int:
        """Set the divisions of the interval that starts at `boundary` MiB (the first entry also sets the
        intervals below it); its index."""
        mb = self._whole(key, boundary)
        if not _power_of_two(mb):
            raise self._bad(key, boundary, "the interval must be a power of 2 MiB")
        index = min(mb.bit_length() - 1, INTERVALS - 1)
        if first:
            self.divisions[:index] = [d] * index
        self.divisions[index] = d
        return index
