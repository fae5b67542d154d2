"""The shipped reference suite on the meta device: same verdicts and bytes as on CPU, at any scale."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

RunReference = Callable[..., dict[str, Any]]  # the conftest fixture run_reference
NOTE = "reference_losses: * on the meta device: bytes checked against every bound*not compared with the naive*"
META = ("--gpumem-device=meta", "--gpumem-report", "-rs")  # the whole suite on meta, at scale 1
CPU = ("--gpumem-report",)  # the guide's main job (docs/guides/reference-strategies.md)


def test_reference_suite_runs_on_meta(tracker: pytest.Pytester, run_reference: RunReference) -> None:
    """Every strategy but the CUDA-only one passes (amp under CUDA's autocast rules), with
    the naive references and value checks left out, said once."""
    ran = run_reference(tracker, *META)
    assert {name: ran["outcomes"].get(name, 0) for name in ("passed", "skipped", "failed", "errors")} == {
        "passed": 18, "skipped": 3, "failed": 0, "errors": 0,
    }  # fmt: skip
    lines = pytest.LineMatcher(ran["lines"])
    lines.fnmatch_lines(
        [
            "*2*test_distributed.py*fully_shard refuses parameters on the meta device for training",
            "*offload_activations needs a CUDA device (measuring on meta)*",
        ]
    )
    lines.fnmatch_lines([NOTE])
    assert sum("bytes checked" in line for line in ran["lines"]) == 1


@pytest.mark.slow
def test_meta_bytes_equal_cpu_bytes(tracker: pytest.Pytester, run_reference: RunReference) -> None:
    """The report's rows on meta are the CPU rows of the same strategies, byte for byte, and say what the
    allocator's model reserves."""
    tests = ["test_loss_strategy[naive_sum]", "test_loss_strategy[dot]", "test_loss_strategy[chunked_ce_checkpoint]",
             "test_training_strategy[clip_grad]", "test_training_strategy[compress_activations]"]  # fmt: skip
    names = tuple(f"{test.split('[')[1][:-1]} " for test in tests)
    rows = {}
    for device, args in (("cpu", CPU), ("meta", META)):
        ran = run_reference(tracker, *args)
        assert set(tests) <= set(ran["passed"]), device
        rows[device] = [" ".join(line.split()) for line in ran["lines"] if line.startswith(names)]
    assert len(rows["cpu"]) == 5
    reserved = re.compile(r" (\d+\.\d\dx|-)$")  # meta's column of reserved memory against naive's (the model)
    assert all(reserved.search(line) for line in rows["meta"])
    assert [reserved.sub("", line) for line in rows["meta"]] == rows["cpu"]


def test_reference_at_production_scale_on_meta(tracker: pytest.Pytester) -> None:
    """At --gpumem-scale=256 (GiB-sized batches no test machine holds) the exact bounds still hold,
    among them the two that the weight gradient dominates at scale 1 and the logits at large scales."""
    selection = "naive_sum or chunked_ce_checkpoint or checkpoint_blocks or compress_activations or amp"
    result = tracker.runpytest(
        "--pyargs", "reference_losses", "--gpumem-device=meta", "--gpumem-scale=256", "-k", selection,
        "--gpumem-report", "-p", "no:cacheprovider",
    )  # fmt: skip
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(
        [
            NOTE,
            "workload product (tracker, meta; naive = naive_sum):",
            "naive_sum*1.0 GiB*2.0 GiB*-*2.0 GiB*",
            "workload lm_head (tracker, meta; naive = full_ce):",
            "chunked_ce_checkpoint*2.0 GiB*3.1 GiB*-*3.1 GiB*",
            "workload residual (tracker, meta; naive = residual_plain):",
            "checkpoint_blocks*1.9 GiB*2.6 GiB*",
        ]
    )
