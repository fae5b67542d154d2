"""The baseline store: load, validate, compare, update, prune and atomically write ``gpumem-baselines.json``.

Baseline files arrive in pull requests, so they are plain JSON (never pickle or ``torch.load``), validated
strictly, and written with stable formatting (``indent=2``, sorted keys, trailing newline) so that a diff
shows exactly the tests whose memory changed. This module never imports torch.

File schema (version 1)::

    {
      "entries": {
        "<test node id>": {
          "<identity key>": {
            "cuda": "12.8",                      # torch.version.cuda when recorded, or null
            "gradients": {...},                  # optional: gradients.Fingerprint.to_json()
            "identity": {
              "backend": "cuda",                 # how memory was measured: cuda, xpu, mps, tracker, ...
              "capability": "9.0",               # CUDA compute capability, or null
              "device": "NVIDIA H200",           # device name
              "total_memory": 150754820096       # bytes, or null
            },
            "peak_bytes": 16777216,              # peak of the whole call phase
            "phases": {"backward": 8388608, "forward": 16777216},
            "torch": "2.13.0"                    # torch.__version__ when recorded, or null
          }
        }
      },
      "schema": "pytest-gpumem-baselines",
      "version": 1
    }

The identity key is ``DeviceIdentity.key``, e.g. ``"cuda | NVIDIA H200 | cc 9.0 | 150754820096 B"`` or
``"tracker | cpu"``; it must match the entry's ``identity``. Unknown keys, non-integer or negative byte
counts, NaN, duplicate keys, a foreign ``schema`` and a ``version`` newer than ``VERSION`` are refused with
one :class:`BaselineError` naming the file and the problem; the file is never touched by a failed load.

Comparison (``compare``) is one-sided. With tolerance ``t`` percent and slack ``s`` bytes, a stored peak
``b`` allows ``b + floor(b * t / 100) + s`` bytes: one byte more is ``REGRESSED`` (fails). Below
``b * (1 - t / 100) - s`` is ``IMPROVED`` (passes, "baseline can be lowered"). A test without a baseline
for this device is ``NEW`` (passes unless strict). Integer arithmetic only, so the boundary is exact.

Typical use in the plugin::

    store = load(path)                                   # BaselineError -> pytest.UsageError
    for line in environment_warnings(store, identity, env): warn once
    verdict = compare(nodeid, current_entry, store.get(nodeid, identity), Tolerance(5, 1 << 20))
    ...
    summary = update(store, {nodeid: entry for tests that ran and passed})
    prune(store, unused(store, identity, seen_nodeids), identity, summary=summary)   # --gpumem-prune
    if summary.changed: write(store)
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import os
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from json.encoder import encode_basestring
from pathlib import Path
from typing import Any, Literal

from pytest_gpumem.constants import DEFAULT_FILENAME, DEFAULT_SLACK_BYTES, DEFAULT_TOLERANCE_PERCENT
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.gradients import Fingerprint, GradientComparison, compare_fingerprints
from pytest_gpumem.sizes import format_size

__all__ = [
    "DEFAULT_FILENAME",
    "DEFAULT_SLACK_BYTES",
    "DEFAULT_TOLERANCE_PERCENT",
    "SCHEMA",
    "VERSION",
    "BaselineError",
    "BaselineStore",
    "DeviceIdentity",
    "Entry",
    "Environment",
    "PhaseComparison",
    "Tolerance",
    "UpdateSummary",
    "Verdict",
    "compare",
    "dumps",
    "environment_warnings",
    "load",
    "loads",
    "prune",
    "unused",
    "update",
    "write",
]

SCHEMA = "pytest-gpumem-baselines"
VERSION = 1

Status = Literal["ok", "REGRESSED", "IMPROVED", "NEW"]
"""Memory verdict of a test (``Verdict.status``)."""
PhaseStatus = Literal["ok", "REGRESSED", "IMPROVED", "NEW", "MISSING"]
"""Per comparison; ``MISSING``: the baseline has this phase, the run did not measure it (a note)."""
GradientStatus = Literal["ok", "CHANGED", "NEW"]
Change = Literal["added", "updated", "unchanged"]

SizeFormatter = Callable[[int], str]


class BaselineError(GpuMemError):
    """A baseline file that cannot be read or written; the one-line message names the file."""


# ------------------------------------------------------------------------------------------- data types


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
            raise ValueError(f"identity.backend: expected a non-empty string, got {_short(self.backend)}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"identity.device: expected a non-empty string, got {_short(self.device)}")
        if self.capability is not None and (not isinstance(self.capability, str) or not self.capability):
            raise ValueError(
                f"identity.capability: expected a string like '9.0' or null, got {_short(self.capability)}"
            )
        if self.total_memory is not None:
            _check_bytes(self.total_memory, "identity.total_memory")
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
        d = _exact_keys(obj, "identity", ("backend", "device", "capability", "total_memory"))
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

    def __post_init__(self) -> None:
        if not isinstance(self.identity, DeviceIdentity):
            raise ValueError(f"identity: expected a DeviceIdentity, got {_short(self.identity)}")
        _check_bytes(self.peak_bytes, "peak_bytes")
        if not isinstance(self.phases, Mapping):
            raise ValueError(f"phases: expected an object of phase name -> bytes, got {_short(self.phases)}")
        phases = dict(self.phases)
        for name, value in phases.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"phases: phase names must be non-empty strings, got {_short(name)}")
            if type(value) is not int or value < 0:
                _check_bytes(value, f"phases[{_key(name)}]")
        object.__setattr__(self, "phases", phases)
        for attr in ("torch", "cuda"):
            value = getattr(self, attr)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{attr}: expected a version string or null, got {_short(value)}")
        if self.gradients is not None and not isinstance(self.gradients, Fingerprint):
            raise ValueError(f"gradients: expected a gradients.Fingerprint, got {_short(self.gradients)}")

    @classmethod
    def measured(
        cls,
        identity: DeviceIdentity,
        env: Environment,
        peak_bytes: int,
        phases: Mapping[str, int],
        gradients: Fingerprint | None = None,
    ) -> Entry:
        """A measurement of this run, ready for ``compare`` and ``update``."""
        return cls(identity, peak_bytes, phases, env.torch, env.cuda, gradients)

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
        return out

    @classmethod
    def from_json(cls, obj: object) -> Entry:
        """Validate and build; ``ValueError`` says what is wrong, relative to the entry."""
        if not isinstance(obj, dict):
            raise ValueError(f"expected an object, got {_short(obj)}")
        for required in ("identity", "peak_bytes", "phases", "torch", "cuda"):
            if required not in obj:
                raise ValueError(f"missing key {required!r}")
        for key in obj:
            if key not in _ENTRY_KEYS:
                raise ValueError(f"unknown key {key!r}")
        if not isinstance(obj["phases"], dict):
            raise ValueError(f"phases: expected an object of phase name -> bytes, got {_short(obj['phases'])}")
        grads = obj.get("gradients")
        return cls(
            identity=DeviceIdentity.from_json(obj["identity"]),
            peak_bytes=obj["peak_bytes"],
            phases=obj["phases"],
            torch=obj["torch"],
            cuda=obj["cuda"],
            gradients=None if grads is None else Fingerprint.from_json(grads),
        )


_ENTRY_KEYS = frozenset(("identity", "peak_bytes", "phases", "torch", "cuda", "gradients"))


@dataclass
class BaselineStore:
    """All baselines of one file: ``entries[nodeid][identity_key] -> Entry``.

    ``existed`` says whether the file was there when loaded (a missing file loads as an empty store).
    """

    path: Path
    entries: dict[str, dict[str, Entry]] = field(default_factory=dict)
    existed: bool = False

    def get(self, nodeid: str, identity: DeviceIdentity) -> Entry | None:
        return self.entries.get(nodeid, {}).get(identity.key)

    def put(self, nodeid: str, entry: Entry) -> Change:
        """Record ``entry`` for ``nodeid`` on its device; say whether it was added, updated or unchanged."""
        if not isinstance(nodeid, str) or not nodeid:
            raise ValueError(f"node id must be a non-empty string, got {_short(nodeid)}")
        per_device = self.entries.setdefault(nodeid, {})
        key = entry.identity.key
        old = per_device.get(key)
        per_device[key] = entry
        if old is None:
            return "added"
        return "unchanged" if old.to_json() == entry.to_json() else "updated"

    def remove(self, nodeid: str, identity: DeviceIdentity) -> bool:
        per_device = self.entries.get(nodeid)
        if per_device is None or per_device.pop(identity.key, None) is None:
            return False
        if not per_device:
            del self.entries[nodeid]
        return True

    def nodeids(self, identity: DeviceIdentity) -> list[str]:
        """Node ids with a baseline for ``identity``, sorted."""
        key = identity.key
        return sorted(n for n, per_device in self.entries.items() if key in per_device)

    def __len__(self) -> int:
        return sum(len(per_device) for per_device in self.entries.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "version": VERSION,
            "entries": {
                nodeid: {key: entry.to_json() for key, entry in per_device.items()}
                for nodeid, per_device in self.entries.items()
                if per_device
            },
        }


# ------------------------------------------------------------------------------------------ load / write


def load(path: str | os.PathLike[str]) -> BaselineStore:
    """Read and validate a baseline file; a missing file is an empty store. Never modifies the file."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        return BaselineStore(path=p, existed=False)
    except OSError as exc:
        raise BaselineError(f"cannot read baseline file {p}: {exc.strerror or exc}") from None
    return loads(raw, p)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building many acyclic objects (halves load time in a big process)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def loads(data: str | bytes, path: str | os.PathLike[str] = DEFAULT_FILENAME) -> BaselineStore:
    """Parse and validate file content; ``path`` names the file in errors and becomes ``store.path``."""
    with _gc_paused():
        return _loads(data, Path(path))


