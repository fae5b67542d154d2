"""The unmoded backward's walk of the autograd graph (`unmoded.graph_of`, `unmoded.hook_plan`), which is on
every measured backward's path and kept lean, hooks exactly the nodes a plain walk says it must: every
node reached, every edge into a buffer slot counted, each node's name read. Compared on random graphs
that join, fork, branch into several outputs, cut themselves off (detach) and run the formulas of
`_TWINS`, from tensors and from gradient edges."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.graph import get_gradient_edge

from pytest_gpumem.backends.tracker import unmoded

Plan = tuple[set[int], set[int], bool, bool]
SHAPE = (4, 3)


def plain_plan(roots: list[Any]) -> Plan:
    """The post-hooked nodes (those whose outputs meet another gradient in a buffer slot, those of
    `_TWINS`), the pre-hooked nodes (those of `_TWINS`), by id, whether gradients meet in some buffer
    slot, and whether a node of `_TWINS` is in the graph, each decided the plain way."""
    nodes: dict[int, Any] = {}  # held: a node's id stays its own
    pending = [root.grad_fn if isinstance(root, torch.Tensor) else root.node for root in roots]
    while pending:
        node = pending.pop()
        if node is not None and id(node) not in nodes:
            nodes[id(node)] = node
            pending.extend(consumer for consumer, _ in node.next_functions)
    incoming = Counter(
        (id(consumer), slot)
        for node in nodes.values()
        for consumer, slot in node.next_functions
        if consumer is not None
    )
    post: set[int] = set()
    pre: set[int] = set()
    for key, node in nodes.items():
        joins = any(incoming[id(consumer), slot] > 1 for consumer, slot in node.next_functions if consumer is not None)
        if joins or node.name() in unmoded._TWIN_OPS:
            post.add(key)
        if node.name() in unmoded._TWIN_OPS:
            pre.add(key)
    twins = any(node.name() in unmoded._TWIN_OPS for node in nodes.values())
    return post, pre, any(count > 1 for count in incoming.values()), twins


def lean_plan(roots: list[Any]) -> Plan:
    graph = unmoded.graph_of(roots)
    returning, starting = unmoded.hook_plan(graph)
    _, _, joined, twins = graph
    return {id(node) for node in returning}, {id(node) for node, _ in starting}, joined, twins


class Doubled(torch.autograd.Function):
    """A Python node (`PyNode`) in the graph."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


def _index() -> torch.Tensor:
    return torch.tensor([[0, 1, 2], [3, 2, 1], [1, 1, 0], [2, 0, 3]])


Op = Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]]
OPS: list[Op] = [
    lambda a, b: [a.exp()],
    lambda a, b: [a * 2],
    lambda a, b: [a + b],
    lambda a, b: [a * b],
    lambda a, b: [a.t().t()],  # views
    lambda a, b: [a.detach()],  # cut off: no node
    lambda a, b: [torch.cat(a.split(2))],  # type: ignore[no-untyped-call]  # one node reached twice, by its two outputs
    lambda a, b: [torch.stack(a.unbind(0)), a.unbind(0)[0].expand(SHAPE)],  # one node, several outputs
    lambda a, b: [a.max(dim=0, keepdim=True).values.expand(SHAPE)],
    lambda a, b: [a.gather(0, _index())],
    lambda a, b: [a.index_select(0, torch.tensor([3, 0, 1, 1]))],
    lambda a, b: [torch.cat([a.topk(2, dim=0).values, b[:2]])],
    lambda a, b: [torch.atan2(a, b)],
    lambda a, b: [F.binary_cross_entropy_with_logits(a, b.detach().sigmoid()).expand(SHAPE)],
    lambda a, b: [Doubled.apply(a)],  # type: ignore[no-untyped-call]
]


def random_roots(rng: random.Random) -> list[Any]:
    """Roots of a random graph: tensors or gradient edges of some of the tensors made."""
    pool = [torch.randn(SHAPE, requires_grad=rng.random() < 0.8) for _ in range(rng.randint(1, 3))]
    for _ in range(rng.randint(1, 10)):
        op = rng.choice(OPS)
        pool.extend(op(rng.choice(pool), rng.choice(pool)))
    made = [t for t in pool if t.grad_fn is not None]
    roots: list[Any] = []
    for tensor in rng.sample(made, min(len(made), rng.randint(1, 3))):
        roots.append(get_gradient_edge(tensor) if rng.random() < 0.2 else tensor.sum())
    return roots or [pool[0]]  # a leaf: no graph


def test_the_lean_walk_hooks_the_nodes_a_plain_walk_hooks_on_random_graphs() -> None:
    kinds = Counter[tuple[bool, bool]]()
    for seed in range(100):
        roots = random_roots(random.Random(seed))
        expected = plain_plan(roots)
        assert lean_plan(roots) == expected, f"seed {seed}"
        kinds[expected[2:]] += 1
    assert len(kinds) == 4 and min(kinds.values()) >= 10, kinds  # joined or not, with twins or not: each met
