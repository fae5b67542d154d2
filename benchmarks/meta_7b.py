"""A 7B-parameter decoder's training step measured on the meta device: sizes, no data, exact bytes.

The model has the shape of a 7B LLaMA-style decoder (32 layers, hidden 4096, 32 heads, SwiGLU MLP 11008,
vocabulary 32000, RMSNorm, untied embedding and head; no rotary embedding), sequence 2048, batch 1.
It is built on `meta` in bfloat16: CPU autocast does not apply to meta tensors (an fp32 matmul of meta
tensors under `torch.autocast("cpu", dtype=torch.bfloat16)` stays fp32, and autocast has no meta device
type), so the parameters, gradients and AdamW states are all bf16 here (pure bf16 training, not
mixed precision with fp32 master weights).

Attention is `scaled_dot_product_attention(is_causal=True)`. On meta the tracker takes a GPU's code
paths by default: SDPA runs as CUDA's flash kernel (bf16, no mask), which saves q, k, v, the output and a
(1, 32, 2048) fp32 logsumexp with the RNG seed and offset, and AdamW takes the foreach path (one sqrt
temporary per parameter, all alive at once). `--paths cpu` measures the CPU's paths instead: the math
decomposition (q, k, v upcast to fp32, the 32 x 2048 x 2048 fp32 softmax saved, 512 MiB a layer) and the
single-tensor AdamW loop.

Run: python benchmarks/meta_7b.py [--paths gpu|cpu] [--json PATH]
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from benchlib import BF16, FP32, parser, show, write_json
from torch import nn

from cuda_allocator_model.cards import cublas_workspace_bytes
from cuda_allocator_model.sizes import format_size
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.measure.measurement import Measurement
from pytest_gpumem.measure.measuring import measuring
from pytest_gpumem.results import PhaseResult


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    mlp: int = 11008
    vocab: int = 32000
    seq: int = 2048
    batch: int = 1

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, in plain ops (so that its saved tensors can be counted)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.heads = s.heads
        self.norm1, self.norm2 = RMSNorm(s.hidden), RMSNorm(s.hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(s.hidden, s.hidden, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(s.hidden, s.mlp, bias=False), nn.Linear(s.hidden, s.mlp, bias=False)
        self.down = nn.Linear(s.mlp, s.hidden, bias=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = (p(x).view(b, t, self.heads, h // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, h))  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        n = self.norm2(x)
        return x + self.down(F.silu(self.gate(n)) * self.up(n))  # type: ignore[no-any-return]


class Decoder(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.hidden)
        self.head = nn.Linear(s.hidden, s.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------------ hand count


def parameter_count(s: Shape) -> int:
    per_layer = 4 * s.hidden * s.hidden + 3 * s.hidden * s.mlp + 2 * s.hidden
    return s.layers * per_layer + 2 * s.vocab * s.hidden + s.hidden


def saved_per_layer(s: Shape, paths: str = "gpu") -> int:
    """Bytes a block's forward leaves for backward (bf16 unless noted); `paths="cpu"`: meta's math SDPA.

    norm1: the input x (by pow and x*r), r = rsqrt(...) (t x 1), x*r (by *weight), the normed n1 (by q, k, v).
    SDPA (math): fp32 q*scale, fp32 k^T*scale (by the first bmm), fp32 softmax (t x t per head) and fp32 v
    (by the second bmm); the bf16 q, k, v and the fp32 scores are not kept. o: its contiguous input.
    The residual sum h1 (by norm2's pow and h1*r), r2, h1*r2, n2 (by gate and up); gate (by silu),
    silu(gate) and up (by the product), the product (by down). 7 t x h bf16, 3 t x h fp32, the t x t fp32
    softmax per head, 4 t x mlp bf16, two t x 1 bf16.

    Flash (paths="gpu"): q, k, v (the projections' outputs) and the output, whose (b, t, h, d) layout makes
    o's input a view of it; logsumexp (b, heads, t) fp32; the philox seed (2 x uint64) and offset (uint64).
    10 t x h bf16, no fp32 t x h, no t x t.
    """
    th, tf = s.tokens * s.hidden, s.tokens * s.mlp
    common = 4 * tf * BF16 + 2 * s.tokens * BF16
    if paths == "gpu":
        return 10 * th * BF16 + s.batch * s.heads * s.seq * FP32 + 3 * 8 + common
    scores = s.batch * s.heads * s.seq * s.seq
    return 7 * th * BF16 + 3 * th * FP32 + scores * FP32 + common


def saved_outside_layers(s: Shape) -> int:
    """The final norm (its input, r, x*r, the normed input the head saves) and the loss: cross_entropy on
    fp32 logits keeps log_softmax's fp32 output; the loss and nll_loss's total_weight (4 B each)."""
    th = s.tokens * s.hidden
    return 3 * th * BF16 + s.tokens * BF16 + s.tokens * s.vocab * FP32 + 2 * FP32


@dataclass(frozen=True)
class HandCount:
    params: int
    grads: int
    optimizer_state: int
    activations: int
    step_temporaries: int
    workspaces: int = 0

    @classmethod
    def of(cls, s: Shape, paths: str = "gpu", rounding: str = "none") -> HandCount:
        p = parameter_count(s)
        # AdamW: exp_avg and exp_avg_sq like each parameter; its `step` counters (one fp32 scalar per
        # parameter tensor, capturable=False) are host memory on a GPU too, and on meta only meta tensors count
        states = 2 * p * BF16
        # foreach: one sqrt of exp_avg_sq per parameter, all alive at once (the parameters' size); the
        # single-tensor loop: the head's sqrt and denominator while the final norm's denominator is still bound
        temps = p * BF16 if paths == "gpu" else 2 * s.vocab * s.hidden * BF16 + s.hidden * BF16
        activations = s.layers * saved_per_layer(s, paths) + saved_outside_layers(s)
        # under the allocator's model each cuBLAS handle (the test's thread, backward's) makes its workspace
        workspaces = 2 * cublas_workspace_bytes(None) if rounding == "cuda" else 0
        return cls(p * BF16, p * BF16, states, activations, temps, workspaces)

    @property
    def whole_peak(self) -> int:
        """The call's peak: gradients, AdamW states and the step's temporaries, and the workspaces."""
        return self.grads + self.optimizer_state + self.step_temporaries + self.workspaces


# --------------------------------------------------------------------------------------------- the run


def build(s: Shape) -> tuple[Decoder, torch.Tensor, torch.Tensor]:
    with torch.device("meta"):
        model = Decoder(s).to(torch.bfloat16)
        ids = torch.zeros(s.batch, s.seq, dtype=torch.long)
        targets = torch.zeros(s.batch * s.seq, dtype=torch.long)
    return model, ids, targets


def measure_step(s: Shape, paths: str = "gpu", rounding: str = "none") -> tuple[dict[str, PhaseResult], PhaseResult]:
    model, ids, targets = build(s)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # torch's default: foreach only on GPU paths
    with measuring(Measurement(TrackerBackend(rounding, device="meta", paths=paths), "meta_7b")) as call:
        meter = call.meter
        with meter.phase("forward"):
            logits = model(ids)
            loss = F.cross_entropy(logits.float().view(-1, s.vocab), targets)
            del logits
        with meter.phase("backward"):
            loss.backward()  # type: ignore[no-untyped-call]
            del loss
        with meter.phase("step"):
            optimizer.step()
    return meter.phases, call.record.call


def table(phases: dict[str, PhaseResult], whole: PhaseResult, hand: HandCount) -> list[list[str]]:
    """Measured peak and net per phase, next to the hand count of the net (and of the whole call's peak:
    gradients + AdamW states + the step's temporaries)."""
    nets = {
        "forward": ("activations", hand.activations),
        "backward": ("grads - activations", hand.grads - hand.activations),
        "step": ("AdamW states", hand.optimizer_state),
    }
    rows = [
        [name, f"{r.peak_bytes:,}", f"{r.net_bytes:,}", f"{nets[name][0]}: {nets[name][1]:,}"]
        for name, r in phases.items()
    ]
    parts = "grads + states + temps" + (" + workspaces" if hand.workspaces else "")
    rows.append(["whole", f"{whole.peak_bytes:,}", f"{whole.net_bytes:,}", f"peak: {parts}: {hand.whole_peak:,}"])
    return rows


def differences(phases: dict[str, PhaseResult], whole: PhaseResult, hand: HandCount) -> dict[str, int]:
    return {
        "forward net": phases["forward"].net_bytes - hand.activations,
        "backward net": phases["backward"].net_bytes - (hand.grads - hand.activations),
        "step net": phases["step"].net_bytes - hand.optimizer_state,
        "step peak": phases["step"].peak_bytes - (hand.optimizer_state + hand.step_temporaries),
        "whole peak": whole.peak_bytes - hand.whole_peak,
    }


def main() -> None:
    cli = parser("A 7B decoder's forward, backward and AdamW step on the meta device, under the tracker")
    cli.add_argument("--paths", choices=("gpu", "cpu"), default="gpu", help="whose code paths (default: gpu)")
    cli.add_argument(
        "--round",
        choices=("none", "cuda"),
        default="none",
        help="none (default): requested bytes, the hand count's; cuda: the CUDA allocator's model (blocks)",
    )
    args = cli.parse_args()
    s = Shape()
    start = time.perf_counter()
    phases, whole = measure_step(s, args.paths, args.round)
    wall = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    hand = HandCount.of(s, args.paths, args.round)
    rows = table(phases, whole, hand)
    show(
        f"7B decoder ({parameter_count(s):,} parameters, bf16) on meta, seq {s.seq}, batch {s.batch}, "
        f"{args.paths} paths",
        ["phase", "peak (B)", "net (B)", "hand count (B)"],
        rows,
        [
            f"wall {wall:.1f} s, peak host RSS {format_size(rss)} (whole process)",
            f"parameters {format_size(hand.params)} exist before the call and are not in these figures",
            f"measured - hand: {', '.join(f'{k} {v:,} B' for k, v in differences(phases, whole, hand).items())}",
            "gpu paths: SDPA as CUDA's flash kernel (no seq x seq matrix), AdamW foreach; cpu paths: the math "
            "SDPA (fp32 softmax saved) and the single-tensor AdamW loop",
            *(
                [f"the allocator's model: reserved peak {whole.reserved_peak_bytes:,} B (peaks above are its blocks)"]
                if whole.reserved_peak_bytes is not None
                else []
            ),
        ],
    )
    write_json(
        args.json,
        {
            "paths": args.paths,
            "wall_s": wall,
            "peak_rss_bytes": rss,
            "parameters": parameter_count(s),
            "phases": {k: {"peak": v.peak_bytes, "net": v.net_bytes} for k, v in phases.items()},
            "whole": {"peak": whole.peak_bytes, "net": whole.net_bytes, "reserved_peak": whole.reserved_peak_bytes},
            "rounding": args.round,
            "hand": vars(hand),
            "measured_minus_hand": differences(phases, whole, hand),
        },
    )


if __name__ == "__main__":
    main()