def _loads(data: str | bytes, p: Path) -> BaselineStore:

    def fail(problem: str) -> BaselineError:
        return BaselineError(f"baseline file {p}: {problem}")

    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise fail(f"not UTF-8 text (byte {exc.start}); fix or delete it") from None
    else:
        text = data
    if not text.strip():
        raise fail("file is empty (truncated?); fix or delete it")
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except _JSONRefused as exc:
        raise fail(f"{exc}; fix or delete it") from None
    except json.JSONDecodeError as exc:
        if "\n<<<<<<< " in "\n" + text:
            hint = " (merge conflict markers?)"
        elif not text.rstrip().endswith("}"):
            hint = " (truncated?)"
        else:
            hint = ""
        raise fail(
            f"not valid JSON{hint}: {exc.msg} (line {exc.lineno}, column {exc.colno}); fix or delete it"
        ) from None
    except RecursionError:
        raise fail("not valid JSON: nested too deeply") from None
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        raise fail(f'not a pytest-gpumem baseline file (no "schema": "{SCHEMA}")')
    version = obj.get("version")
    if type(version) is not int or version < 1:
        raise fail(f'"version" must be an integer >= 1, got {_short(version)}')
    if version > VERSION:
        raise fail(
            f"schema version {version} is newer than this pytest-gpumem reads ({VERSION}); upgrade pytest-gpumem"
        )
    for key in obj:
        if key not in ("schema", "version", "entries"):
            raise fail(f"unknown top-level key {key!r}")
    raw_entries = obj.get("entries")
    if not isinstance(raw_entries, dict):
        raise fail(f'"entries" must be an object, got {_short(raw_entries)}')
    entries: dict[str, dict[str, Entry]] = {}
    for nodeid, per_device in raw_entries.items():
        if not nodeid:
            raise fail("entries: empty test node id")
        if not isinstance(per_device, dict):
            raise fail(f"entries[{_key(nodeid)}]: expected an object of device -> entry, got {_short(per_device)}")
        built: dict[str, Entry] = {}
        for key, value in per_device.items():
            try:
                entry = Entry.from_json(value)
            except ValueError as exc:
                raise fail(f"entries[{_key(nodeid)}][{_key(key)}]: {exc}") from None
            if entry.identity.key != key:
                raise fail(
                    f"entries[{_key(nodeid)}][{_key(key)}]: key does not match its identity "
                    f"(expected {_key(entry.identity.key)})"
                )
            built[key] = entry
        if built:
            entries[nodeid] = built
    return BaselineStore(path=p, entries=entries, existed=True)


