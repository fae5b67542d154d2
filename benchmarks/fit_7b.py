"""The largest batch of a 7B decoder's training step that fits an 80 GiB card, fitted on the meta device.

The model of `meta_7b.py` (bf16 parameters, gradients and AdamW state), built inside the measured call
as a test builds it, warmed up by one step, then `gpumem.fit(step, sizes=[1, 2, 3], capacity="80 GiB",
confirm=True)`: the answer and the answer + 1 are run again held to 80 GiB (the tracker raises
OutOfMemoryError past it, as `max_memory(device="meta", capacity="80 GiB")` does). The hand count of
what is live when the fit begins: parameters + gradients + AdamW state.

Run: python benchmarks/fit_7b.py [--json PATH] [--capacity "80 GiB"] [--sizes 3 4 5]
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from benchlib import parser, show, write_json
from meta_7b import HandCount, Shape, build, parameter_count

from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.measure.meter import GpuMem
from pytest_gpumem.sizes import parse_size


def main() -> None:
    args = parser("The largest 7B training batch that fits a card, fitted on meta and confirmed under its capacity")
    args.add_argument("--capacity", default="80 GiB")
    args.add_argument("--sizes", type=int, nargs="+", default=[3, 4, 5])
    options = args.parse_args()
    s = Shape()
    hand = HandCount.of(s)
    meter = GpuMem(TrackerBackend(device="meta"), "fit_7b")
    start = time.perf_counter()
    meter.begin_call()
    try:
        model = build(s)[0]  # its example inputs are dropped: only the model is live
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # meta takes the GPU's foreach path

        def step(n: int) -> None:
            ids = torch.zeros(n, s.seq, dtype=torch.long, device="meta")
            targets = torch.zeros(n * s.seq, dtype=torch.long, device="meta")
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(ids).float().view(-1, s.vocab), targets)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()

        step(1)  # warm-up: AdamW's state exists from here on
        live = meter.backend.current().allocated
        fit = meter.fit(step, options.sizes, options.capacity, confirm=True)
    finally:
        meter.end_call()
    wall = time.perf_counter() - start
    expected_live = hand.params + hand.grads + hand.optimizer_state
    limit = parse_size(options.capacity)
    # what the fit answered before it counted what is live: peaks above each phase's start
    relative = math.floor((limit - (fit.fixed - fit.live)) / fit.per_item)
    rows = [
        ["live at the fit (B)", f"{fit.live:,}", f"params + grads + AdamW state: {expected_live:,}"],
        ["fixed a (B)", f"{round(fit.fixed):,}", ""],
        ["per item b (B)", f"{round(fit.per_item):,}", ""],
        ["largest batch", f"{fit.largest}", f"predicted peak {fit.predicted_peak:,} B"],
        ["peaks above the phase's start", f"{relative}", "the answer when what is live is left out"],
        *[
            [
                f"batch {c.size} under {options.capacity}",
                "out of memory" if c.out_of_memory else "fits",
                f"{c.peak:,} B",
            ]
            for c in fit.checks
        ],
    ]
    show(
        f"7B decoder ({parameter_count(s):,} parameters, bf16) on meta, seq {s.seq}: fit against {options.capacity}",
        ["figure", "measured", "hand count / note"],
        rows,
        [fit.describe(), f"wall {wall:.1f} s; live before the fit as counted by the tracker: {live:,} B"],
    )
    write_json(
        options.json,
        {
            "wall_s": wall,
            "live": fit.live,
            "hand_live": expected_live,
            "sizes": list(fit.sizes),
            "peaks": list(fit.peaks),
            "largest": fit.largest,
            "largest_without_live": relative,
            "predicted_peak": fit.predicted_peak,
            "checks": [vars(c) for c in fit.checks],
            "describe": fit.describe(),
        },
    )


if __name__ == "__main__":
    main()
