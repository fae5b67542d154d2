"""The baseline file: schema, validated load, and a merging, locked, atomic write of ``gpumem-baselines.json``.

Baseline files arrive in pull requests, so they are plain JSON (never pickle or ``torch.load``), validated
strictly, and written by the standard library's encoder with stable formatting (``indent=2``, sorted keys,
non-ASCII kept, trailing newline) so that a diff shows exactly the tests whose memory changed. This module
never imports torch or pytest; judging a measurement against an entry is ``compare.py``'s business.

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
``"tracker | cpu"``; it must match the entry's ``identity``. Anything but a regular file of at most
``MAX_FILE_BYTES``, unknown keys, byte counts outside ``0 <= n < 2**63``, NaN, duplicate keys, a foreign
``schema`` and a ``version`` newer than ``VERSION`` are refused with one :class:`BaselineError` naming the
file and the problem; a refused file is never touched, not by ``load`` and not by ``write``.

Concurrent writers merge: a store remembers what this run changed (``put``/``remove``), and ``write`` takes
an exclusive lock (``.<name>.lock`` next to the file, removed afterwards), re-reads the file when another
run has replaced it since it was loaded, applies this run's changes onto what is there now, and atomically
replaces it. Temporary files are named ``.<name>.<pid>.<random>.tmp``; ones left by killed writers are
removed by the next write.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from json.encoder import encode_basestring
from pathlib import Path
from typing import Any, Literal

from pytest_gpumem.constants import DEFAULT_FILENAME
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.gradients.fingerprint import Fingerprint
from pytest_gpumem.sizes import format_size, integer_words

__all__ = [
    "DEFAULT_FILENAME",
    "MAX_BYTES",
    "MAX_FILE_BYTES",
    "SCHEMA",
    "VERSION",
    "BaselineError",
    "BaselineStore",
    "DeviceIdentity",
    "Entry",
    "Environment",
    "UpdateSummary",
    "dumps",
    "load",
    "loads",
    "prune",
    "unused",
    "update",
    "write",
]

SCHEMA = "pytest-gpumem-baselines"
VERSION = 1
MAX_BYTES = 2**63
"""Byte counts are integers ``0 <= n < MAX_BYTES``."""
MAX_FILE_BYTES = 64 * 1024 * 1024
"""A larger baseline file is refused without being read."""
LOCK_TIMEOUT_S = 60.0
"""How long ``write`` waits for another run's write before giving up."""
STALE_TMP_AGE_S = 600.0
"""A temporary file this old is stale even when its pid looks alive (pids are reused)."""

