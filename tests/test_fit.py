"""gpumem.fit: the largest batch that fits, from each size's timeline where the ops are the same at every
size, searched with loops held to the capacity where not, and shown by loops at the answer and the next size.

Every figure is counted by hand from the tensors the step makes (float32: 4 B an element), except the
answers on the allocator's model whose loops fragment its cache: those are checked against a fresh
process's training loop, run apart from the fit."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from builders import Reported

from pytest_gpumem.backends.base import Settings
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.measure.fit import BatchFit, Found, Sample
from pytest_gpumem.measure.fit_search import fit_peaks
from pytest_gpumem.measure.host import runs_refused
from pytest_gpumem.measure.measurement import Measurement
from pytest_gpumem.measure.meter import GpuMem

FIXED = 1000 * 4  # torch.zeros(1000)
ROW = 256 * 4  # one row of torch.ones(n, 256)


class Tracked:
    """A `measure` over one tracker kept running for a whole fit, as the meter's is (nothing live before
    it), each call with its timeline and held to `limit` bytes if given."""

    def __init__(self, device: str = "cpu") -> None:
        self.backend = TrackerBackend(device=device)
        self.backend.start()

    def __call__(self, fn: Callable[[], object], limit: int | None = None) -> Sample:
        backend, out_of_memory = self.backend, False
        start = backend.current().allocated
        backend.reset_peak()
        with backend.held_to(limit) if limit is not None else contextlib.nullcontext(), backend.timeline() as got:
            try:
                fn()
            except torch.OutOfMemoryError:
                out_of_memory = True
        peak, end = backend.peak().allocated, backend.current().allocated
        return Sample(start, peak, end, out_of_memory, limit is not None, got())


@pytest.fixture
def tracked() -> Iterator[Tracked]:
    measure = Tracked()
    yield measure
    measure.backend.stop()


def rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both tensors live at once: peak = FIXED + ROW * n."""
    return torch.zeros(1000), torch.ones(n, 256)