def dumps(store: BaselineStore) -> str:
    """The file content: JSON, indent 2, sorted keys, non-ASCII kept, trailing newline.

    Byte for byte ``json.dumps(store.to_json(), indent=2, sort_keys=True, ensure_ascii=False,
    allow_nan=False) + "\\n"``, about twice as fast (the stdlib's indenting encoder is pure Python).
    """
    with _gc_paused():
        return _dumps(store)


def _dumps(store: BaselineStore) -> str:
    out: list[str] = []
    app = out.append
    app('{\n  "entries": ')
    nodeids = sorted(n for n, per_device in store.entries.items() if per_device)
    if not nodeids:
        app("{}")
    else:
        identities: dict[str, str] = {}
        sep = "{\n    "
        for nodeid in nodeids:
            per_device = store.entries[nodeid]
            app(sep)
            app(encode_basestring(nodeid))
            sep2 = ": {\n      "
            for key in sorted(per_device):
                app(sep2)
                app(encode_basestring(key))
                app(": ")
                _emit_entry(per_device[key], identities, app)
                sep2 = ",\n      "
            app("\n    }")
            sep = ",\n    "
        app("\n  }")
    app(f',\n  "schema": {encode_basestring(SCHEMA)},\n  "version": {VERSION}\n}}\n')
    return "".join(out)


