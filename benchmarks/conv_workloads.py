"""Convolutional workloads, written as our own code: a ResNet-18 (no torchvision), a small UNet, and the
workload of the shared conv trace that can be rebuilt from its requests (`HugePandaCoder__octree-nca-groupeq__
traditional_single_step`: one neural-cellular-automaton step in plain PyTorch).

Each model builds on any device; `train_step(model, batch, device)` runs one forward and backward with
phases "forward" and "backward" on a meter (benchlib's `PhaseMeter`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

Record = Callable[[], None]


class Meter(Protocol):
    def phase(self, name: str) -> AbstractContextManager[None]: ...


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with batch norm, and a 1x1 projection when the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.project: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.project = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        out: torch.Tensor = F.relu(self.bn2(self.conv2(y)) + self.project(x))
        return out


class ResNet18(nn.Module):
    """ResNet-18 for 1000 classes: a 7x7 stem, max pooling, four stages of two basic blocks, average pooling."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        widths = (64, 128, 256, 512)
        blocks: list[nn.Module] = []
        c_in = 64
        for i, width in enumerate(widths):
            blocks += [BasicBlock(c_in, width, 1 if i == 0 else 2), BasicBlock(width, width, 1)]
            c_in = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        logits: torch.Tensor = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return logits


def _double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
    )


