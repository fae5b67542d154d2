"""Under `--gpumem-round=cuda` the tracker's storages are served by the model of the CUDA caching allocator:
allocated bytes are its blocks, reserved bytes its segments, and a capacity is judged as a card judges it,
on reserved memory. Figures derived by hand from the allocator's rules (see tests/allocator_model/)."""

from __future__ import annotations

import pytest
import torch
from builders import Reported

from pytest_gpumem.backends.tracker.backend import TrackerBackend

MIB = 2**20


def mib(n: float) -> torch.Tensor:
    return torch.empty(int(n * MIB), dtype=torch.uint8)


def test_small_tensors_share_two_mib_segments(cuda_rounding: TrackerBackend) -> None:
    kept = [mib(1), mib(1), mib(1)]  # the small pool: two 1 MiB blocks to a 2 MiB segment
    counters = cuda_rounding.current()
    assert (counters.allocated, counters.reserved) == (3 * MIB, 4 * MIB)
    del kept
    assert (cuda_rounding.current().allocated, cuda_rounding.current().reserved) == (0, 4 * MIB)  # cached
    torch.cuda.empty_cache()  # the model gives its free segments back
    assert cuda_rounding.current().reserved == 0
    assert cuda_rounding.peak().reserved == 4 * MIB


def test_an_unsplit_tail_counts_as_allocated(cuda_rounding: TrackerBackend) -> None:
    # 13.5 MiB: a segment of 14 MiB; the 0.5 MiB left is not worth a block, so the whole segment counts
    kept = mib(13.5)
    assert (cuda_rounding.current().allocated, cuda_rounding.current().requested) == (14 * MIB, int(13.5 * MIB))
    del kept


def test_a_new_segment_past_the_capacity_runs_out_with_allocated_bytes_below_it(cuda_rounding: TrackerBackend) -> None:
    with cuda_rounding.held_to(3 * MIB):
        kept = [mib(1), mib(1)]  # one 2 MiB segment
        with pytest.raises(torch.OutOfMemoryError) as info:
            kept.append(mib(1))  # a second segment would reserve 4 MiB
    assert cuda_rounding.current().allocated == 2 * MIB < 3 * MIB
    error = info.value.allocator_error  # type: ignore[attr-defined]
    assert (error.allocated, error.reserved, error.capacity) == (2 * MIB, 2 * MIB, 3 * MIB)
    del kept


def test_running_out_in_a_test_says_what_was_reserved_and_that_fragmentation_is_the_cause(
    tracker: pytest.Pytester,
) -> None:
    tracker.makepyfile(
        """
        import pytest, torch

        MIB = 2**20

        @pytest.mark.max_memory(capacity="40 MiB")
        def test_fragmented(gpumem):
            blocks = [torch.empty(5 * MIB, dtype=torch.uint8) for _ in range(8)]  # two 20 MiB segments
            del blocks[::2]  # 20 MiB free, in 5 MiB holes between live blocks
            torch.empty(8 * MIB, dtype=torch.uint8)  # no hole holds it; a third segment passes 40 MiB
        """
    )
    result = tracker.runpytest("-p", "no:randomly", "--gpumem-round=cuda")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            # CUDA names the segment it tried to reserve: 20 MiB for a request under 10 MiB
            "out of memory in the call after a peak of 40.0 MiB (41,943,040 B): past max_memory(capacity='40 MiB'); "
            "fragmentation",
            "also: tried to allocate 20.0 MiB",
            "allocator when it ran out: 40.0 MiB reserved, 20.0 MiB allocated and 20.0 MiB reserved but unallocated",
            "fragmentation: no free block holds 8.0 MiB, though 20.0 MiB is reserved but unallocated;",
            "  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets that memory serve it",
            "call: peak 40.0 MiB (requested 40.0 MiB, reserved 40.0 MiB in all), net 20.0 MiB, entered 1x",
        ]
    )


def test_reserved_peaks_reach_the_report_and_the_json(tracker: pytest.Pytester, reported: Reported) -> None:
    tracker.makepyfile(
        """
        import torch

        def test_phases(gpumem):
            with gpumem.phase("forward"):
                x = torch.empty(2**20, dtype=torch.uint8)  # a 1 MiB block of a 2 MiB segment
            with gpumem.phase("backward"):
                y = torch.empty(12 * 2**20, dtype=torch.uint8)  # a 12 MiB segment
        """
    )
    result = tracker.runpytest("-p", "no:randomly", "--gpumem-round=cuda", "--gpumem-json=out.json", "--gpumem-report")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["test * call peak  reserved  status*", "*::test_phases * 13.0 MiB  14.0 MiB  ok*"])
    phases = reported()["test_phases"]["phases"]
    # peaks above each phase's start; reserved peaks absolute, as the CUDA backend reports them
    assert {name: (p["peak_bytes"], p["reserved_peak_bytes"]) for name, p in phases.items()} == {
        "forward": (MIB, 2 * MIB),
        "backward": (12 * MIB, 14 * MIB),
    }
