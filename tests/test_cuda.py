"""The same scenarios on a real GPU with the cuda backend; skipped where no CUDA/ROCm device exists."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) device")

# N float32 = 4,000,000 bytes: requested exactly, allocated rounded up to 512 (4,000,256) and split
# off a 20 MiB segment; a reused cached block may count up to 1 MiB more.
SCENARIO = """
import pytest, torch

N = 1_000_000
ROUNDED = -(-4 * N // 512) * 512

def within(allocated, rounded):
    return rounded <= allocated <= rounded + 1024**2

@pytest.mark.max_memory(forward="5 MB")
def test_sum_of_product(gpumem):
    assert gpumem.device.type == "cuda"
    x = torch.randn(N, device=gpumem.device, requires_grad=True)
    y = torch.randn(N, device=gpumem.device)
    with gpumem.phase("forward"):
        loss = torch.sum(x * y)
    with gpumem.phase("backward"):
        loss.backward()  # runs on autograd's device thread
    forward, backward = gpumem.result("forward"), gpumem.result("backward")
    assert forward.requested_peak_bytes == 4 * N + 4
    assert within(forward.peak_bytes, ROUNDED + 512)
    assert backward.requested_peak_bytes == 4 * N + 4
    assert within(backward.peak_bytes, ROUNDED + 512)
    assert backward.net_bytes >= ROUNDED
    assert forward.reserved_peak_bytes >= forward.peak_bytes

@pytest.mark.max_memory(forward="3 MB")
def test_over_budget(gpumem):
    x = torch.randn(N, device=gpumem.device)
    with gpumem.phase("forward"):
        (x * 2).sum()
"""


def test_cuda_backend(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(SCENARIO)
    result = pytester.runpytest("--gpumem-backend=cuda", "--gpumem-report")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["gpumem: cuda (*", "*forward peak 4.0 MB exceeds max_memory forward=3 MB*"])


def test_tracker_predicts_cuda_rounding(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import torch

        def test_predicted(gpumem):
            x = torch.randn(1_000_000, device="cuda", requires_grad=True)
            with gpumem.phase("forward"):
                loss = (x * 2).sum()
            assert gpumem.peak("forward") == 4_000_256 + 512
        """
    )
    pytester.runpytest("--gpumem-backend=tracker", "--gpumem-round=cuda").assert_outcomes(passed=1)


OUT_OF_MEMORY = """
import pytest, torch

@pytest.mark.max_memory(capacity="64 MiB")
def test_runs_out(gpumem):
    with gpumem.phase("forward"):
        torch.empty(128 * 1024**2, dtype=torch.uint8, device=gpumem.device)  # 128 MiB > 64 MiB

def test_after(gpumem):
    x = torch.empty(1024**2, dtype=torch.uint8, device=gpumem.device)
    assert gpumem.peak() >= 1024**2
"""


def test_out_of_memory_capacity_and_snapshot_on_cuda(pytester: pytest.Pytester) -> None:
    import pickle

    pytester.makepyfile(OUT_OF_MEMORY)
    result = pytester.runpytest("--gpumem-backend=cuda", "--gpumem-snapshot-dir=snaps", "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["out of memory in forward (tried to allocate 128.00 MiB) after a peak of *"])
    (snapshot,) = (pytester.path / "snaps").glob("*test_runs_out-*.pickle")
    assert "segments" in pickle.loads(snapshot.read_bytes())
