"""Hostile input, end to end: every option, ini value, marker argument, allocator setting, baseline file and
report file that a user could get wrong, each run as a user would run it, counting INTERNALERRORs and
tracebacks through the plugin's own frames (the target is zero of each); and the failures a user's own
code meets under the plugin (issue #48's: a backward or a cast op that raises, a bad fit step, a marker added
in the test, a fork server that cannot start), whose tracebacks must hold no frame of the plugin either.

    python benchmarks/hostile_probes.py [--jobs 2] [--only SUBSTRING] [--json probes.json]

Each probe runs pytest (or `pytest-gpumem`) in a fresh process on a small suite in a temporary folder. A
probe is clean when its output has no `INTERNALERROR` and no frame in `pytest_gpumem/` (a test's own
failure may show the test's frames; a refusal is one line). The table prints the offenders only, then
the counts. Exit status 1 when any probe is not clean.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

SUITE = """
import pytest
import torch


def test_fixture(gpumem):
    with gpumem.phase("forward"):
        x = torch.ones(1024, device=gpumem.device)
    del x


@pytest.mark.max_memory("1 MiB")
def test_marked():
    torch.ones(256)
"""

MARKED = """
import pytest
import torch


@pytest.mark.max_memory({args})
def test_marked(gpumem):
    with gpumem.phase("forward"):
        torch.ones(256, device=gpumem.device)
"""

ODD_VALUES = (
    "",
    " ",
    "-1",
    "+128",
    "0",
    "\u0661\u0662\u0668",  # Arabic-Indic 128
    "\u00b2",  # superscript two
    "9" * 4301,
    "1e999",
    "nan",
    "inf",
    "-inf",
    "5%",
    "1,5 MiB",
    "1 TiB",
    "two",
    "\u00e9",
    "10 GB GB",
    "0x10",
    "1_000",
)
SIZE_OPTIONS = ("--gpumem-slack", "--gpumem-max-memory", "--gpumem-capacity", "--gpumem-leak")
OTHER_OPTIONS = (
    "--gpumem-tolerance",
    "--gpumem-dist-timeout",
    "--gpumem-backend",
    "--gpumem-round",
    "--gpumem-device",
    "--gpumem-paths",
    "--gpumem-devices",
)
PATH_OPTIONS = (
    "--gpumem-json",
    "--gpumem-markdown",
    "--gpumem-baseline-file",
    "--gpumem-html",
    "--gpumem-snapshot-dir",
)
ALLOC_CONFS = (
    "backend:cudaMallocAsync",
    "expandable_segments:maybe",
    "max_split_size_mb:-1",
    "max_split_size_mb:\u00b2",
    "max_split_size_mb:" + "9" * 4301,
    ",expandable_segments:True",
    "roundup_power2_divisions:[>:8]",
    "garbage_collection_threshold:1.5",
    "per_process_memory_fraction:2",
    "pinned_use_cuda_host_register:True,pinned_num_register_threads:3",
    "nonsense",
    ":::",
)
MARKER_ARGS = (
    '"2 apples"',
    "peak=-1",
    "foo=1",
    "1, 2, 3",
    'tolerance="x"',
    'phases={"forward": "x"}',
    'phases={"nope": "1 MiB"}',
    "leak=float('nan')",
    'device="nowhere"',
    'capacity="H100-80GB:banana"',
    "None",
    "[]",
)
BASELINE_FILES = (
    "{",
    "[]",
    "null",
    '{"version": 99}',
    '{"version": 1, "tests": []}',
    '{"version": 1, "tests": {"t.py::t": {"call": {"peak_bytes": "12"}}}}',
    '{"version": 1, "tests": {"t.py::t": {"call": {"peak_bytes": 1e999}}}}',
    "version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 12\n",
    "\x00\x01\x02garbage",
    '{"tests": NaN}',
)
REPORTS = (*BASELINE_FILES, '{"tests": [{"nodeid": 1}]}', '{"tests": [{}]}', '{"tests": "x"}')


FORK_SERVER = """
def nothing(rank, world_size, meter):
    pass


def test_world(gpumem, monkeypatch):
    monkeypatch.setenv("PYTHONHOME", "/nonexistent")
    gpumem.distributed(nothing, 2)
"""

USER_ERRORS = """
import pytest
import torch


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("boom in backward")


def test_backward(gpumem):
    Boom.apply(torch.ones(3, device=gpumem.device, requires_grad=True)).sum().backward()


def test_cast_op(gpumem):
    with torch.autocast("cuda", dtype=torch.float16):
        torch.mm(torch.ones(3, 4, device=gpumem.device), torch.ones(5, 6, device=gpumem.device))


def test_fit_none(gpumem):
    gpumem.fit(None, [1, 2, 4], "1 GB")


def test_fit_no_argument(gpumem):
    gpumem.fit(lambda: torch.ones(10), [1, 2, 4], "1 GB")


def test_marker_in_body(request, gpumem):
    request.node.add_marker(pytest.mark.max_memory(capacity="1 MiB", device="meta"))
    torch.zeros(1024, 1024, device=gpumem.device)


def test_item(gpumem):
    torch.ones(3, device=gpumem.device).sum().item()
"""

UNMEASURED = """
import torch


def test_device(gpumem):
    torch.ones(3, device=gpumem.device)