Change = Literal["added", "updated", "unchanged"]


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
    composition: Mapping[str, Any] | None = None  # per phase: what its peak was made of (explain.compact)

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
            if type(value) is not int or not 0 <= value < MAX_BYTES:  # the name is formatted only when needed
                check_bytes(value, f"phases[{json_key(name)}]")
        object.__setattr__(self, "phases", phases)
        for attr in ("torch", "cuda"):
            value = getattr(self, attr)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{attr}: expected a version string or null, got {short(value)}")
        if self.gradients is not None and not isinstance(self.gradients, Fingerprint):
            raise ValueError(f"gradients: expected a gradients.Fingerprint, got {short(self.gradients)}")
        if self.composition is not None:
            object.__setattr__(self, "composition", check_composition(self.composition))

    @classmethod
    def measured(
        cls,
        identity: DeviceIdentity,
        env: Environment,
        peak_bytes: int,
        phases: Mapping[str, int],
        gradients: Fingerprint | None = None,
        composition: Mapping[str, Any] | None = None,
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
            out["composition"] = self.composition
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
        grads = obj.get("gradients")
        return cls(
            identity=DeviceIdentity.from_json(obj["identity"]),
            peak_bytes=obj["peak_bytes"],
            phases=obj["phases"],
            torch=obj["torch"],
            cuda=obj["cuda"],
            gradients=None if grads is None else Fingerprint.from_json(grads),
            composition=obj.get("composition"),
        )


_ENTRY_KEYS = frozenset(("identity", "peak_bytes", "phases", "torch", "cuda", "gradients", "composition"))


def check_composition(obj: object) -> dict[str, Any]:
    """``{phase: {"categories": {name: bytes}, "cells": [[category, module, bytes], ...], "folded": {group:
    blocks}}}`` ("folded" is absent in compositions made before repeated blocks were folded); a byte count
    may be negative (a phase that freed what was alive at its start)."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"composition: expected an object of phase name -> parts, got {short(obj)}")
    out: dict[str, Any] = {}
    for phase, parts in obj.items():
        where = f"composition[{json_key(str(phase))}]"
        if not isinstance(phase, str) or not phase:
            raise ValueError(f"composition: phase names must be non-empty strings, got {short(phase)}")
        folded = parts.get("folded") if isinstance(parts, dict) else None
        parts = _exact_keys(parts, where, ("categories", "cells", *(("folded",) if folded is not None else ())))
        categories, cells = parts["categories"], parts["cells"]
        if folded is not None and not _is_folded(folded):
            raise ValueError(f"{where}.folded: expected an object of module group -> blocks, got {short(folded)}")
        if not isinstance(categories, dict) or not all(
            isinstance(k, str) and _signed_bytes(v) for k, v in categories.items()
        ):
            raise ValueError(f"{where}.categories: expected an object of category -> bytes, got {short(categories)}")
        if not isinstance(cells, list) or not all(_is_cell(cell) for cell in cells):
            raise ValueError(f"{where}.cells: expected a list of [category, module, bytes], got {short(cells)}")
        out[phase] = {"categories": dict(categories), "cells": [list(cell) for cell in cells]}
        if folded is not None:
            out[phase]["folded"] = dict(folded)
    return out


def _is_folded(obj: object) -> bool:
    return isinstance(obj, dict) and all(isinstance(g, str) and _signed_bytes(n) and n > 0 for g, n in obj.items())


def _signed_bytes(value: object) -> bool:
    return type(value) is int and -MAX_BYTES < value < MAX_BYTES


def _is_cell(cell: object) -> bool:
    return (
        isinstance(cell, list)
        and len(cell) == 3
        and isinstance(cell[0], str)
        and isinstance(cell[1], str)
        and _signed_bytes(cell[2])
    )


Slot = tuple[str, str]
"""``(node id, identity key)``: where an entry lives in the file."""


@dataclass
class BaselineStore:
    """All baselines of one file: ``entries[nodeid][identity_key] -> Entry``.

    ``existed`` says whether the file was there when loaded (a missing file loads as an empty store).
    ``digest`` identifies the file content the entries were read from or last written as (``None``: no
    file). ``changes`` are this run's puts and removals (``None``), which ``write`` applies onto the file
    as it is at write time; a store built with ``entries`` rather than loaded counts them all as changes.
    """

    path: Path
    entries: dict[str, dict[str, Entry]] = field(default_factory=dict)
    existed: bool = False
    digest: bytes | None = field(default=None, repr=False)
    changes: dict[Slot, Entry | None] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.digest is None:
            for nodeid, per_device in self.entries.items():
                self.changes.update(((nodeid, key), entry) for key, entry in per_device.items())

    def get(self, nodeid: str, identity: DeviceIdentity) -> Entry | None:
        return self.entries.get(nodeid, {}).get(identity.key)

    def put(self, nodeid: str, entry: Entry) -> Change:
        """Record ``entry`` for ``nodeid`` on its device; say whether it was added, updated or unchanged."""
        if not isinstance(nodeid, str) or not nodeid:
            raise ValueError(f"node id must be a non-empty string, got {short(nodeid)}")
        per_device = self.entries.setdefault(nodeid, {})
        key = entry.identity.key
        old = per_device.get(key)
        per_device[key] = entry
        if old is not None and old.to_json() == entry.to_json():
            return "unchanged"
        self.changes[nodeid, key] = entry
        return "added" if old is None else "updated"

    def remove(self, nodeid: str, identity: DeviceIdentity) -> bool:
        per_device = self.entries.get(nodeid)
        if per_device is None or per_device.pop(identity.key, None) is None:
            return False
        if not per_device:
            del self.entries[nodeid]
        self.changes[nodeid, identity.key] = None
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


# ------------------------------------------------------------------------------------------------- load


def load(path: str | os.PathLike[str]) -> BaselineStore:
    """Read and validate a baseline file; a missing file is an empty store. Never modifies the file."""
    p = Path(path)
    raw = read_file(p)
    if raw is None:
        return BaselineStore(path=p, existed=False)
    return loads(raw, p)


def read_file(p: Path) -> bytes | None:
    """The bytes of a regular file of at most ``MAX_FILE_BYTES``, ``None`` when there is none.

    Opened without blocking and checked on the open descriptor, so a FIFO or device cannot hang the run.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(p, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        problem = "a symbolic link loop" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
        raise BaselineError(f"cannot read baseline file {p}: {problem}") from None
    try:
        info = os.fstat(fd)
        kind = _not_regular(info.st_mode)
        if kind is not None:
            raise BaselineError(f"cannot read baseline file {p}: {kind}, not a regular file")
        data = b"" if info.st_size > MAX_FILE_BYTES else _read_at_most(fd, MAX_FILE_BYTES + 1, p)
    finally:
        os.close(fd)
    if info.st_size > MAX_FILE_BYTES or len(data) > MAX_FILE_BYTES:
        size = max(info.st_size, len(data))
        raise BaselineError(
            f"cannot read baseline file {p}: too large ({size:,} bytes, limit {format_size(MAX_FILE_BYTES)})"
        )
    return data


def _read_at_most(fd: int, limit: int, p: Path) -> bytes:
    chunks: list[bytes] = []
    left = limit
    try:
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 24))):
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise BaselineError(f"cannot read baseline file {p}: {exc.strerror or exc}") from None
    return b"".join(chunks)


