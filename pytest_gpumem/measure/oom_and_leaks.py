"""When memory goes wrong: out of memory, and what holds the memory a leaking call left allocated."""

from __future__ import annotations

import gc
import inspect
import os
import sys
import sysconfig
import textwrap
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from cuda_allocator_model import exception_text
from pytest_gpumem.private_torch import storage_key

_T = TypeVar("_T")

_UNINITIALIZED = "Attempted to use an uninitialized parameter in "  # torch.nn.parameter.UninitializedParameter
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_HOOKS = os.path.join(_PACKAGE, "run") + os.sep
_PLUGIN = os.path.join(_PACKAGE, "plugin.py")


def is_out_of_memory(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, torch.OutOfMemoryError)


def needs_real_values(exc: BaseException, device: object) -> str | None:
    """On the meta device, an op that needs real values (`.item()`, `nonzero`, a boolean mask, copying
    data out) fails; the one line that says so, naming the op, or None for any other error."""
    from pytest_gpumem.backends.tracker.meta_errors import cannot_run_on_meta

    reason = cannot_run_on_meta(exc) if str(device) == "meta" else None
    if reason is None:
        return None
    return f"this test cannot run on the meta device (tensors without data): {reason}{_asked_where(exc)}"


def _asked_where(exc: BaseException) -> str:
    """'; asked at transformers/masking_utils.py:761 in find_packed_sequence_indices, called from
    test_lm.py:12 in test_step': the innermost frame outside torch and this package (the code that asked
    for a value), and the innermost frame of the user's own code when that is not it."""
    torch = sys.modules.get("torch")
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep if torch and torch.__file__ else None
    frames = [
        tb
        for tb in _tracebacks(exc)
        if not (path := tb.tb_frame.f_code.co_filename).startswith("<")
        and not os.path.abspath(path).startswith(_PACKAGE)
        and (torch_dir is None or not os.path.abspath(path).startswith(torch_dir))
    ]
    if not frames:
        return ""
    asker = frames[-1]
    user = next((tb for tb in reversed(frames) if _library_part(tb.tb_frame.f_code.co_filename) is None), None)
    called = "" if user is None or user is asker else f", called from {_frame_text(user)}"
    return f"; asked at {_frame_text(asker)}{called}"


def _library_part(filename: str) -> str | None:
    """The path of an installed library's file below its site-packages folder (or of the standard
    library's below its folder), or None for the user's code."""
    for folder in ("site-packages", "dist-packages"):
        _, found, after = filename.rpartition(f"{os.sep}{folder}{os.sep}")
        if found:
            return after
    stdlib = sysconfig.get_paths()["stdlib"] + os.sep
    return filename.removeprefix(stdlib) if filename.startswith(stdlib) else None


def _frame_text(tb: TracebackType) -> str:
    code = tb.tb_frame.f_code
    path = _library_part(code.co_filename)
    if path is None:
        path = os.path.abspath(code.co_filename)
        path = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
    return f"{path}:{tb.tb_lineno} in {code.co_name}"


def uninitialized_in_ours(exc: BaseException) -> str | None:
    """Where a Lazy module's parameter, used before its first forward, failed in this plugin's code (not in
    the test's: that keeps torch's error and its traceback, as unmeasured), the one line that says so,
    naming the call of ours the test made; None for any other error."""
    if not isinstance(exc, ValueError) or not exception_text(exc).startswith(_UNINITIALIZED):
        return None
    ours = [tb for tb in _tracebacks(exc) if _ours(tb.tb_frame.f_code.co_filename)]
    if not ours:
        return None
    code = ours[0].tb_frame.f_code
    call = f"gpumem.{code.co_name}()" if code.co_filename.endswith("meter.py") else f"pytest-gpumem's {code.co_name}()"
    return (
        f"{call} met an uninitialized parameter of a Lazy module (torch.nn.LazyLinear and the like, before "
        "their first forward): run the model once on a batch before measuring it"
    )


def _tracebacks(exc: BaseException) -> Iterator[TracebackType]:
    tb = exc.__traceback__
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _ours(filename: str) -> bool:
    """A file of this package other than the hooks that run the test (their frames are around every test)."""
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE) and not path.startswith(_HOOKS) and path != _PLUGIN


