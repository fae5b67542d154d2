"""The workloads of the real cards' snapshots (../shared/snapshots/CATALOG.md), written again as our own code
from the catalog's descriptions and the Python frames the traces recorded (file, line and op of each
request): a CS336-style TransformerLM (vocab 10k, d_model 512, 4 layers, 16 heads, d_ff 1344, RMSNorm,
RoPE, SwiGLU, einsum linears) with its forward passes and training steps, the Hugging Face Linear(10000 ->
50000) recipe, naive attention forward and backward, and the CS336 staff model (`cs336_basics`: rsqrt
RMSNorm, interleaved RoPE gathered from one table, a `where` mask) at the 'small' and '2.7B' sizes.
Where a trace frees an intermediate late, the code names it, so that it lives as long as on the card.

Each workload is `run(device, record)`: it builds what it needs on `device` and calls `record()` where the
card's recording began (at once for the from-empty ones; after setup and warmup for the warm ones), so
that its requests can be set against the card's from that point.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Record = Callable[[], None]


# ------------------------------------------------------------------------------------ the CS336 model


class Linear(nn.Module):
    """y = x W^T as an einsum (the traces' linears run bmm), truncated-normal weights, no bias."""

    def __init__(self, d_in: int, d_out: int, device: str, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        weight = torch.empty(d_out, d_in, device=device, dtype=dtype)
        std = math.sqrt(2.0 / (d_in + d_out))
        self.weight = nn.Parameter(nn.init.trunc_normal_(weight, std=std, a=-3 * std, b=3 * std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...i,oi->...o", x, self.weight)


class Embedding(nn.Module):
    def __init__(self, vocab: int, d_model: int, device: str) -> None:
        super().__init__()
        weight = torch.empty(vocab, d_model, device=device)
        self.weight = nn.Parameter(nn.init.trunc_normal_(weight, std=1.0, a=-3.0, b=3.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, device: str, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True) + self.eps)
        return x / rms * self.weight


class Rope(nn.Module):
    """Rotary embedding; the cos/sin tables stay on the host and are copied to the device at each call, as
    the traces show (two 100 x 16 fp32 copies per call)."""

    def __init__(self, d_k: int, max_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        freqs = 1.0 / theta ** (torch.arange(0, d_k, 2, dtype=torch.float32) / d_k)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), freqs)
        self.cos, self.sin = torch.cos(angles), torch.sin(angles)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos = self.cos[positions].to(x.device)
        sin = self.sin[positions].to(x.device)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        first = x1 * cos - x2 * sin
        second = x1 * sin + x2 * cos
        return torch.cat([first, second], dim=-1)


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """exp(x - max) / sum, with the subtraction written twice as in the traces (sub, exp, sub, exp, sum, div)."""
    top = torch.max(x, dim=dim, keepdim=True)[0]
    return torch.exp(x - top) / torch.sum(torch.exp(x - top), dim=dim, keepdim=True)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention: the mask built on the host and copied, scores scaled by a device sqrt(d_k)."""
    seq, d_k = q.shape[-2], q.shape[-1]
    mask = torch.tril(torch.ones(seq, seq)).to(q.device)
    products = q @ k.transpose(-2, -1)  # kept to the end, as the trace frees it
    scores = products / torch.sqrt(torch.tensor(d_k, device=q.device))
    scores.masked_fill_(~mask.bool(), float("-inf"))
    weights = softmax(scores, dim=-1)
    return weights @ v


class Attention(nn.Module):
    def __init__(self, d_model: int, heads: int, max_len: int, device: str) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = Linear(d_model, d_model, device), Linear(d_model, d_model, device)
        self.v_proj, self.output_proj = Linear(d_model, d_model, device), Linear(d_model, d_model, device)
        self.rope = Rope(d_model // heads, max_len)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        split = (batch, seq, self.heads, d_model // self.heads)
        q = self.q_proj(x).view(split).transpose(1, 2)
        k = self.k_proj(x).view(split).transpose(1, 2)
        v = self.v_proj(x).view(split).transpose(1, 2)
        positions = torch.arange(seq)
        q = self.rope(q, positions)
        k = self.rope(k, positions)
        out = masked_attention(q, k, v)
        out = out.transpose(1, 2).contiguous().view(batch, seq, d_model)
        return self.output_proj(out)  # type: ignore[no-any-return]


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int, device: str) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (
            Linear(d_model, d_ff, device),
            Linear(d_ff, d_model, device),
            Linear(d_model, d_ff, device),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x)
        gate = gate * torch.sigmoid(gate)
        up = self.w3(x)
        return self.w2(gate * up)  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, d_ff: int, max_len: int, device: str) -> None:
        super().__init__()
        self.ln1, self.ln2 = RMSNorm(d_model, device), RMSNorm(d_model, device)
        self.attn = Attention(d_model, heads, max_len, device)
        self.ffn = SwiGLU(d_model, d_ff, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.ln1(x)  # each intermediate named: it lives to the return, where the traces free it
        attended = self.attn(normed)
        mixed = x + attended
        normed_again = self.ln2(mixed)
        return mixed + self.ffn(normed_again)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class LMShape:
    vocab: int = 10_000
    d_model: int = 512
    layers: int = 4
    heads: int = 16
    d_ff: int = 1344
    max_len: int = 256


class TransformerLM(nn.Module):
    def __init__(self, shape: LMShape, device: str) -> None:
        super().__init__()
        self.token_embeddings = Embedding(shape.vocab, shape.d_model, device)
        args = (shape.d_model, shape.heads, shape.d_ff, shape.max_len, device)
        self.layers = nn.ModuleList(Block(*args) for _ in range(shape.layers))
        self.ln_final = RMSNorm(shape.d_model, device)
        self.lm_head = Linear(shape.d_model, shape.vocab, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.token_embeddings(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_final(x))  # type: ignore[no-any-return]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy written out: log-softmax with the max subtracted, a one-hot made by zeros_like."""
    top = logits.max(dim=-1, keepdim=True)[0]
    log_probs = (logits - top) - torch.log(torch.sum(torch.exp(logits - top), dim=-1, keepdim=True))
    one_hot = torch.zeros_like(log_probs).scatter_(1, targets.unsqueeze(1), 1.0)
    return -torch.sum(one_hot * log_probs) / logits.shape[0]


class PlainAdam(torch.optim.Optimizer):
    """AdamW written with out-of-place tensor ops (new m, v and parameter data each step), its moments made
    by zeros_like when the optimizer is built."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 1e-3, weight_decay: float = 0.01) -> None:
        super().__init__(params, {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": weight_decay})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].update(m=torch.zeros_like(p), v=torch.zeros_like(p), t=0)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            (b1, b2), lr, eps, decay = group["betas"], group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["t"] += 1
                m = b1 * state["m"] + (1 - b1) * p.grad
                v = b2 * state["v"] + (1 - b2) * p.grad**2
                state["m"], state["v"] = m, v
                lr_t = lr * math.sqrt(1 - b2 ** state["t"]) / (1 - b1 ** state["t"])
                p.data = p.data - lr_t * (m / (torch.sqrt(v) + eps))
                p.data = p.data - lr * decay * p.data


# ---------------------------------------------- the CS336 staff model (cs336_basics), as its frames show it


class BasicsRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = x * scale
        return self.weight * x


class BasicsRope(nn.Module):
    """Rotary embedding over interleaved pairs; one (2, len, d_k / 2) cos/sin table on the device, gathered
    by position in one index op."""

    cos_sin: torch.Tensor

    def __init__(self, d_k: int, max_len: int, device: str, theta: float = 10000.0) -> None:
        super().__init__()
        freqs = theta ** -(torch.arange(0, d_k, 2, device=device) / d_k)
        angles = torch.outer(torch.arange(max_len, device=device), freqs)
        self.register_buffer("cos_sin", torch.stack((torch.cos(angles), torch.sin(angles))), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin[:, positions]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        first = cos * x1 - sin * x2
        second = sin * x1 + cos * x2
        return torch.cat((first.unsqueeze(-1), second.unsqueeze(-1)), dim=-1).flatten(-2)


def basics_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    shifted = x - torch.max(x, dim=dim, keepdim=True)[0]
    exp = torch.exp(shifted)
    return exp / torch.sum(exp, dim=dim, keepdim=True)


def basics_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    scores = torch.einsum("...qd,...kd->...qk", q, k) / math.sqrt(k.shape[-1])
    scores = torch.where(mask, scores, float("-inf"))
    return torch.einsum("...qk,...kd->...qd", basics_softmax(scores), v)


class BasicsAttention(Attention):
    # forward repeats Attention's lines on purpose: each local's lifetime is the traced code's, and a shared
    # helper that took the attention output would keep it alive through output_proj (a different peak)
    def __init__(self, d_model: int, heads: int, max_len: int, device: str) -> None:
        super().__init__(d_model, heads, max_len, device)
        self.rope = BasicsRope(d_model // heads, max_len, device)  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        split = (batch, seq, self.heads, d_model // self.heads)
        q = self.q_proj(x).view(split).transpose(1, 2)
        k = self.k_proj(x).view(split).transpose(1, 2)
        v = self.v_proj(x).view(split).transpose(1, 2)
        positions = torch.arange(seq, device=x.device)
        q = self.rope(q, positions)
        k = self.rope(k, positions)
        order = torch.arange(seq, device=x.device)
        mask = order[:, None] >= order[None, :]
        out = basics_attention(q, k, v, mask)
        out = out.transpose(1, 2).contiguous().view(batch, seq, d_model)
        return self.output_proj(out)  # type: ignore[no-any-return]


class BasicsBlock(Block):
    def __init__(self, d_model: int, heads: int, d_ff: int, max_len: int, device: str) -> None:
        super().__init__(d_model, heads, d_ff, max_len, device)
        self.ln1, self.ln2 = BasicsRMSNorm(d_model, device), BasicsRMSNorm(d_model, device)
        self.attn = BasicsAttention(d_model, heads, max_len, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attended = self.attn(self.ln1(x))
        mixed = x + attended
        return mixed + self.ffn(self.ln2(mixed))  # type: ignore[no-any-return]


class BasicsLM(TransformerLM):
    def __init__(self, shape: LMShape, device: str) -> None:
        super().__init__(shape, device)
        args = (shape.d_model, shape.heads, shape.d_ff, shape.max_len, device)
        self.layers = nn.ModuleList(BasicsBlock(*args) for _ in range(shape.layers))
        self.ln_final = BasicsRMSNorm(shape.d_model, device)


SMALL = LMShape(d_model=768, layers=12, heads=12, d_ff=3072, max_len=128)
XL_2P7B = LMShape(d_model=2560, layers=32, heads=32, d_ff=10240, max_len=128)


# ------------------------------------------------------------------------------------------ workloads


def lm_forward(ctx: int, autocast: bool) -> Callable[[str, Record], None]:
    """Fresh process: the model built inside the recording, batch 10, three forward passes with grad on
    (under CUDA autocast to bf16 with `autocast`)."""

    def run(device: str, record: Record) -> None:
        record()
        model = TransformerLM(LMShape(), device)
        ids = torch.randint(0, 10_000, (10, ctx), device=device)
        for _ in range(3):  # the output is not kept: each pass's graph dies before the next (the trace's frees)
            with warnings.catch_warnings():  # CUDA autocast without CUDA warns; the tracker may apply it on meta
                warnings.filterwarnings("ignore", "CUDA is not available", UserWarning)
                with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=autocast):
                    model(ids)

    return run


def lm_train(device: str, record: Record) -> None:
    """Fresh process: model and optimizer built inside the recording; three steps of zero_grad, forward,
    cross-entropy on the last token's logits, backward, step; batch 10, ctx 100, fp32."""
    record()
    model = TransformerLM(LMShape(), device)
    optimizer = PlainAdam(model.parameters())
    ids = torch.randint(0, 10_000, (10, 100), device=device)
    targets = torch.randint(0, 10_000, (10,), device=device)
    for _ in range(3):
        optimizer.zero_grad()
        logits = model(ids)
        loss = cross_entropy(logits[:, -1, :], targets)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()


def hf_linear(device: str, record: Record) -> None:
    """The Hugging Face memory recipe: Linear(10000 -> 50000) fp32, three forwards on randn(5000, 10000)."""
    record()
    model = nn.Linear(10_000, 50_000, device=device)
    for _ in range(3):
        inputs = torch.randn(5000, 10_000, device=device)
        out = model(inputs)
    del inputs, out


def einsum_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = torch.einsum("bqd,bkd->bqk", q, k) / math.sqrt(q.shape[-1])
    top = scores.max(dim=-1, keepdim=True)[0]
    exp = torch.exp(scores - top)
    weights = exp / exp.sum(dim=-1, keepdim=True)
    return torch.einsum("bqk,bkd->bqd", weights, v)


def naive_attention_once(device: str, record: Record) -> None:
    """Q, K, V = randn(8, 4096, 16) requiring grad, einsum attention forward, sum, backward (from empty)."""
    record()
    q, k, v = (torch.randn(8, 4096, 16, device=device, requires_grad=True) for _ in range(3))
    out = einsum_attention(q, k, v)
    out.sum().backward()  # type: ignore[no-untyped-call]


def scaled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores -= torch.max(scores, dim=-1, keepdim=True)[0]
    exp = torch.exp(scores)
    return exp / exp.sum(dim=-1, keepdim=True) @ v


def attention_benchmark(device: str, record: Record) -> None:
    """Q, K, V = randn(8, 4096, 64) requiring grad, MSE loss; 5 warmup steps, then 100 recorded steps."""
    q, k, v = (torch.randn(8, 4096, 64, device=device, requires_grad=True) for _ in range(3))
    target = torch.randn(8, 4096, 64, device=device)
    for step in range(105):
        if step == 5:
            record()
        out = scaled_attention(q, k, v)
        F.mse_loss(out, target).backward()  # type: ignore[no-untyped-call]
        q.grad = k.grad = v.grad = None
        del out


def basics_forward(shape: LMShape, warmup: int) -> Callable[[str, Record], None]:
    """The staff model built and run `warmup` forward passes before the recording, then one recorded forward
    pass with grad on whose output is still alive when the snapshot is taken (batch 4, ctx 128)."""

    def run(device: str, record: Record) -> None:
        model = BasicsLM(shape, device)
        ids = torch.randint(0, shape.vocab, (4, 128), device=device)
        for _ in range(warmup):
            model(ids)
        record()
        logits = model(ids)
        del logits

    return run


@dataclass(frozen=True)
class Workload:
    """One card's workload: the snapshot file, how to run it, and the card to predict (None: unknown)."""

    name: str
    snapshot: str
    run: Callable[[str, Record], None]
    card: str | None


WORKLOADS: tuple[Workload, ...] = (
    Workload(
        "LM fwd ctx100 fp32",
        "NiuHuangxiaozi__assignment2-systems__fwd_ctx100_fp32.pickle",
        lm_forward(100, False),
        None,
    ),
    Workload(
        "LM fwd ctx200 bf16",
        "NiuHuangxiaozi__assignment2-systems__fwd_ctx200_bf16autocast.pickle",
        lm_forward(200, True),
        None,
    ),
    Workload("LM train ctx100", "NiuHuangxiaozi__assignment2-systems__train_ctx100_fp32.pickle", lm_train, None),
    Workload("HF Linear 10k-50k", "shreyansh26__MLSys-Experiments__profile_grad.pickle", hf_linear, "H100"),
    Workload(
        "attention s4096 d16", "silmont2000__assignment2-systems__mem_snapshot.pickle", naive_attention_once, None
    ),
    Workload(
        "attention s4096 d64", "sungdk0822__CS336-assignment2-systems__attn_d64_s4096.pickle", attention_benchmark, None
    ),
    Workload("small fwd (warm)", "CliffKai__assignment2-systems__small_fwd.pickle", basics_forward(SMALL, 5), "H100"),
    Workload(
        "2.7B fwd (warm)",
        "charliesabino__cs336-assignment2__2p7b_ctx128_fwd_fp32.pickle",
        basics_forward(XL_2P7B, 5),
        None,
    ),
)