def _not_regular(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO (named pipe)",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    return next((name for test, name in kinds.items() if test(mode)), "not a file")


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
    p = Path(path)
    raw = data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass")
    with _gc_paused():
        entries = _loads(data, p)
    return BaselineStore(path=p, entries=entries, existed=True, digest=_digest(raw))


def _digest(raw: bytes) -> bytes:
    return hashlib.sha256(raw).digest()


def _loads(data: str | bytes, p: Path) -> dict[str, dict[str, Entry]]:
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
    obj = _parse(text, fail)
    if _ESCAPED_SURROGATE.search(text) and not _encodable(obj):
        raise fail(r"a string holds a lone surrogate (an escape like \ud800 that is half of no pair); fix or delete it")
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        raise fail(f'not a pytest-gpumem baseline file (no "schema": "{SCHEMA}")')
    version = obj.get("version")
    if type(version) is not int or version < 1:
        raise fail(f'"version" must be an integer >= 1, got {short(version)}')
    if version > VERSION:
        raise fail(
            f"schema version {short(version)} is newer than this pytest-gpumem reads ({VERSION}); upgrade pytest-gpumem"
        )
    for key in obj:
        if key not in ("schema", "version", "entries"):
            raise fail(f"unknown top-level key {key!r}")
    raw_entries = obj.get("entries")
    if not isinstance(raw_entries, dict):
        raise fail(f'"entries" must be an object, got {short(raw_entries)}')
    entries: dict[str, dict[str, Entry]] = {}
    for nodeid, per_device in raw_entries.items():
        if not nodeid:
            raise fail("entries: empty test node id")
        if _CONTROL.search(nodeid):
            raise fail(f"entries: node id {json_key(nodeid)} holds a control character; fix or delete it")
        if not isinstance(per_device, dict):
            raise fail(f"entries[{json_key(nodeid)}]: expected an object of device -> entry, got {short(per_device)}")
        built = _entries_of(nodeid, per_device, fail)
        if built:
            entries[nodeid] = built
    return entries


_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _encodable(obj: object) -> bool:
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parse(text: str, fail: Callable[[str], BaselineError]) -> Any:
    try:
        return strict_json(text)
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
    except ValueError:  # the only other refusal: an integer beyond sys.get_int_max_str_digits()
        raise fail(f"not valid JSON: a number of more than {sys.get_int_max_str_digits()} digits") from None


def _entries_of(nodeid: str, per_device: dict[str, Any], fail: Callable[[str], BaselineError]) -> dict[str, Entry]:
    built: dict[str, Entry] = {}
    for key, value in per_device.items():
        try:
            entry = Entry.from_json(value)
        except ValueError as exc:
            raise fail(f"entries[{json_key(nodeid)}][{json_key(key)}]: {exc}") from None
        if entry.identity.key != key:
            raise fail(
                f"entries[{json_key(nodeid)}][{json_key(key)}]: key does not match its identity "
                f"(expected {json_key(entry.identity.key)})"
            )
        built[key] = entry
    return built


class _JSONRefused(ValueError):
    pass


def strict_json(text: str) -> Any:
    """JSON that refuses a duplicate key and NaN or Infinity (a ValueError naming the key or the constant)."""
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _JSONRefused(f"duplicate key {json_key(key)}")
            seen.add(key)
    return out


def _no_constant(name: str) -> Any:
    raise _JSONRefused(f"{name} is not a valid JSON number")


# ------------------------------------------------------------------------------------------------ write


def dumps(store: BaselineStore) -> str:
    """The file content: JSON, indent 2, sorted keys, non-ASCII kept, trailing newline."""
    with _gc_paused():
        return json.dumps(store.to_json(), indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


def write(store: BaselineStore, path: str | os.PathLike[str] | None = None) -> Path:
    """Merge this run's changes into the file and replace it atomically. Returns the path written.

    Under an exclusive lock: the file is re-read; when another run replaced it since ``store`` was read,
    ``store.changes`` are applied onto its entries (``store.entries`` becomes the merged result). The
    content goes to a temp file in the same folder, fsync, ``os.replace``. On any failure the previous
    file is left as it was, the temp file is removed, and a :class:`BaselineError` is raised
    (``KeyboardInterrupt`` and friends propagate unchanged). A file that ``load`` would refuse is refused
    here too, untouched. A symlink is followed (its target is replaced); an existing file keeps its
    permission bits. A ``path`` other than ``store.path`` receives the store's entries as they are.
    """
    own = Path(os.path.realpath(store.path))
    target = own if path is None else Path(os.path.realpath(path))
    if not target.parent.is_dir():
        raise BaselineError(f"could not write baseline file {target}: folder {target.parent} does not exist")
    with _locked(target):
        _remove_stale_temps(target)
        if target == own:
            _merge_with_file(store, target)
        data = _write_atomically(store, target)
    if target == own:
        store.digest = _digest(data)
        store.existed = True
        store.changes.clear()
    _fsync_dir(target.parent)
    return target


def _merge_with_file(store: BaselineStore, target: Path) -> None:
    raw = read_file(target)
    digest = None if raw is None else _digest(raw)
    if digest == store.digest:
        return
    now = BaselineStore(target) if raw is None else loads(raw, target)
    for (nodeid, key), entry in store.changes.items():
        per_device = now.entries.setdefault(nodeid, {})
        if entry is None:
            per_device.pop(key, None)
        else:
            per_device[key] = entry
        if not per_device:
            del now.entries[nodeid]
    store.entries = now.entries


def _write_atomically(store: BaselineStore, target: Path) -> bytes:
    """Write the store to a temp file and rename it over ``target``; returns the bytes written."""
    tmp: str | None = None
    try:
        data = dumps(store).encode("utf-8")
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=target.parent)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
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
    return data


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``.<name>.lock`` next to ``target``; the lock file is removed after."""
    if sys.platform == "win32":  # no flock: writes still merge, but two at the same instant can race
        yield
        return
    lock = target.with_name(f".{target.name}.lock")
    try:
        fd = _acquire(lock)
    except OSError as exc:
        raise BaselineError(
            f"could not write baseline file {target}: cannot lock {lock.name}: {_describe(exc)}"
        ) from None
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)


def _acquire(lock: Path) -> int:
    """A descriptor of ``lock``, flock-ed, that is still the file at that path (not one a previous
    holder removed while we waited)."""
    import fcntl

    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            if _try_lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, deadline) and _is_at(fd, lock):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _try_lock(fd: int, flags: int, deadline: float) -> bool:
    import fcntl

    while True:
        try:
            fcntl.flock(fd, flags)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"another run held it for {LOCK_TIMEOUT_S:g} s") from None
            time.sleep(0.01)


def _is_at(fd: int, path: Path) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def _remove_stale_temps(target: Path) -> None:
    """Remove temp files of killed writers: the pid in the name is gone, or the file is old (run under
    the lock, so no live writer of ours is between creating and renaming one)."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(?:(\d+)\.)?[A-Za-z0-9_]+\.tmp")
    now = time.time()
    with contextlib.suppress(OSError), os.scandir(target.parent) as names:
        for item in names:
            match = pattern.fullmatch(item.name)
            if match is None or not item.is_file(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError):
                pid = match.group(1)
                old = now - item.stat(follow_symlinks=False).st_mtime > STALE_TMP_AGE_S
                if old or (pid is not None and not _alive(int(pid))):
                    os.unlink(item.path)


