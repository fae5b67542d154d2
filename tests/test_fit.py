"""fit_peaks: the largest batch that fits, from absolute peaks measured by the exact tracker at a few sizes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.measure.fit import MAX_BATCH, BatchFit, Sample, fit_measured, fit_peaks, fit_samples, least_squares
from pytest_gpumem.measure.meter import GpuMem

Reported = Callable[..., dict[str, dict[str, Any]]]

FIXED = 1000 * 4  # torch.zeros(1000), float32
ROW = 256 * 4  # one row of torch.ones(n, 256), float32


class Tracked:
    """A `measure` over one tracker kept running for a whole fit, as the meter's is (nothing live before
    it), each call held to `limit` bytes if given."""

    def __init__(self) -> None:
        self.backend = TrackerBackend()
        self.backend.start()

    def __call__(self, fn: Callable[[], object], limit: int | None = None) -> Sample:
        backend, out_of_memory = self.backend, False
        start = backend.current().allocated
        backend.reset_peak()
        with backend.held_to(limit) if limit is not None else contextlib.nullcontext():
            try:
                fn()
            except torch.OutOfMemoryError:
                out_of_memory = True
        return Sample(start, backend.peak().allocated, backend.current().allocated, out_of_memory, limit is not None)


@pytest.fixture
def tracked() -> Iterator[Tracked]:
    measure = Tracked()
    yield measure
    measure.backend.stop()


def tracked_peak(fn: Callable[[], object]) -> int:
    """The peak of one call of `fn` under a fresh tracker."""
    measure = Tracked()
    try:
        return measure(fn).peak
    finally:
        measure.backend.stop()


def rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both tensors live at once: peak = FIXED + ROW * n."""
    return torch.zeros(1000), torch.ones(n, 256)


def square(n: int) -> torch.Tensor:
    """4 n^2 bytes: not a line."""
    return torch.ones(n, n)


def linear_step(layer: torch.nn.Linear) -> Callable[[int], None]:
    """Linear(64, 64) forward + backward on a batch of n (the input does not require grad).

    Forward: x (256n) and the output (256n) live together, then the loss (4): peak 512n + 4.
    Backward: the output is already freed (sum saves only its shape); x (256n) and the loss (4) live,
    with the seed (4), grad of the weight 64x64 (16,384) and of the bias (256): peak 256n + 16,648.
    The step's peak is the larger of the two lines: backward's below n = 66, forward's from n = 66.
    """

    def step(n: int) -> None:
        layer.zero_grad(set_to_none=True)
        layer(torch.ones(n, 64)).sum().backward()

    return step


def test_recovers_fixed_and_per_item_bytes_exactly(tracked: Tracked) -> None:
    fit = fit_peaks(rows, [1, 2, 4, 8], "1 MiB", tracked)
    assert fit.peaks == (FIXED + ROW, FIXED + 2 * ROW, FIXED + 4 * ROW, FIXED + 8 * ROW)
    assert (fit.fixed, fit.per_item, fit.residual) == (Fraction(FIXED), Fraction(ROW), 0)
    # (1,048,576 - 4,000) / 1,024 = 1,020.09...
    assert fit.largest == 1020
    assert fit.predicted_peak == FIXED + 1020 * ROW == 1_048_480
    assert fit.checked and not fit.capped


def test_largest_batch_fits_and_the_next_does_not(tracked: Tracked) -> None:
    fit = fit_peaks(rows, [3, 5, 7], 200_000, tracked)
    assert fit.largest == (200_000 - FIXED) // ROW == 191
    assert tracked_peak(lambda: rows(191)) == fit.predicted_peak == 199_584 <= 200_000
    assert tracked_peak(lambda: rows(192)) == 200_608 > 200_000


SMALL = 64 * 64 * 4 + 64 * 4  # Linear(64, 64)'s parameters, made after the tracker started: live


def test_linear_layer_above_the_crossing(tracked: Tracked) -> None:
    step = linear_step(torch.nn.Linear(64, 64))
    fit = fit_peaks(step, [100, 200, 400], "1 MiB", tracked, confirm=True)
    # forward's line over the parameters (the gradients of the size before are set to None first)
    assert (fit.fixed, fit.per_item, fit.residual, fit.live) == (Fraction(SMALL + 4), Fraction(512), 0, SMALL)
    # 16,644 + 512 n <= 1,048,576  ->  n <= 2,015.49...
    assert fit.largest == 2015
    answer, above = fit.checks
    assert (
        (answer.size, answer.peak, answer.out_of_memory)
        == (2015, 16_644 + 512 * 2015, False)
        == (2015, 1_048_324, False)
    )
    # held to 1 MiB, batch 2,016 runs out allocating the output: the parameters and x (256 x 2,016 B) were live
    assert (above.size, above.peak, above.out_of_memory) == (2016, SMALL + 256 * 2016, True)


