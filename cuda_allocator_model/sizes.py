"""Sizes in bytes: parse "1.5 GiB" / "800 MB" / 4096, and format bytes for people."""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

from cuda_allocator_model.errors import ModelError

_DECIMAL_PREFIXES = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
_BINARY_PREFIXES = {"k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_SIZE_RE = re.compile(r"^\s*(?P<number>[-+]?[0-9]*\.?[0-9]+)\s*(?P<unit>[A-Za-z]*)\s*$")
_UNITS_HELP = "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB"

MAX_BYTES = 2**63 - 1
"""The largest size accepted: sizes travel as JSON integers, which other readers hold in 64 bits."""

MAX_TEXT = 100
"""The longest size string read (a size needs a few digits and a unit, never more)."""


def _unit_factor(unit: str) -> int | None:
    unit = unit.lower()
    if unit == "":
        return 1
    if not unit.endswith("b"):
        return None
    prefix, binary = unit[:-1], False
    if prefix.endswith("i"):
        prefix, binary = prefix[:-1], True
    if len(prefix) > 1:
        return None
    table = _BINARY_PREFIXES if binary else _DECIMAL_PREFIXES
    return table.get(prefix)


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as "1.5 GiB", "800MB", "4096" (units case-insensitive)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ModelError(f"size must be an int (bytes) or a string like '64 MiB', got {shorten(value)}")
    if isinstance(value, int):
        if value < 0:
            raise ModelError(f"size must not be negative, got {shorten(value)}")
        return _bounded(value, value)
    if len(value) > MAX_TEXT:
        raise ModelError(f"size text must be at most {MAX_TEXT} characters, got {shorten(value)}")
    match = _SIZE_RE.match(value)
    if match is None:
        raise ModelError(f"cannot read size {value!r}: expected a number and a unit ({_UNITS_HELP})")
    factor = _unit_factor(match["unit"])
    if factor is None:
        raise ModelError(f"unknown unit {match['unit']!r} in size {value!r}: use one of {_UNITS_HELP}")
    try:
        number = Decimal(match["number"])
    except InvalidOperation:  # pragma: no cover - the regex admits only decimals
        raise ModelError(f"cannot read size {value!r}") from None
    if number < 0:
        raise ModelError(f"size must not be negative, got {value!r}")
    return _bounded(int(number * factor), value)


def _bounded(size: int, value: object) -> int:
    if size > MAX_BYTES:
        raise ModelError(f"size must be below 2**63 bytes, got {shorten(value)}")
    return size


def shorten(value: object, limit: int = 60) -> str:
    """A value a message names, as one short line: `repr(value)`, cut in the middle when longer than
    `limit`, with its length ('99999...99999 GiB' (5,004 characters)); a module or a tensor by its kind and
    a collection of them by its length and first items (their reprs run over many lines); a repr over
    several lines folded into one; a repr that raises named by its type."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > _REPR_BITS:
        return integer_words(value)
    kind = _kind(value)
    if kind is not None:
        return kind
    try:
        text = repr(value)
    except Exception:
        return f"<a {type(value).__name__} whose repr raised>"
    if "\n" in text:
        text = " ".join(text.split())
    if len(text) <= limit:
        return text
    half = (limit - 5) // 2
    what = "digits" if isinstance(value, int) else "characters"
    size = len(text) - (value < 0 if isinstance(value, int) else 2)
    return f"{text[:half]}...{text[-half:]} ({size:,} {what})"


def _kind(value: object) -> str | None:
    """'a Linear module', 'a Tensor of float32[2, 3]', 'a list of 3 (a Parameter of ..., ...)'; None for a
    value whose repr says it in one line."""
    kind = type(value).__name__
    if hasattr(value, "named_parameters") and callable(value.named_parameters):
        return f"a {kind} module"
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"a {kind} of {str(dtype).removeprefix('torch.')}{list(shape)}"
    if isinstance(value, (list, tuple, set, frozenset)) and any(not _plain(v) for v in value):
        items = list(value)
        shown = ", ".join(shorten(v) for v in items[:2]) + (", ..." if len(items) > 2 else "")
        return f"a {kind} of {len(items)} ({shown})"
    return None


def _plain(value: object) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def integer_words(value: int) -> str:
    """'an integer of 5,001 digits': an integer named by its length, which str() cannot print past
    sys.get_int_max_str_digits()."""
    size = abs(value)
    digits = max(1, math.floor(size.bit_length() * math.log10(2)))  # within one of the count, never above it
    while 10**digits <= size:
        digits += 1
    return f"{'a negative' if value < 0 else 'an'} integer of {digits:,} digits"


_REPR_BITS = 10_000
"""Integers longer than this are described, not printed (about 3,000 digits, under Python's 4,300 limit)."""


def is_binary(value: object) -> bool:
    """Whether a size was written with binary units (KiB, MiB, ...), to echo it back in the same family."""
    return not isinstance(value, str) or "i" in value.lower().strip().lstrip("0123456789. ")[:2]


def format_size(n: int, binary: bool = True) -> str:
    """'0 B', '512 B', '1.5 KiB' (binary) or '41.9 MB' (decimal); negative numbers keep their sign."""
    sign, n = ("-", -n) if n < 0 else ("", n)
    base, units = (1024, ("KiB", "MiB", "GiB", "TiB")) if binary else (1000, ("kB", "MB", "GB", "TB"))
    if n < base:
        return f"{sign}{n} B"
    value = float(n)
    for unit in units:
        value /= base
        if value < base or unit == units[-1]:
            return f"{sign}{value:.1f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover
