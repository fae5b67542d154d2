"""Explaining a peak: what was alive at it, by category and module, on workloads whose composition is
known by hand (float32: 4 bytes; N = 1,000 floats = 4,000 B)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from builders import Reported

from pytest_gpumem.backends.base import Settings
from pytest_gpumem.budget import budget_from_marker
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.explain.composition import on_rank
from pytest_gpumem.explain.growth import what_grew
from pytest_gpumem.explain.text import describe
from pytest_gpumem.measure.measurement import Measurement
from pytest_gpumem.results.baseline import check_composition
from pytest_gpumem.results.codec import read
from pytest_gpumem.results.explanation import Explanation, PhaseExplanation

CATEGORIES = ("parameters", "gradients", "optimizer_state", "saved", "temporaries", "inputs")

WORKLOADS = """
import pytest, torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

N = 1000
K = 1


class A(nn.Module):
    def forward(self, x):
        return x.exp()  # exp saves its result


class B(nn.Module):
    def forward(self, x):
        return x.repeat(1, K).sin()  # sin saves its input, the repeat


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = A(), B()

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.max_memory(explain=True)
def test_two(gpumem):
    x = torch.randn(1, N, requires_grad=True)
    model = Two()
    with gpumem.phase("forward"):
        out = model(x)
    with gpumem.phase("backward"):
        out.sum().backward()


@pytest.mark.max_memory(explain=True)
def test_adam(gpumem):
    model = nn.Linear(10, 10, bias=False)
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    model(torch.randn(4, 10)).sum().backward()
    with gpumem.phase("step"):
        opt.step()
    gpumem.info["state"] = [v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values()]


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = A()

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False).sum()


@pytest.mark.max_memory(explain=True)
def test_checkpoint(gpumem):
    x = torch.randn(1, N, requires_grad=True)
    model = Checkpointed()
    with gpumem.phase("forward"):
        loss = model(x)
    with gpumem.phase("backward"):
        loss.backward()


@pytest.mark.max_memory(explain=True)
def test_twice(gpumem):
    model = nn.Linear(N, 1, bias=False)
    x = torch.randn(1, N)
    with gpumem.phase("backward"):
        model(x).sum().backward()
        model(x).sum().backward()


@pytest.mark.max_memory(explain=True)
def test_freed(gpumem):
    with gpumem.phase("work"):
        t = torch.ones(2 * N)  # 8,000 B, freed before the 12,000 B peak
        del t
        a = torch.ones(N)
        b = a.exp()
        c = b.sin()
"""


NO_MODULE = "(outside modules)"


def _line(text: str) -> int:
    """The line of WORKLOADS holding `text`, as pytester writes the file (without the first blank line)."""
    return next(i for i, line in enumerate(WORKLOADS.strip().splitlines(), 1) if text in line)


def _explained(pytester: pytest.Pytester, reported: Reported, *args: str, passed: int = 5) -> dict[str, dict[str, Any]]:
    result = pytester.runpytest("--gpumem-json=out.json", "-p", "no:randomly", *args)
    result.assert_outcomes(passed=passed)
    return reported()


def _parts(test: dict[str, Any], phase: str) -> dict[str, int]:
    return {c: b for c, b in test["explanation"]["phases"][phase]["categories"].items() if b}


def _cells(test: dict[str, Any], phase: str) -> dict[tuple[str, str], int]:
    return {(c["category"], c["module"]): c["bytes"] for c in test["explanation"]["phases"][phase]["cells"]}


@dataclass(frozen=True)
class Run:
    """One run of WORKLOADS that several tests read: its folder, output and JSON report's tests."""

    path: Path
    stdout: str
    tests: dict[str, dict[str, Any]]


@pytest.fixture
def run(shared_run: Callable[..., tuple[Path, Any]], read_report: Callable[[Path], dict[str, Any]]) -> Run:
    """WORKLOADS explained once in the suite's run, with the report, Markdown, JSON and the pictures."""
    path, stdout = shared_run("workloads", _explain_workloads)
    return Run(path, stdout, read_report(path / "out.json"))