"""


def issue_48() -> Iterator[Probe]:
    """The defects issue #48 found outside replay, each as its user met it."""
    for conf in ("garbage", "max_split_size_mb:\u00b2"):
        env = (("PYTORCH_CUDA_ALLOC_CONF", conf),)
        disabled, files = ("--gpumem-disable", "--gpumem-round=cuda"), (("test_unmeasured.py", UNMEASURED),)
        yield Probe(f"#48 disable ALLOC_CONF={conf!r}", disabled, env=env, files=files)
    workspace = (("CUBLAS_WORKSPACE_CONFIG", ":" + "9" * 5000 + ":2"),)
    for flag in ("--gpumem-round=cuda", "--gpumem-device=meta"):
        yield Probe(f"#48 CUBLAS_WORKSPACE_CONFIG 5,000 digits {flag}", (flag,), env=workspace)
    yield Probe("#48 fork server cannot start", (), files=(("test_world.py", FORK_SERVER),))
    for device in ((), ("--gpumem-device=meta",)):
        yield Probe(f"#48 user errors {' '.join(device)}", device, files=(("test_user.py", USER_ERRORS),))


@dataclass(frozen=True)
class Probe:
    name: str
    argv: tuple[str, ...]  # after `python -m pytest` or `python -m pytest_gpumem`
    cli: bool = False
    env: tuple[tuple[str, str], ...] = ()
    files: tuple[tuple[str, str], ...] = (("test_suite.py", SUITE),)


@dataclass(frozen=True)
class Outcome:
    probe: Probe
    rc: int
    internal: bool
    frames: tuple[str, ...]
    last: str


def probes() -> Iterator[Probe]:
    for option in SIZE_OPTIONS + OTHER_OPTIONS:
        for value in ODD_VALUES:
            yield Probe(f"{option}={value[:12]!r}", (f"{option}={value}",))
        ini = option.removeprefix("--").replace("-", "_")
        for value in ODD_VALUES[:8]:
            yield Probe(f"-o {ini}={value[:12]!r}", ("-o", f"{ini}={value}"))
    for option in PATH_OPTIONS:
        for value in ("", ".", "/proc/none/x", "/dev/null/x", "\u00e9/\u00e9.json", "a" * 300):
            yield Probe(f"{option}={value[:12]!r}", (f"{option}={value}", "--gpumem-report"))
    for conf in ALLOC_CONFS:
        for rounding in ("none", "cuda"):
            env = (("PYTORCH_CUDA_ALLOC_CONF", conf),)
            yield Probe(f"ALLOC_CONF={conf[:24]!r} round={rounding}", (f"--gpumem-round={rounding}",), env=env)
    for args in MARKER_ARGS:
        yield Probe(f"max_memory({args[:24]})", (), files=(("test_marked.py", MARKED.format(args=args)),))
    for i, text in enumerate(BASELINE_FILES):
        files = (("test_suite.py", SUITE), ("gpumem-baselines.json", text))
        yield Probe(f"baseline file #{i}", (), files=files)
        yield Probe(f"baseline file #{i} --gpumem-update", ("--gpumem-update",), files=files)
    for i, text in enumerate(REPORTS):
        files = (("old.json", text), ("new.json", text))
        yield Probe(f"compare report #{i}", ("compare", "old.json", "new.json"), cli=True, files=files)
        yield Probe(f"merge report #{i}", ("merge", "old.json", "new.json", "-o", "m.json"), cli=True, files=files)
    for flag, value in (("--since", "2026-11-31"), ("--max-growth", "x"), ("--top", "-1"), ("--slack", "\u00b2")):
        yield Probe(f"history {flag} {value}", ("history", flag, value), cli=True, files=())
    for i, pickle in enumerate(("", "not a pickle", "version https://git-lfs.github.com/spec/v1\n")):
        yield Probe(f"replay bad file #{i}", ("replay", "s.pickle"), cli=True, files=(("s.pickle", pickle),))
    yield from issue_48()


PLUGIN_FRAME = re.compile(r"(pytest_gpumem[/\\][\w/\\]+\.py)[\":, ]+(?:line )?(\d+)")


def run(probe: Probe, timeout: float) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="probe-") as folder:
        root = Path(folder)
        for name, text in probe.files:
            (root / name).write_text(text, encoding="utf-8", errors="surrogateescape")
        module = "pytest_gpumem" if probe.cli else "pytest"
        tail = () if probe.cli else ("-p", "no:cacheprovider", "-q")
        env = {key: value for key, value in os.environ.items() if key != "PYTORCH_CUDA_ALLOC_CONF"}
        env.update(probe.env, COLUMNS="100")
        try:
            done = subprocess.run(
                [sys.executable, "-m", module, *probe.argv, *tail],
                cwd=root,
                env=env,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return Outcome(probe, -1, False, (), f"timed out after {timeout:.0f} s")
    text = done.stdout + done.stderr
    frames = tuple(sorted({f"{m.group(1)}:{m.group(2)}" for m in PLUGIN_FRAME.finditer(text)}))
    lines = [line for line in text.splitlines() if line.strip()]
    return Outcome(probe, done.returncode, "INTERNALERROR" in text, frames, lines[-1][:100] if lines else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", default="")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    chosen = [p for p in probes() if args.only in p.name]
    with ThreadPoolExecutor(args.jobs) as pool:
        outcomes = list(pool.map(lambda p: run(p, args.timeout), chosen))
    bad = [o for o in outcomes if o.internal or o.frames or o.rc < 0]
    for o in bad:
        what = "INTERNALERROR" if o.internal else ("timeout" if o.rc < 0 else "plugin frames")
        print(f"{o.probe.name[:40]:40} rc={o.rc:<3} {what}: {', '.join(o.frames[:2]) or o.last}")
    internal = sum(o.internal for o in outcomes)
    framed = sum(bool(o.frames) for o in outcomes)
    print(f"{len(outcomes)} probes: {internal} INTERNALERROR, {framed} with plugin frames, {len(bad)} not clean")
    if args.json is not None:
        rows = [{"probe": o.probe.name, "rc": o.rc, "internal": o.internal, "frames": o.frames} for o in outcomes]
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
