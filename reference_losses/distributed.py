"""Data parallelism of the Q&A's Net on N ranks: DDP keeps a whole replica on every rank, FSDP2
(`fully_shard`, one unit per Linear plus the root) keeps a 1/N shard. Each runs one training step with
SGD and momentum (so that there is optimizer state to shard) on its b = B/N rows of the global batch.

Sizes per rank (fp32): P1 = layer1 (W1 2048x1024, b1) = 8,396,800 B, P2 = layer2 (W2 1024x2048, b2) =
8,392,704 B, P = P1 + P2; h1 = 4*b*2048 (layer1's output, saved for layer2), out = 4*b*1024.
`setup` wraps a model that already exists; every phase is relative to what was allocated when it began.

DDP (gradient buckets separate from .grad, the default; `init_sync=False`, as every rank builds the
same seeded model; the default broadcasts a flat copy of the parameters first, P, freed before the
buckets are made: a rank waits for gloo's worker to let go of it, see pytest_gpumem.distributed.worker):
- setup: P, the reducer's gradient buckets.
- forward: h1 + out + out*target + 4 (their sum); keeps h1 and the 4-byte loss.
- backward: the larger of two moments: P + 4 (the loss's gradient) once all four gradients exist (each
  is copied into its bucket, all-reduced there and copied back, so buckets add nothing now; dh1 is
  made as h1 is freed), or P2 + h1 + out + 4 in layer2's backward (its gradients, dh1 and the output's
  gradient), the larger once h1 + out > P1 (b > 683 rows: 2 ranks at scale 4).
- step: P, the momentum buffers (clones of the gradients) made by the first step.
FSDP2 (reshard after forward, the default; all-gathers and reduce-scatters are flat buffers):
- setup: P1/N + 4N: layer1's shard is made while its full parameters still exist (they are freed
  then); layer2 likewise, smaller. The 4N bytes are FSDP's own small tensors.
- forward: h1 + P1 + 2*P2 at layer2's copy-out: layer1's all-gather buffer (P1) is freed only once the
  next all-gather is copied out, so it is still there with layer2's all-gather buffer (P2) and its
  unsharded parameters (P2). The sharding saves nothing here: buffers are whole layers.
- backward: the larger of two moments; the first grows with the batch and is the larger once
  h1 + out > P1 - P2 + P2/N (b > 341 rows on 2 ranks, b > 171 on 4: from scale 2 on):
  - layer2's backward: its unsharded parameters (P2) and their gradients (P2), layer1's all-gather
    buffer (P1, prefetched), dh1 (h1) and the output's gradient (out), and the loss's gradient (4);
  - layer1's parameters copied out of their all-gather (its buffer and unsharded parameters, 2*P1),
    while layer2's reduce-scatter input (P2, which FSDP keeps until layer1's reduce-scatter) and output
    shard (P2/N, its gradient) exist, and the loss's gradient (4); dh1 (made) and h1 (freed) are the
    same size.
  Every phase of a rank begins and ends once gloo's worker threads are idle: layer2's forward
  all-gather buffer, which only gloo's worker may still hold as forward ends, is gone before backward.
- step: P/N, the momentum buffers of the shards.
State kept between steps per rank (parameters, gradient buffers, optimizer state): DDP 3P (and the
gradients P while they exist), FSDP2 3P/N.

Under torch's fake process group (`gpumem.simulate_rank`) the all-reduce gives DDP no tensor back, which
its default hook refuses (an internal assert in comm.cpp): DDP then runs `noop_hook`, which hands the
bucket back as it is; the memory is the same, as the real all-reduce works in place on the bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from reference_losses.bounds import SMALL
from reference_losses.models import FP32, ModelWorkload, Net, _scaled, build_net, model_loss
from reference_losses.strategy import Expectation

if TYPE_CHECKING:
    from pytest_gpumem import GpuMem, TestResult

STRATEGIES = ("ddp", "fsdp2")
PHASES = ("setup", "forward", "backward", "step")
LOSS = FP32  # a float32 scalar: the loss, its gradient
INFO_KEY = "reference_distributed"  # the rows of the report, in gpumem.info (fixtures.DIST_INFO_KEY)
MOMENTUM = 0.9


@dataclass(frozen=True)
class DistSizes:
    """The Net's sizes on one rank of a world of `world_size` (bytes, fp32)."""

    world_size: int
    batch: int  # the global batch B; each rank has B / world_size rows

    @property
    def rows(self) -> int:
        return self.batch // self.world_size

    @property
    def p1(self) -> int:
        return FP32 * (2048 * 1024 + 2048)

    @property
    def p2(self) -> int:
        return FP32 * (1024 * 2048 + 1024)

    @property
    def params(self) -> int:
        return self.p1 + self.p2

    @property
    def h1(self) -> int:
        return FP32 * self.rows * 2048

    @property
    def out(self) -> int:
        return FP32 * self.rows * 1024


