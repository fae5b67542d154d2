"""--gpumem-device=meta: the same exact bytes as on CPU without data, one line for data-dependent ops,
and predictions kept apart from measured figures."""

from __future__ import annotations

import json

import pytest

WORKLOAD = """
import torch


def test_step(gpumem):
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    model = model.to(gpumem.device)
    x = torch.randn(64, 512, device=gpumem.device)
    with gpumem.phase("forward"):
        loss = model(x).square().mean()
    with gpumem.phase("backward"):
        loss.backward()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    with gpumem.phase("step"):
        opt.step()
    gpumem.info["device"] = str(x.device)
"""


def _figures(pytester: pytest.Pytester, *args: str) -> dict[str, object]:
    pytester.runpytest("--gpumem-json=out.json", *args).assert_outcomes(passed=1)
    (test,) = json.loads((pytester.path / "out.json").read_text(encoding="utf-8"))["tests"]
    return test  # type: ignore[no-any-return]


@pytest.mark.parametrize("rounding", ["none", "cuda"])
def test_meta_bytes_equal_cpu_bytes(tracker: pytest.Pytester, rounding: str) -> None:
    tracker.makepyfile(WORKLOAD)
    cpu = _figures(tracker, f"--gpumem-round={rounding}")
    meta = _figures(tracker, f"--gpumem-round={rounding}", "--gpumem-device=meta")
    assert (cpu["info"], meta["info"]) == ({"device": "cpu"}, {"device": "meta"})
    assert (cpu["device"], meta["device"]) == ("cpu", "meta")
    assert meta["phases"] == cpu["phases"]
    assert meta["call"] == cpu["call"]
    # forward: the peak is ReLU's output made while the first Linear's (64 x 1024 float32 each) still
    # exists; after ReLU only its output stays (saved by ReLU and the second Linear), then 64 x 256 twice
    # and the 4-byte mean: 262,144 + 2 x 65,536 + 4 < 2 x 262,144
    if rounding == "none":
        assert meta["phases"]["forward"]["peak_bytes"] == 2 * 64 * 1024 * 4  # type: ignore[index]


def test_header_and_identity_say_prediction(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(WORKLOAD)
    result = tracker.runpytest("--gpumem-device=meta", "--gpumem-update")
    result.stdout.fnmatch_lines(
        ["gpumem: tracker (*), device meta (a prediction: sizes without data, nothing computed)"]
    )
    entries = json.loads((tracker.path / "gpumem-baselines.json").read_text(encoding="utf-8"))["entries"]
    assert "tracker (meta)" in json.dumps(entries)
    tracker.runpytest("--gpumem-update").assert_outcomes(passed=1)  # CPU figures go beside, not over them
    text = (tracker.path / "gpumem-baselines.json").read_text(encoding="utf-8")
    assert "tracker (meta)" in text
    assert '"tracker|cpu"' in text or '"backend": "tracker"' in text


@pytest.mark.parametrize(
    ("code", "said"),
    [
        ("x.sum().item()", "Tensor.item() cannot be called on meta tensors"),
        ("x[x > 0]", "The register_meta function for torch.nonzero() raises unimplemented*"),
        ("x.tolist()", "Cannot copy out of meta tensor; no data!"),
    ],
)
def test_data_dependent_ops_fail_in_one_line(tracker: pytest.Pytester, code: str, said: str) -> None:
    tracker.makepyfile(
        f"""
        import torch

        def test_needs_data(gpumem):
            x = torch.ones(3, device=gpumem.device)
            {code}
        """
    )
    result = tracker.runpytest("--gpumem-device=meta")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [f"*::test_needs_data: this test cannot run on the meta device (tensors without data): {said}"]
    )
    result.stdout.no_fnmatch_line("*Traceback*")
    result.stdout.no_fnmatch_line("*pytest_gpumem/*.py:*")


def test_meta_needs_the_tracker(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(WORKLOAD)
    result = tracker.runpytest("--gpumem-device=meta", "--gpumem-backend=cuda")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --gpumem-device=meta is measured by the tracker, not --gpumem-backend=cuda"])
    result = tracker.runpytest("--gpumem-device=gpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gpumem-device: invalid device 'gpu' (cpu, or meta*"])


FITS = """
import pytest, torch

def step(device, batch):
    model = torch.nn.Linear(16384, 16384, device=device)  # 1 GiB of float32 weights
    x = torch.randn(batch, 16384, device=device)
    model(x).sum().backward()

@pytest.mark.max_memory(capacity="3 GiB", device="meta")
def test_batch_32_fits_in_3_gib(gpumem):
    assert gpumem.device.type == "meta"
    step(gpumem.device, 32)  # weights, bias and their gradients: just over 2 GiB

@pytest.mark.max_memory(capacity="2 GiB", device="meta")
def test_but_not_in_2_gib(gpumem):
    step(gpumem.device, 32)

def test_on_cpu(gpumem):
    assert gpumem.device.type == "cpu"
"""


def test_a_marker_makes_one_test_a_prediction(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(FITS)
    result = tracker.runpytest("--gpumem-json=out.json", "-p", "no:randomly")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "out of memory in the call (tried to allocate 1.0 GiB) after a peak of 1.0 GiB; "
            "budget capacity 2 GiB, on meta"
        ]
    )
    tests = {t["nodeid"].split("::")[1]: t for t in json.loads((tracker.path / "out.json").read_text())["tests"]}
    assert {name: t["device"] for name, t in tests.items()} == {
        "test_batch_32_fits_in_3_gib": "meta",
        "test_but_not_in_2_gib": "meta",
        "test_on_cpu": "cpu",
    }
    # 2 x (16384 x 16384 + 16384) x 4 B for weights, bias and gradients; the batch's few MiB on top
    assert tests["test_batch_32_fits_in_3_gib"]["peak_bytes"] >= 2 * (16384 * 16384 + 16384) * 4


def test_only_meta_is_chosen_per_test(tracker: pytest.Pytester) -> None:
    tracker.makepyfile("import pytest\n\n@pytest.mark.max_memory(device='cuda')\ndef test_x(gpumem):\n    pass\n")
    result = tracker.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*max_memory device=: only 'meta' (a prediction without data) is chosen per test, got 'cuda'"]
    )
