"""One JSON codec for the frozen values pytest-gpumem writes and reads back, driven by their types.

`encode(value)` gives a dataclass's JSON (keys are the field names, in field order); `decode(cls, data,
where)` builds one from JSON and nothing else: a missing or unknown key, a value of another type or
outside its field's range is one `OffShape` naming its JSON path (`tests[3].call.peak_bytes must be an
integer of bytes, got '12'`), and every value decoded is encoded again and compared with what was read
(the round trip). Types: ints, floats, strs, bools, `X | None`, `tuple[X, ...]` (`Sequence[X]` too) and
fixed tuples, lists, `Mapping[str, X]`, enums (by value), `Any` (any JSON, taken as is) and nested dataclasses.

A field says more of itself with `Annotated[T, Spec(...)]`: its JSON `key`, the words of what it must be
(`expected`), a range (`low`, `high`), a `check` of the value, the one value `omit`ted from the JSON (and
filled in where absent; a null where null is omitted is refused at its key), a reader and writer of its own
(`via`). The words of the errors are a `Wording`: `REPORT` (a `--gpumem-json` report's) or `STORED` (a
baseline file's, as they have always been). A class whose JSON keys come in another order than its fields
names that order in `__json_keys__`; one whose reader leaves a key it does not know to the round trip of what
holds it, takes an absent key as its field's default and says a missing one where it reaches it (as its
hand-written reader did) sets `__json_open__`; one that writes a property as a key names it in
`__json_derived__` (read as anything, the round trip refuses a value the property would not give); the types
its annotations name that it imports late are given by `__json_names__()`. `read` is a decode without the
round trip (for a part of a value checked whole), `validate` checks a value built in Python as its JSON would
be read (for a `__post_init__`).
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

from pytest_gpumem.results.checks import REPORT, STORED, Unplaced, Wording, first_difference
from pytest_gpumem.results.codec_plans import DECODING, made_for, plan_of
from pytest_gpumem.results.codec_spec import BYTES, EMPTY, SIGNED, STORED_BYTES, Reader, Spec

__all__ = [
    "BYTES",
    "EMPTY",
    "REPORT",
    "SIGNED",
    "STORED",
    "STORED_BYTES",
    "Spec",
    "Wording",
    "decode",
    "encode",
    "read",
    "validate",
]

T = TypeVar("T")


def encode(value: Any, as_type: Any = None) -> Any:
    """`value` (a dataclass, or of type `as_type`: any type `decode` reads) as JSON types: dicts, lists,
    strs, numbers, bools, None."""
    write = made_for(type(value) if as_type is None else as_type)[1]
    return value if write is None else write(value)


@overload
def decode(cls: type[T], data: object, where: str, wording: Wording = REPORT) -> T: ...
@overload
def decode(cls: object, data: object, where: str, wording: Wording = REPORT) -> Any: ...
def decode(cls: Any, data: object, where: str, wording: Wording = REPORT) -> Any:
    """The `cls` (a dataclass, or any type the codec reads) that `data` is the JSON of, as `encode` writes
    it and nothing else; the wording's error (`OffShape`) names the JSON path (under `where`) of the first
    value that is not. The round trip compares with `==`: the codec's writers (and a `Spec.via`'s must)
    give back each scalar they were given, so that no 1 is written back as 1.0 or true."""
    value = read(cls, data, where, wording)
    written = encode(value, cls)
    if written != data:
        found = first_difference(data, written, where, wording.path)
        if found is not None:
            raise wording.not_as_written(*found)
    return value


def read(cls: Any, data: object, where: str | None, wording: Wording = REPORT) -> Any:
    """`decode` without the round trip: for a reader of its own (`Spec.via`) or a part of a value whose
    whole `decode` checks."""
    return _placed(made_for(cls)[0], data, where, wording)


def _placed(reader: Reader, data: object, where: str | None, wording: Wording) -> Any:
    """`reader` on `data`, first without paths (`where` None), which is fast; again with them only to say
    where a value is refused."""
    try:
        return reader(data, None, wording)
    except Unplaced:
        if where is None:
            raise
        return reader(data, where, wording)


def validate(value: Any, where: str, wording: Wording = STORED) -> None:
    """Refuse a dataclass built in Python with a value its JSON could not hold, as `decode` would say it
    (for a `__post_init__`; a nested dataclass is built again from its JSON, and so checks itself). A
    value `decode` builds is not checked again: its reader has just checked each field."""
    if getattr(DECODING, "now", False):
        return
    for f in plan_of(type(value)).fields:
        item = getattr(value, f.name)
        try:
            written = item if f.write is None else f.write(item)
        except (AttributeError, TypeError, ValueError):
            raise wording.refuse(wording.field(where, f.key), f.phrase, item) from None
        _placed(f.read, written, wording.field(where, f.key), wording)