def switching(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A kernel that switches with the size: 1,024 B a row below 64 rows, 4,096 B (another op) from 64 on."""
    return torch.zeros(1000), torch.ones(n, 256) if n < 64 else torch.empty(n, 1024)


SMALL = 64 * 64 * 4 + 64 * 4  # Linear(64, 64)'s weight and bias: 16,640 B


def linear_step(layer: torch.nn.Linear) -> Callable[[int], None]:
    """Linear(64, 64) forward + backward on a batch of n, its gradients set to None first.

    Forward: the parameters, x (256 n) and the output (256 n) live, then the loss (4): SMALL + 512 n + 4.
    Backward: the output is freed (sum saves only its shape); the parameters, x, the loss, the seed (4)
    and the gradients (SMALL): 2 SMALL + 256 n + 8. Backward is the peak below n = 65, forward above.
    """

    def step(n: int) -> None:
        layer.zero_grad(set_to_none=True)
        layer(torch.ones(n, 64)).sum().backward()

    return step


def test_the_peak_that_moves_from_backward_to_forward_is_found_exactly(tracked: Tracked) -> None:
    step = linear_step(torch.nn.Linear(64, 64))
    step(1)  # the gradients exist from here on, as at every size after the first
    fit = fit_peaks(step, [1, 2, 4, 8], "64 KiB", tracked)
    # at 1-8 the backward is the peak; a line through those peaks said 125 (33,288 + 256 n <= 65,536).
    # forward: 16,644 + 512 n <= 65,536  ->  n <= 95.5
    assert fit.peaks == tuple(2 * SMALL + 256 * n + 8 for n in (1, 2, 4, 8))
    assert (fit.largest, fit.peak_bytes, fit.found, fit.exact, fit.confirmed) == (
        95,
        65_284,
        Found.TIMELINE,
        True,
        True,
    )
    assert fit.peak_bytes == SMALL + 512 * 95 + 4
    answer, above = fit.checks
    assert (answer.size, answer.peak, answer.out_of_memory, answer.steps) == (95, 65_284, False, 3)
    # held to 64 KiB, batch 96 runs out in its first step allocating the output: the parameters and x were live
    assert (above.size, above.peak, above.out_of_memory, above.steps) == (96, SMALL + 256 * 96, True, 1)
    assert fit.describe() == (
        "largest batch that fits 64 KiB: 95, peak 63.8 KiB at aten.sum.default (tests/test_fit.py:83)\n"
        "  of which 32.5 KiB was live when the fit began\n"
        "  found exactly from the timelines of sizes 1, 2, 4, 8\n"
        "  confirmed: 95 ran 3 steps within 64 KiB, 96 ran out of memory in its 1st step after 40.2 KiB"
    )


def test_state_the_first_run_made_is_taken_as_a_warm_up(tracked: Tracked) -> None:
    fit = fit_peaks(linear_step(torch.nn.Linear(64, 64)), [1, 2, 4, 8], "64 KiB", tracked)
    assert (fit.warm_up, fit.left, fit.live, fit.largest) == (SMALL, (0, 0, 0, 0), SMALL, 95)
    assert fit.describe().endswith(
        "\n  the first run left 16.2 KiB allocated (optimizer state?) and ran again as a warm-up"
    )


def test_rows_give_the_exact_answer_and_the_next_size_runs_out(tracked: Tracked) -> None:
    fit = fit_peaks(rows, [3, 5, 7], 200_000, tracked)
    assert fit.largest == (200_000 - FIXED) // ROW == 191
    assert fit.peak_bytes == FIXED + 191 * ROW == 199_584
    assert [(c.size, c.peak, c.out_of_memory) for c in fit.checks] == [(191, 199_584, False), (192, FIXED, True)]


def test_a_kernel_that_switches_beyond_the_sizes_is_searched(tracked: Tracked) -> None:
    fit = fit_peaks(switching, [1, 2, 4], 200_000, tracked)
    # the timelines say 191; run, 191 takes the 4,096 B rows and runs out, and so does 190: the largest
    # sampled size, 4, runs and 5 too; bisect between 5 and 190
    assert (fit.largest, fit.found, fit.confirmed) == (63, Found.SEARCH, True)
    assert fit.peak_bytes == FIXED + 63 * ROW
    assert [c.size for c in fit.checks] == [191, 190, 4, 5, 97, 51, 74, 62, 68, 65, 63, 64]
    assert fit.describe() == (  # a line of 123 columns wrapped between words
        "largest batch that fits 200,000 B: 63, peak 66.9 KiB at aten.ones.default (tests/test_fit.py:67)\n"
        "  of which 0 B was live when the fit began\n"
        "  searched by loops of 3 steps at 12 sizes held to the capacity (the timelines' answer, 191 fits, did not "
        "hold in a loop\n"
        "    of 3 steps)\n"
        "  confirmed: 63 ran 3 steps within 200,000 B, 64 ran out of memory in its 1st step after 3.9 KiB"
    )


def test_sizes_that_take_other_ops_are_left_out_of_the_lines(tracked: Tracked) -> None:
    fit = fit_peaks(switching, [32, 64, 128], 300_000, tracked)
    # the lines through 64 and 128: 4,000 + 4,096 n <= 300,000 -> 72, confirmed, 73 runs out
    assert (fit.largest, fit.found, fit.exact, fit.confirmed) == (72, Found.TIMELINE, False, True)
    assert fit.note == "size 32 takes other ops than 128 from event 1: aten.ones.default for aten.empty.memory_format"
    assert "  found unchecked (2 sizes) from the timelines of sizes 64, 128 (size 32 takes other ops" in fit.describe()


def test_an_answer_the_lines_cannot_reach_is_searched_below_the_switch(tracked: Tracked) -> None:
    fit = fit_peaks(switching, [32, 64, 128], 200_000, tracked)
    # the lines through 64 and 128 say 47, where the step takes 1,024 B rows: 48 fits too; 64 does not
    assert (fit.largest, fit.found) == (63, Found.SEARCH)
    assert [c.size for c in fit.checks][:2] == [47, 48]


def test_a_peak_that_grows_only_past_the_sizes_is_sampled_larger(tracked: Tracked) -> None:
    def step(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(1000), torch.ones(n // 8, 256)  # no row below 8

    fit = fit_peaks(step, [1, 2, 4], 200_000, tracked)
    assert fit.sizes == (1, 2, 4, 8)  # doubled until an event grew
    # 4,000 + 1,024 (n // 8) <= 200,000  ->  n // 8 <= 191  ->  n <= 1,535
    assert (fit.largest, fit.peak_bytes, fit.confirmed) == (1535, FIXED + 191 * ROW, True)


def test_a_step_that_ignores_n_is_refused(tracked: Tracked) -> None:
    with pytest.raises(GpuMemError) as info:
        fit_peaks(lambda n: torch.ones(1000), [1, 2, 3], "1 MiB", tracked)
    assert str(info.value) == (
        "fit: the step's peak does not grow with the batch size (3.9 KiB from size 1 to 3,072): does step(n) use n, "
        "and make its tensors on the measured device?"
    )


def test_capacity_below_batch_one_gives_none_confirmed(tracked: Tracked) -> None:
    fit = fit_peaks(rows, [4, 8, 16], FIXED + ROW - 1, tracked)
    assert (fit.largest, fit.peak_bytes, fit.confirmed) == (None, FIXED + ROW, True)
    assert fit.describe().startswith(
        "no batch fits 5,023 B: batch 1 needs 4.9 KiB at aten.ones.default (tests/test_fit.py:62)\n"
        "  of which 0 B was live"
    )
    assert fit.describe().endswith("confirmed: batch 1 ran out of memory in its 1st step after 3.9 KiB")
    assert fit_peaks(rows, [4, 8, 16], FIXED + ROW, tracked).largest == 1


def test_where_runs_cannot_be_made_the_exact_answer_is_not_confirmed(tracked: Tracked) -> None:
    fit = fit_peaks(rows, [1, 2, 4], 200_000, tracked, runs_refused="the host is small")
    assert (fit.largest, fit.confirmed, fit.checks) == (191, False, ())
    assert fit.describe().endswith(
        "\n  found exactly from the timelines of sizes 1, 2, 4\n  not confirmed: the host is small"
    )
    unconfirmed = fit_peaks(rows, [1, 2, 4], 200_000, tracked, confirm=False)
    assert unconfirmed.describe().endswith("\n  not confirmed: confirm=False")


def test_where_runs_cannot_be_made_a_search_is_refused_in_one_line(tracked: Tracked) -> None:
    with pytest.raises(GpuMemError) as info:
        fit_peaks(lambda n: torch.ones(n * n), [1, 2, 4], 200_000, tracked, tolerance=0, slack=0, runs_refused="small")
    # n^2 floats: the line through 1 and 4 (4 + 20 (n - 1)) misses size 2's 16 B by 8 B
    assert str(info.value) == (
        "fit: the sizes' bytes are not lines in n: off by up to 8 B, so the answer must be searched with real runs, "
        "but small"
    )


def test_a_backend_without_a_timeline_is_searched(tracked: Tracked) -> None:
    def untimed(fn: Callable[[], object], limit: int | None = None) -> Sample:
        sample = tracked(fn, limit)
        return Sample(sample.start, sample.peak, sample.end, sample.out_of_memory, sample.held)

    fit = fit_peaks(rows, [1, 2, 4], 200_000, untimed)
    assert (fit.largest, fit.found, fit.note) == (191, Found.SEARCH, "the backend records no timeline")


def test_a_step_that_keeps_memory_at_every_size_is_refused(tracked: Tracked) -> None:
    kept: list[torch.Tensor] = []
    with pytest.raises(GpuMemError) as info:
        fit_peaks(lambda n: kept.append(torch.ones(n, 256)), [4, 8, 16], "1 MiB", tracked)
    assert str(info.value) == (
        "fit: the step keeps memory from one size to the next (size 8 left 8.0 KiB allocated after it returned; "
        "sizes 4, 8, 16 left 4,096, 8,192, 16,384 B): each size's peak would include what earlier sizes kept; "
        "free it in the step"
    )


P = 2048 * 2048 * 4 + 2048 * 4  # Linear(2048, 2048)'s weight and bias: 16,785,408 B
ADAMW = 2 * P  # exp_avg and exp_avg_sq like each parameter (its two step counters are CPU scalars: host memory)
LIVE = P + ADAMW + P  # after a warm-up step: parameters, AdamW state and the gradients (zeroed next step)


def adamw_step(device: str) -> Callable[[int], None]:
    """A Linear(2048, 2048) + single-tensor AdamW training step on a batch of n, under a meter.

    Its absolute peak is the largest of: forward, the input x and the output (8,192 n B each) and the
    loss (4 B) over parameters and state, P + ADAMW + 16,384 n + 4; backward, x, the loss, the seed and
    the gradients, P + ADAMW + 8,192 n + 8 + P; the step, two weight-sized temporaries of AdamW's
    denominator (sqrt, then the division) over everything, LIVE + 2 x 16,777,216 = 100,696,064.
    """
    with torch.device(device):
        model = torch.nn.Linear(2048, 2048)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)

    def step(n: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        model(torch.ones(n, 2048, device=device)).sum().backward()
        optimizer.step()

    return step


def meta_rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` on the meta device, which a meta run counts (a CPU tensor there is host memory)."""
    with torch.device("meta"):
        return rows(n)


def started_meter(device: str, capacity: int | None = None, rounding: str = "none") -> Measurement:
    backend = TrackerBackend(rounding, device=device)
    backend.configure(Settings(capacity, origins=False, events=False))
    measured = Measurement(backend, "test_fit")
    measured.begin()
    return measured


def test_a_step_whose_small_sizes_peak_in_the_optimizer_is_answered_from_the_backward() -> None:
    measured = started_meter("meta")  # sizes without data: the same bytes as on cpu, nothing computed
    meter = GpuMem(measured)
    try:
        step = adamw_step("meta")
        step(1)
        fit = meter.fit(step, [8, 16, 32], "200 MiB")
    finally:
        record = measured.end()
    # at 8-32 the optimizer step is the peak at every size: one line through the peaks had slope 0 and
    # said 2,147,483,647. forward: 50,356,228 + 16,384 n <= 209,715,200  ->  n <= 9,726.5
    assert (fit.live, fit.peaks) == (LIVE, (100_696_064,) * 3)
    # at the forward's peak, the full sum of the 9,726 x 2,048 output stages its partial sums on a card (a
    # modelled kernel temporary: 1,728 B + a 4-byte semaphore on the default card)
    from pytest_gpumem.backends.tracker.kernel_temporaries import temporaries

    staging = sum(temporaries("aten.sum.default", [torch.empty(9726, 2048, device="meta")], {}, None))
    assert (fit.largest, fit.exact, fit.confirmed) == (9726, True, True)
    assert fit.peak_bytes == P + ADAMW + 16_384 * 9726 + 4 + staging == 209_708_744
    answer, above = fit.checks
    assert (answer.size, answer.out_of_memory, above.size, above.out_of_memory) == (9726, False, 9727, True)
    # batch 9,727 ran out allocating forward's output: x (8,192 x 9,727 B) over the parameters and state
    assert above.peak == P + ADAMW + 8192 * 9727
    assert record.fits == (fit.describe(),) and record.info == {}


def test_the_fit_holds_its_runs_to_its_own_capacity_under_a_smaller_test_capacity() -> None:
    measured = started_meter("meta", capacity=64 * 2**20)  # max_memory(capacity="64 MiB") on the test
    meter = GpuMem(measured)
    backend = measured.backend
    assert isinstance(backend, TrackerBackend)
    try:
        fit = meter.fit(meta_rows, [1, 2, 4], "1 GiB")
        assert backend.capacity == 64 * 2**20  # the test's own capacity holds again after the fit
    finally:
        measured.end()
    assert (fit.largest, fit.confirmed) == ((2**30 - FIXED) // ROW, True)


def test_on_the_allocators_model_a_batch_fits_on_reserved_memory() -> None:
    measured = started_meter("meta", rounding="cuda")  # the default on meta: what a card would reserve
    meter = GpuMem(measured)
    try:
        fit = meter.fit(meta_rows, [1, 2, 4], "20 MiB")
    finally:
        measured.end()
    # up to 1,024 rows (1 MiB) the rows and the zeros share one 2 MiB segment of the small pool; more rows
    # take a 20 MiB segment of the large pool, and 22 MiB are reserved: no peak grows up to 1,024, and 2,048
    # runs out. Allocated bytes alone: 20,476. (From 10 MiB of rows on a segment is their size rounded up
    # to 2 MiB: 18,432 rows reserve 20 MiB and fit too; the search stays below the size that ran out.)
    assert (fit.largest, fit.peak_bytes, fit.reserved, fit.found, fit.confirmed) == (
        1024,
        2**21,
        True,
        Found.SEARCH,
        True,
    )
    assert fit.describe().startswith("largest batch that fits 20 MiB: 1,024, peak 2.0 MiB reserved\n  peak at aten.")
    assert fit.describe().endswith(
        "confirmed: 1,024 ran 3 steps within 20 MiB, 1,025 ran out of memory in its 1st step after 2.0 MiB"
    )


def test_a_cpu_fit_larger_than_the_host_is_not_run() -> None:
    backend = TrackerBackend()
    backend.start()
    try:
        assert runs_refused(backend, 2**30, available=2**31) is None
        assert runs_refused(backend, 80 * 2**30, available=20 * 2**30) == (
            "on the CPU the step allocates for real and the host has 20.0 GiB available, less than the 80.0 GiB the "
            "capacity allows; fit on the meta device to run a larger card's sizes"
        )
    finally:
        backend.stop()
    assert runs_refused(TrackerBackend(device="meta"), 80 * 2**30, available=0) is None


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ([4], "fit needs at least 2 distinct sizes (3 to check the lines), got [4]"),
        ([4, 4, 4], "fit needs at least 2 distinct sizes (3 to check the lines), got [4, 4, 4]"),
        ([0, 1, 2], "fit sizes must be integers from 1 to 2,147,483,647, got 0 in [0, 1, 2]"),
        ([-1, 1, 2], "fit sizes must be integers from 1 to 2,147,483,647, got -1 in [-1, 1, 2]"),
        ([1, 2.5, 3], "fit sizes must be positive integers, got 2.5 in [1, 2.5, 3]"),
        ([1, True, 3], "fit sizes must be positive integers, got True in [1, True, 3]"),
        (8, "fit sizes must be a list of positive integers, got 8"),
        ("123", "fit sizes must be a list of positive integers, got '123'"),
        ([1, None, 3], "fit sizes must be positive integers, got None in [1, None, 3]"),
        ([1, 2, 2**31], "fit sizes must be integers from 1 to 2,147,483,647, got 2147483648 in [1, 2, 2147483648]"),
        ([1, 10**400], "fit sizes must be integers from 1 to 2,147,483,647, got 1000000000000...0000000000000 (401 "),
    ],
)
def test_bad_sizes_are_refused_before_the_step_runs(sizes: object, expected: str, tracked: Tracked) -> None:
    calls: list[int] = []
    with pytest.raises(GpuMemError) as info:
        fit_peaks(calls.append, sizes, "1 GiB", tracked)  # type: ignore[arg-type]
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)
    assert len(str(info.value)) < 200
    assert calls == []


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"capacity": "80 XB"}, "unknown unit"),
        ({"capacity": -1}, "size must not be negative"),
        ({"tolerance": float("nan")}, "fit tolerance must be a finite number >= 0, got nan"),
        ({"tolerance": -0.1}, "fit tolerance must be a finite number >= 0, got -0.1"),
        ({"slack": 1.5}, "fit slack must be an int >= 0 (bytes), got 1.5"),
        ({"confirm": "yes"}, "fit confirm= must be True or False, got 'yes'"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(kwargs: dict[str, Any], expected: str, tracked: Tracked) -> None:
    arguments: dict[str, Any] = {"capacity": 100, **kwargs}
    with pytest.raises(GpuMemError) as info:
        fit_peaks(rows, [1, 2, 3], measure=tracked, **arguments)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_a_step_that_cannot_be_called_with_a_batch_size_fails_its_test_in_one_line(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import torch

        def test_none(gpumem):
            gpumem.fit(None, [1, 2, 4], "1 GB")

        def test_no_argument(gpumem):
            gpumem.fit(lambda: torch.ones(10), [1, 2, 4], "1 GB")

        def test_two_arguments(gpumem):
            def step(n, model):
                pass
            gpumem.fit(step, [1, 2, 4], "1 GB")
        """
    )
    result = tracker.runpytest("-p", "no:randomly")
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines(
        [
            "*::test_none: fit step must be a function of the batch size, called as step(n), got None",
            "*::test_no_argument: fit step must take the batch size as its one argument, called as step(n); "
            "test_no_argument.<locals>.<lambda>() cannot be",
            "*::test_two_arguments: fit step must take the batch size as its one argument, called as step(n); "
            "test_two_arguments.<locals>.step(n, model) cannot be",
        ]
    )
    result.stdout.no_fnmatch_line("*TypeError*")


def test_integer_like_sizes_are_accepted(tracked: Tracked) -> None:
    fit = fit_peaks(rows, (n for n in np.array([1, 2, 3])), "1 MiB", tracked)
    assert fit.sizes == (1, 2, 3) and all(type(n) is int for n in fit.sizes)


def test_result_is_frozen(tracked: Tracked) -> None:
    fit = fit_peaks(rows, [1, 2, 3], "1 MiB", tracked)
    assert isinstance(fit, BatchFit) and fit.predict(10) == FIXED + 10 * ROW
    with pytest.raises(AttributeError):
        fit.largest = 1  # type: ignore[misc]


FRESH = """
import os, pathlib, pytest, torch
from torch.utils.checkpoint import checkpoint

def checkpointed():
    with torch.device("meta"):
        blocks = [torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
                  for _ in range(4)]

    def step(n):
        x = torch.randn(n, 512, device="meta")
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False)
        x.sum().backward()
        for block in blocks:
            block.zero_grad(set_to_none=True)

    return step

@pytest.mark.max_memory(device="meta", tolerance=5)
def test_fit(gpumem):
    step = checkpointed()
    step(8)  # the warm-up a fresh test makes too
    found = gpumem.fit(step, [8, 16, 32], "256 MiB")
    pathlib.Path("answer").write_text(str(found.largest))
    pathlib.Path("expandable").write_text(str(found.expandable))

@pytest.mark.parametrize("above", [0, 1])
@pytest.mark.max_memory(capacity="256 MiB", device="meta")
def test_fresh(gpumem, above):
    expandable = "expandable" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    n = int(pathlib.Path("expandable" if expandable else "answer").read_text()) + above
    step = checkpointed()
    step(8)
    for _ in range(3):
        step(n)
"""


@pytest.mark.slow
def test_a_fits_answer_runs_in_a_fresh_test_and_the_next_size_does_not(
    tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpointed blocks on meta: each loop of the fit starts from the allocator's state when it began (the
    warm-up's cached segments kept) and without the gradients a loop that ran out of memory left; its answer
    with expandable segments runs, and the next size runs out, in a fresh test that set them."""
    tracker.makepyfile(FRESH)
    result = tracker.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=2, failed=1)
    ran_out = "out of memory in the call *past max_memory(capacity='256 MiB')*"
    result.stdout.fnmatch_lines(["*_ test_fresh[[]1[]] _*", ran_out])
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    result = tracker.runpytest("-p", "no:randomly", "-k", "test_fresh")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*_ test_fresh[[]1[]] _*", ran_out])


