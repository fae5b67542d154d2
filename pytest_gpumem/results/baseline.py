"""Typed baseline results: what a baseline is for (``DeviceIdentity``, ``Environment``), one stored or
measured ``Entry``, and a test's comparison with it (``PhaseComparison``, ``Verdict``, and the words they
are made of, ``BaselineStatus``).

Each type has one JSON form: an entry's is the baseline file's entry (``baselines.schema`` reads the
file around it), and a verdict's is the ``"baseline"`` of a test in the ``--gpumem-json`` report. An
entry validates itself; ``Entry.from_json`` raises a ``ValueError`` naming the offending key. No torch,
no pytest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Annotated, Any

from pytest_gpumem.results.codec import BYTES, STORED, STORED_BYTES, Spec, decode, encode, validate
from pytest_gpumem.results.explanation import COMPOSITION, Composition, StoredComposition
from pytest_gpumem.results.gradients import Fingerprint

__all__ = [
    "BaselineStatus",
    "DeviceIdentity",
    "Entry",
    "Environment",
    "PhaseComparison",
    "Verdict",
    "check_composition",
    "sound_composition",
]


class BaselineStatus(str, Enum):
    """What a comparison with a baseline found; the value is the word in messages and the JSON.

    A phase's peak (``PhaseComparison.status``) and a test's memory (``Verdict.status``) are ``OK``,
    ``REGRESSED``, ``IMPROVED`` or ``NEW``; a phase also ``MISSING`` (the baseline has it, the run did not
    measure it: a note). Gradients (``Verdict.gradient_status``) are ``OK``, ``CHANGED`` or ``NEW``.
    """

    OK = "ok"
    REGRESSED = "REGRESSED"
    IMPROVED = "IMPROVED"
    NEW = "NEW"
    MISSING = "MISSING"
    CHANGED = "CHANGED"

    def __str__(self) -> str:
        return self.value


_NAME = Spec(expected="a non-empty string", check=bool)
_VERSION = Spec(expected="a version string or null", check=bool)
_PHASES = Spec(
    expected="an object of phase name -> bytes", names=bool, names_expected="phase names must be non-empty strings"
)
_STORED_COMPOSITION = replace(COMPOSITION, omit=None)  # explain.growth.compact's


@dataclass(frozen=True, slots=True)
class DeviceIdentity:
    """What a baseline is valid for: the measuring backend and the device (for CUDA: capability, memory)."""

    backend: Annotated[str, _NAME]
    device: Annotated[str, _NAME]
    capability: Annotated[str | None, Spec(expected="a string like '9.0' or null", check=bool)] = None
    total_memory: Annotated[int | None, STORED_BYTES] = None
    key: str = field(init=False, repr=False, compare=False, default="")
    """The entry key: ``"cuda | NVIDIA H200 | cc 9.0 | 150754820096 B"``, ``"tracker | cpu"``."""

    def __post_init__(self) -> None:
        validate(self, "identity")
        parts = [self.backend, self.device]
        if self.capability is not None:
            parts.append(f"cc {self.capability}")
        if self.total_memory is not None:
            parts.append(f"{self.total_memory} B")
        object.__setattr__(self, "key", " | ".join(parts))

    @classmethod
    def from_json(cls, obj: object) -> DeviceIdentity:
        """A backend's identity as a mapping of its JSON keys (`run/regression.py`); `ValueError` names the key."""
        return decode(cls, obj, "identity", STORED)


@dataclass(frozen=True, slots=True)
class Environment:
    """Software versions stored with each entry: ``torch.__version__`` and ``torch.version.cuda``."""

    torch: str | None
    cuda: str | None

    @classmethod
    def from_torch(cls, torch_module: Any) -> Environment:
        """From an already imported torch module (this module never imports torch itself)."""
        cuda = getattr(getattr(torch_module, "version", None), "cuda", None)
        return cls(torch=str(torch_module.__version__), cuda=None if cuda is None else str(cuda))

    def describe(self) -> str:
        torch = f"torch {self.torch}" if self.torch is not None else "unknown torch"
        return f"{torch} / CUDA {self.cuda}" if self.cuda is not None else f"{torch} / no CUDA"


