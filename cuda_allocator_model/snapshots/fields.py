"""A snapshot's fields checked as the reader takes them: each of its type (a bool is no int) and range, its
text made printable, its lists no longer than the file's bytes allow; `Refuse` says what is wrong, before
the reader puts the file's name in front."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, TypeVar

__all__ = ["Budget", "Refuse", "article", "bounded", "field", "kind_of", "printable", "record_list", "text"]

_T = TypeVar("_T")


class Refuse(Exception):
    """What was wrong, before the file's name is put in front."""


def kind_of(value: object) -> str:
    return type(value).__name__


def article(name: str) -> str:
    return f"an {name}" if name[:1] in "aeiou" else f"a {name}"


def field(record: Mapping[Any, Any], key: str, kind: type[_T], where: str, default: Any = ...) -> _T:
    """`record[key]`, of type `kind` (bool is no int), or `default` when absent (no default: required)."""
    if key not in record:
        if default is ...:
            raise Refuse(f"{where} has no {key!r}: not a snapshot's shape")
        return default  # type: ignore[no-any-return]
    value = record[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        if default is not ... and value is None:
            return default  # type: ignore[no-any-return]
        raise Refuse(f"{where}: {key!r} is {article(kind_of(value))}, not {article(kind.__name__)}")
    return value


class Budget:
    """The list items a file may make the reader visit: no more than the pickle has bytes (every item takes
    one at least), so that lists shared between devices or segments cannot multiply the work."""

    def __init__(self, extent: int) -> None:
        self.left = extent + 1024

    def spend(self, items: int, where: str) -> None:
        self.left -= items
        if self.left < 0:
            raise Refuse(f"{where}: more items than the file's bytes can hold (lists shared between records)")


def record_list(value: object, where: str, budget: Budget) -> list[Mapping[Any, Any]]:
    if not isinstance(value, list):
        raise Refuse(f"{where} is {article(kind_of(value))}, not a list")
    budget.spend(len(value), where)
    if any(type(item) is not dict for item in value):
        i, item = next((i, item) for i, item in enumerate(value) if not isinstance(item, dict))
        raise Refuse(f"{where}[{i}] is {article(kind_of(item))}, not a dict")
    return value


def printable(text: str) -> str:
    """`text` with nothing a terminal would act on: a control character becomes its picture (ESC is '␛'),
    anything else unprintable (a lone surrogate, a format character) U+FFFD."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _PICTURES.get(c, "\ufffd") for c in text)


_PICTURES: Final = {chr(i): chr(0x2400 + i) for i in range(32)} | {"\x7f": "\u2421"}


def text(record: Mapping[Any, Any], key: str, where: str, default: Any = ...) -> str:
    value = field(record, key, str, where, default)
    return value if value is None else printable(value)


def bounded(record: Mapping[Any, Any], key: str, where: str, top: int, default: Any = ...) -> int:
    """An int field within [0, top)."""
    value = field(record, key, int, where, default)
    if value is not None and not 0 <= value < top:
        raise Refuse(f"{where}: {key!r} is {_number(value)}, outside [0, {top:,})")
    return value


def _number(value: int) -> str:
    return f"{value:,}" if abs(value) < 1 << 128 else f"a {value.bit_length()}-bit number"
