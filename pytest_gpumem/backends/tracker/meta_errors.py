"""Why a test cannot run on the meta device, in one line naming the op, from the error torch raised.

Meta tensors have sizes and no values: whatever reads values (`.item()`, `.tolist()`, `.numpy()`, a copy
to another device) or makes an output whose size depends on them (`nonzero`, boolean masks, `unique`)
fails. Torch's own messages say so at length, or not at all (`numpy()` says "use Tensor.cpu()").
"""

from __future__ import annotations

import re

_ITEM = "Tensor.item() needs a value (so do float(), int(), bool(), `if` on a tensor)"
_COPY = "copying out of a meta tensor (.cpu(), .to(), .tolist(), copy_()) needs values"
_NUMPY = "Tensor.numpy() needs values"
_DLPACK = "to_dlpack needs the tensor's memory"
_GENERATOR = "there is no torch.Generator on meta (random ops there need none)"
_MIXED = "an op got a {found} tensor among meta tensors (put every tensor on gpumem.device)"
_DATA_SIZED = "{op}'s output size depends on the values (boolean masks, nonzero, where(cond))"
_NO_META_KERNEL = "{op} has no meta kernel (its output depends on the values, or is not implemented there)"

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Tensor\.item\(\) cannot be called on meta tensors"), _ITEM),
    (re.compile(r"Cannot copy out of meta tensor"), _COPY),
    (re.compile(r"can't convert meta device type tensor to numpy"), _NUMPY),
    (re.compile(r"Cannot pack tensors on meta"), _DLPACK),
    (re.compile(r"META device type not an accelerator"), _GENERATOR),
    (re.compile(r"Tensor on device (?P<found>\w+) is not on the expected device meta"), _MIXED),
    (re.compile(r"found at least two devices, (?:meta and (?P<found>\w+)|(?P<first>\w+) and meta)"), _MIXED),
    (re.compile(r"register_meta function for (?P<op>torch\.\w+)\(\) raises unimplemented"), _DATA_SIZED),
    (re.compile(r"(?P<op>aten::\w+(?:\.\w+)?): attempted to run this operator with Meta tensors"), _NO_META_KERNEL),
)
_COMPILER = re.compile(r"^backend='(?P<backend>[^']+)' raised:\s*\n(?P<error>\w+)")
_COMPILE_FAILED = (
    "torch.compile's {backend} cannot compile this graph for meta tensors ({error} in torch): "
    "measure it on the CPU with --gpumem-round=cuda, at a shape that fits"
)
_NEEDS_DATA = re.compile(r"meta tensor|no data|data-independent|'Meta' backend", re.IGNORECASE)
_ERRORS = (RuntimeError, NotImplementedError, TypeError, BufferError)


def cannot_run_on_meta(exc: BaseException) -> str | None:
    """The reason `exc` is a test's need for values that meta tensors do not have, one line naming the op;
    None for any other error."""
    if not isinstance(exc, _ERRORS):
        return None
    try:
        text = str(exc).strip()
    except Exception:
        return None
    compiler = _compiler_failed(exc, text)
    if compiler is not None:
        return compiler
    for pattern, reason in _PATTERNS:
        found = pattern.search(text)
        if found is not None:
            names = {k: v for k, v in found.groupdict().items() if v is not None}
            names.setdefault("found", names.get("first", "non-meta"))
            return reason.format(**names)
    first = text.splitlines()[0] if text else ""
    if isinstance(exc, (RuntimeError, NotImplementedError)) and _NEEDS_DATA.search(first):
        return first if len(first) <= 200 else first[:199] + "…"
    return None


def _compiler_failed(exc: BaseException, text: str) -> str | None:
    """torch.compile's backend failed (Dynamo's BackendCompilerFailed, whose text dumps the graph): which
    backend, and the kind of its error."""
    found = _COMPILER.match(text) if type(exc).__name__ == "BackendCompilerFailed" else None
    return None if found is None else _COMPILE_FAILED.format(**found.groupdict())