def _alive(pid: int) -> bool:
    if sys.platform == "win32":  # os.kill(pid, 0) would terminate it: rely on the age alone
        return True
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


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


# ------------------------------------------------------------------------------------ update and prune


@dataclass
class UpdateSummary:
    """Node ids by what happened to their entry (for the current device); ``removed`` comes from prune."""

    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    """Measured, not re-recorded: the stored entry stays as it is (``--gpumem-update=new``)."""

    @property
    def changed(self) -> bool:
        """Whether the file needs writing."""
        return bool(self.added or self.updated or self.removed)

    def describe(self) -> str:
        """``"2 added, 1 updated, 10 unchanged, 0 removed"`` (and ``", 3 kept"`` when some were kept)."""
        kept = f", {len(self.kept)} kept" if self.kept else ""
        return (
            f"{len(self.added)} added, {len(self.updated)} updated, "
            f"{len(self.unchanged)} unchanged, {len(self.removed)} removed{kept}"
        )

    def to_json(self) -> dict[str, list[str]]:
        return {
            "added": list(self.added),
            "updated": list(self.updated),
            "unchanged": list(self.unchanged),
            "removed": list(self.removed),
            "kept": list(self.kept),
        }


KeepRule = Callable[[Entry, Entry], bool]
"""``keep(stored, measured)``: keep the stored entry as it is (see ``compare.equivalent``)."""


