"""The shipped suite's distributed strategies: DDP and FSDP2 of the Q&A's Net on 2 and 4 ranks, each
world running both, every rank's peaks against their hand derivation (reference_losses/distributed.py)."""

from __future__ import annotations

import pytest

from pytest_gpumem import GpuMem
from reference_losses.checks import DEVICE_SLACK, EXACT_SLACK
from reference_losses.distributed import INFO_KEY, PHASES, STRATEGIES, describe, expected, run_strategies, sizes
from reference_losses.strategy import FP32_RTOL


def _skip_unless_runnable(gpumem: GpuMem, world_size: int) -> None:
    if gpumem.device.type == "meta":
        pytest.skip("fully_shard refuses parameters on the meta device for training")
    if gpumem.device.type == "cuda":
        import torch

        if torch.cuda.device_count() < world_size:
            pytest.skip(f"{world_size} ranks need {world_size} CUDA devices, {torch.cuda.device_count()} visible")


@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel(gpumem: GpuMem, gpumem_scale: float, world_size: int) -> None:
    _skip_unless_runnable(gpumem, world_size)
    ranks = gpumem.distributed(run_strategies, world_size, args=(gpumem_scale,), name="ranks")
    far = {(r.rank, k): e for r in ranks for k, e in r.value.items() if not e <= FP32_RTOL}
    assert not far, f"parameters after one step differ from one process on the whole batch: {far}"
    worst = {f"{s}.{p}": gpumem.result(f"{s}.{p}").requested_peak_bytes for s in STRATEGIES for p in PHASES}
    gpumem.info[INFO_KEY] = describe(world_size, gpumem_scale, worst)
    rel, extra = EXACT_SLACK if gpumem.backend.name == "tracker" else DEVICE_SLACK
    failures = []
    for strategy in STRATEGIES:
        for exp in expected(strategy, sizes(gpumem_scale, world_size)):
            for rank in range(world_size):
                result = gpumem.result(f"{exp.phase}@rank{rank}")
                got = result.net_bytes if exp.net else result.requested_peak_bytes
                if not exp.low * (1 - rel) - extra <= got <= exp.high * (1 + rel) + extra:
                    what = "kept after" if exp.net else "peak of"
                    failures.append(
                        f"rank {rank}: {what} {exp.phase}: {got} B, expected {exp.low}..{exp.high} ({exp.why})"
                    )
    assert not failures, "; ".join(failures)
