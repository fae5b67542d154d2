"""`PYTORCH_CUDA_ALLOC_CONF` (and the variables torch reads beside it) read as a CUDA build of torch 2.13
reads it (`c10/core/AllocatorConfig.{h,cpp}`: `ConfigTokenizer` and `AcceleratorAllocatorConfig::parseArgs`;
`c10/cuda/CUDAAllocatorConfig.{h,cpp}`: `CUDAAllocatorConfig::parseArgs`): tokens split at `, : [ ]` with C
blanks dropped; a key's value is the token two after it and the next key two after that, whatever separates
them (torch checks only that a token is there); numbers are `std::stoull` (`_whole`) and `std::stod`
(`_real`); a size in MiB is clamped to SIZE_MAX / 1 MiB; with the CUDA parser loaded every key outside the
two key lists is an error. A value torch refuses raises ModelError, one line.
"""

from __future__ import annotations

import re
import sys
from typing import Final

from cuda_allocator_model.constants import INTERVALS, LARGE_SEGMENT, MIN_LARGE_ALLOC, UNLIMITED, MiB
from cuda_allocator_model.errors import ModelError
from cuda_allocator_model.sizes import shorten

__all__ = ["CUDA_VARIABLES", "ENV", "GENERIC_VARIABLES", "ConfParser"]

_MAX_MB: Final = UNLIMITED // MiB  # a size in MiB is clamped to it (max_allowed_split_size_mb)
ENV: Final = "PYTORCH_CUDA_ALLOC_CONF"
# AcceleratorAllocatorConfig::instance reads the first of these that is set (the generic keys) ...
GENERIC_VARIABLES: Final = (ENV, "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# ... and a CUDA build's CUDAAllocatorConfig::instance the first of these (backend, per_process_memory_fraction)
CUDA_VARIABLES: Final = (ENV, "PYTORCH_ALLOC_CONF")

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


class ConfParser:
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
        self.large = LARGE_SEGMENT
        self.max_split: int | None = None
        self.non_split_rounding: int | None = None
        self.divisions = [0] * INTERVALS
        self.expandable = False
        self.fraction = 1.0
        self.ignored: list[str] = []

    def read(self, generic: bool, cuda: bool) -> ConfParser:
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
