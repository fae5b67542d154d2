"""Where a CPU run takes other code than a GPU would, measured with the tracker.

    python benchmarks/cpu_vs_cuda_paths.py [--json PATH]

- Optimizers: `foreach` is torch's default only for CUDA-like devices; on CPU the single-tensor loop
  runs. `--gpumem-round=cuda` makes the CPU take the foreach path; both figures are shown.
- Attention: `scaled_dot_product_attention` on CPU takes a flash kernel that keeps the output and the
  log-sum-exp; the math path (what a GPU falls back to when no fused kernel fits) keeps the weights.
"""

from __future__ import annotations

from collections.abc import Callable

import benchlib
import torch
import torch.nn.functional as F

from pytest_gpumem.backends.tracker.backend import TrackerBackend
from reference_losses.models import ResidualMLP


def _tracked(run: Callable[[], object], rounding: str = "none") -> tuple[int, int]:
    """(peak, still allocated) bytes of `run` on the tracker."""
    backend = TrackerBackend(rounding)
    backend.start()
    try:
        kept = run()
        peak, current = backend.peak().requested, backend.current().requested
        del kept
    finally:
        backend.stop()
    return peak, current


def adam_step_peaks(model: torch.nn.Module) -> tuple[int, int]:
    """Peak bytes of a second Adam step: single-tensor (CPU default), then foreach (as on CUDA)."""
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.Adam(params)
    optimizer.step()  # the state exists before the measured step
    single = _tracked(optimizer.step)[0]
    foreach = _tracked(optimizer.step, rounding="cuda")[0]
    return single, foreach


def attention_kept(batch: int, heads: int, seq: int, dim: int) -> tuple[int, int]:
    """Bytes a causal attention forward keeps for backward: SDPA on CPU, then the math path."""
    q = torch.randn(batch, heads, seq, dim, requires_grad=True)
    mask = torch.full((seq, seq), float("-inf")).triu(1)

    def math() -> torch.Tensor:
        return torch.softmax(q @ q.transpose(-1, -2) / dim**0.5 + mask, -1) @ q

    fused = _tracked(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True))[1]
    return fused, _tracked(math)[1]


def main() -> None:
    args = benchlib.parser(__doc__ or "").parse_args()
    models = {
        "10 x Linear(500, 500)": torch.nn.Sequential(*[torch.nn.Linear(500, 500) for _ in range(10)]),
        "ResidualMLP(8, 512, 2048)": ResidualMLP(8, 512, 2048),
    }
    rows, figures = [], {}
    for name, model in models.items():
        single, foreach = adam_step_peaks(model)
        rows.append([f"Adam step, {name}", f"{single:,}", f"{foreach:,}"])
        figures[name] = {"single_tensor": single, "foreach": foreach}
    fused, math = attention_kept(4, 8, 512, 64)
    rows.append(["attention kept for backward, B 4 H 8 S 512 D 64", f"{fused:,}", f"{math:,} (math path)"])
    figures["attention"] = {"sdpa_cpu": fused, "math": math}
    benchlib.show("CPU default vs the CUDA path (requested bytes)", ["workload", "CPU default", "CUDA path"], rows)
    benchlib.write_json(args.json, {"paths": figures})


if __name__ == "__main__":
    main()
