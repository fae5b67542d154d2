"""A third-party suite measured test by test: the same outcomes as unmeasured, and the time it costs.

    python benchmarks/third_party.py [--package einops==0.8.2] [--explain] [--json PATH]

Downloads the package's source distribution from the package index (its tests ship in it), runs its
test suite with the plugin disabled (`-p no:gpumem`) and with every test measured on the tracker
(`--gpumem-all`), and compares the outcome of each test. Nothing of the suite is kept here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import benchlib

SUITES = {"einops": ("einops/tests", {"EINOPS_TEST_BACKENDS": "torch"})}


def fetch(requirement: str, into: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", requirement, "-d", into],
        check=True,
    )
    (archive,) = into.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    (source,) = (p for p in into.iterdir() if p.is_dir())
    return source


def outcomes(junit: Path) -> dict[str, str]:
    result = {}
    for case in ET.parse(junit).iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        result[f"{case.get('classname')}::{case.get('name')}"] = kinds[0] if kinds else "passed"
    return result


def run(source: Path, tests: str, env: dict[str, str], measured: bool, junit: Path, extra: list[str]) -> float:
    plugin = ["--gpumem-all", "--gpumem-backend=tracker", *extra] if measured else ["-p", "no:gpumem"]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *plugin, tests]
    path = str(source)
    start = time.perf_counter()
    subprocess.run(command, cwd=source, env={**os.environ, **env, "PYTHONPATH": path}, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    p = benchlib.parser(__doc__ or "")
    p.add_argument("--package", default="einops==0.8.2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--explain", action="store_true", help="also explain every measured test's peaks")
    args = p.parse_args()
    name = args.package.split("==")[0]
    tests, env = SUITES[name]
    with tempfile.TemporaryDirectory() as tmp:
        source = fetch(args.package, Path(tmp))
        times: dict[bool, list[float]] = {False: [], True: []}
        seen: dict[bool, dict[str, str]] = {}
        for _ in range(args.rounds):
            for measured in (False, True):
                junit = Path(tmp) / f"{measured}.xml"
                extra = ["--gpumem-explain"] if args.explain else []
                times[measured].append(run(source, tests, env, measured, junit, extra))
                seen[measured] = outcomes(junit)
    differ = sorted(t for t in seen[False] if seen[False][t] != seen[True].get(t))
    idle, busy = benchlib.median(times[False]), benchlib.median(times[True])
    counts = {kind: sum(1 for o in seen[False].values() if o == kind) for kind in ("passed", "skipped", "failure")}
    ratio = f"{busy / idle:.2f}x"
    rows = [[args.package, len(seen[False]), str(counts), len(differ), f"{idle:.1f}", f"{busy:.1f}", ratio]]
    headers = ["suite", "tests", "unmeasured outcomes", "differ", "idle s", "measured s", "ratio"]
    benchlib.show("third-party suite, every test measured (median of rounds)", headers, rows, differ)
    benchlib.write_json(args.json, {"suite": args.package, "differ": differ, "idle_s": idle, "measured_s": busy})


if __name__ == "__main__":
    main()