def test_the_fixture_fits_a_batch_size(tracker: pytest.Pytester, reported: Reported) -> None:
    tracker.makepyfile(
        """
        import torch

        def step(n):
            fixed = torch.ones(1000)  # 4,000 B
            return fixed, torch.ones(n, 256)  # 1,024 B per item

        def test_fits(gpumem):
            before = torch.ones(5000)  # 20,000 B live when the fit begins
            found = gpumem.fit(step, sizes=[1, 2, 4, 8], capacity=200_000)
            # (200,000 - 24,000) / 1,024 = 171.9; batch 172 runs out allocating its rows, after `fixed`
            assert (found.live, found.largest, found.peak_bytes) == (20_000, 171, 199_104)
            assert [gpumem.peak(f"fit[{i}]") for i in range(6)] == [5024, 6048, 8096, 12192, 179_104, 4000]

        def test_not_lines(gpumem):
            gpumem.fit(lambda n: torch.ones(n * n * 64), sizes=[8, 16, 32, 64], capacity="4 MiB")

        def broken(n):
            raise ValueError(f"no batch of {n}")

        def test_step_raises(gpumem):
            gpumem.fit(broken, sizes=[1, 2, 3], capacity="1 GiB")
        """
    )
    result = tracker.runpytest("-p", "no:randomly", "--gpumem-json=out.json")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["E *ValueError: no batch of 1"])
    result.stdout.no_fnmatch_line("*pytest_gpumem/*")  # the user's frames only
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    tests = reported()
    assert tests["test_fits"]["fits"] == [
        "largest batch that fits 200,000 B: 171, peak 194.4 KiB\n"  # 116 columns with where the peak was made
        "  peak at aten.ones.default (test_the_fixture_fits_a_batch_size.py:5)\n"
        "  of which 19.5 KiB was live when the fit began\n"
        "  found exactly from the timelines of sizes 1, 2, 4, 8\n"
        "  confirmed: 171 ran 3 steps within 200,000 B, 172 ran out of memory in its 1st step after 23.4 KiB"
    ]
    # 64 n^2 floats: the sizes' bytes are no lines; searched: 64 n^2 x 4 <= 4 MiB  ->  n <= 128
    (searched,) = tests["test_not_lines"]["fits"]
    assert searched.startswith("largest batch that fits 4 MiB: 128, peak 4.0 MiB\n  peak at aten.ones.default")
    assert "the sizes' bytes are not lines in n: off by up to" in searched


