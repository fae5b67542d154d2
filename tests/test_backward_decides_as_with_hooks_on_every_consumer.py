"""The unmoded backward closes an accumulation's window by asking the engine which node it runs
(`current_autograd_node`) where it once put a pre-hook on every consumer of a node whose outputs join:
on random graphs (joins, forks, several outputs, the formulas of `_TWINS`, a Python node) and residual
stacks, it runs in place exactly the ops that the hooks on every consumer ran in place."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_backward_hooks_are_placed_as_a_plain_walk_places_them import random_roots
from torch import nn

from pytest_gpumem.backends.tracker import mode as tracker_mode
from pytest_gpumem.backends.tracker import unmoded
from pytest_gpumem.backends.tracker.backend import TrackerBackend

Decision = tuple[str, bool]


def hooks_on_every_consumer(graph: Any) -> tuple[list[Any], list[tuple[Any, str]]]:
    """The earlier plan: post-hooks on the nodes whose outputs join and on those of `_TWINS`, pre-hooks
    on those and on every consumer of the first but `AccumulateGrad` nodes."""
    nodes, feeds, joined, _ = graph
    returning: list[Any] = []
    starting: dict[Any, None] = {}
    for node, edges in nodes.items():
        consumers = [edge for edge in edges if edge[0] is not None]
        joins = joined and any(feeds[consumer, slot] > 1 for consumer, slot in consumers)
        if joins or node.name() in unmoded._TWINS:
            returning.append(node)
            starting[node] = None
        if joins:
            starting.update((consumer, None) for consumer, _ in consumers)
    named = [(node, node.name()) for node in starting]
    return returning, [(node, name) for node, name in named if name != "torch::autograd::AccumulateGrad"]


def the_last_producer() -> object:
    """The window as the earlier plan kept it: open from a post-hook to the next hooked node's start."""
    runs = unmoded._LOCAL.runs
    return runs[-1].producer if runs else None


class AddsToItsGradient(torch.autograd.Function):
    """A node whose formula adds its incoming gradient to a fresh tensor (out of place, as torch would):
    when the gradient is what a joining node just returned, that `add` is no buffer's accumulation."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.exp() + grad


def residual_roots(rng: random.Random) -> list[Any]:
    """A stack of residual blocks (Linear, relu, or a node adding to its gradient), some gradients made
    twice (a tensor used by two blocks)."""
    width = rng.randint(2, 6)
    blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(rng.randint(1, 4)))
    hidden = torch.randn(rng.randint(1, 4), width, requires_grad=rng.random() < 0.5)
    for block in blocks:
        branch = block(hidden)
        branch = AddsToItsGradient.apply(branch) if rng.random() < 0.5 else torch.relu(branch)  # type: ignore[no-untyped-call]
        hidden = hidden + branch
    return [hidden.sum()]


def decisions(seeds: range, earlier: bool, monkeypatch: pytest.MonkeyPatch) -> list[list[Decision]]:
    """Per graph, each candidate op backward met and whether it ran in place, under one plan."""
    made: list[Decision] = []
    original = unmoded.in_place_twin

    def recorded(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
        out = original(func, args, kwargs)
        made.append((str(func), out is not None))
        return out

    with monkeypatch.context() as patch:
        patch.setattr(tracker_mode, "in_place_twin", recorded)
        if earlier:
            patch.setattr(unmoded, "hook_plan", hooks_on_every_consumer)
            patch.setattr(unmoded, "_current_node", the_last_producer)
        per_graph: list[list[Decision]] = []
        for roots in _graphs(seeds):
            made.clear()
            torch.autograd.backward(roots)
            per_graph.append(list(made))
    return per_graph


def _graphs(seeds: range) -> Iterator[list[Any]]:
    backend = TrackerBackend(rounding="none")
    backend.start()
    try:
        for seed in seeds:
            rng = random.Random(seed)
            roots = residual_roots(rng) if seed % 3 == 0 else random_roots(rng)
            tensors = [root for root in roots if isinstance(root, torch.Tensor) and root.grad_fn is not None]
            if tensors:
                yield tensors
    finally:
        backend.stop()


def test_backward_runs_in_place_what_hooks_on_every_consumer_ran_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    seeds = range(150)
    now = decisions(seeds, earlier=False, monkeypatch=monkeypatch)
    before = decisions(seeds, earlier=True, monkeypatch=monkeypatch)
    assert now == before
    in_place = ran_in_place(now)
    assert in_place["aten.add.Tensor"] >= 50 and len(in_place) >= 3, in_place  # the comparison saw decisions


def ran_in_place(per_graph: list[list[Decision]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for graph in per_graph:
        for func, ran_in_place in graph:
            counts[func] = counts.get(func, 0) + ran_in_place
    return counts