def _explain_workloads(path: Path) -> str:
    (path / "test_work.py").write_text(WORKLOADS.lstrip(), encoding="utf-8")
    (path / "tox.ini").write_text("[pytest]\ngpumem_backend = tracker\n", encoding="utf-8")
    flags = ["--gpumem-json=out.json", "--gpumem-report", "--gpumem-markdown=out.md", "--gpumem-html=pictures"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", *flags],
        cwd=path, capture_output=True, text=True, timeout=300, check=False,
        env={k: v for k, v in os.environ.items() if k not in ("COLUMNS", "CI", "BUILD_NUMBER", "PYTEST_ADDOPTS")},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.fixture
def workloads(run: Run) -> dict[str, dict[str, Any]]:
    return run.tests


def test_every_breakdown_adds_up_to_the_measured_peak(workloads: dict[str, dict[str, Any]]) -> None:
    for name, test in workloads.items():
        for phase, parts in test["explanation"]["phases"].items():
            measured = test["peak_bytes"] if phase == "call" else test["phases"][phase]["peak_bytes"]
            assert parts["unattributed_bytes"] == 0, (name, phase)
            assert sum(parts["categories"].values()) == measured == parts["peak_bytes"], (name, phase)
            assert sum(parts["modules"].values()) == measured, (name, phase)
            assert set(parts["categories"]) == set(CATEGORIES)


def test_forward_activations_by_module(workloads: dict[str, dict[str, Any]]) -> None:
    two = workloads["test_two"]
    # exp's result (saved by exp), the repeat (saved by sin), sin's output (the forward's result)
    assert _parts(two, "forward") == {"saved": 8000, "temporaries": 4000}
    assert _cells(two, "forward") == {("saved", "a"): 4000, ("saved", "b"): 4000, ("temporaries", "b"): 4000}
    # the sin node runs in backward: grad * cos(x) needs cos(x) and the product, both b's
    assert _cells(two, "backward")[("temporaries", "b")] == 8000
    tensors = two["explanation"]["phases"]["forward"]["tensors"]
    assert [(t["category"], t["module"]) for t in tensors] == [("inputs", NO_MODULE), ("saved", "a"), ("saved", "b"),
                                                                ("temporaries", "b")]  # fmt: skip
    assert all(t["bytes"] == 4000 and t["dtype"] == "float32" and t["shape"] == [1, 1000] for t in tensors)
    assert [(t["op"], t["where"]) for t in tensors[:2]] == [
        ("aten.randn.default", f"test_work.py:{_line('x = torch.randn')}"),
        ("aten.exp.default", f"test_work.py:{_line('return x.exp()')}"),  # the line of the user's code
    ]


def test_adam_state_is_optimizer_state(workloads: dict[str, dict[str, Any]]) -> None:
    adam = workloads["test_adam"]
    state = adam["info"]["state"]
    assert sorted(state)[-2:] == [400, 400]  # exp_avg and exp_avg_sq of a 10x10 float32 weight
    assert _parts(adam, "step")["optimizer_state"] == sum(state)
    # the call: the weight and its gradient were made inside it too
    assert _parts(adam, "call")["parameters"] == 400
    assert _parts(adam, "call")["gradients"] == 400


def test_checkpoint_recomputes_in_backward_not_forward(workloads: dict[str, dict[str, Any]]) -> None:
    ckpt = workloads["test_checkpoint"]
    forward, backward = _cells(ckpt, "forward"), _cells(ckpt, "backward")
    assert ("saved", "block") not in forward  # nothing of the block is kept for backward
    assert forward[("temporaries", "block")] == 4000  # its output, consumed by the sum
    assert backward[("temporaries", "block")] == 4000  # exp's result, recomputed
    assert backward[("gradients", "block")] == 4000  # x.grad, made by exp's backward


def test_gradients_accumulated_twice_count_once(workloads: dict[str, dict[str, Any]]) -> None:
    twice = workloads["test_twice"]
    parts = _parts(twice, "backward")
    assert parts["gradients"] == 4000  # the weight's .grad, added to in place the second time
    assert _cells(twice, "backward")[("temporaries", "(Linear)")] == 4000  # the second gradient, before adding


def test_a_temporary_freed_before_the_peak_is_absent(workloads: dict[str, dict[str, Any]]) -> None:
    freed = workloads["test_freed"]
    work = freed["explanation"]["phases"]["work"]
    assert work["peak_bytes"] == 12000
    assert _parts(freed, "work") == {"inputs": 4000, "temporaries": 8000}
    assert all(t["bytes"] == 4000 for t in work["tensors"]) and len(work["tensors"]) == 3


def test_regression_names_the_module_that_grew(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(test_work=WORKLOADS.replace("explain=True", "tolerance=5"))
    # a plain update stores the composition: no --gpumem-explain, no explain=True
    first = tracker.runpytest("--gpumem-update", "--gpumem-slack=0", "-k", "test_two")
    first.assert_outcomes(passed=1)
    stored = (tracker.path / "gpumem-baselines.json").read_bytes()
    assert b"composition" in stored
    # an update that measures the same peaks keeps the stored file as it was
    tracker.runpytest("--gpumem-update", "-k", "test_two").assert_outcomes(passed=1)
    assert (tracker.path / "gpumem-baselines.json").read_bytes() == stored
    tracker.makepyfile(test_work=WORKLOADS.replace("K = 1", "K = 4"))  # only b's activations grow
    second = tracker.runpytest("--gpumem-explain", "--gpumem-slack=0", "-k", "test_two")
    second.assert_outcomes(failed=1)
    message = next(line for line in second.outlines if line.startswith("call peak "))
    at = next(i for i, line in enumerate(second.outlines) if line.startswith("forward peak "))  # the section's
    forward, grew = second.outlines[at : at + 2]  # past 120 columns: what grew goes on, indented, below
    assert forward == "forward peak 35.2 KiB is 200.0% above baseline 11.7 KiB (tolerance 5%):"  # 36,000 vs 12,000 B
    # 12,000 B more saved (the repeat) and 12,000 B more temporaries (sin's output), all b's, nothing of a's
    assert grew == "  b +23.4 KiB: saved for backward +11.7 KiB, temporaries +11.7 KiB"
    assert "a +" not in message
    # the baseline has a composition: the run explains the test by itself, measured once
    tracker.makepyfile(test_work=WORKLOADS.replace("K = 1", "K = 4").replace("explain=True", "tolerance=5"))
    unexplained = tracker.runpytest("--gpumem-slack=0", "-k", "test_two")
    unexplained.assert_outcomes(failed=1)
    unexplained.stdout.fnmatch_lines(["forward peak 35.2 KiB *:", "  b +23.4 KiB: saved for backward +11.7 KiB, *"])
    # a baseline without a composition (as older versions recorded it) says how to record one
    path = tracker.path / "gpumem-baselines.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    for per_device in data["entries"].values():
        for entry in per_device.values():
            del entry["composition"]
    path.write_text(json.dumps(data), encoding="utf-8")
    bare = tracker.runpytest("--gpumem-slack=0", "-k", "test_two")
    bare.assert_outcomes(failed=1)
    bare.stdout.fnmatch_lines(
        ["also: to see what grew, record the baseline with its composition: "
         "pytest --gpumem-backend=tracker test_work.py::test_two --gpumem-update"]
    )  # fmt: skip


def test_the_markdown_says_what_each_recorded_peak_was_made_of_after_a_card(tracker: pytest.Pytester) -> None:
    """A card's cuBLAS workspace is part of the identity a baseline is stored under: a test that names a card,
    and the one after it, are found and explained by their stored composition, as every other test is."""
    tracker.makepyfile(
        test_card_then_plain="""
        import pytest, torch

        @pytest.mark.max_memory(capacity="H100")
        def test_a_card(gpumem):
            x = torch.zeros(1024, device=gpumem.device)

        def test_b_after_it(gpumem):
            x = torch.zeros(2048, device=gpumem.device)
        """
    )
    args = ("--gpumem-device=meta", "-p", "no:randomly")
    tracker.runpytest(*args, "--gpumem-update=new").assert_outcomes(passed=2)  # the command a run prints
    tracker.runpytest(*args, "--gpumem-markdown=out.md").assert_outcomes(passed=2)
    rows = [line.split("|") for line in (tracker.path / "out.md").read_text().splitlines() if "::test_" in line]
    made = {row[1].strip(): row[-2].strip() for row in rows}
    # 1,024 and 2,048 floats: 4,096 and 8,192 B, blocks of that size on the allocator's model
    assert made == {
        "test_card_then_plain.py::test_a_card": "inputs and other 4.0 KiB",
        "test_card_then_plain.py::test_b_after_it": "inputs and other 8.0 KiB",
    }


KV_CACHE = """
import pytest, torch
from torch import nn


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(64, 64, bias=False) for _ in range(3))

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        return (q @ k.transpose(0, 1)).softmax(-1) @ v, (k, v)  # k and v are saved and returned


@pytest.mark.max_memory(explain=True)
def test_cache(gpumem):
    attn = Attention()
    opt = torch.optim.SGD(attn.parameters(), lr=0.1)
    x = torch.randn(128, 64)
    with gpumem.phase("forward"):
        out, cache = attn(x)
    out.sum().backward()
    with gpumem.phase("step"):
        opt.step()
        torch.zeros(1024)


@pytest.mark.max_memory(explain=True)
def test_retained(gpumem):
    attn = Attention()
    out, cache = attn(torch.randn(128, 64))
    out.sum().backward(retain_graph=True)
    with gpumem.phase("after"):
        torch.zeros(1024)
"""


def test_a_kept_kv_cache_is_not_saved_for_backward_once_backward_freed_the_graph(
    tracker: pytest.Pytester, reported: Reported
) -> None:
    """k and v (128 x 64 floats, 32 KiB each) are saved for backward while the graph lives, and after a
    backward without retain_graph only the returned cache the test keeps holds them: temporaries of k, v."""
    tracker.makepyfile(test_work=KV_CACHE)
    tests = _explained(tracker, reported, passed=2)
    explained = tests["test_cache"]["explanation"]["phases"]
    # the forward's peak is softmax's output: q, k, v and it saved (3 x 32 + 64 KiB), q @ k.T's 64 KiB beside
    assert (explained["forward"]["live"]["saved"], explained["forward"]["live"]["temporaries"]) == (163840, 65536)
    step = explained["step"]
    # 3 weights of 16 KiB and their gradients; x and the zeros (32 + 4 KiB); out, k and v (3 x 32 KiB)
    assert {c: b for c, b in step["live"].items() if b} == {
        "parameters": 49152, "gradients": 49152, "inputs": 36864, "temporaries": 98304
    }  # fmt: skip
    assert {(t["module"], t["category"]) for t in step["tensors"] if t["bytes"] == 32768} == {
        ("(outside modules)", "inputs"), ("(Attention)", "temporaries"), ("k", "temporaries"), ("v", "temporaries")
    }  # fmt: skip
    # a graph backward retained still saves q, k, v and softmax's output
    assert tests["test_retained"]["explanation"]["phases"]["after"]["live"]["saved"] == 163840


def test_budget_failure_says_what_made_the_peak(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import pytest, torch

        @pytest.mark.max_memory("10 kB", explain=True)
        def test_over(gpumem):
            x = torch.ones(1000)
            y = x.exp()
            z = y.sin()

        @pytest.mark.max_memory("10 kB")
        def test_over_unexplained(gpumem):
            x = torch.ones(1000)
            y = x.exp()
            z = y.sin()
        """
    )
    result = tracker.runpytest()
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*call peak 12.0 kB exceeds max_memory 10 kB; call peak made of temporaries of (outside modules) "
            "8.0 kB, ...",
            "also: call peak made of temporaries of (outside modules) 8.0 kB, inputs and other of (outside modules) "
            "4.0 kB, ...",
            "*call peak 12.0 kB exceeds max_memory 10 kB (see what made it with --gpumem-explain*",
        ]
    )


def test_explain_must_be_a_bool() -> None:
    with pytest.raises(GpuMemError, match="max_memory explain=: must be True or False, got 'yes'"):
        budget_from_marker((), {"explain": "yes"})


def test_the_explanation_reads_back_to_the_same_json(run: Run) -> None:
    """Typed and written again, each explanation is the JSON the report holds; a rank's phase has no spans
    on the test's events and keeps where its peak was on the rank's own."""
    for test in run.tests.values():
        typed = Explanation.from_json(test["explanation"])
        assert typed.to_json() == test["explanation"]
    forward = Explanation.from_json(run.tests["test_two"]["explanation"]).phases["forward"]
    ranked = on_rank(forward, 1).to_json()
    assert ranked["rank"] == 1 and "peak_index" not in ranked
    assert (ranked["spans"], ranked["rank_peak_index"]) == ([], forward.peak_index)
    assert read(PhaseExplanation, ranked, "phase") == on_rank(forward, 1)


def test_report_markdown_and_pictures_carry_the_composition(run: Run) -> None:
    assert re.search(r"test_freed .*temporaries 7\.8 KiB, inputs and other 3\.9 KiB", run.stdout)
    assert "call peak made of" in run.stdout
    assert "[picture](<pictures/test_work.py_test_freed-" in (run.path / "out.md").read_text()
    assert len(list((run.path / "pictures").glob("*.html"))) == len(run.tests)


def _compare(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest_gpumem", "compare", "old.json", "new.json", "--slack=0"],
        cwd=folder, capture_output=True, text=True, check=False,
    )  # fmt: skip


def test_compare_command_names_what_grew_and_refuses_a_hand_edited_explanation(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(test_work=WORKLOADS)
    tracker.runpytest("--gpumem-explain", "--gpumem-json=old.json", "-k", "test_two").assert_outcomes(passed=1)
    tracker.makepyfile(test_work=WORKLOADS.replace("K = 1", "K = 4"))
    tracker.runpytest("--gpumem-explain", "--gpumem-json=new.json", "-k", "test_two").assert_outcomes(passed=1)
    done = _compare(tracker.path)
    assert done.returncode == 1
    assert "regressed: test_work.py::test_two: forward peak 35.2 KiB is 200.0% above" in done.stdout
    assert ": b +23.4 KiB: saved for backward +11.7 KiB, temporaries +11.7 KiB" in done.stdout
    doc = json.loads((tracker.path / "new.json").read_text())
    doc["tests"][0]["explanation"]["phases"]["forward"]["categories"]["temporaries"] = "12"
    (tracker.path / "new.json").write_text(json.dumps(doc))
    edited = _compare(tracker.path)
    assert (edited.returncode, edited.stdout) == (2, "")
    assert edited.stderr.splitlines()[-1].endswith(
        "error: new.json: tests[0].explanation.phases.forward.categories.temporaries must be an integer, got '12'"
    )


def test_explained_on_the_meta_device(tracker: pytest.Pytester, reported: Reported) -> None:
    tracker.makepyfile(test_work=WORKLOADS.replace("torch.randn(1, N", "torch.randn(1, N, device='meta'"))
    tests = _explained(tracker, reported, "--gpumem-device=meta", "-k", "test_two or test_freed", passed=2)
    # on meta the allocator's model serves the tensors: 8,000 B and 4,000 B are blocks of 8,192 and 4,096
    assert _parts(tests["test_two"], "forward") == {"saved": 8192, "temporaries": 4096}


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs headless Chromium (Debian package chromium)")
def test_the_picture_shows_the_measured_peak(run: Run, tmp_path: Path) -> None:
    test = run.tests["test_adam"]
    page = run.path / test["html"]
    dom = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path}", "--dump-dom",
         page.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    peak = re.search(r'<[^>]*id="gpumem-peak"[^>]*>', dom)
    assert peak is not None and f'data-bytes="{test["peak_bytes"]}"' in peak.group(0)


@pytest.mark.slow  # five reference strategies, explained
def test_reference_report_says_where_each_saving_comes_from(
    tracker: pytest.Pytester, run_reference: Callable[..., dict[str, Any]]
) -> None:
    """At scale 0.25: the shares do not depend on the batch (the blocks' inputs against all that the blocks
    save are both so many bytes per row)."""
    selection = "naive_sum or dot or checkpoint_loss or residual_plain or checkpoint_blocks"
    ran = run_reference(tracker, "--gpumem-scale=0.25", "--gpumem-report", "--gpumem-explain", "-k", selection)
    assert len(ran["passed"]) == 5
    pytest.LineMatcher(ran["lines"]).fnmatch_lines(
        [
            "*strategy*total/naive*vs naive, comes from",
            "naive_sum * -",
            "dot * forward: temporaries -100%",  # sum(x*y) keeps x*y; dot never makes it
            "checkpoint_loss * no change",  # checkpointing the loss saves nothing
            "*strategy*total/naive*vs naive, comes from",
            "residual_plain * -",
            "checkpoint_blocks * forward: saved for backward -91%",  # only the blocks' inputs stay saved
        ]
    )


STAND_IN = """
from pytest_gpumem import Backend
from pytest_gpumem.backends.tracker.backend import TrackerBackend


class StandIn(Backend):
    '''A stand-in for an accelerator backend that cannot explain its own peaks (a fake, labelled as such:
    its figures are the exact tracker's, without the tracker's attribution).'''

    name = "stand-in"
    sees_earlier_allocations = False

    def __init__(self):
        self.inner = TrackerBackend()

    device = property(lambda self: self.inner.device)
    describe = lambda self: "stand-in accelerator (figures from the exact tracker)"
    start = lambda self: self.inner.start()
    stop = lambda self: self.inner.stop()
    settle = lambda self: None
    current = lambda self: self.inner.current()
    peak = lambda self: self.inner.peak()
    reset_peak = lambda self: self.inner.reset_peak()


def pytest_gpumem_make_backend(config, name):
    return StandIn() if name == "stand-in" else None
"""


def test_a_backend_without_attribution_is_explained_by_a_shadow(pytester: pytest.Pytester, reported: Reported) -> None:
    """The shadow rounds as the CUDA allocator (512-byte blocks); the measured figure is the stand-in's
    exact one, and the "unattributed" part is the difference, so the parts still add up."""
    pytester.makeconftest(STAND_IN)
    pytester.makepyfile(
        """
        import pytest, torch

        @pytest.mark.max_memory(explain=True)
        def test_x(gpumem):
            x = torch.ones(1000)  # 4,000 B measured, a 4,096 B block predicted
            y = x.exp()
        """
    )
    result = pytester.runpytest("--gpumem-backend=stand-in", "--gpumem-json=out.json")
    result.assert_outcomes(passed=1)
    (test,) = reported().values()
    call = test["explanation"]["phases"]["call"]
    assert test["explanation"]["backend"] == "stand-in (composition from a shadow tracker)"
    assert test["peak_bytes"] == 8000 == call["peak_bytes"]
    assert {c: b for c, b in call["categories"].items() if b} == {"inputs": 4096, "temporaries": 4096}
    assert call["unattributed_bytes"] == 8000 - 8192


def _explaining_meter() -> Measurement:
    """A meter on the tracker that explains its call, in this process."""
    from pytest_gpumem.backends.tracker.backend import TrackerBackend

    backend = TrackerBackend()
    backend.configure(Settings(None, origins=False, events=False, explain=True))
    measured = Measurement(backend, "t")
    measured.explain = True
    return measured


def test_an_error_in_our_hooks_is_a_note_not_the_tests_failure() -> None:
    import torch

    class Unhashable(torch.nn.Module):  # defines __eq__ only: our hook cannot key anything by it
        def __eq__(self, other: object) -> bool:
            return self is other

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    measured = _explaining_meter()
    measured.begin()
    model = Unhashable()
    y = model(model(torch.ones(1000)))  # the module runs as it does unmeasured, twice: one note
    record = measured.end()
    assert y.tolist() == [4.0] * 1000
    note = "the explanation may be incomplete: module_entered: TypeError: unhashable type: 'Unhashable'"
    assert record.notes == (note,)


def test_a_tensor_two_graphs_save_stays_saved_until_both_released_it() -> None:
    """h (1,000 floats, 4,000 B) is saved by sin in two heads' graphs: a backward through one head leaves it
    saved by the other; after the second backward nothing saves it, and the h the test keeps is a temporary
    (beside the heads' two 4-byte sums)."""
    import torch

    from pytest_gpumem.measure.meter import GpuMem

    class Head(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sin().sum()

    measured = _explaining_meter()
    gpumem = GpuMem(measured)
    measured.begin()
    h = torch.ones(1000).exp().requires_grad_()
    first, second = Head()(h), Head()(h)
    first.backward()
    with gpumem.phase("between"):
        torch.zeros(250)  # 1,000 B: each phase's peak
    second.backward()
    with gpumem.phase("after"):
        torch.zeros(250)
    record = measured.end()
    assert record.explanation is not None
    between, after = (record.explanation.phases[name].live or {} for name in ("between", "after"))
    assert (between["saved"], between["temporaries"]) == (4000, 8)
    assert (after["saved"], after["temporaries"]) == (0, 4008)


@dataclass
class _Output:
    hidden: Any


def test_a_modules_output_in_a_registered_pytree_type_is_followed() -> None:
    """A module returning a registered dataclass (as transformers' ModelOutput is registered): what its
    forward saved for backward is the module's saved part, as for a tensor output."""
    import torch
    from torch.utils._pytree import register_dataclass

    with contextlib.suppress(ValueError):  # registered once per process
        register_dataclass(_Output)

    class Exp(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> _Output:
            return _Output(x.exp())  # exp saves its result: 1,000 floats, 4,000 B

    x = torch.randn(1000, requires_grad=True)
    measured = _explaining_meter()
    measured.begin()
    out = Exp()(x)
    measured.end()
    assert out.hidden.grad_fn is not None
    assert measured.explanation is not None
    cells = measured.explanation.phases["call"].cells
    assert [(c.category, c.module, c.size) for c in cells] == [("saved", "(Exp)", 4000)]


def test_compiled_modules_run_as_unexplained(tracker: pytest.Pytester) -> None:
    """torch.compile traces modules' hooks: ours step aside while it traces (a fullgraph compile would
    fail on them), and the warning torch gives for global hooks (ours, while measuring) is not the test's."""
    tracker.makepyfile(
        """
        import pytest, torch, torch.nn as nn

        @pytest.mark.max_memory(explain=True)
        def test_compiled(gpumem):
            model = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), fullgraph=True)
            model(torch.randn(4, 8)).sum().backward()
        """
    )
    result = tracker.runpytest("-W", "error::UserWarning", "-rA")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*call: peak * = parameters 288 B, *"])  # the 8x8 weight and 8 biases


REVIEWED = """
import pytest, torch
import torch.nn as nn


class Exp(nn.Module):
    def forward(self, x):
        return x.exp()


@pytest.mark.max_memory(explain=True)
def test_ids_reused(gpumem):
    for i in range(12):  # each x dies, and the next one may take its id
        x = torch.randn(1000, requires_grad=True)
        (x * 2).sum().backward()
        with gpumem.phase(f"after{i}"):
            z = torch.zeros(1)


@pytest.mark.max_memory(explain=True)
def test_two_roots(gpumem):
    x1 = torch.randn(1000, requires_grad=True)
    x2 = torch.randn(1000, requires_grad=True)
    torch.autograd.backward([x1.exp().sum(), x2.exp().sum()])
    with gpumem.phase("after"):
        z = torch.zeros(1)


@pytest.mark.max_memory(explain=True)
def test_forward_only(gpumem):
    x = torch.randn(1000, requires_grad=True)
    with gpumem.phase("forward"):
        y = Exp()(x)  # no backward ever runs: exp's result is still held by its graph


@pytest.mark.max_memory(explain=True)
def test_many_entries(gpumem):
    for _ in range(300):
        with gpumem.phase("step"):
            z = torch.zeros(1)
"""


def test_reviewed_cases(tracker: pytest.Pytester, reported: Reported) -> None:
    tracker.makepyfile(test_reviewed=REVIEWED)
    tests = _explained(tracker, reported, passed=4)
    ids = tests["test_ids_reused"]["explanation"]["phases"]
    assert [ids[f"after{i}"]["live"]["gradients"] for i in range(12)] == [4000] * 12
    assert tests["test_two_roots"]["explanation"]["phases"]["after"]["live"]["gradients"] == 8000
    assert _parts(tests["test_forward_only"], "forward") == {"saved": 4000}
    many = tests["test_many_entries"]["explanation"]["phases"]["step"]
    assert (len(many["spans"]), many["entries"]) == (200, 300)


def test_what_grew_never_names_a_cell_the_baseline_may_have_cut() -> None:
    stored = {"call": {"categories": {"temporaries": 100}, "cells": [["temporaries", "a", 100]]}}
    current = {
        "call": {
            "categories": {"temporaries": 100, "saved": 5000},
            "cells": [["saved", "z", 5000], ["temporaries", "a", 100]],
        }
    }
    grew = what_grew(check_composition(stored), check_composition(current), "call")
    assert grew == "saved for backward +4.9 KiB"


def test_the_shadow_counts_only_the_backends_device(pytester: pytest.Pytester, reported: Reported) -> None:
    pytester.makepyfile(
        """
        import pytest, torch

        @pytest.mark.max_memory(explain=True)
        def test_x(gpumem):
            table = torch.ones(1000)  # a host tensor: not the device's memory
            x = torch.ones(1000, device="meta")
        """
    )
    pytester.makeconftest(
        STAND_IN.replace(
            "device = property(lambda self: self.inner.device)",
            "device = property(lambda self: __import__('torch').device('meta'))",
        )
    )
    result = pytester.runpytest("--gpumem-backend=stand-in", "--gpumem-json=out.json")
    result.assert_outcomes(passed=1)
    (test,) = reported().values()
    call = test["explanation"]["phases"]["call"]
    assert {c: b for c, b in call["categories"].items() if b} == {"inputs": 4096}
    assert call["unattributed_bytes"] == test["peak_bytes"] - 4096


HOSTILE = """
import threading
import pytest, torch
import torch.nn as nn


class Exp(nn.Module):
    def forward(self, x):
        return x.exp()


class Tree(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, level=0):
        x = self.fc(x).tanh()
        return self(x, level + 1) if level < 50 else x


class Waits(nn.Module):
    def __init__(self):
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def forward(self, x):
        self.entered.set()
        self.release.wait(10)
        return x


def test_vmap_and_func_grad(gpumem):
    model = nn.Linear(16, 16)
    torch.func.vmap(model)(torch.randn(8, 16, requires_grad=True)).sum().backward()
    params = dict(model.named_parameters())
    torch.func.grad(lambda p: torch.func.functional_call(model, p, (torch.randn(8, 16),)).sum())(params)


def test_user_hooks(gpumem):
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
    model[0].register_forward_hook(lambda m, i, o: o * 2)
    model[0].register_forward_pre_hook(lambda m, i: (i[0] + 1,))
    model.register_full_backward_hook(lambda m, gi, go: None)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        out = model(torch.randn(4, 16, requires_grad=True))
    out.sum().backward()
    model[0].register_forward_hook(lambda m, i, o: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model(torch.randn(4, 16))


def test_called_twice(gpumem):
    shared = Exp()
    x = torch.randn(1000, requires_grad=True)
    with gpumem.phase("forward"):
        y = shared(shared(x))  # both exp results saved (4,000 B each), both the same module's


def test_recursion_and_a_module_holding_itself(gpumem):
    model = Tree()
    model.me = model
    model(torch.randn(2, 8)).sum().backward()


def test_another_threads_module_is_not_the_tests(gpumem):
    waits = Waits()
    thread = threading.Thread(target=waits, args=(torch.zeros(1),))
    thread.start()
    waits.entered.wait(10)
    with gpumem.phase("mine"):
        mine = torch.ones(1000)  # made while the other thread is inside Waits
    waits.release.set()
    thread.join()


def test_a_storage_no_tensor_shows(gpumem):
    storage = torch.UntypedStorage(100)
    storage.resize_(4096)
"""


def test_hostile_workloads_are_explained_exactly(tracker: pytest.Pytester, reported: Reported) -> None:
    """torch.func, user hooks (one raising), a module called twice, recursion, a module holding itself,
    a module running in another thread, a bare storage: each test passes as it does unmeasured, its
    breakdown adds up to the measured peak and its picture is written."""
    tracker.makepyfile(test_hostile=HOSTILE)
    tests = _explained(tracker, reported, "--gpumem-explain", "--gpumem-html=pictures", passed=6)
    for name, test in tests.items():
        assert not any("explain" in note for note in test["notes"]), name
        for phase, parts in test["explanation"]["phases"].items():
            measured = test["peak_bytes"] if phase == "call" else test["phases"][phase]["peak_bytes"]
            assert sum(parts["categories"].values()) == measured, (name, phase)
    assert len(list((tracker.path / "pictures").glob("*.html"))) == 6
    assert _cells(tests["test_called_twice"], "forward") == {("saved", "(Exp)"): 8000}
    assert _cells(tests["test_another_threads_module_is_not_the_tests"], "mine") == {("inputs", NO_MODULE): 4000}
    storage = tests["test_a_storage_no_tensor_shows"]["explanation"]["phases"]["call"]["tensors"]
    assert [(t["bytes"], t["shape"]) for t in storage] == [(4096 - 100, None)]  # a resize counts its growth


def test_a_call_past_the_event_limit_is_measured_but_not_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from pytest_gpumem.backends.tracker import attribution as attribution

    monkeypatch.setattr(attribution, "MAX_EVENTS", 100)
    measured = _explaining_meter()
    measured.begin()
    for _ in range(60):  # 120 events: an allocation and a free each
        t = torch.ones(1)
    del t
    record = measured.end()
    call = record.call
    assert call.peak_bytes == 8 and record.explanation is None  # the next 4-byte tensor, before the last is freed
    assert list(record.notes) == [
        "the peak could not be explained: ValueError: the call made more than 100 allocations, resizes and frees, "
        "the most an explanation follows (its host memory stays under about 100 MB)"
    ]


def test_freed_allocations_alike_share_one_record() -> None:
    import torch

    measured = _explaining_meter()
    measured.begin()
    attributor = measured.backend.attribution()
    for _ in range(1000):
        t = torch.ones(1)  # one line, one op, one shape: each freed by the next
    del t
    measured.end()
    assert attributor is not None and len(attributor.allocations) == 1000
    assert len({id(a) for a in attributor.allocations}) == 1  # one record for them all, once freed
    assert measured.explanation is not None and measured.explanation.phases["call"].peak_bytes == 8


# --- reserved memory at each peak, where the allocator's model serves the call (--gpumem-round=cuda)

MIB = 2**20

FRAGMENTED = """
import torch

MIB = 2**20


def mib(n):
    return torch.empty(int(n * MIB), dtype=torch.uint8)


def test_fragmented(gpumem):
    with gpumem.phase("split"):
        a, b = mib(2), mib(0.5)
    del a, b
    torch.cuda.empty_cache()
    with gpumem.phase("sixteens"):
        blocks = [mib(16) for _ in range(8)]
        del blocks
    with gpumem.phase("thirty_twos"):
        blocks = [mib(32) for _ in range(4)]
"""


def test_the_explanation_says_how_much_of_the_reserved_memory_held_no_block(
    tracker: pytest.Pytester, reported: Reported
) -> None:
    tracker.makepyfile(test_fragmented=FRAGMENTED)
    result = tracker.runpytest("-p", "no:randomly", "--gpumem-round=cuda", "--gpumem-explain", "--gpumem-json=out.json",
                               "-rA")  # fmt: skip
    result.assert_outcomes(passed=1)
    # split: 2 MiB from a new 20 MiB segment (18 MiB left free in it), 0.5 MiB from a new 2 MiB one (1.5 MiB
    # left): 22 MiB reserved, 2.5 MiB allocated, the 19.5 MiB rest in segments that hold a live block.
    # thirty_twos: the eight 16 MiB segments stay cached, whole (no 32 MiB request fits one): four new ones
    # of 32 MiB make 256 MiB, 128 MiB of it in no block and none of that split.
    result.stdout.fnmatch_lines(
        [
            "  split: peak 2.5 MiB = inputs and other 2.5 MiB",
            "    at the peak: reserved 22.0 MiB, 19.5 MiB of it unallocated (19.5 MiB inactive split)",
            "  thirty_twos: peak 128.0 MiB = inputs and other 128.0 MiB",
            "    at the peak: reserved 256.0 MiB, 128.0 MiB of it unallocated (0 B inactive split)",
        ]
    )
    phases = reported()["test_fragmented"]["explanation"]["phases"]
    assert phases["sixteens"]["reserved_at_peak"] == {
        "reserved_bytes": 128 * MIB, "unallocated_bytes": 0, "inactive_split_bytes": 0,
    }  # fmt: skip


Mib = Callable[[float], Any]  # a tensor of that many MiB


def _explained_in_process(rounding: str, call: Callable[[Any, Mib], object]) -> Explanation:
    """The explanation of `call(meter, mib)` measured as a test's call on the tracker, in this process."""
    import torch

    from pytest_gpumem.backends.tracker.backend import TrackerBackend
    from pytest_gpumem.measure.measurement import Measurement
    from pytest_gpumem.measure.meter import GpuMem

    backend = TrackerBackend(rounding=rounding)
    backend.configure(Settings(None, origins=False, events=False, explain=True))
    measured = Measurement(backend, "t")
    meter = GpuMem(measured)
    measured.explain = True
    measured.begin()
    kept = call(meter, lambda n: torch.empty(int(n * MIB), dtype=torch.uint8))
    record = measured.end()
    del kept
    assert record.explanation is not None, record.notes
    return record.explanation


def _reserved(explanation: Explanation, phase: str = "call") -> tuple[float, float, float] | None:
    """(reserved, unallocated, inactive split) at the phase's peak, in MiB."""
    found = explanation.phases[phase].reserved_at_peak
    return None if found is None else (found.reserved / MIB, found.unallocated / MIB, found.inactive_split / MIB)


def test_a_2_mib_and_a_half_mib_tensor_leave_19_5_of_22_mib_reserved_in_split_segments() -> None:
    # 2 MiB: large pool, a 20 MiB segment split (18 MiB free); 0.5 MiB: a 2 MiB small segment split (1.5 MiB)
    explanation = _explained_in_process("cuda", lambda meter, mib: (mib(2), mib(0.5)))
    assert _reserved(explanation) == (22.0, 19.5, 19.5)


def test_a_cached_whole_segment_is_unallocated_but_not_inactive_split() -> None:
    # 0.5 MiB freed: its 2 MiB segment stays cached with no block; 2 MiB: a new 20 MiB segment, 18 MiB free
    def call(meter: Any, mib: Mib) -> object:
        small = mib(0.5)
        del small
        return mib(2)

    assert _reserved(_explained_in_process("cuda", call)) == (22.0, 20.0, 18.0)


def _freed_then(first: float, second: float) -> Callable[[Any, Mib], object]:
    """128 MiB in tensors of `first` MiB, freed, then 128 MiB in tensors of `second` MiB in phase "then"."""

    def call(meter: Any, mib: Mib) -> object:
        blocks = [mib(first) for _ in range(int(128 // first))]
        del blocks
        with meter.phase("then"):
            return [mib(second) for _ in range(int(128 // second))]

    return call


def test_eight_16_mib_freed_then_four_32_mib_reserve_256_mib_and_the_reverse_128() -> None:
    # each 16 MiB request takes a 16 MiB segment, unsplit; none of them holds 32 MiB: four new segments
    assert _reserved(_explained_in_process("cuda", _freed_then(16, 32)), "then") == (256.0, 128.0, 0.0)
    # the reverse: each cached 32 MiB block splits into two 16 MiB ones, and nothing is left free
    assert _reserved(_explained_in_process("cuda", _freed_then(32, 16)), "then") == (128.0, 0.0, 0.0)


def test_without_the_allocator_model_no_reserved_memory_is_told() -> None:
    explanation = _explained_in_process("none", lambda meter, mib: (mib(2), mib(0.5)))
    assert _reserved(explanation) is None
    assert not any("unallocated" in line for line in describe(explanation))
    assert "reserved_at_peak" not in explanation.phases["call"].to_json()


def test_reserved_at_the_peak_reads_back_and_an_older_explanation_reads_without_it() -> None:
    explanation = _explained_in_process("cuda", lambda meter, mib: (mib(2), mib(0.5)))
    phase = explanation.phases["call"]
    written = phase.to_json()
    half_of_39 = 39 * MIB // 2  # 19.5 MiB
    assert written["reserved_at_peak"] == {
        "reserved_bytes": 22 * MIB, "unallocated_bytes": half_of_39, "inactive_split_bytes": half_of_39,
    }  # fmt: skip
    assert read(PhaseExplanation, written, "phase") == phase
    del written["reserved_at_peak"]
    assert read(PhaseExplanation, written, "phase").reserved_at_peak is None


def test_the_trace_gives_the_models_figures_at_any_moment() -> None:
    from cuda_allocator_model.model import CachingAllocatorModel
    from cuda_allocator_model.trace import AllocatorTrace

    class Ledger:
        model = CachingAllocatorModel()

    trace = AllocatorTrace(Ledger())
    for key, nbytes in ((1, 2 * MIB), (2, MIB // 2)):
        Ledger.model.malloc(key, nbytes)
        trace.record()
    Ledger.model.free(1)  # the 20 MiB segment is whole again: cached, not split
    trace.record()
    assert [trace.at(moment) for moment in range(4)] == [
        (0, 0), (20 * MIB, 18 * MIB), (22 * MIB, 18 * MIB + 3 * MIB // 2), (22 * MIB, 3 * MIB // 2)
    ]  # fmt: skip
    assert list(trace.reserved) == [0, 20 * MIB, 22 * MIB]  # kept only where it changed
