"""What a measurement produces: one result per phase and one per test, both JSON-able."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

from cuda_allocator_model import MAX_BYTES
from pytest_gpumem.errors import GpuMemError, first_line
from pytest_gpumem.results.checks import (
    OffShape,
    count,
    fields,
    first_difference,
    listed,
    member,
    refuse,
    short,
    text,
    texts,
)
from pytest_gpumem.results.codec import BYTES, SIGNED, Spec, encode, read

if TYPE_CHECKING:  # imported where a result is read back (start-up needs neither)
    from pytest_gpumem.results.advice import Advice
    from pytest_gpumem.results.baseline import Entry, Verdict
    from pytest_gpumem.results.explanation import Explanation

T = TypeVar("T")

REPORT_ATTRIBUTE = "gpumem_result"  # the test report's attribute that carries its result (JSON text) to xdist
RANK_SEPARATOR = "@rank"  # a distributed test's per-rank phases are named `phase@rankN`


def rank_phase(name: str, rank: int) -> str:
    """The name of phase `name` as recorded for rank `rank`: `name@rankN`."""
    return f"{name}{RANK_SEPARATOR}{rank}"


def split_rank(name: str) -> tuple[str, int | None]:
    """`name@rankN` as `rank_phase` writes it -> (name, N); any other name (`x@rank01` too) -> (name, None)."""
    base, separator, rank = name.rpartition(RANK_SEPARATOR)
    if separator and base and rank.isdigit() and rank.isascii() and str(int(rank)) == rank:
        return base, int(rank)
    return name, None


class Status(str, Enum):
    """What became of a measured test; the value is the word in the report, the JSON and JUnit."""

    OK = "ok"
    NEW = "NEW"  # passed; no baseline to compare with
    IMPROVED = "IMPROVED"  # passed; below its baseline by more than the tolerance
    OVER_BUDGET = "OVER BUDGET"
    OUT_OF_MEMORY = "OUT OF MEMORY"
    LEAKED = "LEAKED"
    REGRESSED = "REGRESSED"
    GRADIENTS_CHANGED = "GRADIENTS CHANGED"
    MISSING_BASELINE = "MISSING BASELINE"  # no baseline, and the run requires one
    ERROR = "error"  # unmeasurable, or failed for a reason the measurement did not see
    XFAILED = "xfailed"
    XPASS = "XPASS"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of(cls, value: object) -> Status:
        """`value` as a status: a `Status`, or its word (what a hook or a backend may set as a plain string)."""
        try:
            return cls(value)
        except ValueError:
            words = ", ".join(status.value for status in cls)
            raise GpuMemError(f"result.status: {value!r} is not a status (one of: {words})") from None

    @property
    def passing(self) -> bool:
        """Whether the test passed as far as the measurement knows."""
        return self in (Status.OK, Status.NEW, Status.IMPROVED)

    @property
    def leaves_evidence(self) -> bool:
        """Whether the test leaves its memory trace in --gpumem-snapshot-dir."""
        return self in (Status.OUT_OF_MEMORY, Status.LEAKED, Status.OVER_BUDGET, Status.REGRESSED)


PRECEDENCE = (
    Status.OUT_OF_MEMORY,
    Status.OVER_BUDGET,
    Status.LEAKED,
    Status.REGRESSED,
    Status.GRADIENTS_CHANGED,
    Status.MISSING_BASELINE,
    Status.ERROR,
    Status.XPASS,
    Status.XFAILED,
    Status.IMPROVED,
    Status.NEW,
    Status.OK,
)
"""The statuses, the worst first: of two that apply to a test, the earlier is its status."""


def first_of(statuses: Iterable[Status]) -> Status:
    """The worst of `statuses` (`PRECEDENCE`), OK when there is none."""
    return min(statuses, key=PRECEDENCE.index, default=Status.OK)


_NAMED = Spec(outside=True, absent=lambda: "call")


@dataclass(frozen=True)
class PhaseResult:
    """Bytes of one phase, as the backend counts them, above what was allocated when it began.

    `peak_bytes`: peak allocated (the allocator's rounded sizes on CUDA, or the tracker's counting);
    `requested_peak_bytes`: the same with unrounded request sizes; `reserved_peak_bytes`: the peak of
    the allocator's reserved memory (absolute, None where the backend has no cache); `net_bytes`:
    allocated at the end minus at the start (negative when the phase freed more than it kept);
    `count`: how many times the phase was entered (peaks are the maximum over entries).
    """

    name: Annotated[str, _NAMED]  # the key the figures sit under: read back, "call" until its reader names it
    peak_bytes: Annotated[int, BYTES]
    requested_peak_bytes: Annotated[int, BYTES]
    reserved_peak_bytes: Annotated[int | None, BYTES]
    net_bytes: Annotated[int, SIGNED]
    count: Annotated[int, Spec(expected="a count of entries (1 or more)", low=1, high=MAX_BYTES)] = 1
    # the distributed rank these figures are from (the worst one for a maximum)
    rank: Annotated[int | None, Spec(expected="a rank (0 or more)", low=0, high=MAX_BYTES, omit=None)] = None

    def merged(self, later: PhaseResult) -> PhaseResult:
        reserved = [r for r in (self.reserved_peak_bytes, later.reserved_peak_bytes) if r is not None]
        return PhaseResult(
            name=self.name,
            peak_bytes=max(self.peak_bytes, later.peak_bytes),
            requested_peak_bytes=max(self.requested_peak_bytes, later.requested_peak_bytes),
            reserved_peak_bytes=max(reserved) if reserved else None,
            net_bytes=later.net_bytes,
            count=self.count + later.count,
            rank=later.rank if later.peak_bytes > self.peak_bytes else self.rank,
        )

    @classmethod
    def from_json(cls, name: str, data: object, where: str) -> PhaseResult:
        """The figures `to_json` wrote for phase `name`; `OffShape` names the first that is not a count."""
        phase: PhaseResult = read(cls, data, where)
        return replace(phase, name=name)

    def to_json(self) -> dict[str, Any]:
        """The phase's figures as the report writes them (its name is the key they sit under)."""
        written: dict[str, Any] = encode(self)
        return written


