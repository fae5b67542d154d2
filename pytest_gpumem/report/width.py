"""Text measured in screen columns, as a terminal shows it: the one place the report pads and cuts.

A character of East Asian width W or F (日本, most emoji) takes two columns, a combining mark or a
zero-width format character none, any other one; `len` counts characters, so a test named in Japanese
would overflow its column. Cuts never split a character from the marks that combine with it.
"""

from __future__ import annotations

import unicodedata
from functools import lru_cache

ELLIPSIS = "…"  # one column (East Asian width A, narrow outside East Asian locales)


@lru_cache(maxsize=4096)
def _char_width(char: str) -> int:
    """The columns `char` takes: 2 for wide and fullwidth, 0 for combining marks and zero-width format
    characters (the soft hyphen excepted: terminals show it), else 1."""
    if unicodedata.combining(char) or unicodedata.category(char) in ("Mn", "Me") or _zero_format(char):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def _zero_format(char: str) -> bool:
    return unicodedata.category(char) == "Cf" and char != "\u00ad"


def display_width(text: str) -> int:
    """The columns `text` takes on a terminal."""
    return len(text) if text.isascii() else sum(map(_char_width, text))


def pad(text: str, width: int, right: bool = False) -> str:
    """`text` with spaces up to `width` columns, on the left when `right` (figures align right)."""
    fill = " " * max(width - display_width(text), 0)
    return fill + text if right else text + fill


def head(text: str, width: int) -> str:
    """The longest start of `text` within `width` columns, with the marks that combine with its last
    character."""
    if text.isascii():
        return text[: max(width, 0)]
    used = 0
    for i, char in enumerate(text):
        used += _char_width(char)
        if used > width:
            return text[:i]
    return text


def tail(text: str, width: int) -> str:
    """The longest end of `text` within `width` columns, starting at a character that takes a column
    (never at a mark whose character was cut off)."""
    if text.isascii():
        return text[len(text) - max(width, 0) :]
    used, start = 0, len(text)
    for i in range(len(text) - 1, -1, -1):
        used += _char_width(text[i])
        if used > width:
            break
        if _char_width(text[i]):
            start = i
    return text[start:]


def truncate(text: str, width: int) -> str:
    """`text` cut at its end to `width` columns, an ellipsis where it was cut."""
    if display_width(text) <= width:
        return text
    return head(text, width - 1) + ELLIPSIS if width >= 1 else ""


def cut(text: str, width: int, start: int) -> str:
    """`text` cut in the middle to `width` columns: `start` columns of its start, the ellipsis, the rest
    from its end."""
    if display_width(text) <= width:
        return text
    if width < 1:
        return ""
    start = min(max(start, 0), width - 1)
    return head(text, start) + ELLIPSIS + tail(text, width - 1 - start)


def flatten(text: str) -> str:
    """A table cell on one line that takes the columns it is measured at: line breaks (a phase named
    "a\\nb") and tabs become spaces, other control characters (an escape sequence, which a terminal would
    obey) and lone surrogates are written as Python escapes ("\\x1b")."""
    text = " ".join(text.splitlines()).replace("\t", " ") if text else text
    return text if text.isprintable() else "".join(map(_visible, text))


def _visible(char: str) -> str:
    if unicodedata.category(char) not in ("Cc", "Cs"):
        return char
    return char.encode("unicode_escape", "backslashreplace").decode("ascii")