def release_memory() -> None:
    """After an out-of-memory error: collect what its frames held, and return cached blocks to the device."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Failed:
    """A trial whose step raised: what it raised (the exception itself is dropped, its frames hold the
    step's tensors)."""

    kind: str  # the exception's type name
    text: str
    out_of_memory: bool


def trial(run: Callable[[], _T], caught: Callable[[Exception], bool]) -> _T | Failed:
    """One trial of a step (a fit's run, an advice's strategy): what `run()` returns, or, where it raised an
    exception that `caught` accepts, what it raised, with the step's memory released outside the handler,
    where no traceback holds its frames any more."""
    __tracebackhide__ = True
    try:
        return run()
    except Exception as exc:
        if not caught(exc):
            raise
        exc.__traceback__ = None  # its frames hold the step's tensors
        failed = Failed(type(exc).__name__, exception_text(exc), is_out_of_memory(exc))
        del exc
    release_memory()
    return failed


@dataclass(frozen=True)
class Holding:
    """What keeps a call's survivors allocated, as far as the objects show: bytes by what they are
    (parameters, saved for backward, a graph's outputs, ...), where they were made, and who holds them."""

    kinds: tuple[tuple[str, int], ...]  # (what, bytes), largest first
    graph: bool  # some are held by an autograd graph (saved tensors, the leaves it accumulates into)
    holder: str | None  # 'global LOSSES of test_x (a list)'
    modules: tuple[tuple[str, str, int], ...] = ()  # (what, module that made it, bytes), largest first

    def held(self) -> str:
        """Who holds them: 'kept by global KEEP of test_x (a list)', 'held by an autograd graph ...', or ''."""
        if self.holder is None:
            return "held by an autograd graph" if self.graph else ""
        return f"held by an autograd graph kept alive by {self.holder}" if self.graph else f"kept by {self.holder}"

    def parts(self, fmt: Callable[[int], str]) -> str:
        """'parameters 16.6 kB, saved for backward 4.1 kB, graph outputs 4 B'."""
        return ", ".join(f"{what} {fmt(size)}" for what, size in self.kinds)

    def by_module(self, fmt: Callable[[int], str], width: int = 120) -> list[str]:
        """For each kind some module made, what each made, repeated blocks folded as the rest of the report
        folds them, in lines of at most `width` characters: 'left allocated by module: parameters 3.0 MiB:
        blocks.* 2.9 MiB (12 blocks), head 103.0 KiB'."""
        from pytest_gpumem.explain.blocks import fold, numbered_lists

        folds = numbered_lists({module for _, module, _ in self.modules})
        lines = []
        for what, size in self.kinds:
            grouped: dict[str, int] = {}
            for w, module, b in self.modules:
                if w == what:
                    group = fold(module, folds)
                    grouped[group] = grouped.get(group, 0) + b
            ranked = sorted(grouped.items(), key=lambda item: -item[1])
            made = ", ".join(f"{group} {fmt(b)}{_blocks(folds.get(group))}" for group, b in ranked)
            if made:
                text = f"left allocated by module: {what} {fmt(size)}: {made}"
                lines += textwrap.wrap(text, width, subsequent_indent="  ", break_long_words=False)
        return lines


def _blocks(count: int | None) -> str:
    return "" if count is None else f" ({count} blocks)"


def leak_holding(live: Mapping[int, tuple[int, Any]]) -> Holding | None:
    """Who holds the storages `live` (key -> (bytes, origin)) that a call left allocated: a scan of every
    object, run only to explain a leak. Tensors are classed as parameters (an nn.Parameter, or a leaf an
    autograd graph accumulates into), saved for backward, and a graph's outputs; the explainer's category
    is used where the call was explained. The holder is the first module global found above the graph's
    outputs (or, without a graph, the largest survivor)."""
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
    roots = [t for found in tensors.values() for t in found if t.grad_fn is not None]
    kind = _kinds(torch, tensors, roots)
    totals, modules = _totals(live, kind)
    graph = any(k != "graph outputs" for k in kind.values()) and bool(roots)
    holder = next((h for h in (_holder(t) for t in _starts(live, tensors, roots, kind, graph)) if h), None)
    if not graph and holder is None and set(totals) == {"other"}:
        return None
    kinds = tuple(sorted(totals.items(), key=lambda item: -item[1])) if set(totals) != {"other"} else ()
    return Holding(kinds, graph, holder, tuple(sorted(modules, key=lambda m: -m[2])))


def _kinds(torch: Any, tensors: Mapping[int, list[Any]], roots: list[Any]) -> dict[int, str]:
    """What each storage is, where its tensors show it: parameters, saved for backward, graph outputs."""
    from pytest_gpumem.backends.tracker.graph import autograd_nodes, saved_tensors

    kind: dict[int, str] = {}
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
    return kind


def _totals(live: Mapping[int, tuple[int, Any]], kind: Mapping[int, str]) -> tuple[dict[str, int], list[Any]]:
    """Bytes by what they are (the explainer's category where the tensors do not show it), and by what
    and the module that made them."""
    from pytest_gpumem.backends.tracker.allocation import Allocation
    from pytest_gpumem.results.categories import LABELS

    totals: dict[str, int] = {}
    modules: dict[tuple[str, str], int] = {}
    for key, (size, origin) in live.items():
        what = kind.get(key)
        if what is None:
            what = LABELS.get(origin.category_now, "other") if isinstance(origin, Allocation) else "other"
        totals[what] = totals.get(what, 0) + size
        if isinstance(origin, Allocation) and origin.module and not origin.module.startswith("("):
            modules[what, origin.module] = modules.get((what, origin.module), 0) + size
    return totals, [(what, module, size) for (what, module), size in modules.items()]


def _starts(
    live: Mapping[int, tuple[int, Any]],
    tensors: Mapping[int, list[Any]],
    roots: list[Any],
    kind: Mapping[int, str],
    graph: bool,
) -> list[Any]:
    """Where the search for a holder starts: a graph's largest outputs (a loss the test kept, not a view
    of a parameter inside the graph, which only the graph holds), or the largest survivor's tensor."""
    if graph:
        outputs = [t for t in roots if kind.get(_storage_key(t)) == "graph outputs"]
        return sorted(outputs or roots, key=lambda t: -live[_storage_key(t)][0])[:3]
    return tensors.get(max(live, key=lambda key: live[key][0]), [])[:1]


def _storage_key(tensor: Any) -> int:
    """The key the ledger follows a tensor's storage by (-1, never followed, for one without a storage: a
    sparse tensor, or the uninitialized parameter of a Lazy module, which raises ValueError)."""
    try:
        return storage_key(tensor.untyped_storage())
    except (RuntimeError, NotImplementedError, AttributeError, ValueError):
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