def _emit_entry(entry: Entry, identities: dict[str, str], app: Callable[[str], object]) -> None:
    """One entry at the file's fixed depth (fields indented by 8), exactly as ``json.dumps`` writes it."""
    app('{\n        "cuda": ')
    app(_scalar(entry.cuda))
    if entry.gradients is not None:
        app(',\n        "gradients": ')
        _emit(entry.gradients.to_json(), "        ", app)
    ident = entry.identity
    text = identities.get(ident.key)
    if text is None:
        text = (
            ',\n        "identity": {\n'
            f'          "backend": {encode_basestring(ident.backend)},\n'
            f'          "capability": {_scalar(ident.capability)},\n'
            f'          "device": {encode_basestring(ident.device)},\n'
            f'          "total_memory": {_scalar(ident.total_memory)}\n'
            "        }"
        )
        identities[ident.key] = text
    app(text)
    app(f',\n        "peak_bytes": {int.__repr__(entry.peak_bytes)},\n        "phases": ')
    phases = entry.phases
    if phases:
        app(
            "{\n          "
            + ",\n          ".join(
                f"{encode_basestring(name)}: {int.__repr__(phases[name])}" for name in sorted(phases)
            )
            + "\n        }"
        )
    else:
        app("{}")
    app(f',\n        "torch": {_scalar(entry.torch)}\n      }}')


def _scalar(value: str | int | None) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return encode_basestring(value)
    return int.__repr__(value)


def _emit(obj: object, indent: str, app: Callable[[str], object]) -> None:
    if isinstance(obj, str):
        app(encode_basestring(obj))
    elif obj is True:
        app("true")
    elif obj is False:
        app("false")
    elif type(obj) is int:
        app(int.__repr__(obj))
    elif obj is None:
        app("null")
    elif type(obj) is dict:
        if not obj:
            app("{}")
            return
        inner = indent + "  "
        sep = "{\n" + inner
        for key in sorted(obj):
            if type(key) is not str:
                raise TypeError(f"JSON object keys must be strings, got {key!r}")
            app(sep)
            app(encode_basestring(key))
            app(": ")
            _emit(obj[key], inner, app)
            sep = ",\n" + inner
        app("\n" + indent + "}")
    elif type(obj) is float:
        if not math.isfinite(obj):
            raise ValueError(f"out of range float values are not JSON compliant: {obj!r}")
        app(float.__repr__(obj))
    elif type(obj) is list:
        if not obj:
            app("[]")
            return
        inner = indent + "  "
        sep = "[\n" + inner
        for value in obj:
            app(sep)
            _emit(value, inner, app)
            sep = ",\n" + inner
        app("\n" + indent + "]")
    else:
        raise TypeError(f"cannot write {type(obj).__name__} {obj!r} to a baseline file")