def test_two_fits_in_one_test_are_measured_apart(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import torch

        def test_two(gpumem):
            big = gpumem.fit(lambda n: torch.ones(n * 1000), sizes=[1, 2, 3], capacity="1 MiB", confirm=False)
            small = gpumem.fit(lambda n: torch.ones(n * 10), sizes=[1, 2, 3], capacity="1 MiB", confirm=False)
            assert big.peaks == (4000, 8000, 12000)
            assert small.peaks == (40, 80, 120)
            assert small.largest == 1024**2 // 40
            assert set(gpumem.phases) == {"fit[0]", "fit[1]", "fit[2]", "fit#2[0]", "fit#2[1]", "fit#2[2]"}
        """
    )
    tracker.runpytest().assert_outcomes(passed=1)


class Reserved(Tracked):
    """`Tracked` on meta under the allocator's model (meta's default), measured as the meter measures a
    run there: from an empty cache, its peak of reserved bytes (what a card runs out on)."""

    def __init__(self) -> None:
        super().__init__("meta")

    def __call__(self, fn: Callable[[], object], limit: int | None = None) -> Sample:
        backend, out_of_memory = self.backend, False
        backend.empty_cache()
        start = backend.current().allocated
        backend.reset_peak()
        with backend.held_to(limit) if limit is not None else contextlib.nullcontext(), backend.timeline() as got:
            try:
                fn()
            except torch.OutOfMemoryError as exc:
                exc.__traceback__ = None  # its frames hold the step's tensors
                out_of_memory = True
        peak, end = backend.peak().reserved, backend.current().allocated
        assert peak is not None
        return Sample(start, peak, end, out_of_memory, limit is not None, got(), reserved=True)


def guide_step(warm: bool = False) -> Callable[[int], None]:
    """The fit guide's 24 GB step 8 times narrower and with an 8 times shorter sequence, on meta: Linear(512,
    2,048), GELU, Linear(2,048, 512) on n x 256 x 512 (512 KiB a row in, 2 MiB a row hidden) + AdamW;
    `warm`: one step of batch 1 first, so that AdamW's state exists before the fit (else the fit's make it)."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
    optimizer = torch.optim.AdamW(model.parameters())

    def step(n: int) -> None:
        model(torch.randn(n, 256, 512, device="meta")).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if warm:
        step(1)
    return step


