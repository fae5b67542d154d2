"""Exact bytes from the tracker, on workloads whose sizes are derived by hand (float32 = 4 bytes), and the
ledger under it: storages followed until they die, peaks, a capacity, the CUDA allocator's rounding."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from builders import FakeStorage

from pytest_gpumem.backends.base import Backend, Counters, Settings
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.backends.tracker.ledger import StorageLedger
from pytest_gpumem.backends.tracker.storages import cuda_block_size
from pytest_gpumem.errors import GpuMemError

WORKLOADS = """
import pytest, torch
from torch.utils.checkpoint import checkpoint

N = 1000  # float32 elements: 4N = 4000 bytes


def step(gpumem, forward):
    x = torch.randn(N, requires_grad=True, device=gpumem.device)
    with gpumem.phase("forward"):
        loss = forward(x)
    with gpumem.phase("backward"):
        loss.backward()
    return x


def test_sum_of_product(gpumem):
    y = torch.randn(N)
    step(gpumem, lambda x: torch.sum(x * y))
    # forward: the product x*y (4N) and the scalar sum (4) coexist; mul saves x and y, made before
    assert gpumem.result("forward").peak_bytes == 4 * N + 4
    assert gpumem.result("forward").net_bytes == 4
    # backward: the seed grad ones_like(loss) (4) and grad*y (4N), which becomes x.grad
    assert gpumem.result("backward").peak_bytes == 4 + 4 * N
    assert gpumem.result("backward").net_bytes == 4 * N


def test_saved_tensors_count(gpumem):
    step(gpumem, lambda x: (x * 2).sigmoid().sum())
    # x*2 (4N) and sigmoid's output (4N) coexist; sigmoid saves its output for backward
    assert gpumem.peak("forward") == 8 * N
    assert gpumem.result("forward").net_bytes == 4 * N + 4
    # seed (4) + sigmoid's grad (4N); the saved output is released before grad*2 (4N) is made
    assert gpumem.peak("backward") == 4 * N + 4
    assert gpumem.result("backward").net_bytes == 0


def test_checkpoint_recomputation_counts(gpumem):
    step(gpumem, lambda x: checkpoint(lambda t: (t * 2).sigmoid(), x, use_reentrant=False).sum())
    assert gpumem.peak("forward") == 8 * N
    assert gpumem.result("forward").net_bytes == 4  # nothing saved but x, made before
    # seed (4) + the recomputed x*2 and sigmoid output (4N each)
    assert gpumem.peak("backward") == 8 * N + 4


