"""Backward under the tracker allocates what it allocates without a dispatch mode: the engine adds a
gradient's contributions in place and formulas fill their fresh tensors in place, as torch does when no
mode makes every tensor look like a subclass (float32 = 4 bytes throughout)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from pytest_gpumem.backends.timeline import FREED, RESIZED
from pytest_gpumem.backends.tracker import unmoded
from pytest_gpumem.backends.tracker.backend import TrackerBackend

N = 1000  # float32 elements: 4N = 4000 bytes
Allocations = list[tuple[str, int]]


class TinyTransformer(nn.Module):
    """Embedding, two pre-norm blocks with residuals, a max-pool over the sequence, a linear head."""

    def __init__(self, vocabulary: int = 11, width: int = 8) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        pooled = F.max_pool1d(hidden.transpose(1, 2), 2).transpose(1, 2)
        logits: torch.Tensor = self.head(pooled)
        return logits


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        query, key, value = self.qkv(self.norm1(hidden)).chunk(3, dim=-1)
        weights = (query @ key.transpose(1, 2) / key.size(-1) ** 0.5).softmax(-1)
        hidden = hidden + self.out(weights @ value)
        out: torch.Tensor = hidden + self.mlp(self.norm2(hidden))
        return out


def transformer_loss() -> torch.Tensor:
    torch.manual_seed(0)
    model = TinyTransformer()
    tokens = torch.randint(0, 11, (2, 6))
    targets = torch.randint(0, 11, (2, 3, 1))
    loss: torch.Tensor = -model(tokens).log_softmax(-1).gather(-1, targets).mean()
    return loss


@functools.cache
def _composite(name: str) -> bool:
    """Ops that decompose above the dispatch modes (a mode sees what they call, not them); the profiler
    names no overload, and a name without a default overload (`aten::div`) is taken for a kernel's."""
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"))
    except RuntimeError:
        return False


def _top_op(chain: list[Any]) -> Any:
    """The outermost op of an allocation's stack that a dispatch mode sees (else its innermost event)."""
    return next((e for e in chain if e.name.startswith("aten::") and not _composite(e.name)), chain[-1])


def profiled_allocations(backward: Callable[[], None]) -> Allocations:
    """The storages `backward` allocates, by the op that made them, as torch.profiler records them
    without any mode: an allocation freed before its op returns is the kernel's scratch, left out."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        backward()
    made: list[list[Any]] = []  # [op, bytes, when its op returned, whether it outlived its op]
    live: dict[int, list[Any]] = {}

    def walk(event: Any, chain: list[Any]) -> None:
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if fields.alloc_size > 0:
                top = _top_op(chain)
                live[fields.ptr] = [top.name, fields.alloc_size, top.end_time_ns, True]
                made.append(live[fields.ptr])
            elif (freed := live.pop(fields.ptr, None)) is not None and event.start_time_ns <= freed[2]:
                freed[3] = False
            return
        for child in event.children:
            walk(child, [*chain, event])

    assert prof.profiler is not None
    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, [])
    return [(op, size) for op, size, _, kept in made if kept]


def tracked_allocations(backward: Callable[[], None], device: str = "cpu") -> Allocations:
    """The storages `backward` allocates under the tracker, by the op that made them."""
    backend = TrackerBackend(device=device, rounding="none")
    backend.start()
    try:
        with backend.timeline() as timeline:
            backward()
    finally:
        backend.stop()
    events = timeline()
    before = [0, *events.allocated]
    return [
        ("aten::" + op.split(".")[1], after - previous)
        for op, previous, after in zip(events.ops, before, events.allocated, strict=False)
        if op not in (FREED, RESIZED) and after > previous
    ]


def backward_peak(make_loss: Callable[[], torch.Tensor], device: str = "cpu", rounding: str = "none") -> int:
    """The tracker's peak over `loss.backward()`, counted from the bytes live when it starts."""
    loss = make_loss()
    backend = TrackerBackend(device=device, rounding=rounding)
    backend.start()
    try:
        loss.backward()  # type: ignore[no-untyped-call]
    finally:
        peak = backend.peak().allocated
        backend.stop()
    return peak


class OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the ops that reach it; below the tracker's mode, it sees what the tracker ran."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.counts[func.__name__] = self.counts.get(func.__name__, 0) + 1
        return func(*args, **(kwargs or {}))


def product_sum(device: str = "cpu") -> torch.Tensor:
    """`y = exp(x)` used twice: backward adds its two gradient contributions (4N each)."""
    x = torch.randn(N, device=device, requires_grad=True)
    y = x.exp()
    loss: torch.Tensor = (y * 2 + y * 3).sum()
    return loss


def test_a_transformers_backward_allocates_what_the_profiler_records_without_the_tracker() -> None:
    loss = transformer_loss()
    unmeasured = profiled_allocations(functools.partial(loss.backward, retain_graph=True))
    assert tracked_allocations(loss.backward) == unmeasured