def ran_out_in(n: int, capacity: int, steps: int = 3, warm: bool = False) -> int | None:
    """A fresh process's training loop, independent of the fit: a new meta tracker, the guide's step built on
    it, `steps` steps of n held to `capacity`; the step that ran out of memory (None: all ran)."""
    backend = TrackerBackend(device="meta")
    backend.start()
    try:
        step = guide_step(warm)
        with backend.held_to(capacity):
            for i in range(1, steps + 1):
                try:
                    step(n)
                except torch.OutOfMemoryError as exc:
                    exc.__traceback__ = None
                    return i
        return None
    finally:
        backend.stop()


GUIDE_CAPACITY = 128 * 2**20


def fit_guide_step(capacity: str, warm: bool = False) -> BatchFit:
    """`guide_step` fitted on its own tracker (stopped before any loop runs apart from it), the backend
    given as the meter gives it: the answer with expandable segments is found too."""
    measure = Reserved()
    try:
        return fit_peaks(guide_step(warm), [1, 2, 3], capacity, measure, backend=measure.backend)
    finally:
        measure.backend.stop()


def test_the_answer_runs_three_steps_in_a_loop_and_the_next_size_runs_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    fit = fit_guide_step("128 MiB")
    # Linear(512, 2,048) and Linear(2,048, 512): 2,099,712 parameters of 4 B; the first run left AdamW's two
    # moments of each and the two cuBLAS workspaces (8 MiB + 128 KiB each): 2 x 8,398,848 + 2 x 8,519,680
    assert (fit.live, fit.warm_up) == (8_398_848, 33_837_056)
    # AdamW's state is made in each loop's first step, among its activations, and the later steps run on
    # the cache the first left: 8 x 512 KiB rows in and 8 x 2 MiB hidden (with the loss's reduction staging
    # its partial sums, a kernel temporary) no longer fit beside it
    assert (fit.largest, fit.found, fit.confirmed) == (7, Found.SEARCH, True)
    loops = {c.size: (c.out_of_memory, c.steps) for c in fit.checks}
    assert (loops[7], loops[8]) == ((False, 3), (True, 3))
    # a fresh process's loop, run apart from the fit, agrees: 7 runs 3 steps, 8 runs out in its third
    assert (ran_out_in(7, GUIDE_CAPACITY), ran_out_in(8, GUIDE_CAPACITY)) == (None, 3)
    # judged on a first step alone, from an empty cache, the answer would have been 11
    assert (ran_out_in(11, GUIDE_CAPACITY, steps=1), ran_out_in(12, GUIDE_CAPACITY, steps=1)) == (None, 1)
    assert fit.describe().endswith(
        "  confirmed: 7 ran 3 steps within 128 MiB, 8 ran out of memory in its 3rd step after 126.0 MiB\n"
        "  the first run left 32.3 MiB allocated (optimizer state, cuBLAS workspaces?) and ran again as a warm-up\n"
        "  fragmentation decides it: with expandable segments: 8; without: 7"
    )
    # a fresh process that sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True runs 8 and runs out at 9
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert (ran_out_in(8, GUIDE_CAPACITY), ran_out_in(9, GUIDE_CAPACITY)) == (None, 1)