def test_linear_layer_below_the_crossing_is_exact_but_refused_when_confirmed(tracked: Tracked) -> None:
    step = linear_step(torch.nn.Linear(64, 64))
    fit = fit_peaks(step, [1, 2, 4, 8], "64 KiB", tracked)
    # backward's line: the parameters, x, the loss and the seed (4 B each) and the gradients (SMALL)
    assert (fit.fixed, fit.per_item, fit.residual) == (Fraction(2 * SMALL + 8), Fraction(256), 0)
    assert fit.largest == (65_536 - 33_288) // 256 == 125  # but at 125 forward's line is the peak:
    with pytest.raises(GpuMemError) as info:
        fit_peaks(step, [1, 2, 4, 8], "64 KiB", tracked, confirm=True)
    message = str(info.value)
    assert "\n" not in message
    # held to 64 KiB: the parameters and x (256 x 125 B) are live when the output (as large as x) is refused
    assert message == (
        "the line fitted at sizes 1, 2, 4, 8 predicts batch 125 fits 64 KiB (65,536 B) with a peak of 65,288 B, "
        f"but run under it the step ran out of memory after {SMALL + 256 * 125:,} B: the peak is not linear beyond "
        "the measured sizes; measure sizes nearer the answer"
    )


def test_sizes_on_both_sides_of_the_crossing_are_refused(tracked: Tracked) -> None:
    step = linear_step(torch.nn.Linear(64, 64))
    with pytest.raises(GpuMemError, match="not linear"):
        fit_peaks(step, [1, 2, 64, 128], "1 MiB", tracked)


def test_non_linear_peak_is_refused_in_one_line(tracked: Tracked) -> None:
    with pytest.raises(GpuMemError) as info:
        fit_peaks(square, [64, 128, 256], "1 GiB", tracked)
    message = str(info.value)
    assert "\n" not in message
    # peaks 4 n^2; the least-squares line through (64, 16,384), (128, 65,536), (256, 262,144) has
    # b = (3 * 76,546,048 - 448 * 344,064) / (3 * 86,016 - 448^2) = 9,216 / 7 and a = -81,920; its
    # residuals are +14,043.4, -21,065.1, +7,021.7 bytes: the largest, rounded up, is 21,066.
    assert message == (
        "peak is not linear in the batch size, refusing to extrapolate: sizes 64, 128, 256 gave peaks "
        "16,384, 65,536, 262,144 B; the best line misses by 21,066 B "
        "(allowed 0.01 x largest peak + 4,096 B = 6,717 B)"
    )


def test_a_looser_tolerance_accepts_the_same_peaks() -> None:
    fit = fit_measured([64, 128, 256], [16_384, 65_536, 262_144], "1 GiB", tolerance=0.1)
    assert fit.residual == 21_066
    assert fit.per_item == Fraction(9_216, 7)
    assert "largest residual 20.6 KiB" in fit.describe()


def test_capacity_strings_and_ints_agree() -> None:
    peaks = [FIXED + ROW * n for n in (1, 2, 3)]
    by_text = fit_measured([1, 2, 3], peaks, "80 GiB")
    by_int = fit_measured([1, 2, 3], peaks, 80 * 1024**3)
    assert (by_text.largest, by_text.predicted_peak) == (by_int.largest, by_int.predicted_peak)
    assert by_text.largest == (80 * 1024**3 - FIXED) // ROW == 83_886_076
    assert by_text.describe() == (
        "largest batch that fits 80 GiB: 83,886,076 (predicted peak 80.0 GiB, counting the 0 B allocated "
        "when the fit began; peak = 3.9 KiB + 1.0 KiB x n, fit exact)"
    )


def test_capacity_below_the_smallest_size_gives_none(tracked: Tracked) -> None:
    fit = fit_peaks(rows, [4, 8, 16], FIXED + 4 * ROW - 1, tracked)
    assert fit.largest is None and fit.predicted_peak is None
    assert fit.describe() == (
        "no measured batch fits 8,095 B: the smallest, 4, needs 7.9 KiB, counting the 0 B allocated when the fit "
        "began (peak = 3.9 KiB + 1.0 KiB x n, fit exact)"
    )
    assert fit_peaks(rows, [4, 8, 16], FIXED + 4 * ROW, tracked).largest == 4


