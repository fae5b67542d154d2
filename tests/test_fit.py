"""fit_peaks: the largest batch that fits, from peaks measured by the exact tracker at a few sizes."""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

import pytest
import torch

from pytest_gpumem.backends.tracker import TrackerBackend
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.fit import MAX_BATCH, BatchFit, fit_measured, fit_peaks, least_squares

FIXED = 1000 * 4  # torch.zeros(1000), float32
ROW = 256 * 4  # one row of torch.ones(n, 256), float32


def tracked_peak(fn: Callable[[], object]) -> int:
    """Peak bytes of one call of `fn` under the tracker (the `measure` the meter provides in a test)."""
    backend = TrackerBackend()
    backend.start()
    try:
        fn()
        return backend.peak().allocated
    finally:
        backend.stop()


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


def test_recovers_fixed_and_per_item_bytes_exactly() -> None:
    fit = fit_peaks(rows, [1, 2, 4, 8], "1 MiB", tracked_peak)
    assert fit.peaks == (FIXED + ROW, FIXED + 2 * ROW, FIXED + 4 * ROW, FIXED + 8 * ROW)
    assert (fit.fixed, fit.per_item, fit.residual) == (Fraction(FIXED), Fraction(ROW), 0)
    # (1,048,576 - 4,000) / 1,024 = 1,020.09...
    assert fit.largest == 1020
    assert fit.predicted_peak == FIXED + 1020 * ROW == 1_048_480
    assert fit.checked and not fit.capped


def test_largest_batch_fits_and_the_next_does_not() -> None:
    fit = fit_peaks(rows, [3, 5, 7], 200_000, tracked_peak)
    assert fit.largest == (200_000 - FIXED) // ROW == 191
    assert tracked_peak(lambda: rows(191)) == fit.predicted_peak == 199_584 <= 200_000
    assert tracked_peak(lambda: rows(192)) == 200_608 > 200_000


def test_linear_layer_above_the_crossing() -> None:
    step = linear_step(torch.nn.Linear(64, 64))
    fit = fit_peaks(step, [100, 200, 400], "1 MiB", tracked_peak, confirm=True)
    assert (fit.fixed, fit.per_item, fit.residual) == (Fraction(4), Fraction(512), 0)
    # 4 + 512 n <= 1,048,576  ->  n <= 2,047.99...
    assert fit.largest == 2047
    assert tracked_peak(lambda: step(2047)) == 1_048_068 <= 1 << 20
    assert tracked_peak(lambda: step(2048)) == 1_048_580 > 1 << 20


def test_linear_layer_below_the_crossing_is_exact_but_refused_when_confirmed() -> None:
    step = linear_step(torch.nn.Linear(64, 64))
    fit = fit_peaks(step, [1, 2, 4, 8], "64 KiB", tracked_peak)
    assert (fit.fixed, fit.per_item, fit.residual) == (Fraction(16_648), Fraction(256), 0)
    assert fit.largest == (65_536 - 16_648) // 256 == 190  # but at 190 forward's line is the peak:
    assert tracked_peak(lambda: step(190)) == 512 * 190 + 4 == 97_284
    with pytest.raises(GpuMemError) as info:
        fit_peaks(step, [1, 2, 4, 8], "64 KiB", tracked_peak, confirm=True)
    message = str(info.value)
    assert "\n" not in message
    assert "predicts batch 190 fits 65,536 B with a peak of 65,288 B, but its measured peak is 97,284 B" in message


def test_sizes_on_both_sides_of_the_crossing_are_refused() -> None:
    step = linear_step(torch.nn.Linear(64, 64))
    with pytest.raises(GpuMemError, match="not linear"):
        fit_peaks(step, [16, 32, 64, 128, 256], "1 MiB", tracked_peak)


def test_non_linear_peak_is_refused_in_one_line() -> None:
    with pytest.raises(GpuMemError) as info:
        fit_peaks(square, [64, 128, 256], "1 GiB", tracked_peak)
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
    assert by_text == by_int
    assert by_text.largest == (80 * 1024**3 - FIXED) // ROW == 83_886_076
    assert by_text.describe() == (
        "largest batch that fits 80.0 GiB: 83,886,076 (predicted peak 80.0 GiB; "
        "peak = 3.9 KiB + 1.0 KiB x n, fit exact)"
    )


def test_capacity_below_the_smallest_size_gives_none() -> None:
    fit = fit_peaks(rows, [4, 8, 16], FIXED + 4 * ROW - 1, tracked_peak)
    assert fit.largest is None and fit.predicted_peak is None
    assert fit.describe() == (
        "no measured batch fits 7.9 KiB: the smallest, 4, needs 7.9 KiB (peak = 3.9 KiB + 1.0 KiB x n, fit exact)"
    )
    assert fit_peaks(rows, [4, 8, 16], FIXED + 4 * ROW, tracked_peak).largest == 4


def test_peak_that_does_not_grow_is_capped() -> None:
    fit = fit_measured([1, 2, 3], [5_000, 5_000, 5_000], "1 MiB")
    assert (fit.largest, fit.predicted_peak, fit.capped) == (MAX_BATCH, 5_000, True)
    assert fit.describe().endswith("capped at 2,147,483,647: the peak does not reach 1.0 MiB)")


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
        ([0, 1, 2], "fit sizes must be positive integers, got 0 in [0, 1, 2]"),
        ([-1, 1, 2], "fit sizes must be positive integers, got -1 in [-1, 1, 2]"),
        ([1, 2.5, 3], "fit sizes must be positive integers, got 2.5 in [1, 2.5, 3]"),
        ([1, True, 3], "fit sizes must be positive integers, got True in [1, True, 3]"),
    ],
)
def test_bad_sizes_are_refused_in_one_line(sizes: list[int], expected: str) -> None:
    calls: list[int] = []
    with pytest.raises(GpuMemError) as info:
        fit_peaks(calls.append, sizes, "1 GiB", tracked_peak)
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


def test_the_fixture_fits_a_batch_size(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ngpumem_backend = tracker\n")
    pytester.makepyfile(
        """
        import torch

        def step(n):
            fixed = torch.ones(1000)  # 4,000 B
            return fixed, torch.ones(n, 256)  # 1,024 B per item

        def test_fits(gpumem):
            found = gpumem.fit(step, sizes=[1, 2, 4, 8], capacity=200_000)
            assert (found.fixed, found.per_item, found.largest) == (4000, 1024, 191)
            assert [gpumem.peak(f"fit[{i}]") for i in range(4)] == [5024, 6048, 8096, 12192]

        def test_not_linear(gpumem):
            gpumem.fit(lambda n: torch.ones(n * n * 64), sizes=[8, 16, 32, 64], capacity="1 GiB")
        """
    )
    result = pytester.runpytest("-p", "no:randomly", "--gpumem-json=out.json")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*::test_not_linear: peak is not linear in the batch size, refusing to extrapolate*"])
    import json

    tests = json.loads((pytester.path / "out.json").read_text())["tests"]
    assert tests[0]["info"]["fits"] == [
        "largest batch that fits 195.3 KiB: 191 (predicted peak 194.9 KiB; peak = 3.9 KiB + 1.0 KiB x n, fit exact)"
    ]
