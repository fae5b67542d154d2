"""On meta the tracker counts what a card would hold: tensors made from data, and a tied parameter once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from pytest_gpumem.backends.tracker.backend import TrackerBackend


@contextmanager
def measured(device: str = "meta") -> Iterator[TrackerBackend]:
    backend = TrackerBackend(device=device, rounding="none")
    backend.start()
    try:
        yield backend
    finally:
        backend.stop()


def _kept(make: Callable[[], object]) -> tuple[int, object]:
    with measured() as backend:
        made = make()
        return backend.current().requested, made


@pytest.mark.parametrize(
    ("make", "size"),
    [
        (lambda: torch.tensor([[1.0, 2.0], [3.0, 4.0]], device="meta"), 4 * 4),
        (lambda: torch.as_tensor([1, 2, 3], device="meta"), 3 * 8),
        (lambda: torch.scalar_tensor(1.5, device="meta", dtype=torch.float64), 8),
        (lambda: torch.ones(2, device="meta").new_tensor([1.0, 2.0, 3.0]), 3 * 4),  # the ones are freed
    ],
    ids=["tensor", "as_tensor", "scalar_tensor", "new_tensor"],
)
def test_a_tensor_made_from_data_on_meta_is_counted_once(make: Callable[[], object], size: int) -> None:
    assert _kept(make)[0] == size


def test_as_tensor_of_a_meta_tensor_is_that_tensor_and_makes_nothing() -> None:
    existing = torch.empty(256, device="meta")
    assert _kept(lambda: torch.as_tensor(existing))[0] == 0


def test_on_cpu_a_tensor_from_data_is_counted_once_as_before() -> None:
    with measured("cpu") as backend:
        kept = torch.tensor([1.0, 2.0, 3.0])
        assert backend.current().requested == 3 * 4
    del kept


class TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 64)
        self.head = torch.nn.Linear(64, 1000, bias=False)
        self.head.weight = self.embed.weight


EMBEDDING = 1000 * 64 * 4


def test_moving_a_tied_model_to_meta_keeps_the_tie_and_counts_it_once() -> None:
    model = TiedLM()
    with measured() as backend:
        model.to("meta")
        assert model.head.weight is model.embed.weight
        assert backend.current().requested == EMBEDDING
        assert backend.peak().requested == EMBEDDING  # no second copy made, even for a moment


def test_to_empty_on_meta_keeps_the_tie() -> None:
    model = TiedLM()
    with measured():
        model.to_empty(device="meta")
    assert model.head.weight is model.embed.weight


def test_outside_a_measurement_torch_unties_as_it_does() -> None:
    model = TiedLM()
    with measured():
        pass
    model.to("meta")
    assert model.head.weight is not model.embed.weight  # torch's own behaviour, untouched once measuring ends


def test_a_gradient_of_a_tied_parameter_moves_once_too() -> None:
    model = TiedLM()
    model.embed.weight.grad = torch.zeros_like(model.embed.weight)
    with measured() as backend:
        model.to("meta")
        assert model.head.weight.grad is model.embed.weight.grad
        assert backend.current().requested == 2 * EMBEDDING