def test_optimizer_state_the_fit_made_is_made_again_in_each_loops_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    # AdamW's state is the fit's own (its first run made it): each loop forgets it and makes it again among
    # its own activations, as a fresh process's loop does: 16 runs 3 steps, 17 runs out in its second
    assert fit_guide_step("208 MiB").largest == 16
    assert (ran_out_in(16, 208 * 2**20), ran_out_in(17, 208 * 2**20)) == (None, 2)
    # made before the fit, among batch 1's activations, the state is live when it begins and stays where
    # it lies: 15, as that process's loop shows
    assert fit_guide_step("208 MiB", warm=True).largest == 15
    assert (ran_out_in(15, 208 * 2**20, warm=True), ran_out_in(16, 208 * 2**20, warm=True)) == (None, 1)


def squares(called: list[int]) -> Callable[[int], torch.Tensor]:
    """A step that makes an n x n float32 tensor (4 n^2 B) on the CPU, recording the sizes it ran."""

    def step(n: int) -> torch.Tensor:
        called.append(n)
        return torch.ones(n, n)

    return step


def test_a_step_that_grows_as_n_squared_runs_no_size_past_its_curve(
    tracked: Tracked, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pytest_gpumem.measure.fit_search.host_available", lambda: 64 * 2**20)
    called: list[int] = []
    fit = fit_peaks(squares(called), [8, 16, 32], "4 MiB", tracked, backend=tracked.backend)
    # 256, 1,024 and 4,096 B: the line through 8 and 32 (160 B a row) misses 16 by 512 B, within the
    # tolerance, and says 26,220 (an n x n tensor of 2.6 GiB); the curve through the three says 4 n^2:
    # 1,024 (4 MiB), run 3 times, and 1,025 runs out
    assert (fit.largest, fit.peak_bytes, fit.found) == (1024, 4 * 2**20, Found.SEARCH)
    assert called == [8, 16, 32, 1024, 1024, 1024, 1025]
    assert fit.note == "the sizes' bytes curve away from the lines by up to 512 B: 26,220 was not run, 1,024 was"


def test_on_the_cpu_a_run_past_what_the_host_can_give_is_refused_before_it_runs(
    tracked: Tracked, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pytest_gpumem.measure.fit_search.host_available", lambda: 2**21)
    called: list[int] = []
    with pytest.raises(GpuMemError) as info:
        fit_peaks(squares(called), [8, 16, 32], "4 MiB", tracked, backend=tracked.backend)
    # the host gives 80% of its 2 MiB available to the runs: 1.6 MiB, and batch 1,024 would take 4 MiB
    assert str(info.value) == (
        "fit: a run of size 1,024 would take about 4.0 MiB of the host's memory (the sampled sizes extrapolated), "
        "more than the 1.6 MiB its runs may take (80% of what it has available): fit on the meta device, whose "
        "runs allocate nothing"
    )
    assert called == [8, 16, 32]  # the sampled sizes only


def test_the_tracker_serves_a_block_with_expandable_segments_its_live_storages_placed_anew(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert TrackerBackend().expandable_segments() is None  # the CPU's exact bytes: no allocator to change
    backend = TrackerBackend(device="meta")
    backend.start()
    try:
        kept = torch.empty(12 * 2**20, dtype=torch.uint8, device="meta")
        # 12 MiB takes a segment of its own size (10 MiB or more: rounded up to 2 MiB); an expandable
        # segment maps 20 MiB pages
        assert (backend.current().allocated, backend.current().reserved) == (12 * 2**20, 12 * 2**20)
        serving = backend.expandable_segments()
        assert serving is not None
        with serving:
            assert (backend.current().allocated, backend.current().reserved) == (12 * 2**20, 20 * 2**20)
        assert (backend.current().allocated, backend.current().reserved) == (12 * 2**20, 12 * 2**20)
        del kept
        assert backend.current().allocated == 0
    finally:
        backend.stop()


def test_a_restored_allocator_state_frees_what_was_freed_since_it_was_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fit's loop starts from the state it began with where a gradient it forgot was live then: the
    gradient's block is freed in it, and stays cached (as the step's zero_grad leaves it in a fresh test)."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    backend = TrackerBackend(device="meta")
    backend.start()
    try:
        kept = torch.empty(12 * 2**20, dtype=torch.uint8, device="meta")  # 12 MiB: a segment of its own size
        freed = torch.empty(12 * 2**20, dtype=torch.uint8, device="meta")
        state = backend.allocator_state()
        del freed
        backend.empty_cache()  # the fit's runs gave its segment back
        assert (backend.current().allocated, backend.current().reserved) == (12 * 2**20, 12 * 2**20)
        backend.start_afresh(state)
        assert (backend.current().allocated, backend.current().reserved) == (12 * 2**20, 24 * 2**20)
        again = torch.empty(12 * 2**20, dtype=torch.uint8, device="meta")  # served from the freed block
        assert (backend.current().allocated, backend.current().reserved) == (24 * 2**20, 24 * 2**20)
        del kept
        backend.start_afresh(state)  # `again` was not live then: what is live placed anew, with no cache
        assert (backend.current().allocated, backend.current().reserved) == (12 * 2**20, 12 * 2**20)
        del again
    finally:
        backend.stop()