def sizes(scale: float, world_size: int) -> DistSizes:
    """The global batch is the Net's (512 rows at scale 1), a multiple of 4 so that 2 and 4 ranks split it."""
    return DistSizes(world_size, _scaled(512, scale, multiple=4))


def expected(strategy: str, s: DistSizes) -> list[Expectation]:
    """Per-rank bounds: [derived, derived + SMALL] (the module docstring derives each)."""
    n, p = s.world_size, s.params
    derived = {
        "ddp": [
            ("setup", p, "the gradient buckets"),
            ("forward", s.h1 + 2 * s.out + LOSS, "h1 + out + out*target + their sum"),
            ("backward", max(p, s.p2 + s.h1 + s.out) + LOSS, "the four gradients, or layer2's and dh1 and dout"),
            ("step", p, "momentum buffers"),
        ],
        "fsdp2": [
            ("setup", s.p1 // n + LOSS * n, "layer1's shard while its full parameters exist (+4N B of FSDP's own)"),
            ("forward", s.h1 + s.p1 + 2 * s.p2, "h1 + layer1's all-gather buffer + layer2's buffer and parameters"),
            ("backward", _fsdp2_backward(s), "the larger of layer2's backward and layer1's copy-out"),
            ("step", p // n, "momentum buffers of the shards"),
        ],
    }[strategy]
    found = [Expectation(f"{strategy}.{phase}", low, low + SMALL, why) for phase, low, why in derived]
    kept = s.h1 + LOSS
    found.append(Expectation(f"{strategy}.forward", kept, kept + SMALL, "keeps h1 (and the loss)", net=True))
    return found


def _fsdp2_backward(s: DistSizes) -> int:
    """The larger of FSDP2's two backward moments (the module docstring derives each)."""
    n = s.world_size
    layer2 = s.p1 + 2 * s.p2 + s.h1 + s.out + LOSS
    layer1 = 2 * s.p1 + s.p2 + s.p2 // n + LOSS
    return max(layer2, layer1)


def state_bytes(strategy: str, s: DistSizes) -> int:
    """Bytes a rank keeps between steps: parameters, gradient buckets (DDP) and momentum."""
    return 3 * s.params if strategy == "ddp" else 3 * s.params // s.world_size


# --- what runs on each rank -------------------------------------------------------------------------


def run_strategies(rank: int, world_size: int, meter: GpuMem, scale: float) -> dict[str, float]:
    """Every strategy in turn on this rank; returns each one's relative error against one process
    training on the whole batch (0 within fp32 rounding)."""
    s = sizes(scale, world_size)
    truth = _single_process(scale, meter.device)
    errors = {}
    for name, step in STEPS.items():
        model = step(rank, meter, s, scale)
        errors[name] = _error(model, truth)
        del model
    return errors


def _wrap_ddp(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, init_sync=False)
    if dist.get_backend() == "fake":
        from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

        ddp.register_comm_hook(None, noop_hook)
    return ddp


def _wrap_fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    assert isinstance(model, Net)
    fully_shard(model.layer1)
    fully_shard(model.layer2)
    fully_shard(model)
    return model


def _step(wrap: Callable[[nn.Module], nn.Module], name: str) -> Callable[[int, GpuMem, DistSizes, float], nn.Module]:
    def step(rank: int, meter: GpuMem, s: DistSizes, scale: float) -> nn.Module:
        w = build_net(scale, meter.device)
        rows = slice(rank * s.rows, (rank + 1) * s.rows)
        with meter.phase(f"{name}.setup"):
            model = wrap(w.model)
        optimizer = torch.optim.SGD(model.parameters(), lr=w.lr, momentum=MOMENTUM)
        with meter.phase(f"{name}.forward"):
            loss = model_loss(model(w.inputs[rows]), w.target[rows])
        with meter.phase(f"{name}.backward"):
            torch.autograd.backward(loss)
        with meter.phase(f"{name}.step"):
            optimizer.step()
        return model

    return step


STEPS = {"ddp": _step(_wrap_ddp, "ddp"), "fsdp2": _step(_wrap_fsdp2, "fsdp2")}


def _single_process(scale: float, device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(before, after) of each parameter, one process training on the whole batch."""
    w: ModelWorkload = build_net(scale, device)
    before = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    optimizer = torch.optim.SGD(w.model.parameters(), lr=w.lr, momentum=MOMENTUM)
    torch.autograd.backward(model_loss(w.model(w.inputs), w.target))
    optimizer.step()
    return {n: (before[n], p.detach()) for n, p in w.model.named_parameters()}


def _error(model: nn.Module, truth: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The largest |after - truth| / |truth's update| over the parameters (all ranks gather shards)."""
    worst = 0.0
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        before, after = truth[name.removeprefix("module.")]
        change = float((after.double() - before.double()).norm())
        worst = max(worst, float((full.detach().double() - after.double()).norm()) / max(change, 1e-30))
    dist.barrier()
    return worst


# --- the report -------------------------------------------------------------------------------------


def describe(world_size: int, scale: float, results: dict[str, int]) -> list[dict[str, Any]]:
    """Rows for the report (one per strategy): the worst rank's peaks, the state kept per rank, the
    hand-derived lower bounds; `results` maps phase names (e.g. 'ddp.forward') to worst-rank peaks."""
    s = sizes(scale, world_size)
    rows = []
    for strategy in STRATEGIES:
        derived = {e.phase: e.low for e in expected(strategy, s) if not e.net}
        rows.append(
            {
                "strategy": strategy,
                "world_size": world_size,
                "peaks": {phase: results.get(f"{strategy}.{phase}") for phase in PHASES},
                "derived": {phase: derived[f"{strategy}.{phase}"] for phase in PHASES},
                "state_bytes": state_bytes(strategy, s),
            }
        )
    return rows


def report_lines(results: Sequence[TestResult]) -> list[str]:
    """One table: per strategy and world size, per-rank peaks (worst rank) and the state kept per rank,
    with what sharding saves against DDP at the same world size."""
    from tabulate import tabulate

    from pytest_gpumem import format_size

    rows = [row for result in results for row in result.info.get(INFO_KEY, [])]
    if not rows:
        return []
    ddp = {row["world_size"]: row for row in rows if row["strategy"] == "ddp"}
    body = []
    for row in rows:
        base = ddp.get(row["world_size"])
        saved = "-" if base is None or row is base else format_size(base["state_bytes"] - row["state_bytes"])
        peaks = [format_size(row["peaks"][p]) if row["peaks"][p] is not None else "-" for p in PHASES]
        body.append([row["strategy"], row["world_size"], *peaks, format_size(row["state_bytes"]), saved])
    headers = ["strategy", "ranks", *PHASES, "state/rank", "saved vs DDP"]
    notes = [
        "phase peaks: the worst rank's",
        "state/rank: parameters, gradient buffers and momentum kept between steps (hand-derived)",
    ]
    return [*tabulate(body, headers=headers, disable_numparse=True).splitlines(), *notes]
