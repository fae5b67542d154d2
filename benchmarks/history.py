"""History: `pytest-gpumem history` over a generated repository of 1,000 commits x 500 tests.

    python benchmarks/history.py [--commits 1000] [--tests 500] [--reports 100] [--keep DIR]

The repository is built with `git fast-import` (one process, no work tree) in a temporary folder; each
commit grows one test's figure by 1%. A folder of `--gpumem-json` reports, one at each of the last
`--reports` commits (every test, on another identity), joins the second run. Prints the build time, the
time of the gate over every version, and of the gate over the last 500 with the reports joined, the page
and the JSON written, and their sizes (target: < 10 s each, wall clock; the CPU time of this process is
printed beside it, since a busy machine stretches the wall clock). `--keep DIR` keeps the page and the
JSON there (to look at a page of 500 tests).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from pytest_gpumem.cli import main

IDENTITY = {"backend": "tracker", "device": "cpu", "capability": None, "total_memory": None}
GPU = {"backend": "cuda", "device": "NVIDIA H200", "capability": "9.0", "total_memory": 150754820096}


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


def report(peaks: list[int], sha: str) -> str:
    def test(i: int, peak: int) -> dict[str, object]:
        phases = {"backward": {"peak_bytes": peak // 3}, "forward": {"peak_bytes": peak // 2}}
        record = {"identity": GPU, "peak_bytes": peak, "phases": {}, "torch": "2.13.0", "cuda": "12.8"}
        nodeid = f"tests/test_models.py::test_model[{i}]"
        return {"nodeid": nodeid, "backend": "cuda", "device": "cuda:0", "peak_bytes": peak, "phases": phases,
                "status": "ok", "record": record}  # fmt: skip

    doc = {"version": 1, "backend": "cuda", "device": "cuda:0", "commit": {"sha": sha, "dirty": False}}
    return json.dumps({**doc, "tests": [test(i, peak * 5 // 4) for i, peak in enumerate(peaks)]})


def build(repo: Path, commits: int, tests: int, reports: int) -> None:
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    peaks = [1 << 20] * tests
    stream = io.BytesIO()
    figures = []
    for n in range(commits):
        peaks[n % tests] = peaks[n % tests] * 101 // 100
        data, message = baselines(peaks), f"commit {n}".encode()
        stamp = 1_790_000_000 + 3600 * n
        stream.write(b"commit refs/heads/main\nmark :%d\n" % (n + 1))
        stream.write(b"committer Bench <bench@example.com> %d +0000\n" % stamp)
        stream.write(b"data %d\n%s\n" % (len(message), message))
        stream.write(b"M 100644 inline gpumem-baselines.json\ndata %d\n%s\n" % (len(data), data))
        figures.append(list(peaks))
    marks = repo / "marks"
    command = ["git", "-C", str(repo), "fast-import", "--quiet", f"--export-marks={marks}"]
    subprocess.run(command, input=stream.getvalue(), check=True)
    subprocess.run(["git", "-C", str(repo), "checkout", "-q", "main"], check=True)
    shas = dict(line.split() for line in marks.read_text().splitlines())
    marks.unlink()
    folder = repo / "reports"
    folder.mkdir()
    for n in range(max(0, commits - reports), commits):
        (folder / f"run-{n}.json").write_text(report(figures[n], shas[f":{n + 1}"]))


def timed(argv: list[str]) -> tuple[str, int, int]:
    """How long `argv` took (wall clock, and this process's CPU: the machine may be busy), its exit
    status and how many lines it printed."""
    out = io.StringIO()
    start, cpu = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        status = main(argv)
    took = f"{time.perf_counter() - start:.2f} s (CPU {time.process_time() - cpu:.2f} s)"
    return took, status, len(out.getvalue().splitlines())


def main_() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--commits", type=int, default=1000, help="commits of the baseline file (default 1000)")
    p.add_argument("--tests", type=int, default=500, help="tests in the file (default 500)")
    p.add_argument("--reports", type=int, default=100, help="reports at the last commits (default 100)")
    p.add_argument("--keep", type=Path, default=None, metavar="DIR", help="keep history.html and history.json here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder) / "repo"
        start = time.perf_counter()
        build(repo, args.commits, args.tests, args.reports)
        built = time.perf_counter() - start
        os.chdir(repo)
        took, status, rows = timed(["history", "--no-sparklines", "--max-growth", "50"])
        since = ["history", "--no-sparklines", "--since", "main~500", "--max-growth", "50"]
        outputs = ["--reports", "reports", "--html", "../history.html", "--json", "../history.json"]
        full, full_status, full_rows = timed([*since, *outputs])
        os.chdir(folder)
        page, doc = (Path(folder, name).stat().st_size / 1e6 for name in ("history.html", "history.json"))
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            for name in ("history.html", "history.json"):
                shutil.copy(Path(folder, name), args.keep / name)
    print(f"built {args.commits} commits x {args.tests} tests, {args.reports} reports in {built:.1f} s")
    print(f"history: {took} for {args.commits} versions ({rows} lines of output, exit {status}; target < 10 s)")
    print(
        f"--since main~500 --reports ({args.reports} reports) --html --json: {full} ({full_rows} lines, exit "
        f"{full_status}); page {page:.2f} MB, JSON {doc:.1f} MB"
    )


if __name__ == "__main__":
    main_()
