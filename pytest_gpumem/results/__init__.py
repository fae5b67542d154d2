"""What a measurement produces: one result per phase and one per test, both JSON-able."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

from cuda_allocator_model import MAX_BYTES
from pytest_gpumem.errors import GpuMemError, first_line
from pytest_gpumem.results.checks import OffShape, Unplaced, refuse
from pytest_gpumem.results.codec import BYTES, SIGNED, Spec, Wording, decode, encode, read

if TYPE_CHECKING:  # imported where a result is read back (start-up needs neither)
    from pytest_gpumem.results.advice import Advice
    from pytest_gpumem.results.baseline import Entry, Verdict
    from pytest_gpumem.results.explanation import Explanation

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


def _read_phases(value: Any, where: str | None, wording: Wording) -> dict[str, PhaseResult]:
    """Phases by name, each named by the key it sits under (`PHASES`, a field's spec)."""
    if not isinstance(value, dict):
        raise wording.refuse(where, "an object", value)
    phases = {}
    for name, phase in value.items():
        if not name:
            raise Unplaced() if where is None else OffShape(f"{where} has a phase with no name")
        figures: PhaseResult = read(PhaseResult, phase, None if where is None else wording.member(where, name), wording)
        phases[name] = replace(figures, name=name)
    return phases


PHASES = Spec(via=(_read_phases, lambda phases: {name: phase.to_json() for name, phase in phases.items()}))
"""A field of phases by name (a result's, a rank's): each written by its `to_json`, which a hook's value of
another type is told it lacks."""


def _read_simulated(value: Any, where: str | None, wording: Wording) -> list[dict[str, int]]:
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
    return value


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
    __json_keys__ = (
        *("nodeid", "backend", "device", "peak_bytes", "call", "phases", "budget", "budget_text", "status"),
        *("message", "detail", "info", "baseline", "record", "notes", "worker_device", "explanation", "html"),
        *("fits", "advice", "distributed", "simulated"),
    )
    __json_derived__ = ("peak_bytes",)
    __json_names__ = staticmethod(_late_names)

    nodeid: Annotated[str, Spec(expected="a node id", check=bool)]
    backend: Annotated[str, Spec(expected="a backend's name")]
    device: Annotated[str, Spec(expected="a device's name")]
    call: Annotated[PhaseResult | None, _OBJECT]
    phases: Annotated[Mapping[str, PhaseResult], PHASES] = field(default_factory=dict)  # read-only once made
    budget_limits: Annotated[dict[str, Any] | None, Spec(key="budget", expected="an object")] = None
    budget_text: str | None = None
    status: Annotated[Status, _STATUS] = Status.OK
    message: str | None = None
    detail: Sequence[str] = ()  # what the one-line message left to the report section (a tuple once made)
    info: dict[str, Any] = field(default_factory=dict)  # the test's own, in JSON types
    verdict: Annotated[Verdict | None, _whole(_verdict, "baseline")] = None
    baseline_entry: Annotated[Entry | None, _whole(_entry, "record")] = None
    notes: Sequence[str] = ()
    worker_device: str | None = None  # under --gpumem-devices: which of the caller's devices a worker used
    # what made each peak (pytest_gpumem.explain.composition), when asked for
    explanation: Annotated[Explanation | None, _whole(_explanation)] = None
    html_path: Annotated[str | None, Spec(key="html")] = None  # the picture of an explained test (--gpumem-html)
    fits: Sequence[str] = ()
    advice: Annotated[Advice | None, _whole(_advice)] = None
    distributed: Sequence[dict[str, Any]] = ()
    simulated: Annotated[Sequence[dict[str, int]], Spec(via=(_read_simulated, _listed))] = ()

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
        """The test's entry in the `--gpumem-json` report (a value a hook left of another type as it is), the
        same for the copy a hook is handed (a subclass)."""
        written: dict[str, Any] = encode(self, TestResult)
        return written

    @classmethod
    def from_json(cls, data: object, where: str = "result") -> TestResult:
        """The result a report's entry holds, as `to_json` writes it and nothing else: `OffShape` names the
        JSON path of the first value that is not (under `where`, the entry's own path)."""
        return decode(cls, data, where)


_SEQUENCES = tuple(f.name for f in dataclasses.fields(TestResult) if "Sequence[" in str(f.type).split(",")[0])
"""TestResult's fields declared as sequences: a list given for one is kept as a tuple."""
