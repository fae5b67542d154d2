"""One JSON codec for the frozen values pytest-gpumem writes and reads back, driven by their types.

`encode(value)` gives a dataclass's JSON (keys are the field names, in field order); `decode(cls, data,
where)` builds one from JSON and nothing else: a missing or unknown key, a value of another type or
outside its field's range is one `OffShape` naming its JSON path (`tests[3].call.peak_bytes must be an
integer of bytes, got '12'`), and every value decoded is encoded again and compared with what was read
(the round trip). Types: ints, floats, strs, bools, `X | None`, `tuple[X, ...]` (`Sequence[X]` too) and
fixed tuples, lists, `Mapping[str, X]`, enums (by value), `Any` (any JSON, taken as is) and nested dataclasses.

A field says more of itself with `Annotated[T, Spec(...)]`: its JSON `key`, the words of what it must be
(`expected`), a range (`low`, `high`), a `check` of the value, the one value `omit`ted from the JSON (and
filled in where absent), a reader and writer of its own (`via`). The words of the errors are a `Wording`:
`REPORT` (a `--gpumem-json` report's) or `STORED` (a baseline file's, as they have always been). A class
whose JSON keys come in another order than its fields names that order in `__json_keys__`; one whose
reader leaves a key it does not know to the round trip of what holds it, takes an absent key as its
field's default and says a missing one where it reaches it (as its hand-written reader did) sets
`__json_open__`; one that writes a property as a key names it in `__json_derived__` (read as anything, the
round trip refuses a value the property would not give); the types its annotations name that it imports late
are given by `__json_names__()`. `read` is a decode without the round trip (for a part of a value checked
whole), `validate` checks a value built in Python as its JSON would be read (for a `__post_init__`).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Annotated, Any, NamedTuple, TypeVar, Union, get_args, get_origin, get_type_hints, overload

from cuda_allocator_model import MAX_BYTES
from pytest_gpumem.results.checks import REPORT, STORED, Unplaced, Wording, exact_keys, first_difference, short

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
    "exact_keys",
    "read",
    "validate",
]

T = TypeVar("T")
Reader = Callable[[Any, str | None, "Wording"], Any]
Writer = Callable[[Any], Any]


KEEP: Any = object()  # `Spec.omit` unset: no value is omitted from the JSON
EMPTY: Any = object()  # `Spec(omit=EMPTY)`: an empty list or mapping is omitted from the JSON


@dataclass(frozen=True, eq=False)  # hashed by identity: a type that holds one is a key of `_MADE`
class Spec:
    """What a field's type does not say: its JSON `key`, the words of what it must be, its range (`low` <=
    value <= `high`), a `check` the value passes, the one value `omit`ted from the JSON (read back where
    the key is absent), the keys a mapping allows (`names`, said by `names_expected`), a reader and a
    writer of its own (`via`: the reader gets the JSON value, its path, None on the first read, where the
    wording's errors are `Unplaced`, and the wording; the writer gives back each scalar the reader was
    given, as the round trip's `==` needs), or what a key
    absent from an earlier version's JSON is read as (`absent`, a factory; the round trip still refuses
    such a value at the end, but a wrong value beside it is named first). A field `outside` the JSON (the
    key its value sits under, which what reads it sets) is never written and read as `absent` gives it."""

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


def encode(value: Any, as_type: Any = None) -> Any:
    """`value` (a dataclass, or of type `as_type`: any type `decode` reads) as JSON types: dicts, lists,
    strs, numbers, bools, None."""
    write = _made(type(value) if as_type is None else as_type)[1]
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
    return _placed(_made(cls)[0], data, where, wording)


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
    if getattr(_DECODING, "now", False):
        return
    for f in _plan(type(value)).fields:
        item = getattr(value, f.name)
        try:
            written = item if f.write is None else f.write(item)
        except (AttributeError, TypeError, ValueError):
            raise wording.refuse(wording.field(where, f.key), f.phrase, item) from None
        _placed(f.read, written, wording.field(where, f.key), wording)


# ----------------------------------------------------------------------------------------- the plans


class _Field(NamedTuple):
    name: str
    key: str
    read: Reader
    write: Writer | None  # None: written as it is
    omit: Any
    default: Callable[[], Any] | None  # None: the key is required
    kinds: tuple[type, ...]  # the types `read` takes as they are, which a class's reader tests itself
    phrase: str


@dataclass
class _Plan:
    fields: tuple[_Field, ...] = ()  # in the order of their keys
    keys: frozenset[str] = frozenset()
    required: frozenset[str] = frozenset()
    checks: bool = False  # the class has a `__post_init__`, which may `validate` it
    open: bool = False  # `__json_open__`
    outside: tuple[tuple[str, Callable[[], Any]], ...] = ()  # the fields not in the JSON, and what they read as
    derived: tuple[str, ...] = ()  # `__json_derived__`: keys written from a property, read by the round trip
    bare: bool = False  # an instance is its fields in a `__dict__` and nothing else: made without `__init__`


_PLANS: dict[type, _Plan] = {}
_DECODING = threading.local()  # `now`: a reader is building a value whose fields it has checked


def _plan(cls: type) -> _Plan:
    """The fields of dataclass `cls` as JSON keys, their readers and writers (made once per class)."""
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = _Plan()  # filled in below; a class that holds itself finds it
        late = getattr(cls, "__json_names__", None)  # the types its annotations name, imported late
        hints = get_type_hints(cls, localns=None if late is None else late(), include_extras=True)
        plan.open = cls.__dict__.get("__json_open__", False)
        fields = [(f, _unwrap(hints[f.name], Spec())[1]) for f in dataclasses.fields(cls) if f.init]
        plan.outside = tuple((f.name, spec.absent or str) for f, spec in fields if spec.outside)
        made = [_field(f, hints[f.name], plan.open) for f, spec in fields if not spec.outside]
        plan.derived = cls.__dict__.get("__json_derived__", ())
        made += [_Field(name, name, _as_is, None, KEEP, None, (), "") for name in plan.derived]
        order = cls.__dict__.get("__json_keys__")  # the keys' order where it is not the fields'
        if order is not None:
            made.sort(key=lambda f: order.index(f.key))
        plan.fields, plan.keys = tuple(made), frozenset(f.key for f in made)
        plan.required = frozenset(f.key for f in made if f.default is None)
        plan.checks = hasattr(cls, "__post_init__")
        everything = all(f.init for f in dataclasses.fields(cls))
        plan.bare = everything and not plan.checks and "__slots__" not in cls.__dict__
    return plan


def _field(f: dataclasses.Field[Any], tp: Any, open_: bool) -> _Field:
    spec = _unwrap(tp, Spec())[1]
    default: Callable[[], Any] | None = spec.absent
    if (spec.omit is not KEEP or open_) and default is None:
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory
        elif f.default is not dataclasses.MISSING:
            default = (lambda value: lambda: value)(f.default)
        elif not open_:
            raise TypeError(f"{f.name}: a field omitted from the JSON needs a default")
    read, write = _build(tp, Spec())
    kinds = _PLAIN.get(read, ())
    return _Field(f.name, spec.key or f.name, read, write, spec.omit, default, kinds, _phrase(tp, Spec()))


def _unwrap(tp: Any, spec: Spec) -> tuple[Any, Spec]:
    """`Annotated[T, Spec(...)]` as `(T, its Spec)`; any other type with `spec`."""
    if get_origin(tp) is not Annotated:
        return tp, spec
    inner, *meta = get_args(tp)
    return inner, next((m for m in meta if isinstance(m, Spec)), spec)


_MADE: dict[Any, tuple[Reader, Writer | None]] = {}


def _made(tp: Any) -> tuple[Reader, Writer | None]:
    """The reader and the writer of `tp` (made once per type)."""
    made = _MADE.get(tp)
    if made is None:
        made = _MADE[tp] = _build(tp, Spec())
    return made


def _build(tp: Any, spec: Spec, phrase: str | None = None) -> tuple[Reader, Writer | None]:
    """The reader and the writer (None: a value written as it is) of type `tp`; `phrase` is what a wrong
    value is told it must be. A reader given no path (`where` None) raises `Unplaced` for a wrong value."""
    if get_origin(tp) is Annotated:
        tp, spec = _unwrap(tp, spec)
        phrase = phrase or spec.expected
    if spec.via is not None:
        return spec.via
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return _optional(args, spec, phrase)
    phrase = phrase or _phrase(tp, spec)
    if tp is Any:
        return _as_is, None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum(tp, phrase)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _nested(tp, phrase)
    if tp in _SCALARS:
        return _scalar(tp, spec, phrase)
    if origin in (tuple, list, Sequence):
        return _sequence(origin, args, spec, phrase)
    if origin in (dict, Mapping):
        return _mapping(args[1], spec, phrase)
    raise TypeError(f"the JSON codec has no rule for {tp!r}")


_SCALARS: dict[Any, tuple[tuple[type, ...], str]] = {
    int: ((int,), "an integer"),
    float: ((float, int), "a number"),  # an integer stays one: it is written back as it was read
    str: ((str,), "a string"),
    bool: ((bool,), "true or false"),
}


def _as_is(value: Any, where: str | None, wording: Wording) -> Any:
    return value


_PLAIN: dict[Reader, tuple[type, ...]] = {}
"""The readers of a scalar with no range or check, by the types they take as they are (a container
tests them itself, for speed, and calls the reader only for another value, to refuse it or take a str's
subclass)."""


def _scalar(tp: Any, spec: Spec, phrase: str) -> tuple[Reader, None]:
    kinds = _SCALARS[tp][0]
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
        _PLAIN[read] = kinds
    return read, None


def _optional(args: tuple[Any, ...], spec: Spec, phrase: str | None) -> tuple[Reader, Writer | None]:
    inner = [arg for arg in args if arg is not type(None)]
    if len(inner) != 1 or len(args) != 2:
        raise TypeError(f"the JSON codec reads only X | None of unions, not {args!r}")
    words = phrase or f"{_phrase(inner[0], spec)} or null"
    read_inner, write_inner = _build(inner[0], spec, words)

    def read(value: Any, where: str | None, wording: Wording) -> Any:
        return None if value is None else read_inner(value, where, wording)

    def write(value: Any) -> Any:
        return None if value is None else write_inner(value)  # type: ignore[misc]

    return read, None if write_inner is None else write


def _phrase(tp: Any, spec: Spec) -> str:
    """What a value of `tp` must be, in words."""
    if get_origin(tp) is Annotated:
        tp, spec = _unwrap(tp, spec)
    if spec.expected is not None:
        return spec.expected
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_phrase(tp)
    if tp in _SCALARS:
        return _SCALARS[tp][1]
    return "a list" if get_origin(tp) in (tuple, list, Sequence) else "an object"


def _enum_phrase(tp: type[enum.Enum]) -> str:
    return f"one of {', '.join(str(member.value) for member in tp)}"


def _enum(tp: type[enum.Enum], phrase: str) -> tuple[Reader, Writer]:
    by_value = {member.value: member for member in tp}

    def read(value: Any, where: str | None, wording: Wording) -> Any:
        if type(value) not in (str, int) or value not in by_value:
            raise wording.refuse(where, phrase, value)
        return by_value[value]

    def write(value: Any) -> Any:
        return value.value

    return read, write


def _nested(cls: type, phrase: str) -> tuple[Reader, Writer]:
    plan = _Plan()  # the class's, once it is made (not before: a class may hold itself)

    def read(value: Any, where: str | None, wording: Wording) -> Any:
        nonlocal plan
        if not plan.fields:
            plan = _plan(cls)
        if type(value) is not dict:
            raise wording.refuse(where, phrase, value)
        if not (plan.open or (plan.keys.issuperset(value) and value.keys() >= plan.required)):
            required = tuple(f.key for f in plan.fields if f.default is None)
            exact_keys(value, where, required, tuple(plan.keys), wording)
        made = {}
        for f in plan.fields:
            if f.key not in value:
                if f.default is None:  # an open class's
                    raise wording.no_key(where, f.key)
                made[f.name] = f.default()
            elif type(item := value[f.key]) in f.kinds:
                made[f.name] = item
            else:
                made[f.name] = f.read(item, None if where is None else wording.field(where, f.key), wording)
        for name in plan.derived:
            del made[name]
        for name, absent in plan.outside:
            made[name] = absent()
        if plan.bare:
            new: Any = object.__new__(cls)
            new.__dict__.update(made)
            return new
        if not plan.checks:
            return cls(**made)
        was, _DECODING.now = getattr(_DECODING, "now", False), True
        try:
            return cls(**made)
        finally:
            _DECODING.now = was

    def write(value: Any) -> Any:
        nonlocal plan
        if not plan.fields:
            plan = _plan(cls)
        out = {}
        for f in plan.fields:
            item = getattr(value, f.name)
            if f.omit is KEEP or (item if f.omit is EMPTY else item != f.omit):
                out[f.key] = item if f.write is None else f.write(item)
        return out

    return read, write


def _sequence(origin: Any, args: tuple[Any, ...], spec: Spec, phrase: str) -> tuple[Reader, Writer]:
    """A list or tuple of items of one type, or a tuple of so many items, each of its own type."""
    fixed = origin is tuple and not (len(args) == 2 and args[1] is Ellipsis)
    parts = [_build(arg, Spec()) for arg in (args if fixed else args[:1])]
    kinds = None if fixed else _PLAIN.get(parts[0][0])
    make: Callable[[Any], Any] = list if origin is list else tuple
    check = spec.check

    def read(value: Any, where: str | None, wording: Wording) -> Any:
        if (
            not isinstance(value, list)
            or (fixed and len(value) != len(parts))
            or (check is not None and not check(value))
        ):
            raise wording.refuse(where, phrase, value)
        if kinds and all(type(item) in kinds for item in value):
            return make(value)
        readers = [part[0] for part in parts] if fixed else repeat(parts[0][0])
        pairs = enumerate(zip(readers, value, strict=False))  # as many readers as items, or one repeated
        return make([read_item(item, _index(where, i), wording) for i, (read_item, item) in pairs])

    def write(value: Any) -> Any:
        if not isinstance(value, (list, tuple)):
            return value  # not a sequence (a hook's): written as it is, for the reading back to refuse
        if not fixed and parts[0][1] is None:
            return list(value)
        writers = [part[1] for part in parts] if fixed else repeat(parts[0][1])
        return [
            item if write_item is None else write_item(item) for write_item, item in zip(writers, value, strict=False)
        ]

    return read, write


def _index(where: str | None, i: int) -> str | None:
    return None if where is None else f"{where}[{i}]"


def _member(where: str | None, key: str, wording: Wording) -> str | None:
    return None if where is None else wording.member(where, key)


def _mapping(value_type: Any, spec: Spec, phrase: str) -> tuple[Reader, Writer]:
    read_value, write_value = _build(value_type, Spec())
    kinds = _PLAIN.get(read_value)
    names, names_expected, check = spec.names, spec.names_expected, spec.check

    def read(value: Any, where: str | None, wording: Wording) -> Any:
        if names is not None and isinstance(value, dict):
            bad = next((key for key in value if not names(key)), None)
            if bad is not None:
                raise wording.says(where, f"{names_expected}, got {short(bad)}")
        if not isinstance(value, dict) or (check is not None and not check(value)):
            raise wording.refuse(where, phrase, value)
        if kinds and all(type(item) in kinds for item in value.values()):
            return dict(value)
        return {key: read_value(item, _member(where, key, wording), wording) for key, item in value.items()}

    def write(value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value  # a hook's: written as it is, for the reading back to refuse
        return dict(value) if write_value is None else {key: write_value(item) for key, item in value.items()}

    return read, write