def test_peak_that_does_not_grow_is_capped() -> None:
    fit = fit_measured([1, 2, 3], [5_000, 5_000, 5_000], "1 MiB")
    assert (fit.largest, fit.predicted_peak, fit.capped) == (MAX_BATCH, 5_000, True)
    assert fit.describe().endswith("capped at 2,147,483,647: the peak does not reach 1 MiB)")


def test_two_sizes_fit_but_are_unchecked() -> None:
    fit = fit_measured([2, 4], [10, 30], 100)
    assert (fit.fixed, fit.per_item, fit.largest, fit.predicted_peak) == (Fraction(-10), Fraction(10), 11, 100)
    assert not fit.checked
    assert "2 sizes, linearity unchecked" in fit.describe()


def test_least_squares_is_exact_rational() -> None:
    assert least_squares([1, 2, 3], [1, 2, 4]) == (Fraction(-2, 3), Fraction(3, 2))


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ([4], "fit needs at least 2 distinct sizes (3 to check linearity), got [4]"),
        ([4, 4, 4], "fit needs at least 2 distinct sizes (3 to check linearity), got [4, 4, 4]"),
        ([0, 1, 2], "fit sizes must be integers from 1 to 2,147,483,647, got 0 in [0, 1, 2]"),
        ([-1, 1, 2], "fit sizes must be integers from 1 to 2,147,483,647, got -1 in [-1, 1, 2]"),
        ([1, 2.5, 3], "fit sizes must be positive integers, got 2.5 in [1, 2.5, 3]"),
        ([1, True, 3], "fit sizes must be positive integers, got True in [1, True, 3]"),
    ],
)
def test_bad_sizes_are_refused_in_one_line(sizes: list[int], expected: str, tracked: Tracked) -> None:
    calls: list[int] = []
    with pytest.raises(GpuMemError) as info:
        fit_peaks(calls.append, sizes, "1 GiB", tracked)
    assert str(info.value) == expected
    assert calls == []  # refused before measuring anything


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"capacity": "80 XB"}, "unknown unit"),
        ({"capacity": -1}, "size must not be negative"),
        ({"tolerance": float("nan")}, "fit tolerance must be a finite number >= 0, got nan"),
        ({"tolerance": -0.1}, "fit tolerance must be a finite number >= 0, got -0.1"),
        ({"slack": 1.5}, "fit slack must be an int >= 0 (bytes), got 1.5"),
        ({"peaks": [1, 2]}, "fit needs one peak per size: 3 sizes, 2 peaks"),
        ({"peaks": [1, -2, 3]}, "fit: the measured peak at size 2 must be an int >= 0 (bytes), got -2"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(kwargs: dict[str, object], expected: str) -> None:
    arguments: dict[str, object] = {"sizes": [1, 2, 3], "peaks": [1, 2, 3], "capacity": 100, **kwargs}
    with pytest.raises(GpuMemError) as info:
        fit_measured(**arguments)  # type: ignore[arg-type]
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_result_is_frozen() -> None:
    fit = fit_measured([1, 2, 3], [1, 2, 3], 100)
    assert isinstance(fit, BatchFit)
    with pytest.raises(AttributeError):
        fit.largest = 1  # type: ignore[misc]


P = 2048 * 2048 * 4 + 2048 * 4  # Linear(2048, 2048)'s weight and bias, float32: 16,785,408 B
ADAMW = 2 * P + 2 * 4  # exp_avg and exp_avg_sq like each parameter, and two fp32 step counters
LIVE = P + ADAMW + P  # after a warm-up step: parameters, AdamW state and the gradients (zeroed next step)


def adamw_step(device: str) -> Callable[[int], None]:
    """A Linear(2048, 2048) + single-tensor AdamW training step on a batch of n, warmed up, under a meter.

    Its absolute peak is the largest of: forward, the input x and the output (8,192 n B each) and the
    loss (4 B) over parameters and state, P + ADAMW + 16,384 n + 4; backward, x, the loss, the seed and
    the gradients, P + ADAMW + 8,192 n + 8 + P; the step, two weight-sized temporaries of AdamW's
    denominator (sqrt, then the division) over everything, LIVE + 2 x 16,777,216 = 100,696,072.
    """
    with torch.device(device):
        model = torch.nn.Linear(2048, 2048)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)

    def step(n: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        model(torch.ones(n, 2048, device=device)).sum().backward()
        optimizer.step()

    return step


def started_meter(device: str) -> GpuMem:
    meter = GpuMem(TrackerBackend(device=device), "test_fit")
    meter.begin_call()
    return meter


def test_what_is_live_before_the_fit_counts_against_the_capacity() -> None:
    meter = started_meter("cpu")
    try:
        step = adamw_step("cpu")  # built inside the measured call, as a test does
        step(1)
        # 64 MiB + 100 rows of activations: the old fit, peaks above each phase's start, said 2,147,483,647
        fit = meter.fit(step, [1, 2, 3], 64 * 2**20 + 100 * 16_384)
    finally:
        meter.end_call()
    assert (fit.live, fit.peaks, fit.left) == (LIVE, (100_696_072,) * 3, (0, 0, 0)) == (67_141_640, fit.peaks, fit.left)
    assert fit.largest is None  # the optimizer step alone needs 96 MiB
    assert fit.describe() == (
        "no measured batch fits 68,747,264 B: the smallest, 1, needs 96.0 MiB, counting the 64.0 MiB allocated "
        "when the fit began (peak = 96.0 MiB + 0 B x n, fit exact)"
    )


def test_the_answer_fits_under_the_capacity_and_the_next_size_runs_out() -> None:
    meter = started_meter("meta")  # sizes without data: the same bytes as on cpu, nothing computed
    try:
        step = adamw_step("meta")
        step(1)
        fit = meter.fit(step, [8192, 16384, 32768], "200 MiB", confirm=True)
    finally:
        meter.end_call()
    # forward's line from n = 3,073 on: P + ADAMW + 16,384 n + 4 = 50,356,236 + 16,384 n
    assert (fit.fixed, fit.per_item, fit.residual, fit.live) == (Fraction(P + ADAMW + 4), Fraction(16_384), 0, LIVE)
    # (209,715,200 - 50,356,236) / 16,384 = 9,726.5 (peaks above each phase's start would say 13,824)
    assert fit.largest == 9726 and fit.predicted_peak == 50_356_236 + 16_384 * 9726 == 209_707_020
    answer, above = fit.checks
    assert (answer.size, answer.peak, answer.out_of_memory, answer.enforced) == (9726, 209_707_020, False, True)
    assert (above.size, above.out_of_memory, above.enforced) == (9727, True, True)
    # batch 9,727 ran out allocating forward's output: x (8,192 x 9,727 B) over the parameters and state
    assert above.peak == P + ADAMW + 8192 * 9727 == 130_039_816
    assert fit.describe().endswith(
        "batch 9,726 ran within the capacity, peak 200.0 MiB; batch 9,727 ran out of memory after 124.0 MiB"
    )


def test_a_step_not_warmed_up_is_refused_with_the_reason() -> None:
    meter = started_meter("meta")
    try:
        with pytest.raises(GpuMemError) as info:
            meter.fit(adamw_step("meta"), [8192, 16384, 32768], "1 GiB")
    finally:
        meter.end_call()
    message = str(info.value)
    # the first size made the gradients and AdamW's state and kept them: 16,785,408 + 33,570,824 B
    assert message.startswith("peak is not linear in the batch size, refusing to extrapolate: sizes 8,192, 16,384")
    assert message.endswith(
        "; the first size left 48.0 MiB behind (optimizer state?): warm the step up first (run it once before the fit)"
    )


def test_a_step_that_keeps_memory_at_every_size_is_refused() -> None:
    kept: list[torch.Tensor] = []
    samples = [Sample(0, 1000, 0), Sample(0, 2000, 400), Sample(400, 3400, 1200)]
    with pytest.raises(GpuMemError) as info:
        fit_samples([1, 2, 3], samples, "1 MiB", slack=0, tolerance=0)
    assert str(info.value) == (
        "fit: the step keeps memory from one size to the next (size 2 left 400 B allocated after it returned; "
        "sizes 1, 2, 3 left 0, 400, 800 B): each size's peak would include what earlier sizes kept; free it in the step"
    )
    assert kept == []


def test_limits_are_echoed_as_written() -> None:
    fit = fit_measured([1, 2, 3], [10**9, 2 * 10**9, 3 * 10**9], " 24 GB ")
    assert fit.describe() == (
        "largest batch that fits 24 GB: 24 (predicted peak 24.0 GB, counting the 0 B allocated when the fit "
        "began; peak = 0 B + 1.0 GB x n, fit exact)"
    )


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        (8, "fit sizes must be a list of positive integers, got 8"),
        ("123", "fit sizes must be a list of positive integers, got '123'"),
        ([1, None, 3], "fit sizes must be positive integers, got None in [1, None, 3]"),
        ([1, 2.0, 3], "fit sizes must be positive integers, got 2.0 in [1, 2.0, 3]"),
        ([1, 2, 2**31], "fit sizes must be integers from 1 to 2,147,483,647, got 2147483648 in [1, 2, 2147483648]"),
        ([1, 10**400], "fit sizes must be integers from 1 to 2,147,483,647, got 1000000000000...0000000000000 (401 "),
    ],
)
def test_hostile_sizes_are_refused_before_the_step_runs(sizes: object, expected: str, tracked: Tracked) -> None:
    calls: list[int] = []
    with pytest.raises(GpuMemError) as info:
        fit_peaks(calls.append, sizes, "1 GiB", tracked)  # type: ignore[arg-type]
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)
    assert len(str(info.value)) < 200
    assert calls == []


