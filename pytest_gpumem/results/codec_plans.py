"""The JSON codec's plans: each type's reader and writer, built once from its annotations (unions with None,
sequences, mappings and nested dataclasses, whose fields are planned as JSON keys), and how a class's
value is made from them."""

from __future__ import annotations

import dataclasses
import enum
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Annotated, Any, NamedTuple, Union, get_args, get_origin, get_type_hints

from pytest_gpumem.results.checks import Wording, short, wrong_keys
from pytest_gpumem.results.codec_scalars import PLAIN, SCALARS, as_is, enum_rule, phrase_of, scalar_rule
from pytest_gpumem.results.codec_spec import EMPTY, KEEP, Reader, Spec, Writer, unwrap

__all__ = ["DECODING", "made_for", "plan_of"]


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
DECODING = threading.local()  # `now`: a reader is building a value whose fields it has checked


def plan_of(cls: type) -> _Plan:
    """The fields of dataclass `cls` as JSON keys, their readers and writers (made once per class)."""
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = _Plan()  # filled in below; a class that holds itself finds it
        late = getattr(cls, "__json_names__", None)  # the types its annotations name, imported late
        hints = get_type_hints(cls, localns=None if late is None else late(), include_extras=True)
        plan.open = cls.__dict__.get("__json_open__", False)
        fields = [(f, unwrap(hints[f.name], Spec())[1]) for f in dataclasses.fields(cls) if f.init]
        plan.outside = tuple((f.name, spec.absent or str) for f, spec in fields if spec.outside)
        made = [_field(f, hints[f.name], plan.open) for f, spec in fields if not spec.outside]
        plan.derived = cls.__dict__.get("__json_derived__", ())
        made += [_Field(name, name, as_is, None, KEEP, None, (), "") for name in plan.derived]
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
    spec = unwrap(tp, Spec())[1]
    default: Callable[[], Any] | None = None
    if spec.omit is not KEEP or open_:
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory
        elif f.default is not dataclasses.MISSING:
            default = (lambda value: lambda: value)(f.default)
        elif not open_:
            raise TypeError(f"{f.name}: a field omitted from the JSON needs a default")
    read, write = _build(tp, Spec())
    kinds = PLAIN.get(read, ())
    return _Field(f.name, spec.key or f.name, read, write, spec.omit, default, kinds, phrase_of(tp, Spec()))


_MADE: dict[Any, tuple[Reader, Writer | None]] = {}


def made_for(tp: Any) -> tuple[Reader, Writer | None]:
    """The reader and the writer of `tp` (made once per type)."""
    made = _MADE.get(tp)
    if made is None:
        made = _MADE[tp] = _build(tp, Spec())
    return made


def _build(tp: Any, spec: Spec, phrase: str | None = None) -> tuple[Reader, Writer | None]:
    """The reader and the writer (None: a value written as it is) of type `tp`; `phrase` is what a wrong
    value is told it must be. A reader given no path (`where` None) raises `Unplaced` for a wrong value."""
    if get_origin(tp) is Annotated:
        tp, spec = unwrap(tp, spec)
        phrase = phrase or spec.expected
    if spec.via is not None:
        return spec.via
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return _optional(args, spec, phrase)
    phrase = phrase or phrase_of(tp, spec)
    if tp is Any:
        return as_is, None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return enum_rule(tp, phrase)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _nested(tp, phrase)
    if tp in SCALARS:
        return scalar_rule(tp, spec, phrase)
    if origin in (tuple, list, Sequence):
        return _sequence(origin, args, spec, phrase)
    if origin in (dict, Mapping):
        return _mapping(args[1], spec, phrase)
    raise TypeError(f"the JSON codec has no rule for {tp!r}")


def _optional(args: tuple[Any, ...], spec: Spec, phrase: str | None) -> tuple[Reader, Writer | None]:
    inner = [arg for arg in args if arg is not type(None)]
    if len(inner) != 1 or len(args) != 2:
        raise TypeError(f"the JSON codec reads only X | None of unions, not {args!r}")
    words = phrase or f"{phrase_of(inner[0], spec)} or null"
    read_inner, write_inner = _build(inner[0], spec, words)

    def read(value: Any, where: str | None, wording: Wording) -> Any:
        return None if value is None else read_inner(value, where, wording)

    def write(value: Any) -> Any:
        return None if value is None else write_inner(value)  # type: ignore[misc]

    return read, None if write_inner is None else write


def _nested(cls: type, phrase: str) -> tuple[Reader, Writer]:
    plan = _Plan()  # the class's, once it is made (not before: a class may hold itself)

    def read(value: Any, where: str | None, wording: Wording) -> Any:
        nonlocal plan
        if not plan.fields:
            plan = plan_of(cls)
        if type(value) is not dict:
            raise wording.refuse(where, phrase, value)
        if not (plan.open or (plan.keys.issuperset(value) and value.keys() >= plan.required)):
            required = tuple(f.key for f in plan.fields if f.default is None)
            raise wrong_keys(value, where, required, plan.keys, wording)
        made = {}
        for f in plan.fields:
            if f.key not in value:
                if f.default is None:  # an open class's
                    raise wording.no_key(where, f.key)
                made[f.name] = f.default()
            elif type(item := value[f.key]) in f.kinds:
                made[f.name] = item
            elif item is None and f.omit is None:  # never written: the key would be left out
                raise wording.refuse(None if where is None else wording.field(where, f.key), f.phrase, item)
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
        was, DECODING.now = getattr(DECODING, "now", False), True
        try:
            return cls(**made)
        finally:
            DECODING.now = was

    def write(value: Any) -> Any:
        nonlocal plan
        if not plan.fields:
            plan = plan_of(cls)
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
    kinds = None if fixed else PLAIN.get(parts[0][0])
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
    kinds = PLAIN.get(read_value)
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
