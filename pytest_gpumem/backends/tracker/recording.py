"""Where each tracked allocation came from (the op, and the line of the test's own code that led to it),
and on request the sequence of allocations and frees. Leak reports, out-of-memory messages and traces
read it; it costs nothing unless a run asks for it (a leak limit, a snapshot folder).
"""

from __future__ import annotations

import gc
import os
import sys
import sysconfig
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from cuda_allocator_model import format_size
from pytest_gpumem.private_torch import storage_key

if TYPE_CHECKING:
    import torch

MAX_EVENTS = 1_000_000
"""A trace keeps at most this many events (about 100 MB of JSON); later ones are counted as dropped."""

_NOT_USER_CODE = tuple(
    os.sep + part + os.sep
    for part in ("torch", "pytest_gpumem", "_pytest", "pluggy", "contextlib.py", "threading.py", "functools.py")
)


@dataclass(eq=False, slots=True)
class Origin:
    op: str
    where: str | None  # "path/to/test_x.py:12 [via lib/x.py:80]": the test's own line (`user_line`)


class Followed(Protocol):
    """What the ledger knows of a storage it follows (its weak reference)."""

    key: int
    requested: int
    counted: int
    origin: Origin | None


_SHOWN: dict[str, tuple[bool, str] | None] = {}  # a code file -> (the user's own?, how a line of it is shown)
_SHOWN_FROM: list[str] = [""]  # the working directory those were made relative to
_OP_NAMES: dict[object, str] = {}
_INSTALLED = tuple(os.sep + part + os.sep for part in ("site-packages", "dist-packages"))
_STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "")


def user_line() -> str | None:
    """Where an allocation was made: the innermost frame of the user's own code (neither torch, this plugin,
    pytest, an installed package nor the standard library), followed by the innermost frame of an installed
    package below it where there is one (`test_x.py:12 via transformers/models/bert.py:80`); the package's
    line alone when no frame is the user's."""
    cwd = os.getcwd()
    if cwd != _SHOWN_FROM[0]:
        _SHOWN.clear()
        _SHOWN_FROM[0] = cwd
    frame = sys._getframe(1)
    library = None
    while frame is not None:
        path = frame.f_code.co_filename
        try:
            shown = _SHOWN[path]
        except KeyError:
            shown = _SHOWN[path] = code_file_shown(path)
        if shown is not None:
            own, name = shown
            if own:
                line = f"{name}:{frame.f_lineno}"
                return sys.intern(line if library is None else f"{line} via {library}")
            library = library or f"{name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return None if library is None else sys.intern(library)


def code_file_shown(path: str) -> tuple[bool, str] | None:
    """Whether a code file is the user's own, and how it is shown; None for torch, this plugin, pytest."""
    if any(part in path or path.endswith(part.rstrip(os.sep)) for part in _NOT_USER_CODE):
        return None
    installed = max(path.rfind(part) for part in _INSTALLED)
    if installed >= 0:  # an installed package: from its top-level folder on
        return False, path[installed:].split(os.sep, 2)[-1]
    if path.startswith(_STDLIB) or path.startswith("<frozen "):
        return False, path.removeprefix(_STDLIB)
    return True, path if path.startswith("<") else os.path.relpath(path)


def op_arg(args: Sequence[Any], kwargs: dict[str, Any], index: int, name: str, default: Any = None) -> Any:
    """An op's argument `name`, given at position `index` or by name (`default` where it is neither)."""
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def op_name(op: object) -> str:
    if op is None:
        return "unknown op"
    try:
        return _OP_NAMES[op]
    except KeyError:
        name = _OP_NAMES[op] = str(op)
        return name
    except TypeError:  # not hashable
        return str(op)


class Recorder:
    """Origins for every new storage; with `events`, also each allocation, resize and free in order."""

    def __init__(self, events: bool) -> None:
        self.events: list[dict[str, Any]] | None = [] if events else None
        self.dropped = 0

    def entered(self) -> None:
        """An op is about to run (the ledger's `op`)."""

    def allocated(self, op: object, out: object, ref: Followed, total: int) -> Origin:
        """`ref`, a storage among the outputs `out` of `op`, is followed from now on."""
        origin = Origin(op_name(op), user_line())
        ref.origin = origin
        self.event("alloc", ref, total)
        return origin

    def event(self, action: str, ref: Followed, total: int) -> None:
        """`ref` was allocated, resized or freed, leaving `total` bytes allocated."""
        if self.events is None:
            return
        if len(self.events) >= MAX_EVENTS:
            self.dropped += 1
            return
        op, where = (None, None) if ref.origin is None else (ref.origin.op, ref.origin.where)
        self.events.append({"action": action, "bytes": ref.requested, "allocated": total, "op": op, "where": where})

    def trace(self) -> dict[str, Any]:
        return {"format": "pytest-gpumem trace 1", "events": self.events or [], "dropped_events": self.dropped}


@dataclass(frozen=True)
class Survivor:
    """A storage the call made that is still allocated after it returned."""

    bytes: int
    shape: tuple[int, ...] | None
    dtype: str | None
    device: str | None
    origin: Origin | None

    def describe(self, fmt: Callable[[int], str] = format_size) -> str:
        what = "a storage no tensor shows" if self.dtype is None else f"{self.dtype}{list(self.shape or ())}"
        made = (
            ""
            if self.origin is None
            else f", made by {self.origin.op}" + (f" at {self.origin.where}" if self.origin.where else "")
        )
        device = f" on {self.device}" if self.device else ""
        return f"{fmt(self.bytes)} {what}{device}{made}"


def tensors_by_storage(keys: set[int]) -> dict[int, torch.Tensor]:
    """A live tensor for each storage key (a scan of every object: run it only to explain a failure)."""
    import torch

    found: dict[int, torch.Tensor] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on some objects trips deprecation warnings
        for obj in gc.get_objects():
            if type(obj) is not torch.Tensor and not isinstance(obj, torch.Tensor):
                continue
            try:
                key = storage_key(obj.untyped_storage())
            except (RuntimeError, NotImplementedError, ValueError):  # ValueError: a Lazy module's parameter
                continue
            if key in keys and key not in found:
                found[key] = obj
    return found
