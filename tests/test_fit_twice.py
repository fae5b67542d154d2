"""Two `gpumem.fit` calls in one test are measured apart: each its own peaks, largest size and phases."""

from __future__ import annotations

import pytest


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