class Phases(dict[str, "PhaseResult"]):
    """A result's phases by name: a dict that refuses changes once made (it copies, pickles and compares as a
    dict, which a read-only view of one does not)."""

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("a result's phases are read-only: dataclasses.replace(result, phases=...) makes a new one")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __reduce__(self) -> tuple[type[Phases], tuple[dict[str, PhaseResult]]]:
        return type(self), (dict(self),)


def _listed(value: object) -> object:
    """A tuple as the JSON list it is written as; anything else (a hook's) as it is."""
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class TestResult:
    """Everything measured for one test call, plus its budget and verdict: a value, never changed once
    made (a change is a new result, `dataclasses.replace`); a `pytest_gpumem_result` hook is handed a copy
    whose fields it may set, which then replaces the result (`run/hand_over.py`).

    `info` is the test's own `gpumem.info`; what pytest-gpumem measured on request has fields of its
    own: `fits` (each `gpumem.fit()`'s sentence), `advice` (the last `gpumem.advise()`), `distributed`
    (a summary per `gpumem.distributed()` world) and `simulated` (each `gpumem.simulate_rank()`'s world
    size and rank). `budget_limits` is the budget's limits as its JSON writes them, `verdict` the
    baseline's comparison, `baseline_entry` the figures recorded as the test's baseline (None unless
    they are) and `html_path` the path of its picture (--gpumem-html) as the report shows it.
    """

    __test__ = False  # not a test class, despite its name

    nodeid: str
    backend: str
    device: str
    call: PhaseResult | None
    phases: Mapping[str, PhaseResult] = field(default_factory=dict)  # read-only once made
    budget_limits: dict[str, Any] | None = None
    budget_text: str | None = None
    status: Status = Status.OK
    message: str | None = None
    detail: Sequence[str] = ()  # what the one-line message left to the report section (a tuple once made)
    info: dict[str, Any] = field(default_factory=dict)  # the test's own, in JSON types
    verdict: Verdict | None = None
    baseline_entry: Entry | None = None
    notes: Sequence[str] = ()
    worker_device: str | None = None  # under --gpumem-devices: which of the caller's devices a worker used
    explanation: Explanation | None = None  # what made each peak (pytest_gpumem.explain.composition), when asked for
    html_path: str | None = None  # the picture of an explained test (--gpumem-html)
    fits: Sequence[str] = ()
    advice: Advice | None = None
    distributed: Sequence[dict[str, Any]] = ()
    simulated: Sequence[dict[str, int]] = ()

    def __post_init__(self) -> None:
        """The status as a `Status` (a word is one: what a hook may set), lists as tuples and the phases
        read-only. Anything else is left as given, for `to_json` and the reading back to refuse."""
        setting = object.__setattr__  # the one place a result's fields are set: as it is made
        setting(self, "status", Status.of(self.status))
        if isinstance(self.phases, Mapping) and not isinstance(self.phases, Phases):
            setting(self, "phases", Phases(self.phases))
        for name in _SEQUENCES:
            if isinstance(getattr(self, name), list):
                setting(self, name, tuple(getattr(self, name)))

    @property
    def peak_bytes(self) -> int | None:
        return None if self.call is None else self.call.peak_bytes

    def to_json(self) -> dict[str, Any]:
        """The test's entry in the `--gpumem-json` report."""
        return {
            "nodeid": self.nodeid,
            "backend": self.backend,
            "device": self.device,
            "peak_bytes": self.peak_bytes,
            "call": None if self.call is None else self.call.to_json(),
            "phases": {name: phase.to_json() for name, phase in self.phases.items()},
            "budget": self.budget_limits,
            "budget_text": self.budget_text,
            "status": self.status.value,
            "message": self.message,
            "detail": _listed(self.detail),
            "info": self.info,
            "baseline": None if self.verdict is None else self.verdict.to_json(),
            "record": None if self.baseline_entry is None else self.baseline_entry.to_json(),
            "notes": _listed(self.notes),
            "worker_device": self.worker_device,
            "explanation": None if self.explanation is None else self.explanation.to_json(),
            "html": self.html_path,
            "fits": _listed(self.fits),
            "advice": None if self.advice is None else self.advice.to_json(),
            "distributed": _listed(self.distributed),
            "simulated": _listed(self.simulated),
        }

    @classmethod
    def from_json(cls, data: object, where: str = "result") -> TestResult:
        """The result a report's entry holds, as `to_json` writes it and nothing else: `OffShape` names the
        JSON path of the first value that is not (under `where`, the entry's own path)."""
        from pytest_gpumem.results.advice import Advice
        from pytest_gpumem.results.baseline import Entry, Verdict
        from pytest_gpumem.results.explanation import Explanation

        d = fields(data, where, _RESULT_KEYS)

        def maybe(key: str, read: Callable[[Any, str], T]) -> T | None:
            return None if d[key] is None else _nested(read, d[key], f"{where}.{key}")

        call = None if d["call"] is None else PhaseResult.from_json("call", d["call"], f"{where}.call")
        result = cls(
            nodeid=text(d["nodeid"], f"{where}.nodeid", "a node id") or _empty(f"{where}.nodeid"),
            backend=text(d["backend"], f"{where}.backend", "a backend's name"),
            device=text(d["device"], f"{where}.device", "a device's name"),
            call=call,
            phases=_phases(d["phases"], f"{where}.phases"),
            budget_limits=None if d["budget"] is None else _object(d["budget"], f"{where}.budget"),
            budget_text=_text_or_none(d["budget_text"], f"{where}.budget_text"),
            status=_status(d["status"], f"{where}.status"),
            message=_text_or_none(d["message"], f"{where}.message"),
            detail=texts(d["detail"], f"{where}.detail"),
            info=_object(d["info"], f"{where}.info"),
            verdict=maybe("baseline", lambda v, w: Verdict.from_json(v, w)),
            baseline_entry=maybe("record", lambda v, _: Entry.from_json(v)),
            notes=texts(d["notes"], f"{where}.notes"),
            worker_device=_text_or_none(d["worker_device"], f"{where}.worker_device"),
            explanation=maybe("explanation", lambda v, w: Explanation.from_json(v, w)),
            html_path=_text_or_none(d["html"], f"{where}.html"),
            fits=texts(d["fits"], f"{where}.fits"),
            advice=maybe("advice", lambda v, w: Advice.from_json(_object(v, w), w)),
            distributed=[
                _object(w, f"{where}.distributed[{i}]")
                for i, w in enumerate(listed(d["distributed"], f"{where}.distributed"))
            ],
            simulated=[
                _simulated(s, f"{where}.simulated[{i}]")
                for i, s in enumerate(listed(d["simulated"], f"{where}.simulated"))
            ],
        )
        _same_as_written(d, result, where)
        return result


