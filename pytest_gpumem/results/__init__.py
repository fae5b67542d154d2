"""What a measurement produces: one result per phase and one per test, both JSON-able."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from pytest_gpumem.errors import GpuMemError

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


@dataclass(frozen=True)
class PhaseResult:
    """Bytes of one phase, as the backend counts them, above what was allocated when it began.

    `peak_bytes`: peak allocated (the allocator's rounded sizes on CUDA, or the tracker's counting);
    `requested_peak_bytes`: the same with unrounded request sizes; `reserved_peak_bytes`: the peak of
    the allocator's reserved memory (absolute, None where the backend has no cache); `net_bytes`:
    allocated at the end minus at the start (negative when the phase freed more than it kept);
    `count`: how many times the phase was entered (peaks are the maximum over entries).
    """

    name: str
    peak_bytes: int
    requested_peak_bytes: int
    reserved_peak_bytes: int | None
    net_bytes: int
    count: int = 1
    rank: int | None = None  # the distributed rank these figures are from (the worst one for a maximum)

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
        data = asdict(self)
        del data["name"]
        if self.rank is None:
            del data["rank"]
        return data


@dataclass
class TestResult:
    """Everything measured for one test call, plus its budget and verdict.

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
    phases: dict[str, PhaseResult] = field(default_factory=dict)
    budget_limits: dict[str, Any] | None = None
    budget_text: str | None = None
    status: Status = Status.OK
    message: str | None = None
    detail: list[str] = field(default_factory=list)  # what the one-line message left to the report section
    info: dict[str, Any] = field(default_factory=dict)
    verdict: Verdict | None = None
    baseline_entry: Entry | None = None
    notes: list[str] = field(default_factory=list)
    worker_device: str | None = None  # under --gpumem-devices: which of the caller's devices a worker used
    explanation: Explanation | None = None  # what made each peak (pytest_gpumem.explain.replay), when asked for
    html_path: str | None = None  # the picture of an explained test (--gpumem-html)
    fits: list[str] = field(default_factory=list)
    advice: Advice | None = None
    distributed: list[dict[str, Any]] = field(default_factory=list)
    simulated: list[dict[str, int]] = field(default_factory=list)

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, Status.of(value) if name == "status" else value)

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
            "detail": self.detail,
            "info": self.info,
            "baseline": None if self.verdict is None else self.verdict.to_json(),
            "record": None if self.baseline_entry is None else self.baseline_entry.to_json(),
            "notes": self.notes,
            "worker_device": self.worker_device,
            "explanation": None if self.explanation is None else self.explanation.to_json(),
            "html": self.html_path,
            "fits": self.fits,
            "advice": None if self.advice is None else self.advice.to_json(),
            "distributed": self.distributed,
            "simulated": self.simulated,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TestResult:
        """The result a report's entry holds."""
        from pytest_gpumem.results.advice import Advice
        from pytest_gpumem.results.baseline import Entry, Verdict
        from pytest_gpumem.results.explanation import Explanation

        call, info = data.get("call"), dict(data.get("info", {}))
        advice = data.get("advice")
        return cls(
            nodeid=data["nodeid"],
            backend=data["backend"],
            device=data["device"],
            call=None if call is None else PhaseResult(name="call", **call),
            phases={name: PhaseResult(name=name, **p) for name, p in data.get("phases", {}).items()},
            budget_limits=data.get("budget"),
            budget_text=data.get("budget_text"),
            status=Status.of(data.get("status", Status.OK)),
            message=data.get("message"),
            detail=list(data.get("detail") or []),
            info=info,
            verdict=None if data.get("baseline") is None else Verdict.from_json(data["baseline"]),
            baseline_entry=None if data.get("record") is None else Entry.from_json(data["record"]),
            notes=list(data.get("notes", [])),
            worker_device=data.get("worker_device"),
            explanation=None if data.get("explanation") is None else Explanation.from_json(data["explanation"]),
            html_path=data.get("html"),
            fits=list(data.get("fits") or []),
            advice=None if advice is None else Advice.from_json(advice),
            distributed=list(data.get("distributed") or []),
            simulated=list(data.get("simulated") or []),
        )


def settle(result: TestResult, report: Any) -> None:
    """Make `result` agree with pytest's verdict on the call (`report`): a test that failed for a reason
    the measurement did not see (a unittest body, an xfail) is not `ok`, and only a test that passed
    records its figures as a baseline."""
    expected_failure = hasattr(report, "wasxfail")
    if report.failed and result.status.passing:
        result.status = Status.ERROR
        result.message = _first_line(str(report.longreprtext)) or "the test failed"
    elif expected_failure and report.skipped:
        result.status = Status.XFAILED
    elif expected_failure and result.status.passing:
        result.status = Status.XPASS
    if not report.passed or expected_failure:
        result.baseline_entry = None


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E ")]
    return (errors or lines or [""])[0].removeprefix("E ").strip()


_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\u007e\u0080-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
"""What XML 1.0 cannot carry (and DEL), as pytest's junitxml sees it: control characters, NUL, lone
surrogates, U+FFFE and U+FFFF."""


def _xml_text(text: str) -> str:
    """`text` with each character XML cannot carry shown as `#xHH` (`#xHHHH` above 0xFF), every other
    character kept: what pytest's junitxml does to a property's value but not to its name."""
    return _NOT_XML.sub(lambda m: f"#x{ord(m.group()):02X}", text)


def junit_properties(result: TestResult) -> list[tuple[str, str]]:
    """What `--junitxml` shows of a measured test: its status and peaks in bytes, per phase (a phase's
    name with what XML cannot carry written as `#xHH`, so that the run's XML stays readable)."""
    properties = [("gpumem_status", result.status.value)]
    if result.call is not None:
        properties.append(("gpumem_peak_bytes", str(result.call.peak_bytes)))
    properties += [
        (_xml_text(f"gpumem_peak_bytes[{name}]"), str(phase.peak_bytes)) for name, phase in result.phases.items()
    ]
    return properties
