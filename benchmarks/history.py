"""History: `pytest-gpumem history` over a generated repository of 1,000 commits x 500 tests.

    python benchmarks/history.py [--commits 1000] [--tests 500]

The repository is built with `git fast-import` (one process, no work tree) in a temporary folder; each
commit grows one test's figure by 1%. Prints the build time and the time `history` takes (target: < 10 s).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from pytest_gpumem.cli import main

IDENTITY = {"backend": "tracker", "device": "cpu", "capability": None, "total_memory": None}


def baselines(peaks: list[int]) -> bytes:
    entries = {
        f"tests/test_models.py::test_model[{i}]": {
            "tracker | cpu": {"cuda": None, "torch": "2.13.0", "identity": IDENTITY, "peak_bytes": peak,
                              "phases": {"backward": peak // 3, "forward": peak // 2}}
        }
        for i, peak in enumerate(peaks)
    }  # fmt: skip
    doc = {"schema": "pytest-gpumem-baselines", "version": 1, "entries": entries}
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def build(repo: Path, commits: int, tests: int) -> None:
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    peaks = [1 << 20] * tests
    stream = io.BytesIO()
    for n in range(commits):
        peaks[n % tests] = peaks[n % tests] * 101 // 100
        data, message = baselines(peaks), f"commit {n}".encode()
        stamp = 1_790_000_000 + 3600 * n
        stream.write(b"commit refs/heads/main\n")
        stream.write(b"committer Bench <bench@example.com> %d +0000\n" % stamp)
        stream.write(b"data %d\n%s\n" % (len(message), message))
        stream.write(b"M 100644 inline gpumem-baselines.json\ndata %d\n%s\n" % (len(data), data))
    subprocess.run(["git", "-C", str(repo), "fast-import", "--quiet"], input=stream.getvalue(), check=True)
    subprocess.run(["git", "-C", str(repo), "checkout", "-q", "main"], check=True)


def main_() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--commits", type=int, default=1000)
    p.add_argument("--tests", type=int, default=500)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder) / "repo"
        start = time.perf_counter()
        build(repo, args.commits, args.tests)
        built = time.perf_counter() - start
        os.chdir(repo)
        out = io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(out):
            status = main(["history", "--no-sparklines", "--since", "main~500", "--max-growth", "50"])
        took = time.perf_counter() - start
        os.chdir(folder)
    rows = len(out.getvalue().splitlines())
    print(f"built {args.commits} commits x {args.tests} tests in {built:.1f} s (git fast-import)")
    print(f"history: {took:.2f} s for {args.commits} versions ({rows} lines of output, exit {status}; target < 10 s)")


if __name__ == "__main__":
    main_()
