"""Compiled functions where a card is predicted: as Inductor splits them, run unfused.

Inductor's plan on the CPU is not a card's (its C++ kernels fuse and reuse buffers otherwise), and on meta
it cannot plan at all (it counted 4 MiB of a forward where a card holds at least 20, or failed inside
torch). What a card does and the tracker can run is Inductor's front half: its decompositions and min-cut
partitioner decide what the forward saves for backward and what backward recomputes, and the backward
graph returns every gradient at once. Run op by op with each value freed after its last use, those graphs
hold every buffer Inductor's fused kernels would and the intermediates fusion would drop: an upper bound
of a card's plan.

On meta, torch's tracing of the joint graph took the Python meta kernels torch gives some ops that
decompose on every device, and lost their gradient (nll_loss, so cross_entropy): those kernels stand aside
while the partition is traced, as on a card. Should a gradient still be lost (torch warns that "an autograd
kernel was not registered" while compiling), the graph runs as Dynamo captured it, eagerly, which is no
bound: the frame is noticed apart.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from pytest_gpumem import private_torch

_LOST_GRADIENT = "an autograd kernel was not registered to the Autograd key"
_META = torch.device("meta")


class UnfusedPartition:
    """Dynamo's backend for a card's prediction; `ran_eagerly` is told each time a graph whose partition
    lost a gradient runs eagerly instead."""

    __name__ = "inductor (its partition, unfused)"  # how Dynamo's errors name a backend

    def __init__(self) -> None:
        self.ran_eagerly: Callable[[], None] | None = None

    def __call__(self, graph: Any, example_inputs: list[Any]) -> Callable[..., Any]:
        partition = private_torch.inductor_partition_backend()
        on_meta = any(getattr(value, "device", None) == _META for value in example_inputs)
        decomposed = private_torch.composite_ops_decomposed_on_meta() if on_meta else contextlib.nullcontext()
        with warnings.catch_warnings(record=True) as caught, decomposed:
            warnings.simplefilter("always")
            compiled: Callable[..., Any] = partition(graph, example_inputs)
        lost = False
        for warning in caught:
            if _LOST_GRADIENT in str(warning.message):
                lost = True
            else:
                _warn_again(warning)
        return self._eager(graph.forward) if lost else compiled

    def _eager(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(forward)
        def run(*args: Any) -> Any:
            if self.ran_eagerly is not None:
                self.ran_eagerly()
            return forward(*args)

        return run


def _warn_again(warning: warnings.WarningMessage) -> None:
    """`warning` warned again as its module warned it, so that the filters naming that module (`-W
    ignore::DeprecationWarning:torch.jit._script`) and its registry of warnings shown once still apply."""
    module = _module_of(warning.filename)
    if module is None:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        return
    where = vars(module)
    registry = where.setdefault("__warningregistry__", {})
    warnings.warn_explicit(
        warning.message, warning.category, warning.filename, warning.lineno, module.__name__, registry, where
    )


def _module_of(filename: str) -> Any:
    """The loaded module whose source is `filename`, or None."""
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) == filename:
            return module
    return None


BACKEND = UnfusedPartition()
"""One per process: Dynamo reuses what it compiled for the same backend."""


_CALLBACKS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def callback(like: Any) -> Any:
    """Dynamo's callback that compiles frames with `BACKEND`, made as `like` (the callback `torch.compile`
    chose for the function) was, with its hooks and recompile limit: a `fullgraph=True` function still refuses
    graph breaks. One per chosen callback, so that each call of a function finds what it compiled before."""
    made = _CALLBACKS.get(like)
    if made is None:
        made = _CALLBACKS[like] = private_torch.dynamo_callback(BACKEND, like)
    return made
