"""Checks of JSON read back into typed results: exact keys, byte counts, and a short echo of a bad value."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import Any

from cuda_allocator_model import MAX_BYTES, integer_words
from pytest_gpumem.errors import GpuMemError


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


class Unplaced(Exception):
    """A refusal met while reading without paths (`where` None), which is fast: the reader reads again
    with them, to say where."""


def refuse(where: str, expected: str, value: object) -> OffShape:
    """`tests[3].call.peak_bytes must be an integer of bytes, got '12'`."""
    return OffShape(f"{where} must be {expected}, got {short(value)}")


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


@dataclass(frozen=True)
class Wording:
    """How an error says where and what: templates with `{where}`, `{expected}`, `{value}`, `{key}` (`key`
    written by `quote`), the path of a field (`where.key`; `key` alone under the root, `""` or `top`), the
    path of a mapping's key (`member`), and the error it raises."""

    wrong: str
    missing: str
    unknown: str
    rewritten: str
    quote: Callable[[str], str]
    member: Callable[[str, str], str]
    error: Callable[[str], ValueError] = OffShape
    top: str = ""

    def field(self, where: str, key: str) -> str:
        return f"{where}.{key}" if where and where != self.top else key

    def path(self, where: str, key: str) -> str:
        """The path of `key` under `where`, a field's or a mapping's by the look of the key."""
        return self.field(where, key) if key.isascii() and key.isidentifier() else self.member(where, key)

    def refuse(self, where: str | None, expected: str, value: object) -> Exception:
        return self._say(self.wrong, where, expected=expected, value=value)

    def no_key(self, where: str | None, key: str) -> Exception:
        return self._say(self.missing, where, key=key)

    def unknown_key(self, where: str | None, key: str) -> Exception:
        return self._say(self.unknown, where, key=key)

    def not_as_written(self, where: str, value: object) -> Exception:
        return self._say(self.rewritten, where, value=value)

    def says(self, where: str | None, problem: str) -> Exception:
        """`where: problem`, in this wording's error."""
        return Unplaced() if where is None else self.error(f"{where}: {problem}")

    def _say(self, template: str, where: str | None, **words: Any) -> Exception:
        """The error, or `Unplaced` where there is no path (the words are made only for an error)."""
        if where is None:
            return Unplaced()
        if "key" in words:
            words["key"] = self.quote(words["key"])
        if "value" in words:
            words["value"] = short(words["value"])
        return self.error(template.format(where=where, **words).removeprefix(": "))


REPORT = Wording(
    wrong="{where} must be {expected}, got {value}",
    missing="{where} has no {key}",
    unknown="{where} has an unknown key {key}",
    rewritten="{where} is not as pytest-gpumem writes it, got {value}",
    quote=json_key,
    member=member,
)
"""A report's words: `tests[0].call has no "count"`, `tests[0].call.count must be ..., got '1'`."""

STORED = Wording(
    wrong="{where}: expected {expected}, got {value}",
    missing="{where}: missing key {key}",
    unknown="{where}: unknown key {key}",
    rewritten="{where}: not as pytest-gpumem writes it, got {value}",
    quote=repr,
    member=lambda where, key: f"{where}[{json_key(key)}]",
    error=ValueError,
)
"""A baseline file's words, a `ValueError` relative to the entry (the file's reader names the entry):
`identity: missing key 'device'`, `phases["forward"]: expected ..., got -1`."""


def wrong_keys(
    value: dict[str, Any], where: str | None, required: tuple[str, ...], allowed: frozenset[str], wording: Wording
) -> Exception:
    """The one exact-keys check's error, for an object whose keys are not every `required` one and perhaps
    others `allowed`: the wording's naming the first missing key, else the first unknown one."""
    missing = next((key for key in required if key not in value), None)
    if missing is not None:
        return wording.no_key(where, missing)
    return wording.unknown_key(where, str(next(key for key in value if key not in allowed)))