class UNet(nn.Module):
    """A small UNet: three levels down (32, 64, 128 channels), a 256-channel bottom, transposed
    convolutions up with skip connections, a 1x1 head."""

    def __init__(self, c_in: int = 3, classes: int = 2, widths: tuple[int, ...] = (32, 64, 128, 256)) -> None:
        super().__init__()
        self.down = nn.ModuleList()
        c = c_in
        for width in widths:
            self.down.append(_double_conv(c, width))
            c = width
        self.up = nn.ModuleList()
        self.merge = nn.ModuleList()
        for width in reversed(widths[:-1]):
            self.up.append(nn.ConvTranspose2d(c, width, 2, stride=2))
            self.merge.append(_double_conv(2 * width, width))
            c = width
        self.head = nn.Conv2d(c, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, level in enumerate(self.down):
            x = level(x)
            if i < len(self.down) - 1:
                skips.append(x)
                x = F.max_pool2d(x, 2)
        for up, merge in zip(self.up, self.merge, strict=True):
            x = merge(torch.cat([skips.pop(), up(x)], 1))
        out: torch.Tensor = self.head(x)
        return out


def classify_step(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, meter: Meter) -> None:
    """One training step's forward (cross-entropy) and backward, in the meter's phases."""
    with meter.phase("forward"):
        loss = F.cross_entropy(model(images), labels)
    with meter.phase("backward"):
        loss.backward()  # type: ignore[no-untyped-call]


# ------------------------------------------------------------------------ the octree-NCA single step


def nca_single_step(device: str, record: Record) -> None:
    """One NCA update as the notebook of the trace ran it (frames `<module>` lines 2-21): a 16-channel
    320 x 320 state, a depthwise 3x3 perception with reflect padding, two 1x1 convolutions (32 -> 64 -> 13),
    a stochastic update mask, the first 3 channels kept. Each name is reassigned as the notebook's cells did,
    so each intermediate is freed where the card freed it."""
    torch.manual_seed(0)
    perceive = nn.Conv2d(16, 16, 3, padding=1, groups=16, padding_mode="reflect", device=device)
    fc0 = nn.Conv2d(32, 64, 1, device=device)
    fc1 = nn.Conv2d(64, 13, 1, bias=False, device=device)
    record()
    x = torch.randn(1, 16, 320, 320, device=device)
    image = torch.randn(1, 3, 320, 320, device=device)
    with torch.no_grad():
        y = perceive(x)
        y = torch.cat((x, y), 1)
        y = fc0(y)
        y = F.relu(y)
        y = fc1(y)
        mask = torch.rand(1, 1, 320, 320, device=device)
        y = y * mask
        updated = x[:, 3:] + y  # a new name: the card keeps the masked update alive
        x = torch.cat((x[:, :3], updated), 1)
    del image, mask, y, updated, x


# ------------------------------------------------------------ the octree-NCA whole-slide inference

SLIDE_LEVELS = ((5280, 5440), (2640, 2720), (1320, 1360), (660, 680), (330, 340))
"""The octree's resolutions, finest first: a 5280 x 5440 slide region halved four times."""


class NCA2D(nn.Module):
    """A neural cellular automaton's backbone (16 channels, 3 of them the image's): a reflect-padded depthwise
    3x3 perception, then 1x1 convolutions 32 -> 64 -> 13, a stochastic mask per pixel, the image kept."""

    def __init__(self, channels: int = 16, hidden: int = 64, image: int = 3, device: str = "cpu") -> None:
        super().__init__()
        self.image = image
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, padding_mode="reflect", groups=channels, device=device)
        self.fc0 = nn.Conv2d(2 * channels, hidden, 1, device=device)
        self.fc1 = nn.Conv2d(hidden, channels - image, 1, bias=False, device=device)

    def update(self, state: torch.Tensor) -> torch.Tensor:
        delta = self.conv(state)
        delta = torch.cat([state, delta], dim=1)
        delta = self.fc0(delta)
        delta = F.relu(delta)
        delta = self.fc1(delta)
        stochastic = torch.zeros(delta.size(0), 1, delta.size(2), delta.size(3), device=delta.device)
        stochastic.bernoulli_(0.5)
        delta = delta * stochastic
        updated: torch.Tensor = state[:, self.image :] + delta
        return updated

    def forward(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        """`steps` updates of a B H W C state (a B C H W view of it is what the convolutions see)."""
        state = x.permute(0, 3, 1, 2)
        image = state[:, : self.image]
        for _ in range(steps):
            new_state = self.update(state)
            state = torch.cat([image, new_state], dim=1)
        return state.permute(0, 2, 3, 1)


def nca_whole_slide(device: str, record: Record) -> None:
    """The OctreeNCA-2D inference of the trace (`inference2_peso_oct.py`, torch's path, no custom layer): 20
    steps at 330 x 340, then at each finer level the state upsampled, the slide's channels written into it
    from the host, and 10 steps (the 1320 x 1360 level twice); at the finest level the steps are the script's
    own loop, with the image channels cloned once."""
    torch.manual_seed(0)
    ncas = [NCA2D(device=device) for _ in SLIDE_LEVELS]
    slide = torch.randn(1, 3, *SLIDE_LEVELS[0])  # host memory, as the script's slide
    seed = torch.zeros(1, *SLIDE_LEVELS[-1], 16)
    seed[..., :3] = F.interpolate(slide, size=SLIDE_LEVELS[-1]).permute(0, 2, 3, 1)
    record()
    with torch.no_grad():
        state = ncas[4](seed.to(device), steps=20)
        for level, steps in ((3, 10), (2, 10), (2, 10), (1, 10)):
            state = state.permute(0, 3, 1, 2)
            state = F.interpolate(state, size=SLIDE_LEVELS[level])
            state[0, :3] = F.interpolate(slide, size=SLIDE_LEVELS[level])[0]
            state = state.permute(0, 2, 3, 1)
            state = ncas[level](state, steps=steps)
        state = state.permute(0, 3, 1, 2)
        state = F.interpolate(state, size=SLIDE_LEVELS[0])
        state[0, :3] = slide[0]
        nca = ncas[0]  # the script's own loop: `NCA2D.update` written out, the image channels cloned once
        image = state[:, : nca.image].clone()
        for _ in range(10):
            delta = nca.conv(state)
            delta = torch.cat([state, delta], dim=1)
            delta = nca.fc0(delta)
            delta = F.relu(delta)
            delta = nca.fc1(delta)
            stochastic = torch.zeros(delta.size(0), 1, delta.size(2), delta.size(3), device=delta.device)
            stochastic.bernoulli_(0.5)
            delta = delta * stochastic
            new_state = state[:, nca.image :] + delta
            state = torch.cat([image, new_state], dim=1)