def write(store: BaselineStore, path: str | os.PathLike[str] | None = None) -> Path:
    """Write atomically: temp file in the same folder, fsync, ``os.replace``. Returns the path written.

    On any failure the previous file is left as it was, the temp file is removed, and a
    :class:`BaselineError` is raised (``KeyboardInterrupt`` and friends propagate unchanged).
    A symlink is followed (its target is replaced); an existing file keeps its permission bits.
    """
    target = Path(os.path.realpath(path if path is not None else store.path))
    folder = target.parent
    tmp: str | None = None
    try:
        text = dumps(store)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, _mode_for(target))
        os.replace(tmp, target)
        tmp = None
    except Exception as exc:
        raise BaselineError(
            f"could not write baseline file {target}: {_describe(exc)}; the previous file is unchanged"
        ) from exc
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    _fsync_dir(folder)
    return target


def _mode_for(target: Path) -> int:
    try:
        return target.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows cannot open folders
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


class _JSONRefused(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _JSONRefused(f"duplicate key {_key(key)}")
            seen.add(key)
    return out


def _no_constant(name: str) -> Any:
    raise _JSONRefused(f"{name} is not a valid JSON number")


# -------------------------------------------------------------------------------------------- comparing


@dataclass(frozen=True, slots=True)
class Tolerance:
    """One-sided tolerance: ``percent`` of the stored value plus ``slack_bytes``.

    ``upper(b)`` is the largest passing value for a stored ``b``; ``lower(b)`` the smallest value that is
    not an improvement. Exact integer arithmetic (``percent`` is read as the decimal it prints as).
    """

    percent: float = DEFAULT_TOLERANCE_PERCENT
    slack_bytes: int = DEFAULT_SLACK_BYTES
    _num: int = field(init=False, repr=False, compare=False, default=0)
    _den: int = field(init=False, repr=False, compare=False, default=1)

    def __post_init__(self) -> None:
        if isinstance(self.percent, bool) or not isinstance(self.percent, (int, float)):
            raise ValueError(f"tolerance must be a number of percent, got {_short(self.percent)}")
        if not math.isfinite(self.percent) or self.percent < 0:
            raise ValueError(f"tolerance must be a finite percentage >= 0, got {self.percent!r}")
        _check_bytes(self.slack_bytes, "slack")
        ratio = _ratio(float(self.percent))
        object.__setattr__(self, "_num", ratio.numerator)
        object.__setattr__(self, "_den", ratio.denominator)

    def upper(self, stored: int) -> int:
        return stored + (stored * self._num) // self._den + self.slack_bytes

    def lower(self, stored: int) -> int:
        # ceil(stored * (1 - p) - slack)
        return -((-(stored * (self._den - self._num) - self.slack_bytes * self._den)) // self._den)

    def describe(self, fmt: SizeFormatter = format_size) -> str:
        pct = f"{self.percent:g}%"
        return f"{pct} + {fmt(self.slack_bytes)}" if self.slack_bytes else pct


@functools.lru_cache(maxsize=64)
def _ratio(percent: float) -> Fraction:
    return Fraction(repr(percent)) / 100


@dataclass(frozen=True, slots=True)
class PhaseComparison:
    """One compared peak: ``phase`` is ``None`` for the whole call phase."""

    phase: str | None
    baseline: int | None
    current: int | None
    allowed: int | None
    change_percent: float | None
    status: PhaseStatus
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
    def from_json(cls, obj: Mapping[str, Any]) -> PhaseComparison:
        return cls(**obj)


@dataclass(frozen=True, slots=True)
class Verdict:
    """Outcome of comparing one test with its baseline.

    ``status`` is the memory verdict (``REGRESSED`` if any peak regressed, else ``IMPROVED`` if any
    improved, else ``NEW`` without a baseline, else ``ok``); ``gradient_status`` is ``None`` when no
    gradients were compared. ``problems`` are the lines that made it fail (``failed``), ``notes`` inform.
    """

    nodeid: str
    status: Status
    comparisons: tuple[PhaseComparison, ...]
    problems: tuple[str, ...]
    notes: tuple[str, ...]
    gradient_status: GradientStatus | None = None
    failed: bool = False

    @property
    def messages(self) -> tuple[str, ...]:
        return self.problems + self.notes

    @property
    def label(self) -> str:
        """One word for a report column: ``REGRESSED``, ``CHANGED`` (gradients), else ``status``."""
        if self.status == "REGRESSED":
            return "REGRESSED"
        if self.gradient_status == "CHANGED":
            return "CHANGED"
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
    def from_json(cls, obj: Mapping[str, Any]) -> Verdict:
        return cls(
            nodeid=obj["nodeid"],
            status=obj["status"],
            comparisons=tuple(PhaseComparison.from_json(c) for c in obj["comparisons"]),
            problems=tuple(obj["problems"]),
            notes=tuple(obj["notes"]),
            gradient_status=obj["gradient_status"],
            failed=obj["failed"],
        )


def compare(
    nodeid: str,
    current: Entry,
    baseline: Entry | None,
    tolerance: Tolerance | None = None,
    *,
    strict: bool = False,
    fmt: SizeFormatter = format_size,
    grad_rtol: float | Mapping[str, float] | None = None,
    grad_atol: float | None = None,
) -> Verdict:
    """Compare a measurement with its stored baseline (``store.get(nodeid, current.identity)``).

    The whole-call peak and every phase are compared. Growth beyond ``tolerance.upper`` fails:
    ``"forward peak 20.1 MiB is 25.6% above baseline 16.0 MiB (tolerance 5% + 1.0 MiB)"``. A drop below
    ``tolerance.lower`` passes with an "improved" note. No baseline: ``NEW``, failing only when
    ``strict`` (which also fails a phase or gradients without a baseline). Gradients are compared when
    both sides have fingerprints (``grad_rtol``/``grad_atol`` as in ``compare_fingerprints``).
    """
    tol = tolerance if tolerance is not None else _DEFAULT_TOLERANCE
    if baseline is None:
        hint = f"no baseline for this test on {current.identity.key} (record one with --gpumem-update)"
        comparisons = [PhaseComparison(None, None, current.peak_bytes, None, None, "NEW")]
        comparisons.extend(PhaseComparison(n, None, v, None, None, "NEW") for n, v in current.phases.items())
        return Verdict(
            nodeid=nodeid,
            status="NEW",
            comparisons=tuple(comparisons),
            problems=(hint,) if strict else (),
            notes=() if strict else (hint,),
            gradient_status=None if current.gradients is None else "NEW",
            failed=strict,
        )
    results = [_compare_one(None, baseline.peak_bytes, current.peak_bytes, tol, fmt)]
    base_phases = baseline.phases
    for name, value in current.phases.items():
        results.append(_compare_one(name, base_phases.get(name), value, tol, fmt))
    for name, value in base_phases.items():
        if name not in current.phases:
            results.append(_compare_one(name, value, None, tol, fmt))
    problems: list[str] = []
    notes: list[str] = []
    status: Status = "ok"
    for c in results:
        if c.status == "ok":
            continue
        if c.status == "REGRESSED":
            status = "REGRESSED"
        elif c.status == "IMPROVED" and status == "ok":
            status = "IMPROVED"
        if c.message is not None:
            if c.status == "REGRESSED" or (strict and c.status == "NEW"):
                problems.append(c.message)
            else:
                notes.append(c.message)

    gradient_status: GradientStatus | None = None
    if current.gradients is not None and baseline.gradients is not None:
        grads: GradientComparison = compare_fingerprints(
            baseline.gradients, current.gradients, rtol=grad_rtol, atol=grad_atol
        )
        gradient_status = "ok" if grads.ok else "CHANGED"
        problems.extend(grads.messages)
        notes.extend(grads.notes)
    elif current.gradients is not None:
        gradient_status = "NEW"
        message = "gradients have no baseline (record one with --gpumem-update)"
        (problems if strict else notes).append(message)
    elif baseline.gradients is not None:
        notes.append("the baseline has gradient fingerprints, this run recorded none")
    return Verdict(
        nodeid=nodeid,
        status=status,
        comparisons=tuple(results),
        problems=tuple(problems),
        notes=tuple(notes),
        gradient_status=gradient_status,
        failed=bool(problems),
    )


def _compare_one(
    phase: str | None, stored: int | None, current: int | None, tol: Tolerance, fmt: SizeFormatter
) -> PhaseComparison:
    label = "call" if phase is None else phase
    if stored is None:
        assert current is not None
        message = f"{label} peak {fmt(current)} has no baseline (record one with --gpumem-update)"
        return PhaseComparison(phase, None, current, None, None, "NEW", message)
    if current is None:
        message = f"{label} has a baseline ({fmt(stored)}) but was not measured in this run"
        return PhaseComparison(phase, stored, None, None, None, "MISSING", message)
    allowed = tol.upper(stored)
    change = (current - stored) * 100 / stored if stored else None
    if current > allowed:
        by = f"is {_pct(change, tol.percent)}% above" if change is not None else "is above"
        message = f"{label} peak {fmt(current)} {by} baseline {fmt(stored)} (tolerance {tol.describe(fmt)})"
        return PhaseComparison(phase, stored, current, allowed, change, "REGRESSED", message)
    if current < tol.lower(stored):
        drop = -change if change is not None else 0.0
        message = (
            f"{label} peak {fmt(current)} is {_pct(drop, tol.percent)}% below baseline {fmt(stored)} "
            f"(tolerance {tol.describe(fmt)}): improved, baseline can be lowered (--gpumem-update)"
        )
        return PhaseComparison(phase, stored, current, allowed, change, "IMPROVED", message)
    return PhaseComparison(phase, stored, current, allowed, change, "ok")


def _pct(change: float, tolerance: float) -> str:
    """One decimal, or more where one would hide that the change exceeds the tolerance (5.0% vs 5%)."""
    text = f"{change:.1f}"
    return text if float(text) > tolerance else f"{change:.6g}"


def environment_warnings(store: BaselineStore, identity: DeviceIdentity, env: Environment) -> list[str]:
    """Warnings to show once per run: baselines recorded with other torch/CUDA versions, or for other
    devices only. Empty when everything matches (or the store is empty)."""
    key = identity.key
    mine = 0
    others: dict[str, int] = {}
    versions: dict[Environment, int] = {}
    for per_device in store.entries.values():
        for k, entry in per_device.items():
            if k == key:
                mine += 1
                if entry.torch != env.torch or entry.cuda != env.cuda:
                    e = entry.environment
                    versions[e] = versions.get(e, 0) + 1
            else:
                others[k] = others.get(k, 0) + 1
    warnings: list[str] = []
    if mine == 0 and others:
        listed = ", ".join(f"{k} ({n})" for k, n in sorted(others.items(), key=lambda kv: (-kv[1], kv[0]))[:3])
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        warnings.append(f"{store.path} has no baselines for this device ({key}); it has baselines for {listed}{more}")
    if versions:
        n = sum(versions.values())
        ranked = sorted(versions.items(), key=lambda kv: (-kv[1], kv[0].describe()))
        listed = ", ".join(f"{e.describe()} ({c})" for e, c in ranked[:3])
        more = f" and {len(ranked) - 3} more" if len(ranked) > 3 else ""
        warnings.append(
            f"{n} of {mine} baselines in {store.path} for {key} were recorded with {listed}{more}; "
            f"this run uses {env.describe()}: peaks can differ between versions "
            "(refresh with --gpumem-update)"
        )
    return warnings


# ------------------------------------------------------------------------------------ update and prune


@dataclass
class UpdateSummary:
    """Node ids by what happened to their entry (for the current device); ``removed`` comes from prune."""

    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        """Whether the file needs writing."""
        return bool(self.added or self.updated or self.removed)

    def describe(self) -> str:
        """``"2 added, 1 updated, 10 unchanged, 0 removed"``."""
        return (
            f"{len(self.added)} added, {len(self.updated)} updated, "
            f"{len(self.unchanged)} unchanged, {len(self.removed)} removed"
        )

    def to_json(self) -> dict[str, list[str]]:
        return {
            "added": list(self.added),
            "updated": list(self.updated),
            "unchanged": list(self.unchanged),
            "removed": list(self.removed),
        }


def update(
    store: BaselineStore,
    results: Mapping[str, Entry] | Iterable[tuple[str, Entry]],
    *,
    keep_within: Tolerance | None = None,
    summary: UpdateSummary | None = None,
) -> UpdateSummary:
    """Record the measurements of tests that ran and passed; every other entry stays as it is.

    ``results`` maps node ids to ``Entry.measured(...)`` (pass only tests whose body passed; a memory
    regression itself is what an update accepts). Each entry is stored under its own identity, so xdist
    workers on different devices are fine. With ``keep_within``, a stored entry whose peaks are all within
    that tolerance, with the same phases, matching gradients and the same versions, is kept byte for byte
    ("unchanged"), so re-recording noise does not churn the file.
    """
    out = summary if summary is not None else UpdateSummary()
    items = results.items() if isinstance(results, Mapping) else results
    for nodeid, entry in items:
        if keep_within is not None:
            old = store.get(nodeid, entry.identity)
            if old is not None and _equivalent(old, entry, keep_within):
                out.unchanged.append(nodeid)
                continue
        change = store.put(nodeid, entry)
        getattr(out, change).append(nodeid)
    return out


def _equivalent(old: Entry, new: Entry, tol: Tolerance) -> bool:
    if old.torch != new.torch or old.cuda != new.cuda or set(old.phases) != set(new.phases):
        return False
    if (old.gradients is None) != (new.gradients is None):
        return False
    pairs = [(old.peak_bytes, new.peak_bytes), *((old.phases[k], new.phases[k]) for k in old.phases)]
    if any(not (tol.lower(b) <= c <= tol.upper(b)) for b, c in pairs):
        return False
    if old.gradients is not None and new.gradients is not None:
        return compare_fingerprints(old.gradients, new.gradients).ok
    return True


def unused(store: BaselineStore, identity: DeviceIdentity, seen_nodeids: Collection[str]) -> list[str]:
    """Node ids with a baseline for ``identity`` that are not in ``seen_nodeids``, sorted.

    Meaningful only after a full, unfiltered run: pass every collected test that was selected, whether
    it passed, failed or was skipped (a test skipped here keeps its baseline). Entries for other devices
    are never unused.
    """
    seen = seen_nodeids if isinstance(seen_nodeids, (set, frozenset)) else set(seen_nodeids)
    return [n for n in store.nodeids(identity) if n not in seen]


def prune(
    store: BaselineStore,
    nodeids: Iterable[str],
    identity: DeviceIdentity,
    *,
    summary: UpdateSummary | None = None,
) -> UpdateSummary:
    """Remove the entries of ``nodeids`` for ``identity`` (typically ``unused(...)``); others stay."""
    out = summary if summary is not None else UpdateSummary()
    for nodeid in nodeids:
        if store.remove(nodeid, identity):
            out.removed.append(nodeid)
    return out


# ------------------------------------------------------------------------------------------------ helpers


def _check_bytes(value: object, what: str) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(f"{what}: expected an integer >= 0 (bytes), got {_short(value)}")


def _exact_keys(obj: object, where: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object, got {_short(obj)}")
    for k in keys:
        if k not in obj:
            raise ValueError(f"{where}: missing key {k!r}")
    for k in obj:
        if k not in keys:
            raise ValueError(f"{where}: unknown key {k!r}")
    return obj


def _key(name: str) -> str:
    return encode_basestring(name)


def _short(v: object, limit: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_DEFAULT_TOLERANCE = Tolerance()
