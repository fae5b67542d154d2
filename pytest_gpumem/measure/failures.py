"""When memory goes wrong: out of memory, and what holds the memory a leaking call left allocated."""

from __future__ import annotations

import gc
import inspect
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


def is_out_of_memory(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, torch.OutOfMemoryError)


def needs_real_values(exc: BaseException, device: object) -> str | None:
    """On the meta device, an op that needs real values (`.item()`, `nonzero`, a boolean mask, copying
    data out) fails; the one line that says so, naming the op, or None for any other error."""
    from pytest_gpumem.backends.tracker.meta_errors import cannot_run_on_meta

    reason = cannot_run_on_meta(exc) if str(device) == "meta" else None
    return None if reason is None else f"this test cannot run on the meta device (tensors without data): {reason}"


def exception_text(exc: BaseException, fallback: str = "") -> str:
    """`str(exc)`, or `fallback` where the exception's own `__str__` raises."""
    try:
        return str(exc)
    except Exception:
        return fallback


def release_memory() -> None:
    """After an out-of-memory error: collect what its frames held, and return cached blocks to the device."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Holding:
    """What keeps a call's survivors allocated, as far as the objects show: bytes by what they are
    (parameters, saved for backward, a graph's outputs, ...) and who holds them."""

    kinds: tuple[tuple[str, int], ...]  # (what, bytes), largest first
    graph: bool  # some are held by an autograd graph (saved tensors, the leaves it accumulates into)
    holder: str | None  # 'global LOSSES of test_x (a list)'

    def describe(self, fmt: Callable[[int], str]) -> str:
        kinds = ", ".join(f"{what} {fmt(size)}" for what, size in self.kinds)
        if self.holder is None:
            held = "held by an autograd graph" if self.graph else ""
        else:
            by = self.holder
            held = f"held by an autograd graph kept alive by {by}" if self.graph else f"kept by {by}"
        return ", ".join(part for part in (kinds, held) if part)


def leak_holding(live: Mapping[int, tuple[int, Any]]) -> Holding | None:
    """Who holds the storages `live` (key -> (bytes, origin)) that a call left allocated: a scan of every
    object, run only to explain a leak. Tensors are classed as parameters (an nn.Parameter, or a leaf an
    autograd graph accumulates into), saved for backward, and a graph's outputs; the explainer's category
    is used where the call was explained. The holder is the first module global found above them."""
    torch = sys.modules.get("torch")
    if torch is None or not live:
        return None
    tensors: dict[int, list[Any]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                key = _storage_key(obj)
                if key in live:
                    tensors.setdefault(key, []).append(obj)
    from pytest_gpumem.backends.tracker.attribution import LABELS, Allocation
    from pytest_gpumem.backends.tracker.graph import autograd_nodes, saved_tensors

    kind: dict[int, str] = {}
    roots = [t for found in tensors.values() for t in found if t.grad_fn is not None]
    for node in autograd_nodes([root.grad_fn for root in roots], lambda n: False):
        for saved in saved_tensors(node):
            kind.setdefault(_storage_key(saved), "saved for backward")
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            kind[_storage_key(variable)] = "parameters"
    for key, found in tensors.items():
        if any(isinstance(t, torch.nn.Parameter) for t in found):
            kind[key] = "parameters"
    for root in roots:
        kind.setdefault(_storage_key(root), "graph outputs")
    totals: dict[str, int] = {}
    for key, (size, origin) in live.items():
        what = kind.get(key)
        if what is None:
            what = LABELS.get(origin.category, "other") if isinstance(origin, Allocation) else "other"
        if isinstance(origin, Allocation) and origin.module and not origin.module.startswith("("):
            what = f"{what} of {origin.module}"
        totals[what] = totals.get(what, 0) + size
    graph = any(k != "graph outputs" for k in kind.values()) and bool(roots)
    largest = max(live, key=lambda key: live[key][0])
    start = sorted(roots, key=lambda t: -live[_storage_key(t)][0])[:3] if graph else tensors.get(largest, [])[:1]
    holder = next((h for h in (_holder(t) for t in start) if h is not None), None)
    kinds = tuple(sorted(totals.items(), key=lambda item: -item[1]))
    if not graph and holder is None and set(totals) == {"other"}:
        return None
    return Holding(kinds if set(totals) != {"other"} else (), graph, holder)


def _storage_key(tensor: Any) -> int:
    """The key the ledger follows a tensor's storage by (-1, never followed, for one without a storage)."""
    try:
        return int(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, AttributeError):
        return -1


def _holder(obj: object, depth: int = 4) -> str | None:
    """'global NAME of MODULE (a list)': the first module global found going up from `obj` through the
    objects that refer to it (frames of running code left out: they are this scan's own)."""
    running = set()
    frame = sys._getframe()
    while frame is not None:
        running.add(id(frame))
        frame = frame.f_back  # type: ignore[assignment]
    modules = {id(vars(m)): name for name, m in list(sys.modules.items()) if hasattr(m, "__dict__")}
    level: list[tuple[object, str | None]] = [(obj, None)]
    seen = {id(obj)}
    for _ in range(depth):
        ahead: list[tuple[object, str | None]] = []
        for node, through in level:
            for ref in gc.get_referrers(node)[:100]:
                if id(ref) in seen or id(ref) in running or ref is level or ref is ahead:
                    continue
                seen.add(id(ref))
                if id(ref) in modules and isinstance(ref, dict):
                    name = next((k for k, v in ref.items() if v is node), None)
                    if name is not None:
                        return f"global {name} of {modules[id(ref)]}" + (f" ({through})" if through else "")
                elif not isinstance(ref, type):
                    ahead.append((ref, through or _what(ref)))
        level = ahead
    return None


def _what(obj: object) -> str:
    if inspect.isframe(obj):
        return f"the frame of {obj.f_code.co_name}"
    if inspect.isgenerator(obj):
        return f"the suspended generator {obj.__name__}"
    return f"a {type(obj).__name__}"
