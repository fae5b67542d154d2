"""CUDA's autocast (and GradScaler) on the tracker's meta or CPU tensors, where a measurement predicts a GPU.

Without this, `torch.autocast("cuda")` on a CPU-only build warns and disables itself, `torch.autocast("meta")`
raises, and CPU autocast casts by other lists than CUDA's: a bf16 prediction comes out in fp32 or with
CPU's choices. While a measurement predicts a GPU:

- `torch.autocast("cuda")`, `torch.amp.autocast("cuda")`, `torch.cuda.amp.autocast()` and
  `torch.autocast("meta")` (taken as "cuda") set torch's own CUDA autocast state (`is_autocast_enabled("cuda")`,
  `get_autocast_dtype("cuda")`, nesting, `cache_enabled`), as on a card.
- Python kernels for each op of CUDA's lists (`autocast_lists`) are registered on the AutocastCUDA dispatch
  key, which is in the thread's included key set for the measurement (meta and CPU tensors do not carry
  it; it acts only where CUDA autocast is enabled, as torch excludes the key elsewhere). A kernel casts as
  CUDA's policy says, above autograd (backward gets `ToCopyBackward0` as on a card), then runs the op with
  the key excluded. Torch's own C++ kernels on that key leave non-CUDA tensors uncast: ours replace them
  for the measurement (they are back afterwards).
- `cached_cast`: a lower-precision cast of a float32 leaf that requires grad (a weight) is made once and
  kept until the outermost autocast region exits (`torch.clear_autocast_cache`); other casts each time.
- `GradScaler("cuda")` keeps itself enabled; its scale and growth tracker are made on the outputs' device
  and counted; unscale_ and update run torch's own ops (both have meta kernels).
- `torch.utils.checkpoint` saves CUDA's autocast state for the recompute of meta or CPU inputs.

Not as on a card: on meta, GradScaler cannot read whether a gradient was inf (`.item()` on meta): the
optimizer always steps (a card skips a step with infs). An op with an AutocastCUDA kernel that the table
does not name runs uncast and says so in the test's notes. An
autocast region or GradScaler made before the measurement (a decorator applied at import, a fixture's)
keeps what torch decided then: disabled on a CPU-only build. CUDA graphs' cached tensors, which
`cached_cast` never caches, do not exist here. Registering the kernels takes about 50 ms, once in each
measured test that makes a CUDA autocast region.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pytest_gpumem.backends.tracker.autocast_lists import (
    APPEND_DTYPE_TARGETS,
    BANNED,
    BANNED_MESSAGE,
    CUDA_AUTOCAST_POLICIES,
    FP32,
    FP32_APPEND_DTYPE,
    FP32_SET_OPT_DTYPE,
    LOWER_PRECISION_FP,
    PROMOTE,
)
from pytest_gpumem.backends.tracker.autocast_patches import (
    cpu_as_cuda,
    cuda_amp_available,
    meta_as_cuda,
    meta_available,
    stepping_on_meta,
)
from pytest_gpumem.backends.tracker.graph import tensors_in
from pytest_gpumem.private_torch import (
    checkpoint_autocast_state,
    checkpoint_device_type,
    cuda_autocast_key_included,
    destroy_library,
    include_cuda_autocast_key,
    is_view,
    op_schema,
    ops_with_cuda_autocast,
    scaler_step,
    without_cuda_autocast,
)

if TYPE_CHECKING:
    import torch

_Replace = Callable[[Any, str, Any], None]

_ACTIVE: list[CudaAutocast] = []  # the emulation of the measurement under way


# --- casts ------------------------------------------------------------------------------------------


def op_overload(name: str) -> Any:
    """The OpOverload of a dispatcher name (`aten::pow.Tensor_Scalar`)."""
    import torch

    op, _, overload = name.removeprefix("aten::").partition(".")
    return getattr(getattr(torch.ops.aten, op), overload or "default")


class CudaAutocast:
    """CUDA's autocast for one measurement: `install` patches, `undo` takes everything back."""

    def __init__(self, device_type: str, notes: list[str]) -> None:
        self.eligible = frozenset((device_type, "cuda"))  # the tensors standing for the GPU's
        self.device_type = device_type
        self.notes = notes
        self._cache: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        self._orphans: list[torch.Tensor] = []  # casts whose weight died while cached: kept to the clear
        self._library: Any = None
        self._included_before = False
        self._enabled_before = False
        self._nesting_before = 0

    # -- installing --

    def install(self, replace: _Replace) -> None:
        import torch
        import torch.amp.autocast_mode as autocast_mode
        import torch.amp.grad_scaler as grad_scaler

        replace(autocast_mode.autocast, "__init__", self._autocast_init(autocast_mode.autocast.__init__))
        replace(grad_scaler.GradScaler, "__init__", self._scaler_init(grad_scaler.GradScaler.__init__))
        replace(torch, "clear_autocast_cache", self._clearing(torch.clear_autocast_cache))
        if self.device_type == "meta":
            scaler, step = scaler_step()
            replace(scaler, step, stepping_on_meta(getattr(scaler, step)))
            available = meta_available(autocast_mode.is_autocast_available)
            replace(autocast_mode, "is_autocast_available", available)
            replace(torch.amp, "is_autocast_available", available)
        checkpoint, state = checkpoint_autocast_state()
        replace(checkpoint, state, meta_as_cuda(getattr(checkpoint, state)))
        if self.device_type == "cpu":
            checkpoint, device = checkpoint_device_type()
            replace(checkpoint, device, cpu_as_cuda(getattr(checkpoint, device)))
        self._included_before = cuda_autocast_key_included()
        self._enabled_before = torch.is_autocast_enabled("cuda")
        self._nesting_before = _nesting()
        include_cuda_autocast_key(True)
        _ACTIVE.append(self)
        if torch.is_autocast_enabled("cuda"):  # a region entered before the measurement (a fixture's)
            self.register_kernels()

    def undo(self) -> None:
        import torch

        if self in _ACTIVE:
            _ACTIVE.remove(self)
        include_cuda_autocast_key(self._included_before)
        if torch.is_autocast_enabled("cuda") and not self._enabled_before:
            # on a CPU-only build torch would have disabled the region: later tests must not see it open
            torch.set_autocast_enabled("cuda", False)
            for _ in range(_nesting() - self._nesting_before):
                torch.autocast_decrement_nesting()
            self.notes.append("a CUDA autocast region the test entered was still open when it ended: closed")
        if self._library is not None:
            destroy_library(self._library)
            self._library = None
        self.clear()

    def _autocast_init(self, original: Callable[..., None]) -> Callable[..., None]:
        emulation = self

        @functools.wraps(original)
        def __init__(autocast: Any, device_type: str, *args: Any, **kwargs: Any) -> None:
            if device_type == "meta" and emulation.device_type == "meta":
                device_type = "cuda"
            if device_type != "cuda":
                original(autocast, device_type, *args, **kwargs)
                return
            emulation.register_kernels()
            with cuda_amp_available():
                original(autocast, device_type, *args, **kwargs)

        return __init__

    def _scaler_init(self, original: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(original)
        def __init__(scaler: Any, device: str = "cuda", *args: Any, **kwargs: Any) -> None:
            if device != "cuda":
                original(scaler, device, *args, **kwargs)
                return
            with cuda_amp_available():
                original(scaler, device, *args, **kwargs)

        return __init__

    def _clearing(self, original: Callable[[], None]) -> Callable[[], None]:
        @functools.wraps(original)
        def clear_autocast_cache() -> None:
            original()
            self.clear()

        return clear_autocast_cache

    def register_kernels(self) -> None:
        """Our kernels on the AutocastCUDA key for every op that has one, once per measurement."""
        if self._library is not None:
            return
        import torch

        library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": torch's C++ ones
            for name in sorted(ops_with_cuda_autocast()):
                library.impl(name.removeprefix("aten::"), self._kernel(name), "AutocastCUDA")  # type: ignore[no-untyped-call]
        self._library = library

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    # -- kernels --

    def _kernel(self, name: str) -> Callable[..., Any]:
        op = op_overload(name)
        policy = CUDA_AUTOCAST_POLICIES.get(name)
        if policy == LOWER_PRECISION_FP:
            return functools.partial(self._cast_to, op, None)
        if policy == FP32:
            return functools.partial(self._cast_to, op, _float32())
        if policy == FP32_SET_OPT_DTYPE:
            return functools.partial(self._set_opt_dtype, op)
        if policy == FP32_APPEND_DTYPE:
            return functools.partial(self._append_dtype, op, op_overload(APPEND_DTYPE_TARGETS[name]))
        if policy == PROMOTE:
            return functools.partial(self._promote, op)
        if policy == BANNED:
            return _banned
        return functools.partial(self._unknown, op, name)

    def _cast_to(self, op: Any, dtype: torch.dtype | None, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # an op's error shows the test's frames and torch's
        with without_cuda_autocast():
            to = _lower() if dtype is None else dtype
            return op(*self.cast_all(to, args), **self.cast_all(to, kwargs))

    def _set_opt_dtype(self, op: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # an op's error shows the test's frames and torch's
        with without_cuda_autocast():
            if not self._eligible(args[0]):
                return op(*args, **kwargs)
            args, kwargs = _with_dtype(op, args, kwargs, _float32())
            return op(*args, **kwargs)

    def _append_dtype(self, op: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # an op's error shows the test's frames and torch's
        with without_cuda_autocast():
            first = args[0]
            dtype = _float32() if self._eligible(first) else first.dtype
            return target(*_with_defaults(op, args), **kwargs, dtype=dtype)

    def _promote(self, op: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # an op's error shows the test's frames and torch's
        with without_cuda_autocast():
            to = functools.reduce(self._prioritize, tensors_in([*args, *kwargs.values()]), _lower())
            return op(*self.cast_all(to, args), **self.cast_all(to, kwargs))

    def _unknown(self, op: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # an op's error shows the test's frames and torch's
        self.note(f"{name} has a CUDA autocast kernel this tracker has no cast policy for: it ran uncast")
        with without_cuda_autocast():
            return op(*args, **kwargs)

    def _prioritize(self, current: torch.dtype, tensor: torch.Tensor) -> torch.dtype:
        """CUDA's `prioritize`: float32 wins over the lower precision; float64 and other devices are ignored."""
        import torch

        if not self._eligible(tensor):
            return current
        if current == torch.float32 or tensor.dtype == torch.float32:
            return torch.float32
        if current == tensor.dtype == _lower():
            return current
        raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")

    # -- cached_cast --

    def _eligible(self, value: object) -> bool:
        import torch

        return (
            isinstance(value, torch.Tensor)
            and value.device.type in self.eligible
            and value.is_floating_point()
            and value.dtype != torch.float64
        )

    def cast_all(self, dtype: torch.dtype, values: Any) -> Any:
        """`values` (args tuple, kwargs dict) with each eligible tensor, alone or in a list, cast to `dtype`."""
        import torch

        if isinstance(values, dict):
            return {key: self.cast_all(dtype, value) for key, value in values.items()}
        if isinstance(values, (list, tuple)):
            cast = [self.cast_all(dtype, value) for value in values]
            return tuple(cast) if isinstance(values, tuple) else cast
        return self.cached_cast(dtype, values) if isinstance(values, torch.Tensor) else values

    def cached_cast(self, dtype: torch.dtype, tensor: torch.Tensor) -> torch.Tensor:
        """CUDA's `cached_cast`: eligible tensors cast to `dtype`, weights' lower-precision casts cached."""
        if not self._eligible(tensor) or tensor.dtype == dtype:
            return tensor
        if not self._cacheable(dtype, tensor):
            return tensor.to(dtype)
        held = self._cache.get(id(tensor))
        if held is not None and held[0]() is tensor:
            return held[1]
        if held is not None:
            self._orphans.append(held[1])
        import torch

        with torch.enable_grad():
            cast = tensor.to(dtype)
        self._cache[id(tensor)] = (weakref.ref(tensor), cast)
        return cast

    def _cacheable(self, dtype: torch.dtype, tensor: torch.Tensor) -> bool:
        import torch

        return (
            dtype == _lower()
            and tensor.dtype == torch.float32
            and tensor.requires_grad
            and tensor.is_leaf
            and not is_view(tensor)
            and torch.is_autocast_cache_enabled()
            and not torch.is_inference_mode_enabled()
        )

    def clear(self) -> None:
        self._cache.clear()
        self._orphans.clear()


# --- helpers -----------------------------------------------------------------------------------------


def emulating() -> bool:
    """Whether a measurement on this process runs CUDA's autocast rules for its tensors now."""
    return bool(_ACTIVE)


def autocast_device_type(device: torch.device) -> str:
    """The device type to give `torch.autocast` for tensors on `device`: "cuda" while a measurement that
    predicts a GPU runs on this process (its meta or CPU tensors then follow CUDA's autocast rules, as on
    a card), else `device.type`."""
    return "cuda" if emulating() else device.type


def active() -> CudaAutocast | None:
    """The emulation of the measurement under way, where CUDA autocast is enabled now; else None."""
    import torch

    if not _ACTIVE or not torch.is_autocast_enabled("cuda"):
        return None
    return _ACTIVE[-1]


def lower_precision(values: dict[str, Any]) -> dict[str, Any]:
    """`values` as CUDA autocast's lower-precision policy hands them to an op (unchanged where none runs)."""
    emulation = active()
    return values if emulation is None else emulation.cast_all(_lower(), values)


def _nesting() -> int:
    """How deep autocast regions are nested now (torch has no getter: one step in and back out)."""
    import torch

    depth: int = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return depth


def _lower() -> torch.dtype:
    import torch

    return torch.get_autocast_dtype("cuda")


def _float32() -> torch.dtype:
    import torch

    return torch.float32


def _with_dtype(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) with the op's optional `dtype` argument set to `dtype` where it is None."""
    names = [arg.name for arg in op_schema(op).arguments]
    position = names.index("dtype")
    if position < len(args):
        return (*args[:position], args[position] or dtype, *args[position + 1 :]), kwargs
    return args, {**kwargs, "dtype": kwargs.get("dtype") or dtype}


def _with_defaults(op: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """`args` with the defaults of the positional arguments not given (the kernel gets only those given)."""
    rest = [arg.default_value for arg in op_schema(op).arguments[len(args) :] if not arg.kwarg_only]
    return (*args, *rest)


def _banned(*args: Any, **kwargs: Any) -> Any:
    __tracebackhide__ = True  # raised where a card's autocast raises it: in the test's call
    raise RuntimeError(BANNED_MESSAGE)
