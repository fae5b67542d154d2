"""The meter's region arithmetic, on a scripted fake allocator.

FAKE: `ScriptedAllocator` stands in for the CUDA statistics to test the folding of nested peaks only;
real CUDA readings are tested in test_cuda.py (skipped without a GPU) and benchmarks/validate_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

from pytest_gpumem import Backend, Counters, GpuMemError
from pytest_gpumem.measure.measurement import Measurement
from pytest_gpumem.measure.measuring import measuring
from pytest_gpumem.measure.meter import GpuMem


class ScriptedAllocator(Backend):
    """A fake allocator with one resettable peak, driven by `alloc`/`free` calls from the test."""

    name = "scripted"
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.now = 0
        self.high = 0
        self.resets = 0
        self.observing = False

    def alloc(self, n: int) -> None:
        self.now += n
        self.high = max(self.high, self.now)

    def free(self, n: int) -> None:
        self.now -= n

    def describe(self) -> str:
        return "scripted fake"

    def start(self) -> None:
        self.observing = True

    def stop(self) -> None:
        self.observing = False

    def settle(self) -> None:
        pass

    def current(self) -> Counters:
        return Counters(self.now, self.now, self.now + 100)

    def peak(self) -> Counters:
        return Counters(self.high, self.high, self.high + 100)

    def reset_peak(self) -> None:
        self.high = self.now
        self.resets += 1


def test_phase_reset_does_not_hide_an_earlier_call_peak() -> None:
    fake = ScriptedAllocator()
    fake.alloc(1000)  # before the call: not part of any peak
    measured = Measurement(fake, "t")
    meter = GpuMem(measured)
    measured.begin()
    fake.alloc(500)
    fake.free(500)  # a transient before any phase: the call's peak must keep it
    with meter.phase("forward"):
        fake.alloc(200)
    with meter.phase("backward"):
        fake.free(200)
        fake.alloc(300)
        fake.free(300)
    call = measured.end().call
    assert call.peak_bytes == 500
    assert call.net_bytes == 0
    assert measured.peak("forward") == 200
    assert measured.result("forward").net_bytes == 200
    # backward starts at 1200, frees 200 and allocates 300: its peak above start is 100
    assert measured.peak("backward") == 100
    assert measured.result("backward").net_bytes == -200
    assert measured.result("backward").reserved_peak_bytes == 1300 + 100  # the fake reserves 100 above allocated
    assert fake.resets == 3


def test_peak_inside_phase_reaches_the_call() -> None:
    fake = ScriptedAllocator()
    measured = Measurement(fake, "t")
    meter = GpuMem(measured)
    measured.begin()
    with meter.phase("p"):
        fake.alloc(5000)
        fake.free(5000)
    fake.alloc(10)
    assert measured.end().call.peak_bytes == 5000


def test_repeated_phase_keeps_max_and_last_net() -> None:
    fake = ScriptedAllocator()
    measured = Measurement(fake, "t")
    meter = GpuMem(measured)
    measured.begin()
    for n in (300, 700, 100):
        with meter.phase("step"):
            fake.alloc(n)
    measured.end()
    result = measured.result("step")
    assert (result.peak_bytes, result.net_bytes, result.count) == (700, 100, 3)


def test_a_phase_left_open_is_closed_when_the_call_ends() -> None:
    fake = ScriptedAllocator()
    measured = Measurement(fake, "t")
    meter = GpuMem(measured)
    measured.begin()
    context = meter.phase("left-open")
    context.__enter__()
    fake.alloc(64)
    assert measured.end().call.peak_bytes == 64
    with pytest.raises(GpuMemError, match="the call of t is measured only while its test function runs"):
        GpuMem(Measurement(fake, "t")).peak()


def test_measuring_ends_the_call_into_its_record_when_the_block_ends() -> None:
    fake = ScriptedAllocator()
    with measuring(Measurement(fake, "t")) as call:
        assert fake.observing
        with call.meter.phase("p"):
            fake.alloc(700)
        fake.free(700)
    assert not fake.observing
    assert (call.record.call.peak_bytes, call.record.call.net_bytes) == (700, 0)
    assert call.record.phases["p"].net_bytes == 700


def test_measuring_ends_a_call_whose_block_raised_and_keeps_no_record() -> None:
    fake = ScriptedAllocator()
    measured = Measurement(fake, "t")
    with pytest.raises(ValueError, match="the step's own"), measuring(measured) as call:
        fake.alloc(300)
        raise ValueError("the step's own error")
    assert not fake.observing and measured.stack is None
    with pytest.raises(GpuMemError, match="has a record only once its `with` block ended"):
        call.record  # noqa: B018


def test_call_so_far() -> None:
    fake = ScriptedAllocator()
    measured = Measurement(fake, "t")
    meter = GpuMem(measured)
    measured.begin()
    with meter.phase("forward"):
        fake.alloc(300)
        assert measured.peak() == 300
    fake.free(300)
    assert measured.peak() == 300
    assert measured.result().net_bytes == 0
    fake.alloc(500)
    fake.free(500)
    assert measured.end().call.peak_bytes == 500


@pytest.mark.parametrize("name", ["x@rank1", "forward@rank0", "a@rank@rank12"])
def test_a_phase_named_like_a_ranks_phase_is_refused(name: str) -> None:
    fake = ScriptedAllocator()
    measured = Measurement(fake, "t")
    meter = GpuMem(measured)
    measured.begin()
    with pytest.raises(GpuMemError, match=rf"^phase name '{name}' reads as rank \d+'s phase '.+' \('@rank' and a"):
        meter.phase(name).__enter__()  # refused before it opens
    with meter.phase("after"):  # nothing was left open
        fake.alloc(20)
    assert list(measured.phases) == ["after"] and measured.end().call.peak_bytes == 20


@pytest.mark.parametrize("name", ["x@rank", "x@rankA", "x@rank01", "@rank1", "x@rank1b"])
def test_other_names_with_at_rank_are_phases_of_their_own(name: str) -> None:
    fake = ScriptedAllocator()
    measured = Measurement(fake, "t")
    meter = GpuMem(measured)
    measured.begin()
    with meter.phase(name):
        fake.alloc(10)
    measured.end()
    assert measured.result(name).peak_bytes == 10


def test_a_test_opening_a_rank_phase_name_fails_in_one_line(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        test_ranks="""
        import torch

        def test_names_a_rank(gpumem):
            with gpumem.phase("x@rank1"):
                torch.ones(10)
        """
    )
    result = tracker.runpytest()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "test_ranks.py::test_names_a_rank: phase name 'x@rank1' reads as rank 1's phase 'x' ('@rank' and a number "
            "end the phases of gpumem.distributed ranks): choose another name"
        ]
    )
    result.stdout.no_fnmatch_line("*Traceback*")


def test_what_the_measuring_code_finds_joins_the_record_by_its_field_name() -> None:
    fake = ScriptedAllocator()
    with measuring(Measurement(fake, "t")) as call:
        measured = call.meter._measured
        assert isinstance(measured, Measurement) and measured.found("fits") == ()
        measured.add(fits="batch 8 fits")
        measured.add(fits="batch 16 fits")  # a field of several: added to
        measured.keep(gradient_tolerance=(0.1, None))
        measured.keep(gradient_tolerance=(None, 0.5))  # any other: replaced
        with pytest.raises(TypeError, match=r"^a call's record has no field 'fit'$"):
            measured.add(fit="x")
        with pytest.raises(TypeError, match=r"^a call's record has no field 'advise'$"):
            measured.keep(advise=None)
    assert (call.record.fits, call.record.gradient_tolerance, call.record.advice) == (
        ("batch 8 fits", "batch 16 fits"), (None, 0.5), None,
    )  # fmt: skip
