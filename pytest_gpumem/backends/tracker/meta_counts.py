"""What a card holds that meta would not count by itself: tensors made from data, and tied parameters.

- `torch.tensor(data, device="meta")` (and `as_tensor`, `new_tensor`, `scalar_tensor`, `asarray`) makes its
  tensor below the dispatcher's Python key: on CPU the constant reaches the mode as `lift_fresh`, on meta
  nothing does. A torch-function mode counts the meta storage such a factory returns, unless an op made
  it or it was an input's (`as_tensor` of a meta tensor returns the tensor itself).
- `Module.to("meta")` (and `to_empty`) from CPU makes a new parameter for each module that holds a tied
  one (`_has_compatible_shallow_copy_type` is false across those devices), so a tied embedding would be
  counted twice; CPU to CUDA keeps the tie. During a measurement on meta, each tensor is converted once
  (the same result for the same tensor) and every module holding a tied parameter gets the same new one.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pytest_gpumem.backends.tracker.graph import tensors_in
from pytest_gpumem.private_torch import storage_key

if TYPE_CHECKING:
    import torch

    from pytest_gpumem.backends.tracker.ledger import StorageLedger

_FACTORIES = ("tensor", "as_tensor", "asarray", "scalar_tensor")


def _counted_factories() -> frozenset[Any]:
    import torch

    found = {getattr(torch, name) for name in _FACTORIES if hasattr(torch, name)}
    return frozenset({*found, torch.Tensor.new_tensor})


@functools.cache
def factory_mode_class() -> type[Any]:
    """One class for every measurement (torch.compile guards on the types on the mode stack)."""
    from torch.overrides import TorchFunctionMode

    factories = _counted_factories()

    class MetaFactories(TorchFunctionMode):
        def __init__(self, ledger: Callable[[], StorageLedger | None]) -> None:
            super().__init__()
            self.ledger = ledger  # the measuring mode's, when it is on this thread's stack

        def __torch_function__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            __tracebackhide__ = True
            if func not in factories:
                return func(*args, **(kwargs or {}))
            given = _storage_keys([*args, *(kwargs or {}).values()])
            out = func(*args, **(kwargs or {}))
            ledger = self.ledger()
            if ledger is not None and out.device.type == "meta":
                storage = out.untyped_storage()
                if storage_key(storage) not in given:
                    ledger.op, ledger.out = f"torch.{func.__name__}", out
                    ledger.add(storage)  # a storage an op made is already followed: counted once
            return out

    return MetaFactories


def _storage_keys(values: list[Any]) -> set[int]:
    keys = set()
    for tensor in tensors_in(values):
        try:
            keys.add(storage_key(tensor.untyped_storage()))
        except (RuntimeError, NotImplementedError):  # sparse and other layouts without one storage
            continue
    return keys


_converting = threading.local()


def keeping_ties(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Module._apply` that converts each tensor once and leaves tied parameters tied."""

    @functools.wraps(original)
    def apply(module: torch.nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if getattr(_converting, "active", False):
            return original(module, fn, *args, **kwargs)
        tied = _tied_parameters(module)
        _converting.active = True
        try:
            result = original(module, _once_per_tensor(fn), *args, **kwargs)
        finally:
            _converting.active = False
        _tie_again(tied)
        return result

    return apply


def _tied_parameters(module: torch.nn.Module) -> list[list[tuple[torch.nn.Module, str]]]:
    """The holders (module, name) of each parameter that more than one place holds."""
    holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for owner in module.modules():
        for name, param in owner.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(param), []).append((owner, name))
    return [places for places in holders.values() if len(places) > 1]


def _once_per_tensor(fn: Callable[..., Any]) -> Callable[..., Any]:
    done: dict[int, tuple[Any, Any]] = {}  # the input is kept: its id stays its own

    def convert(tensor: Any) -> Any:
        key = id(tensor)
        if key not in done:
            done[key] = (tensor, fn(tensor))
        return done[key][1]

    return convert


def _tie_again(tied: list[list[tuple[torch.nn.Module, str]]]) -> None:
    for (first, first_name), *others in tied:
        param = getattr(first, first_name)
        for owner, name in others:
            if getattr(owner, name) is not param:
                setattr(owner, name, param)