def update(
    store: BaselineStore,
    results: Mapping[str, Entry] | Iterable[tuple[str, Entry]],
    *,
    keep: KeepRule | None = None,
    summary: UpdateSummary | None = None,
) -> UpdateSummary:
    """Record the measurements of tests that ran and passed; every other entry stays as it is.

    ``results`` maps node ids to ``Entry.measured(...)`` (pass only tests whose body passed; a memory
    regression itself is what an update accepts). Each entry is stored under its own identity, so xdist
    workers on different devices are fine. A stored entry for which ``keep(stored, measured)`` is true is
    kept byte for byte ("unchanged"), so re-recording noise does not churn the file.
    """
    out = summary if summary is not None else UpdateSummary()
    items = results.items() if isinstance(results, Mapping) else results
    for nodeid, entry in items:
        if keep is not None:
            old = store.get(nodeid, entry.identity)
            if old is not None and keep(old, entry):
                out.unchanged.append(nodeid)
                continue
        change = store.put(nodeid, entry)
        getattr(out, change).append(nodeid)
    return out


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


def check_bytes(value: object, what: str) -> None:
    """``ValueError`` unless ``value`` is an int byte count, ``0 <= value < MAX_BYTES``."""
    if type(value) is not int or not 0 <= value < MAX_BYTES:
        raise ValueError(f"{what}: expected an integer 0 <= n < 2**63 (bytes), got {short(value)}")


def _exact_keys(obj: object, where: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object, got {short(obj)}")
    for k in keys:
        if k not in obj:
            raise ValueError(f"{where}: missing key {k!r}")
    for k in obj:
        if k not in keys:
            raise ValueError(f"{where}: unknown key {k!r}")
    return obj


def json_key(name: str) -> str:
    return encode_basestring(name)


def short(v: object, limit: int = 60) -> str:
    """``repr`` cut to ``limit`` characters (a 400-digit number names its first digits)."""
    text = integer_words(v) if type(v) is int and v.bit_length() > 200 else repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
