"""Workloads: the models and tensors the strategies run on, with their sizes in one place.

Every workload is built on the CPU from a seeded generator and then moved, so the numbers are the same
on every device (on the meta device, which holds no data, it is made there directly, with the same
sizes); `clone(dtype)` gives fresh leaf tensors (for the fp64 ground truth and for the naive
implementation in a reduced dtype). Sizes are multiplied by the `--gpumem-scale` option.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

FP32 = 4  # bytes per float32 element; every byte formula in this package is written with it


def _scaled(base: int, scale: float, multiple: int = 1) -> int:
    """`base * scale`, rounded to a positive multiple of `multiple`."""
    return max(multiple, round(base * scale / multiple) * multiple)


def _randn(gen: torch.Generator, device: torch.device, *shape: int) -> torch.Tensor:
    """Seeded normal values on the CPU; on the meta device an empty tensor of that shape (meta tensors
    hold no data, so nothing is drawn and no host memory is used, whatever the scale)."""
    if device.type == "meta":
        return torch.empty(shape, device=device)
    return torch.randn(shape, generator=gen)


def _leaf(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype, grad: bool) -> torch.Tensor:
    return tensor.detach().to(device=device, dtype=dtype).clone().requires_grad_(grad)


# --- the Q&A's custom loss: loss = sum(x * y) -------------------------------------------------------


@dataclass
class ProductWorkload:
    """Two tensors that both need gradients, as when `x` is a model output and `y` a learned target."""

    x: torch.Tensor
    y: torch.Tensor

    @property
    def numel(self) -> int:
        return self.x.numel()

    def clone(self, dtype: torch.dtype | None = None) -> ProductWorkload:
        dtype = dtype or self.x.dtype
        return ProductWorkload(_leaf(self.x, self.x.device, dtype, True), _leaf(self.y, self.y.device, dtype, True))


def build_product(scale: float, device: torch.device) -> ProductWorkload:
    rows = _scaled(1024, scale)
    gen = torch.Generator().manual_seed(0)
    # mean 0.5: the loss is ~N/4, so its relative error measures rounding rather than cancellation
    x, y = _randn(gen, device, 2, rows, 1024) + 0.5
    return ProductWorkload(_leaf(x, device, torch.float32, True), _leaf(y, device, torch.float32, True))


# --- the Q&A's Net: Linear(1024, 2048) -> Linear(2048, 1024) ---------------------------------------


class Net(nn.Module):
    """The network of the Q&A. Linear layers save only their input (and weight) for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(1024, 2048)
        self.layer2 = nn.Linear(2048, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.layer1(x))  # type: ignore[no-any-return]


@dataclass
class ModelWorkload:
    """A model, an input batch and a target; the loss is the Q&A's `sum(out * target)` over the batch
    size, which keeps fp16 gradients times GradScaler's 2**16 finite. lr 1.0 makes the SGD update large
    against fp32 rounding of the parameters, so updated parameters can be compared at fp32 tolerance."""

    model: nn.Module
    inputs: torch.Tensor
    target: torch.Tensor
    lr: float = 1.0

    @property
    def batch(self) -> int:
        return self.inputs.shape[0]

    @property
    def net(self) -> Net:
        """The model, where it is the Q&A's Net."""
        assert isinstance(self.model, Net)
        return self.model

    @property
    def residual(self) -> ResidualMLP:
        """The model, where it is the deep residual MLP."""
        assert isinstance(self.model, ResidualMLP)
        return self.model

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def largest_param_bytes(self) -> int:
        return max(p.numel() * p.element_size() for p in self.model.parameters())

    def clone(self, dtype: torch.dtype | None = None) -> ModelWorkload:
        dtype = dtype or self.inputs.dtype
        model = copy.deepcopy(self.model).to(dtype)
        device = self.inputs.device
        return ModelWorkload(
            model, _leaf(self.inputs, device, dtype, False), _leaf(self.target, device, dtype, False), self.lr
        )


