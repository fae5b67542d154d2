"""The header of a run that measures: what measures, and on what terms, in lines that fit a terminal
(imported only where a header is shown: an idle run reads none of it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pytest_gpumem.backends.base import Backend
    from pytest_gpumem.config import Options


def header_lines(options: Options, backend: Backend) -> list[str]:
    """The header of a run with `options` measuring on `backend`, cut into lines of at most 100 columns."""
    spread = "" if options.devices is None else f"; xdist workers get one device each ({_spread(options)})"
    capacity = options.capacity
    cap = "" if capacity is None else f"; capacity {capacity.written}: {_capacity_means(backend)}"
    return _lines(f"gpumem: {backend.describe()}{spread}{cap}{_no_traces(options, backend)}")


def _no_traces(options: Options, backend: Backend) -> str:
    if options.snapshot_dir is None or backend.records_events:
        return ""
    return f"; --gpumem-snapshot-dir: the {backend.name} backend records no trace, none will be written"


def _capacity_means(backend: Backend) -> str:
    if backend.name == "cuda":
        return "the process is capped with torch.cuda.set_per_process_memory_fraction"
    return "an allocation past it raises torch.OutOfMemoryError"


def _spread(options: Options) -> str:
    spec = options.devices
    return "all visible, round-robin" if spec == "auto" else f"cuda:{', cuda:'.join(map(str, spec or ()))}"


def _lines(text: str, width: int = 100) -> list[str]:
    """`text` on lines of at most `width` columns where it can be, cut only at a "; " or before ", device "
    outside parentheses; each line after the first indented by two."""
    lines = [""]
    for joint, clause in _clauses(text):
        if lines[-1] and len(lines[-1]) + len(joint) + len(clause) > width:
            lines.append("  " + clause)
        else:
            lines[-1] += joint + clause
    return lines


def _clauses(text: str) -> list[tuple[str, str]]:
    """`text` as (joint, clause) pairs, cut at each "; " and ", device " outside parentheses."""
    pieces, depth, joint, start = [], 0, "", 0
    for at, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        cut = next((sep for sep in ("; ", ", ") if depth == 0 and text.startswith(sep, at)), None)
        if cut == ", " and not text.startswith(", device ", at):
            cut = None
        if cut is not None:
            pieces.append((joint, text[start:at]))
            joint, start = cut, at + len(cut)
    return [*pieces, (joint, text[start:])]
