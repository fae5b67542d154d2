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
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from cuda_allocator_model import MAX_BYTES
from pytest_gpumem.results.checks import (
    check_bytes,
    count,
    exact_keys,
    fields,
    flag,
    json_key,
    listed,
    number,
    refuse,
    short,
    signed_bytes,
    text,
    texts,
)
from pytest_gpumem.results.explanation import Cell, Composition, PhaseComposition, composition_to_json
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


@dataclass(frozen=True, slots=True)
class DeviceIdentity:
    """What a baseline is valid for: the measuring backend and the device (for CUDA: capability, memory)."""

    backend: str
    device: str
    capability: str | None = None
    total_memory: int | None = None
    key: str = field(init=False, repr=False, compare=False, default="")
    """The entry key: ``"cuda | NVIDIA H200 | cc 9.0 | 150754820096 B"``, ``"tracker | cpu"``."""

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"identity.backend: expected a non-empty string, got {short(self.backend)}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"identity.device: expected a non-empty string, got {short(self.device)}")
        if self.capability is not None and (not isinstance(self.capability, str) or not self.capability):
            raise ValueError(f"identity.capability: expected a string like '9.0' or null, got {short(self.capability)}")
        if self.total_memory is not None:
            check_bytes(self.total_memory, "identity.total_memory")
        parts = [self.backend, self.device]
        if self.capability is not None:
            parts.append(f"cc {self.capability}")
        if self.total_memory is not None:
            parts.append(f"{self.total_memory} B")
        object.__setattr__(self, "key", " | ".join(parts))

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "device": self.device,
            "capability": self.capability,
            "total_memory": self.total_memory,
        }

    @classmethod
    def from_json(cls, obj: object) -> DeviceIdentity:
        d = exact_keys(obj, "identity", ("backend", "device", "capability", "total_memory"))
        return cls(d["backend"], d["device"], d["capability"], d["total_memory"])


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
    peak_bytes: int
    phases: Mapping[str, int]
    torch: str | None
    cuda: str | None
    gradients: Fingerprint | None = None
    composition: Composition | None = None  # per phase: what its peak was made of (explain.growth.compact)

    def __post_init__(self) -> None:
        if not isinstance(self.identity, DeviceIdentity):
            raise ValueError(f"identity: expected a DeviceIdentity, got {short(self.identity)}")
        check_bytes(self.peak_bytes, "peak_bytes")
        if not isinstance(self.phases, Mapping):
            raise ValueError(f"phases: expected an object of phase name -> bytes, got {short(self.phases)}")
        phases = dict(self.phases)
        for name, value in phases.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"phases: phase names must be non-empty strings, got {short(name)}")
            if type(value) is not int or not 0 <= value <= MAX_BYTES:  # the name is formatted only when needed
                check_bytes(value, f"phases[{json_key(name)}]")
        object.__setattr__(self, "phases", phases)
        for attr in ("torch", "cuda"):
            value = getattr(self, attr)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{attr}: expected a version string or null, got {short(value)}")
        if self.gradients is not None and not isinstance(self.gradients, Fingerprint):
            raise ValueError(f"gradients: expected a gradients.Fingerprint, got {short(self.gradients)}")
        if self.composition is not None and not sound_composition(self.composition):
            raise ValueError(f"composition: expected phase name -> PhaseComposition, got {short(self.composition)}")

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
        """JSON-able dict (the file's entry form; also what xdist workers send to the controller)."""
        out: dict[str, Any] = {
            "identity": self.identity.to_json(),
            "peak_bytes": self.peak_bytes,
            "phases": dict(self.phases),
            "torch": self.torch,
            "cuda": self.cuda,
        }
        if self.gradients is not None:
            out["gradients"] = self.gradients.to_json()
        if self.composition is not None:
            out["composition"] = composition_to_json(self.composition)
        return out

    @classmethod
    def from_json(cls, obj: object) -> Entry:
        """Validate and build; ``ValueError`` says what is wrong, relative to the entry."""
        if not isinstance(obj, dict):
            raise ValueError(f"expected an object, got {short(obj)}")
        for required in ("identity", "peak_bytes", "phases", "torch", "cuda"):
            if required not in obj:
                raise ValueError(f"missing key {required!r}")
        for key in obj:
            if key not in _ENTRY_KEYS:
                raise ValueError(f"unknown key {key!r}")
        if not isinstance(obj["phases"], dict):
            raise ValueError(f"phases: expected an object of phase name -> bytes, got {short(obj['phases'])}")
        grads, composition = obj.get("gradients"), obj.get("composition")
        return cls(
            identity=DeviceIdentity.from_json(obj["identity"]),
            peak_bytes=obj["peak_bytes"],
            phases=obj["phases"],
            torch=obj["torch"],
            cuda=obj["cuda"],
            gradients=None if grads is None else Fingerprint.from_json(grads),
            composition=None if composition is None else check_composition(composition),
        )