def model_loss(out: torch.Tensor, target: torch.Tensor, batch: int | None = None) -> torch.Tensor:
    """The Q&A's `sum(out * target)`, averaged over the batch (`batch` rows: the full batch's size)."""
    return torch.sum(out * target) / (batch or out.shape[0])


def _build_model(model: nn.Module, batch: int, width: int, device: torch.device) -> ModelWorkload:
    gen = torch.Generator().manual_seed(1)
    if device.type == "meta":
        model = model.to(device)  # parameters without data: nothing to draw
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(_randn(gen, p.device, *p.shape) / (p.shape[-1] ** 0.5))
    inputs = _randn(gen, device, batch, width)
    target = _randn(gen, device, batch, width)
    return ModelWorkload(model.to(device), _leaf(inputs, device, torch.float32, False), target.to(device))


def build_net(scale: float, device: torch.device) -> ModelWorkload:
    return _build_model(Net(), _scaled(512, scale), 1024, device)


# --- a deep residual MLP (pre-LayerNorm transformer MLP blocks) ------------------------------------


class ResidualBlock(nn.Module):
    """`x + fc2(gelu(fc1(norm(x))))`. Saved for backward per block (B rows, D width, H hidden):
    norm input x (B*D) and mean/rstd (2*B), fc1 input (B*D), fc1 output for gelu (B*H), gelu output
    for fc2 (B*H)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))  # type: ignore[no-any-return]


class ResidualMLP(nn.Module):
    def __init__(self, depth: int, width: int, hidden: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResidualBlock(width, hidden) for _ in range(depth))
        self.width, self.hidden = width, hidden


@dataclass(frozen=True)
class ResidualSizes:
    batch: int
    depth: int = 8
    width: int = 256
    hidden: int = 1024

    def block_saved_bytes(self) -> int:
        """fp32 bytes one block saves for backward in plain autograd (see ResidualBlock)."""
        return FP32 * (2 * self.batch * self.width + 2 * self.batch * self.hidden + 2 * self.batch)


def residual_sizes(scale: float) -> ResidualSizes:
    return ResidualSizes(batch=_scaled(512, scale))


def build_residual(scale: float, device: torch.device) -> ModelWorkload:
    sizes = residual_sizes(scale)
    model = ResidualMLP(sizes.depth, sizes.width, sizes.hidden)
    return _build_model(model, sizes.batch, sizes.width, device)


# --- a large-vocabulary LM head: logits = hidden @ W.T, cross-entropy over V classes ---------------


@dataclass
class LMHeadWorkload:
    """Hidden states (B x D) and the output embedding (V x D) both need gradients; the logits are
    B x V, far larger than either when V is large."""

    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    chunks: int = 8

    @property
    def logits_bytes(self) -> int:
        """fp32 bytes of the full B x V logits."""
        return FP32 * self.hidden.shape[0] * self.weight.shape[0]

    @property
    def chunk_logits_bytes(self) -> int:
        return self.logits_bytes // self.chunks

    def grad_bytes(self) -> int:
        return FP32 * (self.hidden.numel() + self.weight.numel())

    def clone(self, dtype: torch.dtype | None = None) -> LMHeadWorkload:
        dtype = dtype or self.hidden.dtype
        device = self.hidden.device
        return LMHeadWorkload(
            _leaf(self.hidden, device, dtype, True),
            _leaf(self.weight, device, dtype, True),
            self.targets.clone(),
            self.chunks,
        )


def build_lm_head(scale: float, device: torch.device) -> LMHeadWorkload:
    tokens, width, vocab = _scaled(512, scale, multiple=8), 256, 16384
    gen = torch.Generator().manual_seed(2)
    hidden = _randn(gen, device, tokens, width)
    weight = _randn(gen, device, vocab, width) / width**0.5
    if device.type == "meta":
        targets = torch.empty(tokens, dtype=torch.long, device=device)
    else:
        targets = torch.randint(0, vocab, (tokens,), generator=gen)
    return LMHeadWorkload(
        _leaf(hidden, device, torch.float32, True), _leaf(weight, device, torch.float32, True), targets.to(device)
    )
