"""`PYTORCH_CUDA_ALLOC_CONF` as torch 2.13 reads it, read only where the allocator's model runs.

The verdicts of the table follow torch 2.13's parsers (`c10/core/AllocatorConfig.{h,cpp}`: `ConfigTokenizer`,
`AcceleratorAllocatorConfig::parseArgs`; `c10/cuda/CUDAAllocatorConfig.{h,cpp}`: `CUDAAllocatorConfig::parseArgs`)
on a CUDA build, where the CUDA parser's keys make every other key an error: numbers are `std::stoull` (ASCII
digits after an optional sign, the longest prefix, a minus wrapping around 2**64, past 2**64 - 1 refused) and
`std::stod` (the longest prefix, hex and inf/nan included, out of range refused); a size in MiB is clamped to
SIZE_MAX / 1 MiB; the ':' and ',' between tokens are never checked, only that a token is there.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from cuda_allocator_model import ModelError
from cuda_allocator_model.settings import INTERVALS, AllocatorSettings
from pytest_gpumem.backends.tracker.backend import TrackerBackend

MiB = 2**20
GiB = 2**30
CLAMPED = ((2**64 - 1) // MiB) * MiB  # a size in MiB past SIZE_MAX / 1 MiB: min(value, SIZE_MAX / kMB) * kMB
ASYNC = "backend:cudaMallocAsync"

ACCEPTED: list[tuple[str, AllocatorSettings]] = [
    ("", AllocatorSettings()),
    ("max_split_size_mb:128", AllocatorSettings(max_split_size=128 * MiB)),
    ("max_split_size_mb:+128", AllocatorSettings(max_split_size=128 * MiB)),  # stoull takes a sign
    ("max_split_size_mb:-1", AllocatorSettings(max_split_size=CLAMPED)),  # -1 wraps to 2**64 - 1
    ("max_split_size_mb:18446744073709551615", AllocatorSettings(max_split_size=CLAMPED)),
    ("max_split_size_mb:" + "0" * 4300 + "128", AllocatorSettings(max_split_size=128 * MiB)),
    ("max_split_size_mb:128\u0661", AllocatorSettings(max_split_size=128 * MiB)),  # the ASCII prefix
    ("max_split_size_mb:128abc", AllocatorSettings(max_split_size=128 * MiB)),
    ("max_split_size_mb:\t128", AllocatorSettings(max_split_size=128 * MiB)),  # a C blank, dropped
    ("max_split_size_mb,128", AllocatorSettings(max_split_size=128 * MiB)),  # ':' is not checked
    ("expandable_segments:True,", AllocatorSettings(expandable_segments=True)),
    (
        "expandable_segments:True:max_split_size_mb:128",  # nor ','
        AllocatorSettings(max_split_size=128 * MiB, expandable_segments=True),
    ),
    ("large_segment_size_mb:-1", AllocatorSettings(large_segment_size=CLAMPED)),
    (
        "large_segment_size_mb:11,max_split_size_mb:11",
        AllocatorSettings(max_split_size=11 * MiB, large_segment_size=11 * MiB),
    ),
    ("roundup_power2_divisions:-9223372036854775808", AllocatorSettings(roundup_power2_divisions=(2**63,))),
    ("roundup_power2_divisions:[1:4,]", AllocatorSettings(roundup_power2_divisions=(4,) + (0,) * (INTERVALS - 1))),
    ("roundup_power2_divisions:[]", AllocatorSettings()),
    ("garbage_collection_threshold:0x1p-1", AllocatorSettings(ignored=("garbage_collection_threshold",))),
    ("garbage_collection_threshold:.5abc", AllocatorSettings(ignored=("garbage_collection_threshold",))),
    ("pinned_max_round_threshold_mb:-1", AllocatorSettings(ignored=("pinned_max_round_threshold_mb",))),
    ("pinned_num_register_threads:128", AllocatorSettings(ignored=("pinned_num_register_threads",))),
    ("per_process_memory_fraction:0.5", AllocatorSettings(per_process_memory_fraction=0.5)),
    ("per_process_memory_fraction:2e-1x", AllocatorSettings(per_process_memory_fraction=0.2)),
    ("per_process_memory_fraction:-0", AllocatorSettings(per_process_memory_fraction=0.0)),
    ("per_process_memory_fraction:1", AllocatorSettings()),
]

REFUSED: list[tuple[str, str]] = [
    ("max_split_size_mb:\u0661\u0662\u0668", "expected a whole number"),  # Arabic-Indic digits
    ("max_split_size_mb:\u00b2", "expected a whole number"),  # superscript two
    ("max_split_size_mb:18446744073709551616", "past 2**64 - 1"),
    ("max_split_size_mb:" + "1" * 4301, "past 2**64 - 1"),
    ("max_split_size_mb:-18446744073709551615", "must be at least 20 MiB"),  # wraps to 1
    ("max_split_size_mb:0x80", "must be at least 20 MiB"),  # base 10: the prefix '0'
    ("max_split_size_mb:\x1c128", "expected a whole number"),  # a blank to Python, not to C
    ("max_split_size_mb:\u00a0128", "expected a whole number"),
    ("max_split_size_mb:32,large_segment_size_mb:33", "must be at least 33 MiB"),  # read first
    ("max_split_size_mb", "expected ':' after max_split_size_mb"),
    ("max_split_size_mb:", "max_split_size_mb has no value"),
    (",expandable_segments:True", "unrecognized key ','"),
    ("expandable_segments:True,,max_split_size_mb:128", "unrecognized key ','"),
    ("expandable_segments:true", "expected True or False"),
    ("expandable_segments:True max_split_size_mb:128", "expected True or False"),
    ("roundup_power2_divisions:[1:4", "no ']'"),
    ("roundup_power2_divisions:[,]", "has no value"),
    ("roundup_power2_divisions:3", "power of 2"),
    ("garbage_collection_threshold:1e-400", "out of range"),
    ("garbage_collection_threshold:nan", "must be in (0.0, 1.0)"),
    ("garbage_collection_threshold:infinity", "must be in (0.0, 1.0)"),
    ("garbage_collection_threshold:large_segment_size_mb:32", "expected a number"),
    ("per_process_memory_fraction:1.5", "must be in [0.0, 1.0]"),
    ("per_process_memory_fraction:nan", "must be in [0.0, 1.0]"),
    ("per_process_memory_fraction:1e999", "out of range"),
    ("pinned_num_register_threads:256", "a power of 2 up to 128"),
    ("pinned_num_register_threads:-0", "a power of 2 up to 128"),
    ("foo:1", "unrecognized key 'foo'"),
    (ASYNC, "not modelled"),
]


@pytest.mark.parametrize(("text", "settings"), ACCEPTED, ids=[repr(t[:48]) for t, _ in ACCEPTED])
def test_settings_torch_accepts_are_read_to_its_values(text: str, settings: AllocatorSettings) -> None:
    assert AllocatorSettings.parse(text) == settings


@pytest.mark.parametrize(("text", "reason"), REFUSED, ids=[repr(t[:48]) for t, _ in REFUSED])
def test_settings_torch_refuses_stop_in_one_line_naming_the_variable_and_the_value(text: str, reason: str) -> None:
    with pytest.raises(ModelError) as caught:
        AllocatorSettings.from_environ({"PYTORCH_CUDA_ALLOC_CONF": text})
    message = str(caught.value)
    assert message.startswith("PYTORCH_CUDA_ALLOC_CONF: ")
    assert reason in message
    assert "\n" not in message
    assert len(message) < 400


def test_the_generic_keys_come_from_the_first_variable_set_the_cuda_keys_skip_the_hip_one() -> None:
    environ = {
        "PYTORCH_HIP_ALLOC_CONF": "expandable_segments:True,per_process_memory_fraction:0.5",
        "PYTORCH_ALLOC_CONF": "max_split_size_mb:64,per_process_memory_fraction:0.25",
    }
    # AcceleratorAllocatorConfig reads the HIP variable; a CUDA build's CUDAAllocatorConfig skips it
    assert AllocatorSettings.from_environ(environ) == AllocatorSettings(
        expandable_segments=True, per_process_memory_fraction=0.25
    )
    environ["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:32"
    assert AllocatorSettings.from_environ(environ) == AllocatorSettings(max_split_size=32 * MiB)


# ------------------------------------------------------------------------- only where the model runs


def test_a_run_without_the_model_ignores_the_allocator_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", ASYNC)
    assert TrackerBackend(rounding="none").allocator == AllocatorSettings()
    with pytest.raises(ModelError, match="not modelled"):
        TrackerBackend(rounding="cuda")


def test_a_cpu_job_inheriting_a_gpu_jobs_settings_runs(
    tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracker.makepyfile("def test_one(gpumem):\n    pass\n")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", ASYNC)
    tracker.runpytest("-p", "no:randomly").assert_outcomes(passed=1)


@pytest.mark.parametrize(
    "text", ["max_split_size_mb:\u00b2", "max_split_size_mb:" + "9" * 4301, "expandable_segments:\u0661\n", ASYNC]
)
def test_a_bad_value_stops_a_run_with_the_model_in_one_line(
    tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    tracker.makepyfile("def test_one(gpumem):\n    pass\n")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", text)
    result = tracker.runpytest("-p", "no:randomly", "--gpumem-round=cuda")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    output = "\n".join(result.outlines + result.errlines)
    assert "INTERNALERROR" not in output and "Traceback" not in output
    errors = [line for line in result.errlines if "PYTORCH_CUDA_ALLOC_CONF" in line]
    assert len(errors) == 1 and errors[0].startswith("ERROR: PYTORCH_CUDA_ALLOC_CONF: ")


# ------------------------------------------------------------------------ per_process_memory_fraction


def meta(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device="meta")


def test_the_memory_fraction_caps_a_named_card(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "per_process_memory_fraction:0.1")
    backend = TrackerBackend(device="meta")
    backend.predict_card("H100-80GB")  # torch: 0.1 x the card's total memory, 7.9 GiB of its 79.2 GiB
    backend.start()
    try:
        kept = meta(7 * GiB)
        with pytest.raises(torch.OutOfMemoryError, match="per_process_memory_fraction"):
            meta(2 * GiB)
        del kept
    finally:
        backend.stop()


def test_the_memory_fraction_leaves_with_the_card_a_fit_predicted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "per_process_memory_fraction:0.1")
    backend = TrackerBackend(device="meta")
    backend.start()
    try:
        with backend.predicting("H100-80GB"), pytest.raises(torch.OutOfMemoryError):
            meta(10 * GiB)
        meta(10 * GiB)  # no card named again
    finally:
        backend.stop()


def test_the_memory_fraction_is_not_applied_without_a_card_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "per_process_memory_fraction:0.1")
    backend = TrackerBackend(device="meta")
    backend.start()
    try:
        meta(20 * GiB)  # no card's total to take a tenth of
    finally:
        backend.stop()
    assert "per_process_memory_fraction:0.1 (applied where a card is named" in backend.describe()
    assert "per_process_memory_fraction" not in backend.identity().backend  # not a figure's setting


def test_a_test_held_to_a_card_runs_out_at_its_memory_fraction(
    tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracker.makepyfile(
        """
        import pytest, torch

        @pytest.mark.max_memory(capacity="H100-80GB")
        def test_twenty_gib(gpumem):
            torch.empty(20 * 2**30, dtype=torch.uint8, device="meta")
        """
    )
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "per_process_memory_fraction:0.1")
    result = tracker.runpytest("-p", "no:randomly", "--gpumem-device=meta")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*out of memory*"])


# ---------------------------------------------------------------------------- expandable segments


def test_a_terabyte_fits_an_unlimited_device_with_expandable_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    backend = TrackerBackend(device="meta")
    backend.start()
    try:
        kept = meta(2**40)
        reserved = backend.current().reserved
        del kept
    finally:
        backend.stop()
    assert reserved == -(-(2**40) // (20 * MiB)) * 20 * MiB  # whole 20 MiB pages


# ------------------------------------------------------------------------------------- empty_cache


@pytest.mark.parametrize(
    "empty_cache", [lambda: torch.cuda.empty_cache(), lambda: torch.cuda.memory.empty_cache()], ids=["cuda", "memory"]
)
def test_empty_cache_by_either_name_gives_back_the_models_free_segments(empty_cache: Callable[[], None]) -> None:
    backend = TrackerBackend(rounding="cuda")
    backend.start()
    try:
        torch.empty(MiB, dtype=torch.uint8)  # freed at once: its segment is cached
        assert backend.current().reserved == 2 * MiB
        empty_cache()
        assert backend.current().reserved == 0
    finally:
        backend.stop()