@dataclass(frozen=True, slots=True)
class Entry:
    """One baseline (or one measurement to compare or record): peaks in bytes for a test on a device."""

    identity: DeviceIdentity
    peak_bytes: Annotated[int, STORED_BYTES]
    phases: Annotated[Mapping[str, Annotated[int, STORED_BYTES]], _PHASES]
    torch: Annotated[str | None, _VERSION]
    cuda: Annotated[str | None, _VERSION]
    gradients: Annotated[Fingerprint | None, Spec(omit=None, expected="an object")] = None
    composition: Annotated[Composition | None, _STORED_COMPOSITION] = None  # per phase: what made its peak

    def __post_init__(self) -> None:
        validate(self, "")
        object.__setattr__(self, "phases", dict(self.phases))

    @classmethod
    def measured(
        cls,
        identity: DeviceIdentity,
        env: Environment,
        peak_bytes: int,
        phases: Mapping[str, int],
        gradients: Fingerprint | None = None,
        composition: Composition | None = None,
    ) -> Entry:
        """A measurement of this run, ready for ``compare`` and ``update``."""
        return cls(identity, peak_bytes, phases, env.torch, env.cuda, gradients, composition)

    @property
    def environment(self) -> Environment:
        return Environment(self.torch, self.cuda)

    def to_json(self) -> dict[str, Any]:
        """The file's entry form (also a report's `record`, and what xdist workers send to the controller)."""
        out: dict[str, Any] = encode(self)
        return out

    @classmethod
    def from_json(cls, obj: object) -> Entry:
        """The entry `to_json` wrote; a `ValueError` says what is wrong, relative to the entry."""
        return decode(cls, obj, "", STORED)


def check_composition(obj: object) -> Composition:
    """The typed form of a stored composition (`Entry.composition`); `ValueError` names what is wrong."""
    composition: Composition = decode(StoredComposition, obj, "composition", STORED)
    return composition


def sound_composition(composition: object) -> bool:
    """Whether a typed composition holds what ``check_composition`` accepts from a file."""
    try:
        check_composition(encode(composition, Composition))
    except (ValueError, TypeError, AttributeError):
        return False
    return True


@dataclass(frozen=True, slots=True)
class PhaseComparison:
    """One compared peak: ``phase`` is ``None`` for the whole call phase."""

    phase: Annotated[str | None, Spec(expected="a phase's name or null")]
    baseline: Annotated[int, BYTES] | None
    current: Annotated[int, BYTES] | None
    allowed: Annotated[int, BYTES] | None
    change_percent: Annotated[float | None, Spec(expected="a number")]
    status: BaselineStatus
    message: Annotated[str | None, Spec(expected="a string")] = None

    @property
    def label(self) -> str:
        return "call" if self.phase is None else self.phase


@dataclass(frozen=True, slots=True)
class Verdict:
    """Outcome of comparing one test with its baseline.

    ``status`` is the memory verdict (``REGRESSED`` if any peak regressed, else ``IMPROVED`` if any
    improved, else ``NEW`` without a baseline, else ``ok``); ``gradient_status`` is ``None`` when no
    gradients were compared. ``problems`` are the lines that made it fail (``failed``), ``notes`` inform.
    """

    nodeid: Annotated[str, Spec(expected="a node id")]
    status: BaselineStatus
    comparisons: tuple[PhaseComparison, ...]
    problems: tuple[str, ...]
    notes: tuple[str, ...]
    gradient_status: Annotated[BaselineStatus | None, Spec(expected=f"one of {', '.join(BaselineStatus)}")] = None
    failed: bool = False

    @property
    def messages(self) -> tuple[str, ...]:
        return self.problems + self.notes

    @property
    def label(self) -> BaselineStatus:
        """One word for a report column: ``REGRESSED``, ``CHANGED`` (gradients), else ``status``."""
        if self.status == BaselineStatus.REGRESSED:
            return BaselineStatus.REGRESSED
        if self.gradient_status == BaselineStatus.CHANGED:
            return BaselineStatus.CHANGED
        return self.status

    def failure_message(self) -> str:
        """One line for the test's failure report (empty when not failed)."""
        return "; ".join(self.problems)

    def to_json(self) -> dict[str, Any]:
        """A test's `baseline` in the `--gpumem-json` report."""
        written: dict[str, Any] = encode(self)
        return written

    @classmethod
    def from_json(cls, obj: object, where: str = "baseline") -> Verdict:
        """What `to_json` wrote; `OffShape` names the JSON path of the first value it would not write."""
        return decode(cls, obj, where)
