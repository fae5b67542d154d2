"""Convolutional training steps predicted for a card: ResNet-18 (batch 8, 224 x 224) and a small UNet (batch 8,
128 x 128), one forward and backward each, on the meta device and on the CPU with the allocator's model
(`--gpumem-round=cuda`), by phase.

    python benchmarks/convolutions.py [--json PATH] [--only NAME]

Prints each phase's peak (requested, allocated and reserved bytes), the most bytes one op's kernel
temporaries held, and the backend's notes (what the figure leaves out, where it is not a card's to the byte).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for entry in (ROOT, ROOT / "benchmarks"):
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

import benchlib  # noqa: E402
from conv_workloads import ResNet18, UNet, classify_step  # noqa: E402

from pytest_gpumem.backends.tracker.backend import TrackerBackend  # noqa: E402

Peak = tuple[int, int, int]  # requested, allocated, reserved


@dataclass
class Result:
    phases: dict[str, Peak] = field(default_factory=dict)
    largest_temporaries: int = 0
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


class _Phases:
    """A meter for `classify_step`: each phase's peak from the backend."""

    def __init__(self, backend: TrackerBackend, result: Result) -> None:
        self.backend, self.result = backend, result

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.backend.reset_peak()
        yield
        self.result.phases[name] = _peak(self.backend)


def _peak(backend: TrackerBackend) -> Peak:
    peak = backend.peak()
    return peak.requested, peak.allocated, peak.reserved or 0


Build = Callable[[str], tuple[torch.nn.Module, torch.Tensor, torch.Tensor]]


def resnet(device: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return (
        ResNet18().to(device),
        torch.randn(8, 3, 224, 224, device=device),
        torch.randint(0, 1000, (8,), device=device),
    )


def unet(device: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    labels = torch.randint(0, 2, (8, 128, 128), device=device)
    return UNet().to(device), torch.randn(8, 3, 128, 128, device=device), labels


WORKLOADS: dict[str, Build] = {"ResNet-18 b8": resnet, "UNet b8": unet}


def measure(build: Build, device: str) -> Result:
    """One step of `build`'s model on `device` under the tracker with the allocator's model (not counting
    the model and the batch, made before)."""
    backend = TrackerBackend(rounding="cuda", device=device)
    model, images, labels = build(device)
    result = Result()
    started = time.perf_counter()
    backend.start()
    try:
        classify_step(model, images, labels, _Phases(backend, result))
        result.largest_temporaries = backend.largest_kernel_temporaries
    finally:
        backend.stop()
    result.notes, result.seconds = backend.notes(), time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> int:
    p = benchlib.parser("convolutional training steps predicted for a card")
    p.add_argument("--only", action="append", default=None, help="run only workloads whose name contains this")
    args = p.parse_args(argv)
    results: dict[str, Result] = {}
    for name, build in WORKLOADS.items():
        if args.only and not any(part in name for part in args.only):
            continue
        for device in ("meta", "cpu"):
            found = results[f"{name} {device}"] = measure(build, device)
            print(f"{name} on {device} ({found.seconds:.1f} s)")
            for phase, (requested, allocated, reserved) in found.phases.items():
                print(f"  {phase:<9} requested {requested:>11} allocated {allocated:>11} reserved {reserved:>11}")
            print(f"  the most one op's kernel temporaries held: {found.largest_temporaries} B")
            for note in found.notes:
                print(f"  note: {note}")
    benchlib.write_json(args.json, {"convolutions": {name: asdict(r) for name, r in results.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