_SEQUENCES = tuple(f.name for f in dataclasses.fields(TestResult) if str(f.type).startswith("Sequence["))
"""TestResult's fields declared as sequences: a list given for one is kept as a tuple."""


_RESULT_KEYS = tuple(TestResult("", "", "", None).to_json())
"""The keys of a report's entry: all of them, always."""


def _nested(read: Callable[[Any, str], T], value: object, where: str) -> T:
    """`read(value, where)`; whatever it raises for a value not shaped as written becomes `OffShape` at
    `where` (a reader that names the path itself raises `OffShape` already)."""
    try:
        return read(value, where)
    except OffShape:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise OffShape(f"{where}: {first_line(exc)}") from None


def _same_as_written(read: dict[str, Any], result: TestResult, where: str) -> None:
    """Refuse an entry that its result would write otherwise: a value cast on the way in ("12" for 12),
    a `peak_bytes` that is not the call's, a default filled in."""
    written = json.loads(json.dumps(result.to_json(), allow_nan=False))
    found = first_difference(read, written, where)
    if found is not None:
        raise OffShape(f"{found[0]} is not as pytest-gpumem writes it, got {short(found[1])}")


def _empty(where: str) -> str:
    raise OffShape(f"{where} must be a node id, got ''")


def _text_or_none(value: object, where: str) -> str | None:
    return None if value is None else text(value, where, "a string or null")


def _object(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise refuse(where, "an object", value)
    return value


def _status(value: object, where: str) -> Status:
    if not isinstance(value, str) or value not in _STATUS_WORDS:
        raise refuse(where, "a status word as the report writes it ('ok', 'REGRESSED', ...)", value)
    return Status(value)


_STATUS_WORDS = frozenset(status.value for status in Status)


def _phases(value: object, where: str) -> dict[str, PhaseResult]:
    phases = _object(value, where)
    out: dict[str, PhaseResult] = {}
    for name, phase in phases.items():
        at = member(where, name)
        if not name:
            raise OffShape(f"{where} has a phase with no name")
        out[name] = PhaseResult.from_json(name, phase, at)
    return out


def _simulated(value: object, where: str) -> dict[str, int]:
    return {key: count(n, f"{where}.{key}", what="an integer") for key, n in _object(value, where).items()}