def test_autocast_copies_count(gpumem):
    w = torch.randn(N, N // 4)

    def forward(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (x @ w).float().sum()

    step(gpumem, forward)
    # bf16 copies of x (2N) and w (2 * N * N/4), bf16 product (2 * N/4), its float copy (4 * N/4)
    # and the sum (4); the product is freed only after .float() ran, so all but the sum coexist
    assert gpumem.peak("forward") == 2 * N + 2 * N * N // 4 + 2 * N // 4 + 4 * N // 4
    # mv saves the bf16 copy of w for x's gradient
    assert gpumem.result("forward").net_bytes == 2 * N * N // 4 + 4


def test_views_and_inplace_count_zero(gpumem):
    x = torch.randn(N)
    with gpumem.phase("views"):
        a = x.view(10, 100).t()[::2]
        b = x[:10].unsqueeze(0).expand(5, 10)
        x.add_(1).mul_(2)
        x.relu_()
        del a, b
    assert gpumem.peak("views") == 0


def test_resize_out_counts_growth(gpumem):
    y = torch.randn(N)
    out = torch.empty(0)
    with gpumem.phase("out"):
        torch.add(y, y, out=out)
    assert gpumem.peak("out") == 4 * N


def test_same_phase_twice_keeps_maximum(gpumem):
    with gpumem.phase("alloc"):
        torch.ones(N)
    with gpumem.phase("alloc"):
        torch.ones(2 * N)
    with gpumem.phase("alloc"):
        torch.ones(N // 2)
    assert gpumem.peak("alloc") == 8 * N
    assert gpumem.result("alloc").count == 3


def test_dtypes_and_factories(gpumem):
    with gpumem.phase("made"):
        keep = [torch.zeros(N, dtype=torch.float64), torch.empty(N, dtype=torch.int8), torch.tensor([1.0, 2.0])]
    assert gpumem.peak("made") == 8 * N + N + 8
    assert gpumem.result("made").net_bytes == 8 * N + N + 8
    del keep


def test_out_overloads_of_every_name(gpumem):
    x = torch.randn(100, 10)
    v, i = torch.empty(0), torch.empty(0, dtype=torch.long)
    with gpumem.phase("out"):
        p = torch.pow(x, 2, out=torch.empty(0))  # overload Tensor_Scalar_out: 4000 bytes
        torch.sort(x[0], out=(v, i))  # overload values: 10 float32 and 10 int64
    assert gpumem.peak("out") == 4000 + 40 + 80
    assert gpumem.result("out").net_bytes == 4000 + 40 + 80
    del p


def test_growing_an_earlier_storage_twice(gpumem):
    c = torch.empty(100)
    with gpumem.phase("grow"):
        c.resize_(200)
        c.resize_(300)
    assert gpumem.peak("grow") == 4 * (300 - 100)


def test_memory_torch_did_not_allocate_is_not_counted(gpumem):
    import numpy

    a = numpy.ones(N, dtype=numpy.float32)
    with gpumem.phase("shared"):
        views = [torch.as_tensor(a), torch.from_numpy(a)]
    assert gpumem.peak("shared") == 0
    del views


def test_wrapper_subclasses_count_their_inner_tensors(gpumem):
    from torch.testing._internal.two_tensor import TwoTensor

    t = TwoTensor(torch.ones(N), torch.ones(N))
    with gpumem.phase("twice"):
        u = t * 2
    assert gpumem.peak("twice") == 2 * 4 * N
    del u


def test_meta_tensors_are_counted_without_memory(gpumem):
    with gpumem.phase("meta"):
        big = torch.empty(1024, 1024, 1024, device="meta")
    assert gpumem.peak("meta") == 4 * 1024**3
    del big
"""


def test_exact_bytes(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(WORKLOADS)
    result = tracker.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=13)


def test_cuda_rounding_option(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import torch

        def test_rounded(gpumem):
            with gpumem.phase("p"):
                a = torch.ones(1000)           # 4000 B -> 4096
                b = torch.ones(4_000_000)      # 16,000,000 B -> a whole 16 MiB segment
            r = gpumem.result("p")
            assert r.peak_bytes == 4096 + 16 * 1024**2
            assert r.requested_peak_bytes == 4000 + 16_000_000
        """
    )
    tracker.runpytest("--gpumem-round=cuda").assert_outcomes(passed=1)


@pytest.mark.parametrize(
    ("request_bytes", "counted"),
    [
        (0, 0),
        (1, 512),
        (512, 512),
        (513, 1024),
        (1024**2, 1024**2),
        (5 * 1024**2 + 1, 5 * 1024**2 + 512),
        (10 * 1024**2 + 512 * 1024, 10 * 1024**2 + 512 * 1024),  # 1.5 MiB would remain: split
        (11 * 1024**2 + 1, 12 * 1024**2),  # under 1 MiB would remain: the whole segment
        (12 * 1024**2, 12 * 1024**2),
        (16_000_000, 16 * 1024**2),
    ],
)
def test_cuda_block_size(request_bytes: int, counted: int) -> None:
    assert cuda_block_size(request_bytes) == counted


def test_the_ledger_imports_no_torch() -> None:
    code = "import sys, pytest_gpumem.backends.tracker.ledger; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_the_ledger_counts_storages_until_they_die() -> None:
    ledger = StorageLedger("cuda")
    a, b = FakeStorage(1, 1000), FakeStorage(2, 600)
    ledger.add(a)
    ledger.add(b)
    assert (ledger.requested, ledger.allocated) == (1600, 1024 + 1024)  # each rounded up to 512 B blocks
    del a  # its last reference: the weak reference's callback runs now
    assert (ledger.requested, ledger.allocated) == (600, 1024)
    assert (ledger.peak_requested, ledger.peak_allocated) == (1600, 2048)
    ledger.reset_peak()
    assert (ledger.peak_requested, ledger.peak_allocated) == (600, 1024)
    del b


def test_the_ledger_counts_only_the_device_it_stands_for_and_follows_a_change_of_it() -> None:
    ledger = StorageLedger("none")
    ledger.device_type = "meta"  # the predicted GPU: a CPU storage is its host's memory
    on_gpu, on_host, later = (torch.empty(n, dtype=torch.uint8, device=d).untyped_storage() for n, d in
                              ((100, "meta"), (30, "cpu"), (7, "cpu")))  # fmt: skip
    ledger.add(on_gpu)
    ledger.add(on_host)
    assert ledger.requested == 100
    ledger.device_type = "cpu"  # each device decided anew
    ledger.add(later)
    assert ledger.requested == 100 + 7
    ledger.device_type = None  # every storage
    ledger.add(on_host)
    assert ledger.requested == 100 + 7 + 30


def test_the_ledger_follows_resizes_and_growth_of_earlier_storages() -> None:
    ledger = StorageLedger("none")
    made, earlier = FakeStorage(1, 100), FakeStorage(2, 300)
    ledger.add(made)
    made.size = 400
    ledger.resized(made, before=100)  # grown outside any op: counted anew
    earlier.size = 500
    ledger.grow_existing(earlier, before=300)  # made before tracking: only the growth is new
    assert ledger.requested == 400 + 200
    earlier.size = 300
    ledger.resize(earlier)  # back to what it had before tracking: nothing of it counted
    assert (ledger.requested, ledger.peak_requested) == (400, 600)
    ledger.forget()
    assert (ledger.requested, ledger.peak_requested, ledger.live) == (0, 0, {})


def test_the_ledger_refuses_an_allocation_past_its_capacity() -> None:
    ledger = StorageLedger("none", out_of_memory=OverflowError)
    ledger.capacity = 1000
    kept = FakeStorage(1, 600)
    ledger.add(kept)
    with pytest.raises(OverflowError, match=r"tried to allocate 500 B with 600 B of the capacity 1000 B already"):
        ledger.add(FakeStorage(2, 500))
    assert ledger.allocated == 600


class Minimal(Backend):
    """A backend with only the required members."""

    name = "minimal"

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def describe(self) -> str:
        return "minimal"

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def settle(self) -> None:
        pass

    def current(self) -> Counters:
        return Counters(0, 0)

    def peak(self) -> Counters:
        return Counters(0, 0)

    def reset_peak(self) -> None:
        pass


def test_a_backend_with_only_the_required_members_sees_everything_and_can_do_nothing_more() -> None:
    backend = Minimal()
    backend.configure(Settings(1000, origins=True, events=True, explain=True))
    assert (backend.sees_earlier_allocations, backend.rounding, backend.capacity) == (True, "none", None)
    assert (backend.caps_the_process, backend.records_events, backend.caps_a_block) == (False, False, False)
    assert (backend.attribution(), backend.snapshot(), backend.trace(), backend.timeline()) == (None,) * 4
    assert (backend.live_storages(), backend.survivors(3), backend.notes()) == ({}, [], [])
    assert (backend.identity().backend, backend.identity().device) == ("minimal", "cpu")  # type: ignore[union-attr]
    with pytest.raises(GpuMemError, match=r"^the minimal backend cannot hold a block to a capacity$"):
        backend.held_to(1000)


def test_the_tracker_explains_rounds_and_counts_only_what_it_observes() -> None:
    backend = TrackerBackend("cuda")
    assert (backend.sees_earlier_allocations, backend.rounding, backend.snapshot()) == (False, "cuda", None)
    backend.configure(Settings(1000, explain=True))
    assert backend.capacity == 1000 and backend.attribution() is not None


def test_the_trackers_capacity_is_set_or_lifted_for_a_block() -> None:
    backend = TrackerBackend()
    backend.configure(Settings(1000, origins=False, events=False))
    with backend.held_to(2000):  # a fit asks about a larger card than the test's
        assert backend.capacity == 2000
    with backend.held_to(500):
        assert backend.capacity == 500
    with backend.held_to(None):
        assert backend.capacity is None
    assert backend.capacity == 1000
