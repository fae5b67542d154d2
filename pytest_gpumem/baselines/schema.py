"""The baseline file's schema: its JSON text <-> a ``BaselineStore`` of typed entries, validated strictly.

Baseline files arrive in pull requests, so they are plain JSON (never pickle or ``torch.load``), validated
strictly, and written by the standard library's encoder with stable formatting (``indent=2``, sorted keys,
non-ASCII kept, trailing newline) so that a diff shows exactly the tests whose memory changed. Reading and
writing the file is ``file.py``'s business, judging a measurement against an entry ``compare.py``'s; an
entry's own JSON is ``results.baseline.Entry``'s. No torch, no pytest.

File schema (version 1)::

    {
      "entries": {
        "<test node id>": {
          "<identity key>": {
            "cuda": "12.8",                      # torch.version.cuda when recorded, or null
            "gradients": {...},                  # optional: a results.gradients.Fingerprint
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
file and the problem; a refused file is never touched, not by ``load`` and not by ``write``
(``file.py`` reads the file and checks its size and kind).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pytest_gpumem.constants import DEFAULT_FILENAME
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.results.baseline import DeviceIdentity, Entry
from pytest_gpumem.results.checks import json_key, short
from pytest_gpumem.results.codec import STORED, decode, encode

__all__ = [
    "SCHEMA",
    "VERSION",
    "BaselineError",
    "BaselineStore",
    "Change",
    "Versions",
    "digest",
    "dumps",
    "loads",
    "strict_json",
]

SCHEMA = "pytest-gpumem-baselines"
VERSION = 1

Change = Literal["added", "updated", "unchanged"]


class BaselineError(GpuMemError):
    """A baseline file that cannot be read or written; the one-line message names the file."""


_Slot = tuple[str, str]
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
    changes: dict[_Slot, Entry | None] = field(default_factory=dict, repr=False)

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
        if old is not None and encode(old) == encode(entry):
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


def loads(data: str | bytes, path: str | os.PathLike[str] = DEFAULT_FILENAME) -> BaselineStore:
    """Parse and validate file content; ``path`` names the file in errors and becomes ``store.path``."""
    p = Path(path)
    raw = data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass")
    with paused_gc():
        entries = _loads(data, p)
    return BaselineStore(path=p, entries=entries, existed=True, digest=digest(raw))


def digest(raw: bytes) -> bytes:
    """What identifies a file's content (``BaselineStore.digest``)."""
    return hashlib.sha256(raw).digest()


class Versions:
    """Successive versions of one baseline file (its git history, say), each validated as ``loads``
    validates it, faster: a test whose entries' JSON equals what was last read for it (most tests do not
    change from one version to the next) gets the entries built then, not built and checked again.
    The entries returned share those dicts between versions: read them, do not change them."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[dict[str, Any], dict[str, Entry]]] = {}
        self._floats = False
        self._exact: bool | None = None

    def entries(self, data: str | bytes, path: str | os.PathLike[str]) -> dict[str, dict[str, Entry]]:
        """The entries of one version; a ``BaselineError`` where ``loads`` would raise one, with its message."""
        self._floats, self._exact = False, None
        with paused_gc():
            return _loads(data, Path(path), self)

    def parse_float(self, text: str) -> float:
        self._floats = True
        return float(text)

    def known(self, nodeid: str, per_device: object, text: str) -> dict[str, Entry] | None:
        """The entries built from JSON equal to ``per_device``, if it was read before. ``==`` alone would
        take ``1.0`` or ``true`` for ``1``: where the version holds a float or a bool, ``repr`` tells them
        apart (``true`` or ``false`` in a string costs only the ``repr``)."""
        seen = self._seen.get(nodeid)
        if seen is None or seen[0] != per_device:
            return None
        if self._exact is None:
            self._exact = not self._floats and "true" not in text and "false" not in text
        return seen[1] if self._exact or repr(seen[0]) == repr(per_device) else None

    def learn(self, nodeid: str, per_device: Any, built: dict[str, Entry]) -> None:
        self._seen[nodeid] = (per_device, built)


def _loads(data: str | bytes, p: Path, versions: Versions | None = None) -> dict[str, dict[str, Entry]]:
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
    obj = _parse(text, fail, None if versions is None else versions.parse_float)
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
    return _all_entries(raw_entries, fail, versions, text)


def _all_entries(
    raw_entries: dict[str, Any], fail: Callable[[str], BaselineError], versions: Versions | None, text: str
) -> dict[str, dict[str, Entry]]:
    entries: dict[str, dict[str, Entry]] = {}
    for nodeid, per_device in raw_entries.items():
        built = None if versions is None else versions.known(nodeid, per_device, text)
        if built is None:
            built = _test_entries(nodeid, per_device, fail)
            if versions is not None:
                versions.learn(nodeid, per_device, built)
        if built:
            entries[nodeid] = built
    return entries


def _test_entries(nodeid: str, per_device: object, fail: Callable[[str], BaselineError]) -> dict[str, Entry]:
    if not nodeid:
        raise fail("entries: empty test node id")
    if _CONTROL.search(nodeid):
        raise fail(f"entries: node id {json_key(nodeid)} holds a control character; fix or delete it")
    if not isinstance(per_device, dict):
        raise fail(f"entries[{json_key(nodeid)}]: expected an object of device -> entry, got {short(per_device)}")
    return _entries_of(nodeid, per_device, fail)


_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _encodable(obj: object) -> bool:
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parse(text: str, fail: Callable[[str], BaselineError], parse_float: Callable[[str], float] | None) -> Any:
    try:
        return strict_json(text, parse_float)
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
            entry = decode(Entry, value, "", STORED)
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


def strict_json(text: str, parse_float: Callable[[str], float] | None = None) -> Any:
    """JSON that refuses a duplicate key and NaN or Infinity (a ValueError naming the key or the constant)."""
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant, parse_float=parse_float)


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


def dumps(store: BaselineStore) -> str:
    """The file content: JSON, indent 2, sorted keys, non-ASCII kept, trailing newline."""
    with paused_gc():
        document = {
            "schema": SCHEMA,
            "version": VERSION,
            "entries": {
                nodeid: {key: encode(entry) for key, entry in per_device.items()}
                for nodeid, per_device in store.entries.items()
                if per_device
            },
        }
        return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection while many acyclic objects are made (each collection would walk all of
    them again: it halves load time in a big process); the collector as it was afterwards."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