def test_integer_like_sizes_are_accepted(tracked: Tracked) -> None:
    fit = fit_peaks(rows, (n for n in np.array([1, 2, 3])), "1 MiB", tracked)
    assert fit.sizes == (1, 2, 3) and all(type(n) is int for n in fit.sizes)


def test_confirm_must_be_a_bool(tracked: Tracked) -> None:
    with pytest.raises(GpuMemError, match="fit confirm= must be True or False, got 'yes'"):
        fit_peaks(rows, [1, 2, 3], "1 MiB", tracked, confirm="yes")  # type: ignore[arg-type]


def test_the_fixture_fits_a_batch_size(tracker: pytest.Pytester, reported: Reported) -> None:
    tracker.makepyfile(
        """
        import torch

        def step(n):
            fixed = torch.ones(1000)  # 4,000 B
            return fixed, torch.ones(n, 256)  # 1,024 B per item

        def test_fits(gpumem):
            before = torch.ones(5000)  # 20,000 B live when the fit begins
            found = gpumem.fit(step, sizes=[1, 2, 4, 8], capacity=200_000, confirm=True)
            # (200,000 - 24,000) / 1,024 = 171.9; batch 172 runs out allocating its rows, after `fixed`
            assert (found.live, found.fixed, found.per_item, found.largest) == (20_000, 24_000, 1024, 171)
            assert [gpumem.peak(f"fit[{i}]") for i in range(6)] == [5024, 6048, 8096, 12192, 179_104, 4000]

        def test_not_linear(gpumem):
            gpumem.fit(lambda n: torch.ones(n * n * 64), sizes=[8, 16, 32, 64], capacity="1 GiB")

        def broken(n):
            raise ValueError(f"no batch of {n}")

        def test_step_raises(gpumem):
            gpumem.fit(broken, sizes=[1, 2, 3], capacity="1 GiB")
        """
    )
    result = tracker.runpytest("-p", "no:randomly", "--gpumem-json=out.json")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["*::test_not_linear: peak is not linear in the batch size, refusing to extrapolate*"])
    result.stdout.fnmatch_lines(["E *ValueError: no batch of 1"])
    result.stdout.no_fnmatch_line("*pytest_gpumem/*")  # the user's frames only
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    assert reported()["test_fits"]["info"]["fits"] == [
        "largest batch that fits 200,000 B: 171 (predicted peak 194.4 KiB, counting the 19.5 KiB allocated when "
        "the fit began; peak = 23.4 KiB + 1.0 KiB x n, fit exact); batch 171 ran within the capacity, peak "
        "194.4 KiB; batch 172 ran out of memory after 23.4 KiB"
    ]


def test_two_fits_in_one_test_are_measured_apart(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import torch

        def test_two(gpumem):
            big = gpumem.fit(lambda n: torch.ones(n * 1000), sizes=[1, 2, 3], capacity="1 MiB")
            small = gpumem.fit(lambda n: torch.ones(n * 10), sizes=[1, 2, 3], capacity="1 MiB")
            assert big.peaks == (4000, 8000, 12000)
            assert small.peaks == (40, 80, 120)
            assert small.largest == 1024**2 // 40
            assert set(gpumem.phases) == {"fit[0]", "fit[1]", "fit[2]", "fit#2[0]", "fit#2[1]", "fit#2[2]"}
        """
    )
    tracker.runpytest().assert_outcomes(passed=1)
