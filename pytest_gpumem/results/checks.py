"""Checks of JSON read back into typed results: exact keys, byte counts, and a short echo of a bad value."""

from __future__ import annotations

from json.encoder import encode_basestring
from typing import Any

from pytest_gpumem.sizes import integer_words

MAX_BYTES = 2**63
"""Byte counts are integers ``0 <= n < MAX_BYTES``."""


def check_bytes(value: object, what: str) -> None:
    """``ValueError`` unless ``value`` is an int byte count, ``0 <= value < MAX_BYTES``."""
    if type(value) is not int or not 0 <= value < MAX_BYTES:
        raise ValueError(f"{what}: expected an integer 0 <= n < 2**63 (bytes), got {short(value)}")


def signed_bytes(value: object) -> bool:
    """A byte difference: an int with ``-MAX_BYTES < value < MAX_BYTES``."""
    return type(value) is int and -MAX_BYTES < value < MAX_BYTES


def exact_keys(obj: object, where: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """``obj`` as an object with exactly ``keys``; a ``ValueError`` names the first missing or unknown one."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object, got {short(obj)}")
    for k in keys:
        if k not in obj:
            raise ValueError(f"{where}: missing key {k!r}")
    for k in obj:
        if k not in keys:
            raise ValueError(f"{where}: unknown key {k!r}")
    return obj


def json_key(name: str) -> str:
    """A key as JSON writes it (quoted, escaped, non-ASCII kept)."""
    return encode_basestring(name)


def short(value: object, limit: int = 60) -> str:
    """``repr`` cut to ``limit`` characters (a 400-digit number names its digit count)."""
    if type(value) is int and value.bit_length() > 200:
        return integer_words(value)
    try:
        text = repr(value)
    except Exception:
        text = f"<a {type(value).__name__} whose repr raised>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
