"""Checks of JSON read back into typed results: exact keys, byte counts, and a short echo of a bad value."""

from __future__ import annotations

from collections.abc import Callable
from json.encoder import encode_basestring
from typing import Any

from cuda_allocator_model import MAX_BYTES, integer_words
from pytest_gpumem.errors import GpuMemError


def check_bytes(value: object, what: str) -> None:
    """``ValueError`` unless ``value`` is an int byte count, ``0 <= value <= MAX_BYTES``."""
    if type(value) is not int or not 0 <= value <= MAX_BYTES:
        raise ValueError(f"{what}: expected an integer 0 <= n < 2**63 (bytes), got {short(value)}")


def signed_bytes(value: object) -> bool:
    """A byte difference: an int with ``-MAX_BYTES <= value <= MAX_BYTES``."""
    return type(value) is int and -MAX_BYTES <= value <= MAX_BYTES


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


class OffShape(GpuMemError, ValueError):
    """A value read back that is not what pytest-gpumem writes there; the message names its JSON path."""


def refuse(where: str, expected: str, value: object) -> OffShape:
    """`tests[3].call.peak_bytes must be an integer of bytes, got '12'`."""
    return OffShape(f"{where} must be {expected}, got {short(value)}")


def fields(obj: object, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """``obj`` as an object with every ``required`` key, perhaps ``optional`` ones, and no other."""
    if not isinstance(obj, dict):
        raise refuse(where, "an object", obj)
    missing = next((key for key in required if key not in obj), None)
    if missing is not None:
        raise OffShape(f"{where} has no {json_key(missing)}")
    unknown = next((key for key in obj if key not in required and key not in optional), None)
    if unknown is not None:
        raise OffShape(f"{where} has an unknown key {json_key(str(unknown))}")
    return obj


def count(value: object, where: str, low: int = 0, what: str = "an integer of bytes") -> int:
    """An integer ``low <= value <= MAX_BYTES`` (``what`` says what it counts); no bool, float or string."""
    if type(value) is not int or not low <= value <= MAX_BYTES:
        raise refuse(where, what, value)
    return value


def signed(value: object, where: str) -> int:
    if not signed_bytes(value):
        raise refuse(where, "an integer of bytes (negative where freed)", value)
    assert isinstance(value, int)
    return value


def text(value: object, where: str, what: str = "a string") -> str:
    if not isinstance(value, str):
        raise refuse(where, what, value)
    return value


def listed(value: object, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise refuse(where, "a list", value)
    return value


def texts(value: object, where: str) -> list[str]:
    """A list of strings, each checked (the bad one named by its index)."""
    return [text(item, f"{where}[{i}]") for i, item in enumerate(listed(value, where))]


def first_difference(
    read: object, written: object, where: str, path: Callable[[str, str], str] | None = None
) -> tuple[str, object] | None:
    """Where ``read`` (a report's value) and ``written`` (what the value read from it writes) first
    differ, in type or value: the JSON path (a key's written by `path`, `member` unless given) and the value
    read there; None where they are the same JSON.
    Walked with a stack of its own: a value as deep as JSON is read is compared too. A node is `(read,
    written, its parent's node, its key)`: the path is spelled only for the difference found."""
    stack: list[_Node] = [(read, written, None, where)]
    while stack:
        node = stack.pop()
        a, b = node[0], node[1]
        if type(a) is not type(b):
            return _spelled(node, path or member), a
        if type(a) is dict:
            if a.keys() != b.keys():
                return _spelled(node, path or member), a
            stack += reversed([(x, b[k], node, k) for k, x in a.items() if not _same(x, b[k])])
        elif type(a) is list:
            if len(a) != len(b):
                return _spelled(node, path or member), a
            stack += reversed([(x, y, node, i) for i, (x, y) in enumerate(zip(a, b, strict=True)) if not _same(x, y)])
        elif a != b:
            return _spelled(node, path or member), a
    return None


_Node = tuple[Any, Any, Any, str | int]
_SCALARS = (str, int, float, bool, type(None))


def _same(a: object, b: object) -> bool:
    """The same JSON, seen without walking: one object (a value taken whole), or equal scalars of one type."""
    return a is b or (type(a) is type(b) and type(a) in _SCALARS and a == b)


def _spelled(node: _Node, path: Callable[[str, str], str]) -> str:
    keys: list[str | int] = []
    while node[2] is not None:
        keys.append(node[3])
        node = node[2]
    at = str(node[3])
    for key in reversed(keys):
        at = f"{at}[{key}]" if isinstance(key, int) else path(at, key)
    return at


def member(where: str, key: str) -> str:
    """The JSON path of `key` under `where`: `.key` where `key` is a name, else `["key"]`."""
    return f"{where}.{key}" if key.isascii() and key.isidentifier() else f"{where}[{json_key(key)}]"