_ENTRY_KEYS = frozenset(("identity", "peak_bytes", "phases", "torch", "cuda", "gradients", "composition"))


def check_composition(obj: object) -> Composition:
    """The typed form of a stored composition, ``{phase: {"categories": {name: bytes}, "cells": [[category,
    module, bytes], ...], "folded": {group: blocks}}}`` ("folded" is absent in compositions made before
    repeated blocks were folded); a byte count may be negative (a phase that freed what was alive at its
    start). ``ValueError`` names what is wrong."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"composition: expected an object of phase name -> parts, got {short(obj)}")
    out: Composition = {}
    for phase, parts in obj.items():
        where = f"composition[{json_key(str(phase))}]"
        if not isinstance(phase, str) or not phase:
            raise ValueError(f"composition: phase names must be non-empty strings, got {short(phase)}")
        folded = parts.get("folded") if isinstance(parts, dict) else None
        parts = exact_keys(parts, where, ("categories", "cells", *(("folded",) if folded is not None else ())))
        categories, cells = parts["categories"], parts["cells"]
        if folded is not None and not _is_folded(folded):
            raise ValueError(f"{where}.folded: expected an object of module group -> blocks, got {short(folded)}")
        if not isinstance(categories, dict) or not all(
            isinstance(k, str) and signed_bytes(v) for k, v in categories.items()
        ):
            raise ValueError(f"{where}.categories: expected an object of category -> bytes, got {short(categories)}")
        if not isinstance(cells, list) or not all(_is_cell(cell) for cell in cells):
            raise ValueError(f"{where}.cells: expected a list of [category, module, bytes], got {short(cells)}")
        out[phase] = PhaseComposition(
            dict(categories), [Cell(*cell) for cell in cells], None if folded is None else dict(folded)
        )
    return out


def sound_composition(composition: object) -> bool:
    """Whether a typed composition holds what ``check_composition`` accepts from a file."""
    return isinstance(composition, dict) and all(
        isinstance(phase, str) and phase and isinstance(parts, PhaseComposition) and _sound_parts(parts)
        for phase, parts in composition.items()
    )


def _sound_parts(parts: PhaseComposition) -> bool:
    return (
        all(isinstance(k, str) and signed_bytes(v) for k, v in parts.categories.items())
        and all(isinstance(c.category, str) and isinstance(c.module, str) and signed_bytes(c.size) for c in parts.cells)
        and (parts.folded is None or _is_folded(parts.folded))
    )


def _is_folded(obj: object) -> bool:
    return isinstance(obj, dict) and all(isinstance(g, str) and signed_bytes(n) and n > 0 for g, n in obj.items())


def _is_cell(cell: object) -> bool:
    return (
        isinstance(cell, list)
        and len(cell) == 3
        and isinstance(cell[0], str)
        and isinstance(cell[1], str)
        and signed_bytes(cell[2])
    )


@dataclass(frozen=True, slots=True)
class PhaseComparison:
    """One compared peak: ``phase`` is ``None`` for the whole call phase."""

    phase: str | None
    baseline: int | None
    current: int | None
    allowed: int | None
    change_percent: float | None
    status: BaselineStatus
    message: str | None = None

    @property
    def label(self) -> str:
        return "call" if self.phase is None else self.phase

    def to_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "baseline": self.baseline,
            "current": self.current,
            "allowed": self.allowed,
            "change_percent": self.change_percent,
            "status": self.status,
            "message": self.message,
        }

    @classmethod
    def from_json(cls, obj: object, where: str = "comparison") -> PhaseComparison:
        """What `to_json` wrote; `OffShape` names the JSON path of the first value it would not write."""
        d = fields(obj, where, _COMPARISON_KEYS)
        change = d["change_percent"]
        return cls(
            phase=None if d["phase"] is None else text(d["phase"], f"{where}.phase", "a phase's name or null"),
            baseline=_bytes_or_none(d["baseline"], f"{where}.baseline"),
            current=_bytes_or_none(d["current"], f"{where}.current"),
            allowed=_bytes_or_none(d["allowed"], f"{where}.allowed"),
            change_percent=None if change is None else number(change, f"{where}.change_percent"),
            status=_word(d["status"], f"{where}.status"),
            message=None if d["message"] is None else text(d["message"], f"{where}.message"),
        )


@dataclass(frozen=True, slots=True)
class Verdict:
    """Outcome of comparing one test with its baseline.

    ``status`` is the memory verdict (``REGRESSED`` if any peak regressed, else ``IMPROVED`` if any
    improved, else ``NEW`` without a baseline, else ``ok``); ``gradient_status`` is ``None`` when no
    gradients were compared. ``problems`` are the lines that made it fail (``failed``), ``notes`` inform.
    """

    nodeid: str
    status: BaselineStatus
    comparisons: tuple[PhaseComparison, ...]
    problems: tuple[str, ...]
    notes: tuple[str, ...]
    gradient_status: BaselineStatus | None = None
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
        return {
            "nodeid": self.nodeid,
            "status": self.status,
            "comparisons": [c.to_json() for c in self.comparisons],
            "problems": list(self.problems),
            "notes": list(self.notes),
            "gradient_status": self.gradient_status,
            "failed": self.failed,
        }

    @classmethod
    def from_json(cls, obj: object, where: str = "baseline") -> Verdict:
        """What `to_json` wrote; `OffShape` names the JSON path of the first value it would not write."""
        d = fields(obj, where, _VERDICT_KEYS)
        comparisons = listed(d["comparisons"], f"{where}.comparisons")
        gradients = d["gradient_status"]
        return cls(
            nodeid=text(d["nodeid"], f"{where}.nodeid", "a node id"),
            status=_word(d["status"], f"{where}.status"),
            comparisons=tuple(
                PhaseComparison.from_json(c, f"{where}.comparisons[{i}]") for i, c in enumerate(comparisons)
            ),
            problems=tuple(texts(d["problems"], f"{where}.problems")),
            notes=tuple(texts(d["notes"], f"{where}.notes")),
            gradient_status=None if gradients is None else _word(gradients, f"{where}.gradient_status"),
            failed=flag(d["failed"], f"{where}.failed"),
        )


_COMPARISON_KEYS = ("phase", "baseline", "current", "allowed", "change_percent", "status", "message")
_VERDICT_KEYS = ("nodeid", "status", "comparisons", "problems", "notes", "gradient_status", "failed")
_WORDS = {status.value: status for status in BaselineStatus}


def _word(value: object, where: str) -> BaselineStatus:
    if not isinstance(value, str) or value not in _WORDS:
        raise refuse(where, f"one of {', '.join(_WORDS)}", value)
    return _WORDS[value]


def _bytes_or_none(value: object, where: str) -> int | None:
    return None if value is None else count(value, where, what="an integer of bytes or null")
