"""A test's result: what its call measured that the report writes (`WrittenRecord`), its outcome, its
budget as written, its baseline's verdict and entry (`TestResult`), and the flat layout of its entry in the
`--gpumem-json` report, which the JSON codec reads and writes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Generic, TypeVar, get_type_hints, overload

from cuda_allocator_model import MAX_BYTES
from pytest_gpumem.errors import first_line
from pytest_gpumem.results.checks import OffShape, Unplaced, refuse
from pytest_gpumem.results.codec import Spec, Wording, decode, encode
from pytest_gpumem.results.codec_spec import unwrap
from pytest_gpumem.results.phase import PHASES, PhaseResult, Phases
from pytest_gpumem.results.status import Status

if TYPE_CHECKING:  # imported where a result is read back (start-up needs neither)
    from pytest_gpumem.results.advice import Advice
    from pytest_gpumem.results.baseline import Entry, Verdict
    from pytest_gpumem.results.explanation import Explanation


def _listed(value: object) -> object:
    """A tuple as the JSON list it is written as; anything else (a hook's) as it is."""
    return list(value) if isinstance(value, tuple) else value


def _read_simulated(value: Any, where: str | None, wording: Wording) -> tuple[dict[str, int], ...]:
    """Each simulated world's figures (a key's path is `.key`, whatever the key, as it always was)."""
    if not isinstance(value, list):
        raise wording.refuse(where, "a list", value)
    for i, world in enumerate(value):
        at = None if where is None else f"{where}[{i}]"
        if not isinstance(world, dict):
            raise wording.refuse(at, "an object", world)
        for key, n in world.items():
            if type(n) is not int or not 0 <= n <= MAX_BYTES:
                raise wording.refuse(None if at is None else f"{at}.{key}", "an integer", n)
    return tuple(value)


def _whole(read_whole: Callable[[Any, str], Any], key: str | None = None) -> Spec:
    """A value or null, the value read by a reader of its own, its round trip first (where the result's
    reader reaches it, as it always was) and written by its `to_json`: whatever the reader raises for a
    value not shaped as written is said at the value's path (`OffShape` names the path itself)."""

    def read_it(value: Any, where: str | None, wording: Wording) -> Any:
        if value is None:
            return None
        try:
            return read_whole(value, where or "")
        except OffShape:
            if where is None:
                raise Unplaced() from None
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise Unplaced() if where is None else OffShape(f"{where}: {first_line(exc)}") from None

    return Spec(key=key, via=(read_it, _json_of))


def _verdict(value: Any, where: str) -> Verdict:
    from pytest_gpumem.results.baseline import Verdict

    return Verdict.from_json(value, where)


def _entry(value: Any, where: str) -> Entry:
    from pytest_gpumem.results.baseline import Entry

    return Entry.from_json(value)


def _explanation(value: Any, where: str) -> Explanation:
    from pytest_gpumem.results.explanation import Explanation

    return Explanation.from_json(value, where)


def _advice(value: Any, where: str) -> Advice:
    from pytest_gpumem.results.advice import Advice

    if not isinstance(value, dict):
        raise refuse(where, "an object", value)
    return Advice.from_json(value, where)


def _json_of(value: Any) -> Any:
    return None if value is None else value.to_json()


_OBJECT = Spec(expected="an object")  # or null, said as a report always has
_STATUS = Spec(expected="a status word as the report writes it ('ok', 'REGRESSED', ...)")


def _late_names() -> dict[str, Any]:
    """The types a result's annotations name that are imported only when a result is written or read."""
    from pytest_gpumem.results.advice import Advice
    from pytest_gpumem.results.baseline import Entry, Verdict
    from pytest_gpumem.results.explanation import Explanation

    return {"Advice": Advice, "Entry": Entry, "Verdict": Verdict, "Explanation": Explanation}


def _tuples(value: WrittenRecord | Outcome) -> None:
    """`value`'s fields declared as sequences, given as lists, kept as tuples (the one place they are set:
    as it is made)."""
    for name in _sequences(type(value)):
        if isinstance(getattr(value, name), list):
            object.__setattr__(value, name, tuple(getattr(value, name)))


_SEQUENCES: dict[type, tuple[str, ...]] = {}


def _sequences(cls: type) -> tuple[str, ...]:
    """The fields of dataclass `cls` declared as sequences (found once per class)."""
    found = _SEQUENCES.get(cls)
    if found is None:
        found = _SEQUENCES[cls] = tuple(
            f.name for f in dataclasses.fields(cls) if "Sequence[" in str(f.type).split(",")[0]
        )
    return found


@dataclass(frozen=True)
class WrittenRecord:
    """What a measured call left that its report writes: the record's part that a result holds
    (`pytest_gpumem.measure.record.CallRecord` is this and the evidence the report does not write).

    `info` is the test's own `gpumem.info` (in JSON types in a result); what pytest-gpumem measured on
    request has fields of its own: `fits` (each `gpumem.fit()`'s sentence), `advice` (the last
    `gpumem.advise()`), `distributed` (a summary per `gpumem.distributed()` world) and `simulated` (each
    `gpumem.simulate_rank()`'s world size and rank). A field added here is in the result, its JSON and the
    hook's copy; one the reports of earlier versions lack is read as absent (`Spec(omit=EMPTY)`).
    """

    nodeid: Annotated[str, Spec(expected="a node id", check=bool)]
    backend: Annotated[str, Spec(expected="a backend's name")]
    device: Annotated[str, Spec(expected="a device's name")]
    call: Annotated[PhaseResult | None, _OBJECT]
    phases: Annotated[Mapping[str, PhaseResult], PHASES] = field(default_factory=dict)  # read-only once made
    notes: Sequence[str] = ()
    info: dict[str, Any] = field(default_factory=dict)
    # what made each peak (pytest_gpumem.explain.composition), when asked for
    explanation: Annotated[Explanation | None, _whole(_explanation)] = None
    fits: Sequence[str] = ()
    advice: Annotated[Advice | None, _whole(_advice)] = None
    distributed: Sequence[dict[str, Any]] = ()
    simulated: Annotated[Sequence[dict[str, int]], Spec(via=(_read_simulated, _listed))] = ()

    def __post_init__(self) -> None:
        """Lists as tuples and the phases read-only; anything else is left as given, for the writing and
        the reading back to refuse."""
        if isinstance(self.phases, Mapping) and not isinstance(self.phases, Phases):
            object.__setattr__(self, "phases", Phases(self.phases))
        _tuples(self)

    @property
    def peak_bytes(self) -> int | None:
        return None if self.call is None else self.call.peak_bytes


@dataclass(frozen=True)
class Outcome:
    """What became of a test as its report says it: its status, the one line of a failure (`message`) and
    what the line left to the report's section (`detail`)."""

    status: Annotated[Status, _STATUS] = Status.OK
    message: str | None = None
    detail: Sequence[str] = ()

    def __post_init__(self) -> None:
        """The status as a `Status` (a word is one: what a hook may set), the detail a tuple."""
        object.__setattr__(self, "status", Status.of(self.status))
        _tuples(self)


@dataclass(frozen=True)
class BudgetView:
    """A test's budget as its report writes it: the limits (the budget's JSON) and the sentence."""

    limits: Annotated[dict[str, Any] | None, Spec(key="budget", expected="an object")] = None
    text: str | None = None


_NONE = Phases()
T = TypeVar("T")


class _ByName(Generic[T]):
    """A field of one of a result's parts read by its name in the report (`result.status` is
    `result.outcome.status`), or one of the result's own under another name (`part` "")."""

    def __init__(self, part: str, inner: str = "") -> None:
        self.part, self.inner = part, inner

    def __set_name__(self, owner: type, name: str) -> None:
        self.inner = self.inner or name

    @overload
    def __get__(self, result: None, owner: type) -> _ByName[T]: ...
    @overload
    def __get__(self, result: object, owner: type) -> T: ...
    def __get__(self, result: object, owner: type) -> Any:
        if result is None:
            return self
        return getattr(getattr(result, self.part) if self.part else result, self.inner)


def _built(cls: type, values: dict[str, Any]) -> Any:
    return cls(**values)


def _bare(cls: type, values: dict[str, Any]) -> Any:
    """A value of `cls` of `values` that the codec has read, each already as the value holds it (made
    without `__init__`, which would check and convert them again)."""
    value: Any = object.__new__(cls)
    value.__dict__.update(values)
    return value


@dataclass(frozen=True)
class TestResult:
    """Everything measured for one test call, plus its budget and verdict: a value, never changed once
    made (a change is a new result, `dataclasses.replace(result, outcome=...)` or `result.replaced(status=...)`);
    a `pytest_gpumem_result` hook is handed a copy whose fields it may set by their names below, which then
    replaces the result (`run/hand_over.py`).

    `record` is what the call measured (a `WrittenRecord`), `outcome` its status and line, `budget` its
    budget as written, `verdict` the baseline's comparison, `entry` the figures recorded as the test's
    baseline (None unless they are), `worker_device` which of the caller's devices a worker used
    (--gpumem-devices) and `html_path` the path of its picture (--gpumem-html) as the report shows it.
    Each of their fields is also read by its name in the report (`result.status`, `result.peak_bytes`,
    `result.budget_limits`, `result.baseline_entry`, ...).
    """

    __test__ = False  # not a test class, despite its name

    record: WrittenRecord
    outcome: Outcome = Outcome()
    budget: BudgetView = BudgetView()
    verdict: Annotated[Verdict | None, _whole(_verdict, "baseline")] = None
    entry: Annotated[Entry | None, _whole(_entry, "record")] = None
    worker_device: str | None = None
    html_path: Annotated[str | None, Spec(key="html")] = None

    def __post_init__(self) -> None:
        record, outcome, budget = self.record, self.outcome, self.budget
        if not (isinstance(record, WrittenRecord) and isinstance(outcome, Outcome) and isinstance(budget, BudgetView)):
            raise TypeError(
                "TestResult(record, outcome, budget, ...) takes a result's parts; "
                "TestResult.of(nodeid, backend, device, call, ...) makes one from its fields"
            )

    @classmethod
    def of(
        cls,
        nodeid: str,
        backend: str,
        device: str,
        call: PhaseResult | None,
        phases: Mapping[str, PhaseResult] = _NONE,
        **named: Any,
    ) -> TestResult:
        """A result from its fields by their names in the report (`status=`, `budget_text=`, `fits=`, ...)."""
        unknown = named.keys() - _WHERE.keys()
        if unknown:
            raise TypeError(f"a TestResult has no field {min(unknown)!r}")
        given = {"nodeid": nodeid, "backend": backend, "device": device, "call": call, "phases": phases, **named}
        return cls._made(given)

    @classmethod
    def _made(cls, given: Mapping[str, Any], build: Callable[[type, dict[str, Any]], Any] = _built) -> TestResult:
        """A result from fields by their names in the report, each a field of a result, its parts and itself
        made by `build`."""
        parts = {
            part: build(made, {inner: given[name] for name, inner in names if name in given})
            for part, made, names in _BY_PART
        }
        made: TestResult = build(cls, {**parts, **{inner: given[name] for name, inner in _OWN if name in given}})
        return made

    def named(self) -> dict[str, Any]:
        """Every field by its name in the report, as `of` takes them."""
        parts = {part: getattr(self, part) for part in _PARTS} | {"": self}
        return {name: getattr(parts[part], inner) for name, (part, inner) in _WHERE.items()}

    def replaced(self, **named: Any) -> TestResult:
        """This result with the fields `named` (by their names in the report) changed."""
        return TestResult.of(**{**self.named(), **named})

    # each field of the parts by its name in the report, as results were read before they had parts
    nodeid: ClassVar[_ByName[str]] = _ByName("record")
    backend: ClassVar[_ByName[str]] = _ByName("record")
    device: ClassVar[_ByName[str]] = _ByName("record")
    call: ClassVar[_ByName[PhaseResult | None]] = _ByName("record")
    phases: ClassVar[_ByName[Mapping[str, PhaseResult]]] = _ByName("record")
    notes: ClassVar[_ByName[Sequence[str]]] = _ByName("record")
    info: ClassVar[_ByName[dict[str, Any]]] = _ByName("record")
    explanation: ClassVar[_ByName[Explanation | None]] = _ByName("record")
    fits: ClassVar[_ByName[Sequence[str]]] = _ByName("record")
    advice: ClassVar[_ByName[Advice | None]] = _ByName("record")
    distributed: ClassVar[_ByName[Sequence[dict[str, Any]]]] = _ByName("record")
    simulated: ClassVar[_ByName[Sequence[dict[str, int]]]] = _ByName("record")
    status: ClassVar[_ByName[Status]] = _ByName("outcome")
    message: ClassVar[_ByName[str | None]] = _ByName("outcome")
    detail: ClassVar[_ByName[Sequence[str]]] = _ByName("outcome")
    budget_limits: ClassVar[_ByName[dict[str, Any] | None]] = _ByName("budget", "limits")
    budget_text: ClassVar[_ByName[str | None]] = _ByName("budget", "text")
    baseline_entry: ClassVar[_ByName[Entry | None]] = _ByName("", "entry")
    peak_bytes: ClassVar[_ByName[int | None]] = _ByName("record")

    def to_json(self) -> dict[str, Any]:
        """The test's entry in the `--gpumem-json` report (a value a hook left of another type as it is)."""
        return write_entry(self.named())

    @classmethod
    def from_json(cls, data: object, where: str = "result") -> TestResult:
        """The result a report's entry holds, as `to_json` writes it and nothing else: `OffShape` names the
        JSON path of the first value that is not (under `where`, the entry's own path)."""
        read = vars(decode(_entry_layout(), data, where))  # every value as a result holds it, but its phases
        return cls._made({**read, "phases": Phases(read["phases"])}, _bare)


_PARTS: dict[str, type] = {"record": WrittenRecord, "outcome": Outcome, "budget": BudgetView}
_CLASSES: dict[str, type] = {**_PARTS, "": TestResult}
_RENAMED = {("budget", "limits"): "budget_limits", ("budget", "text"): "budget_text", ("", "entry"): "baseline_entry"}
_WHERE = {
    _RENAMED.get((part, f.name), f.name): (part, f.name)
    for part, cls in _CLASSES.items()
    for f in dataclasses.fields(cls)
    if f.name not in _PARTS
}
"""Each field of a result by its name in the report and the JSON layout: (its part, its name there; "" the
result's own)."""
REPORT_NAMES = tuple(_WHERE)
"""Every field of a result's parts (and its own) by its name in the report."""
_BY_PART = [
    (part, made, [(n, inner) for n, (p, inner) in _WHERE.items() if p == part]) for part, made in _PARTS.items()
]
_OWN = [(name, inner) for name, (part, inner) in _WHERE.items() if not part]

_PUBLISHED = (
    *("nodeid", "backend", "device", "peak_bytes", "call", "phases", "budget", "budget_text", "status"),
    *("message", "detail", "info", "baseline", "record", "notes", "worker_device", "explanation", "html"),
    *("fits", "advice", "distributed", "simulated"),
)
"""The keys of a report's entry in their published order (docs/reference/json.md); a key added later
follows them."""


@cache
def _entry_layout() -> type:
    """A report's entry as the JSON codec reads and writes it: a flat class of every field of a result by
    its name in the report, each with its part's annotation (its key, words, range and reader)."""
    hints = {part: get_type_hints(cls, localns=_late_names(), include_extras=True) for part, cls in _CLASSES.items()}
    fields = {part: {f.name: f for f in dataclasses.fields(cls)} for part, cls in _CLASSES.items()}
    made = [
        (name, hints[part][inner], field(default_factory=default_of(fields[part][inner])))
        for name, (part, inner) in _WHERE.items()
    ]
    keys = [unwrap(tp, Spec())[1].key or name for name, tp, _ in made]
    order = (*_PUBLISHED, *(key for key in keys if key not in _PUBLISHED))
    namespace = {"__json_keys__": order, "__json_derived__": ("peak_bytes",), "peak_bytes": property(_peak)}
    return dataclasses.make_dataclass("TestResult", made, namespace=namespace, frozen=True)


def default_of(f: dataclasses.Field[Any]) -> Callable[[], Any]:
    """What makes field `f`'s default (None where it has none)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory
    value = None if f.default is dataclasses.MISSING else f.default
    return lambda: value


def write_entry(named: Mapping[str, Any]) -> dict[str, Any]:
    """A result's entry in the report from its fields by their names (a result's, a hook's copy's)."""
    written: dict[str, Any] = encode(_Named(named), _entry_layout())
    return written


class _Named:
    """Fields by name as attributes, for the codec's writer."""

    def __init__(self, named: Mapping[str, Any]) -> None:
        self.__dict__.update(named)

    @property
    def peak_bytes(self) -> int | None:
        return _peak(self)


def _peak(value: Any) -> int | None:
    return None if value.call is None else value.call.peak_bytes