def test_a_gradients_second_contribution_is_added_in_place() -> None:
    # the seed (4) is held by torch.autograd.backward throughout; y*2's gradient (4N) waits in exp's
    # buffer while y*3's (4N) is made; it is added into the first instead of into a third 4N
    assert backward_peak(product_sum) == 4 + 2 * 4 * N


def test_without_the_emulation_the_contribution_is_added_out_of_place(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_gpumem.backends.tracker import mode

    monkeypatch.setattr(mode, "in_place_twin", lambda func, args, kwargs: None)
    monkeypatch.setattr(unmoded, "_PROBE", unmoded._Probe())  # this start's probe reads nothing
    assert backward_peak(product_sum) == 4 + 3 * 4 * N


def _breaks_its_graph(x: torch.Tensor) -> torch.Tensor:
    return x * 3 if x.sum() > 0 else x  # a data-dependent branch


def _as_traced(graph: Any, inputs: Any) -> Any:
    return graph.forward


def test_the_contribution_is_added_in_place_after_a_fullgraph_break_leaves_dynamo_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # from such a break on, Dynamo's frame evaluator holds a reference to each argument of every Python call
    monkeypatch.setattr(unmoded, "_PROBE", unmoded._Probe())  # the probe reads its counts before the break
    before = backward_peak(product_sum)
    with pytest.raises(RuntimeError, match="graph break"):
        torch.compile(_breaks_its_graph, fullgraph=True, backend=_as_traced)(torch.ones(2))
    assert (before, backward_peak(product_sum)) == (4 + 2 * 4 * N, 4 + 2 * 4 * N)


def test_on_meta_the_contribution_is_added_in_place_as_on_a_gpu() -> None:
    # CUDA rounding: the seed's 4 bytes take a 512-byte block, each 4000-byte gradient 4096
    assert backward_peak(lambda: product_sum("meta"), "meta", "cuda") == 512 + 2 * 4096


def test_the_in_place_accumulation_is_what_runs() -> None:
    loss = product_sum()
    counter = OpCounter()
    backend = TrackerBackend(rounding="none")
    with counter:  # below the tracker's mode: it sees the ops the tracker runs
        backend.start()
        try:
            loss.backward()  # type: ignore[no-untyped-call]
        finally:
            backend.stop()
    assert (counter.counts.get("add_.Tensor"), counter.counts.get("add.Tensor")) == (1, None)


def test_gradients_are_those_computed_without_the_tracker() -> None:
    unmeasured = transformer_loss()
    expected = torch.autograd.grad(unmeasured, _leaves(unmeasured))
    loss = transformer_loss()
    backend = TrackerBackend(rounding="none")
    backend.start()
    try:
        found = torch.autograd.grad(loss, _leaves(loss))
    finally:
        backend.stop()
    assert all(torch.equal(a, b) for a, b in zip(expected, found, strict=True))


def _leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    found, pending, seen = [], [loss.grad_fn], set()
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            found.append(node.variable)
        pending.extend(next_node for next_node, _ in node.next_functions)
    return sorted(found, key=lambda t: t.numel())


def test_a_max_over_a_dimension_scatters_into_its_zeros_in_place() -> None:
    # the seed (4); the gradient of the 40 maxima is its expanded view; zeros of x's size (4N) take
    # them in place, where a second 4N would hold the scatter's result
    def loss() -> torch.Tensor:
        return torch.randn(40, N // 40, requires_grad=True).max(1).values.sum()

    assert backward_peak(loss) == 4 + 4 * N


def test_a_gather_adds_into_its_zeros_in_place() -> None:
    x = torch.randn(N, requires_grad=True)
    index = torch.zeros(10, dtype=torch.long)
    # the seed (4), the expanded gradient of the 10 picks is a view of it; new_zeros (4N) filled in place
    assert backward_peak(lambda: x.gather(0, index).sum()) == 4 + 4 * N


def test_a_contribution_a_hook_holds_is_added_out_of_place_as_torch_does() -> None:
    kept: list[torch.Tensor] = []

    def loss() -> torch.Tensor:
        x = torch.randn(N, requires_grad=True)
        y = x.exp()
        later = y * 3  # its node runs first: its gradient (4N) waits in exp's buffer, kept by the hook
        assert later.grad_fn is not None
        later.grad_fn.register_hook(lambda grad_inputs, grad_outputs: kept.append(grad_inputs[0]))
        return (y * 2 + later).sum()

    assert tracked_allocations(loss().backward) == profiled_allocations(loss().backward)
    assert backward_peak(loss) == 4 + 3 * 4 * N  # the seed, both contributions and their sum


def test_a_retained_gradient_is_the_sum_made_in_place_as_torch_does() -> None:
    def loss() -> torch.Tensor:
        x = torch.randn(N, requires_grad=True)
        y = x.exp()
        y.retain_grad()
        return (y * 2 + y * 3).sum()

    assert tracked_allocations(loss().backward) == profiled_allocations(loss().backward)
    # y.grad is the buffer's sum itself; exp's gradient (4N) is made beside it
    assert backward_peak(loss) == 4 + 2 * 4 * N


def test_a_second_backward_replaces_a_retained_gradient_out_of_place_as_torch_does() -> None:
    """The retain_grad hook adds `v.grad + g` on v's node, after the node that returned g (hooked: its
    other output joins) has finished: not the engine's accumulation, so a new tensor as without a mode."""
    replaced: list[bool] = []

    def two_backwards() -> None:
        leaves = torch.randn(N, requires_grad=True), torch.randn(N, requires_grad=True)
        a = leaves[1] + 0
        v = leaves[0] + 1
        loss = ((a + v) * 3 + a).sum()
        v.retain_grad()
        loss.backward(retain_graph=True)  # type: ignore[no-untyped-call]
        assert v.grad is not None
        first = v.grad.data_ptr()
        loss.backward()  # type: ignore[no-untyped-call]
        replaced.append(v.grad.data_ptr() != first)

    two_backwards()
    allocations = tracked_allocations(two_backwards)
    assert replaced == [True, True]
    # the seed, the gradient of `* 3`, a's two contributions summed, v.grad's sum beside the one it replaces
    assert allocations[-4:] == [
        ("aten::ones_like", 4),
        ("aten::mul", 4 * N),
        ("aten::add", 4 * N),
        ("aten::add", 4 * N),
    ]


def test_create_graph_adds_out_of_place_as_torch_does() -> None:
    loss = product_sum()
    counter = OpCounter()
    backend = TrackerBackend(rounding="none")
    with counter:
        backend.start()
        try:
            torch.autograd.grad(loss, _leaves(loss), create_graph=True)
        finally:
            backend.stop()
    assert counter.counts.get("add_.Tensor") is None


def test_reentrant_checkpoint_adds_in_place_inside_its_nested_backward() -> None:
    def loss() -> torch.Tensor:
        x = torch.randn(N, requires_grad=True)
        segment: torch.Tensor = checkpoint(lambda t: (lambda y: y * 2 + y * 3)(t.exp()), x, use_reentrant=True)
        return segment.sum()

    # the seed (4); the recomputed exp (4N, saved) and output (4N, held by checkpoint's backward); in
    # the nested backward y*3's and y*2's gradients (4N each), the second added into the first
    assert backward_peak(loss) == 4 + 4 * 4 * N


def test_the_hooks_are_removed_after_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    returned: list[str] = []

    class Recording(unmoded._Run):
        def returned(self, node: Any, grad_inputs: Sequence[torch.Tensor | None], grad_outputs: object) -> None:
            returned.append(node.name())
            super().returned(node, grad_inputs, grad_outputs)

    monkeypatch.setattr(unmoded, "_Run", Recording)
    loss = product_sum()
    backend = TrackerBackend(rounding="none")
    backend.start()
    returned.clear()  # the first start's probe runs a backward of its own
    try:
        loss.backward(retain_graph=True)  # type: ignore[no-untyped-call]
    finally:
        backend.stop()
    hooked = ["MulBackward0", "MulBackward0"]  # the products, whose gradients meet
    assert returned == hooked
    loss.backward()  # type: ignore[no-untyped-call]
    assert returned == hooked


def _parts_summed() -> torch.Tensor:
    a, b = torch.randn(2, N, requires_grad=True).exp().unbind()  # UnbindBackward0 is reached twice, by two inputs
    return (a * 2 + b * 3).sum()


@pytest.mark.parametrize(
    "make_loss",
    [lambda: (torch.randn(N, requires_grad=True).exp() * 2).sum(), _parts_summed],
    ids=["a chain", "two inputs of one node"],
)
def test_a_graph_where_no_gradients_meet_is_hooked_nowhere(
    monkeypatch: pytest.MonkeyPatch, make_loss: Callable[[], torch.Tensor]
) -> None:
    seen: list[str] = []

    class Recording(unmoded._Run):
        def starts(self, name: str, grad_outputs: object) -> None:
            seen.append(name)

        def returned(self, node: Any, grad_inputs: Sequence[torch.Tensor | None], grad_outputs: object) -> None:
            seen.append("returned")

    monkeypatch.setattr(unmoded, "_Run", Recording)
    loss = make_loss()
    backend = TrackerBackend(rounding="none")
    backend.start()
    seen.clear()  # the first start's probe runs a backward of its own
    try:
        loss.backward()  # type: ignore[no-untyped-call]
    finally:
        backend.stop()
    assert seen == []


def test_grad_with_inputs_adds_in_place() -> None:
    loss = product_sum()
    x = _leaves(loss)[0]
    backend = TrackerBackend(rounding="none")
    backend.start()
    try:
        (grad,) = torch.autograd.grad(loss, inputs=[x])
    finally:
        peak = backend.peak().allocated
        backend.stop()
    assert peak == 4 + 2 * 4 * N
    assert grad.shape == (N,)
