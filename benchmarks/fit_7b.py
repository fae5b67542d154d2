"""The largest batch of a 7B decoder's training step that fits an 80 GiB card, fitted on the meta device.

The model of `meta_7b.py` (bf16 parameters, gradients and AdamW state), built inside the measured call
as a test builds it, warmed up by one step, then `gpumem.fit(step, sizes=[1, 2, 3], capacity="80 GiB")`:
the answer shown by training loops of 3 steps at it and the next size held to 80 GiB (the tracker raises
OutOfMemoryError past it, as `max_memory(device="meta", capacity="80 GiB")` does). The
hand count of what is live when the fit begins: parameters + gradients + AdamW state + the two cuBLAS
workspaces (under the allocator's model, which meta uses by default).

Run: python benchmarks/fit_7b.py [--json PATH] [--capacity "80 GiB"] [--sizes 1 2 3]
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from benchlib import parser, show, write_json
from meta_7b import HandCount, Shape, build, parameter_count

from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.measure.fit import BatchFit
from pytest_gpumem.measure.measurement import Measurement
from pytest_gpumem.measure.measuring import measuring


@dataclass(frozen=True)
class Timed:
    """The fit, what was live when it began, and how long one step and the fit took."""

    fit: BatchFit
    live: int
    one_step: float
    fit_wall: float


def fit_on_meta(s: Shape, sizes: list[int], capacity: str) -> Timed:
    """Build the model and AdamW inside a measured call on meta, warm one step up, then fit."""
    with measuring(Measurement(TrackerBackend(device="meta"), "fit_7b")) as call:
        model = build(s)[0]  # its example inputs are dropped: only the model is live
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # meta takes the GPU's foreach path

        def step(n: int) -> None:
            ids = torch.zeros(n, s.seq, dtype=torch.long, device="meta")
            targets = torch.zeros(n * s.seq, dtype=torch.long, device="meta")
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(ids).float().view(-1, s.vocab), targets)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()

        began = time.perf_counter()
        step(1)  # warm-up: AdamW's state exists from here on
        one_step = time.perf_counter() - began
        live = call.meter.backend.current().allocated
        began = time.perf_counter()
        fit = call.meter.fit(step, sizes, capacity)
        return Timed(fit, live, one_step, time.perf_counter() - began)


def rows(timed: Timed, expected_live: int, capacity: str) -> list[list[str]]:
    fit = timed.fit
    checks = [
        [
            f"batch {c.size} under {capacity}",
            f"out of memory in step {c.steps}" if c.out_of_memory else f"{c.steps} steps",
            f"{c.peak:,} B",
        ]
        for c in fit.checks
    ]
    runs = len(fit.sizes) + len(fit.checks) + len(fit.expandable_checks)
    loops = f"{len(fit.checks)} loops held to the capacity, {len(fit.expandable_checks)} with expandable segments"
    return [
        ["live at the fit (B)", f"{fit.live:,}", f"params + grads + AdamW state + workspaces: {expected_live:,}"],
        ["largest batch", f"{fit.largest}", f"peak {fit.peak_bytes:,} B at {fit.at}"],
        ["found", f"{fit.found.value}{', exact' if fit.exact else ''}", fit.note],
        *checks,
        ["runs of the step", f"{runs}", f"{len(fit.sizes)} sampled, {loops}"],
        ["fit's time", f"{timed.fit_wall:.1f} s", f"{timed.fit_wall / timed.one_step:.1f} x one step"],
    ]


def main() -> None:
    args = parser("The largest 7B training batch that fits a card, fitted on meta and confirmed under its capacity")
    args.add_argument("--capacity", default="80 GiB")
    args.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3])
    options = args.parse_args()
    s = Shape()
    hand = HandCount.of(s, rounding="cuda")  # meta serves tensors by the allocator's model by default
    start = time.perf_counter()
    timed = fit_on_meta(s, options.sizes, options.capacity)
    fit = timed.fit
    wall = time.perf_counter() - start
    expected_live = hand.params + hand.grads + hand.optimizer_state + hand.workspaces
    show(
        f"7B decoder ({parameter_count(s):,} parameters, bf16) on meta, seq {s.seq}: fit against {options.capacity}",
        ["figure", "measured", "hand count / note"],
        rows(timed, expected_live, options.capacity),
        [
            fit.describe(),
            f"wall {wall:.1f} s, one step {timed.one_step:.2f} s; live before the fit as counted by the tracker: "
            f"{timed.live:,} B",
        ],
    )
    write_json(
        options.json,
        {
            "wall_s": wall,
            "fit_s": timed.fit_wall,
            "step_s": timed.one_step,
            "live": fit.live,
            "hand_live": expected_live,
            "sizes": list(fit.sizes),
            "peaks": list(fit.peaks),
            "largest": fit.largest,
            "peak_bytes": fit.peak_bytes,
            "found": fit.found.value,
            "exact": fit.exact,
            "confirmed": fit.confirmed,
            "checks": [vars(c) for c in fit.checks],
            "expandable": fit.expandable,
            "describe": fit.describe(),
        },
    )


if __name__ == "__main__":
    main()
