"""What a field of a value the JSON codec reads and writes says of itself beyond its type: `Spec`, given as
`Annotated[T, Spec(...)]`, and the ranges of bytes most fields share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, get_args, get_origin

from cuda_allocator_model import MAX_BYTES
from pytest_gpumem.results.checks import Wording

__all__ = ["BYTES", "EMPTY", "KEEP", "SIGNED", "STORED_BYTES", "Reader", "Spec", "Writer", "unwrap"]

Reader = Callable[[Any, str | None, "Wording"], Any]
Writer = Callable[[Any], Any]


KEEP: Any = object()  # `Spec.omit` unset: no value is omitted from the JSON
EMPTY: Any = object()  # `Spec(omit=EMPTY)`: an empty list or mapping is omitted from the JSON


@dataclass(frozen=True, eq=False)  # hashed by identity: a type that holds one is a key of `codec_plans._MADE`
class Spec:
    """What a field's type does not say: its JSON `key`, the words of what it must be, its range (`low` <=
    value <= `high`), a `check` the value passes, the one value `omit`ted from the JSON (read back where
    the key is absent), the keys a mapping allows (`names`, said by `names_expected`), a reader and a
    writer of its own (`via`: the reader gets the JSON value, its path, None on the first read, where the
    wording's errors are `Unplaced`, and the wording; the writer gives back each scalar the reader was
    given, as the round trip's `==` needs). A field `outside` the JSON (the key its value sits under, which
    what reads it sets) is never written and read as `absent` (a factory) gives it."""

    key: str | None = None
    expected: str | None = None
    low: int | float | None = None
    high: int | float | None = None
    check: Callable[[Any], bool] | None = None
    omit: Any = KEEP
    names: Callable[[str], bool] | None = None
    names_expected: str = ""
    via: tuple[Reader, Writer] | None = None
    absent: Callable[[], Any] | None = None
    outside: bool = False


BYTES = Spec(expected="an integer of bytes", low=0, high=MAX_BYTES)
STORED_BYTES = Spec(expected="an integer 0 <= n < 2**63 (bytes)", low=0, high=MAX_BYTES)  # a baseline file's words
SIGNED = Spec(expected="an integer of bytes (negative where freed)", low=-MAX_BYTES, high=MAX_BYTES)


def unwrap(tp: Any, spec: Spec) -> tuple[Any, Spec]:
    """`Annotated[T, Spec(...)]` as `(T, its Spec)`; any other type with `spec`."""
    if get_origin(tp) is not Annotated:
        return tp, spec
    inner, *meta = get_args(tp)
    return inner, next((m for m in meta if isinstance(m, Spec)), spec)
