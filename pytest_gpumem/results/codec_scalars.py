"""The JSON codec's readers of scalars (ints, floats, strs, bools, their ranges and checks), enums and `Any`,
and the words of what a value of a type must be."""

from __future__ import annotations

import enum
import types
from collections.abc import Sequence
from typing import Annotated, Any, Union, get_args, get_origin

from pytest_gpumem.results.checks import Wording
from pytest_gpumem.results.codec_spec import Reader, Spec, Writer, unwrap

__all__ = ["PLAIN", "SCALARS", "as_is", "enum_rule", "phrase_of", "scalar_rule"]


SCALARS: dict[Any, tuple[tuple[type, ...], str]] = {
    int: ((int,), "an integer"),
    float: ((float, int), "a number"),  # an integer stays one: it is written back as it was read
    str: ((str,), "a string"),
    bool: ((bool,), "true or false"),
}


def as_is(value: Any, where: str | None, wording: Wording) -> Any:
    return value


PLAIN: dict[Reader, tuple[type, ...]] = {}
"""The readers of a scalar with no range or check, by the types they take as they are (a container
tests them itself, for speed, and calls the reader only for another value, to refuse it or take a str's
subclass)."""


def scalar_rule(tp: Any, spec: Spec, phrase: str) -> tuple[Reader, None]:
    kinds = SCALARS[tp][0]
    low, high, check = spec.low, spec.high, spec.check

    def read(value: Any, where: str | None, wording: Wording) -> Any:
        if (
            (type(value) in kinds or (tp is str and isinstance(value, str)))
            and (low is None or low <= value)
            and (high is None or value <= high)
            and (check is None or check(value))
        ):
            return value
        raise wording.refuse(where, phrase, value)

    if low is None and high is None and check is None:
        PLAIN[read] = kinds
    return read, None


def phrase_of(tp: Any, spec: Spec) -> str:
    """What a value of `tp` must be, in words."""
    if get_origin(tp) is Annotated:
        tp, spec = unwrap(tp, spec)
    if spec.expected is not None:
        return spec.expected
    if get_origin(tp) in (Union, types.UnionType):  # X | None: what a value other than null must be
        return phrase_of(next(arg for arg in get_args(tp) if arg is not type(None)), spec)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_phrase(tp)
    if tp in SCALARS:
        return SCALARS[tp][1]
    return "a list" if get_origin(tp) in (tuple, list, Sequence) else "an object"


def _enum_phrase(tp: type[enum.Enum]) -> str:
    return f"one of {', '.join(str(member.value) for member in tp)}"


def enum_rule(tp: type[enum.Enum], phrase: str) -> tuple[Reader, Writer]:
    by_value = {member.value: member for member in tp}

    def read(value: Any, where: str | None, wording: Wording) -> Any:
        if type(value) not in (str, int) or value not in by_value:
            raise wording.refuse(where, phrase, value)
        return by_value[value]

    def write(value: Any) -> Any:
        return value.value

    return read, write
