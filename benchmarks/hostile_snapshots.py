"""Hostile and damaged snapshots, end to end: each file is made here (never stored), then `pytest-gpumem
replay` runs on it in a fresh process, as a user would run it, with a time limit; the row says how it
ended (exit status, a one-line refusal or a result), whether a traceback or a signal was seen, and the
time and the most memory it took.

    python benchmarks/hostile_snapshots.py [--only SUBSTRING] [--json PATH] [--source DIR]

`--source DIR` runs the packages found in DIR (an exported older commit: `git archive COMMIT pytest_gpumem
cuda_allocator_model | tar -x -C DIR`), for a before-and-after table. A case is clean when it exits 0 or 2,
shows no traceback, says a refusal in one line, and takes under 10 s and 1 GiB. Exit status 1 when any case
is not clean.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
TIMEOUT_S = 30.0
CLEAN_S, CLEAN_RSS = 10.0, GiB


def frame(name: str = "step", filename: str = "train.py", line: int = 1) -> dict[str, Any]:
    return {"name": name, "filename": filename, "line": line}


def event(action: str, addr: int, size: int, **extra: Any) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": [frame()], **extra}


def card(device_traces: list[Any] | None = None, **top: Any) -> dict[str, Any]:
    """A small from-empty card trace: a 2 MiB segment, 1000 B allocated and freed."""
    base = 0x7F0000000000
    trace = [
        event("segment_alloc", base, 2 * MiB),
        event("alloc", base, 1000),
        event("free_requested", base, 1000),
        event("free_completed", base, 1000),
    ]
    segment = {"device": 0, "address": base, "total_size": 2 * MiB, "stream": 0, "segment_type": "small",
               "blocks": [{"address": base, "size": 2 * MiB, "requested_size": 0, "state": "inactive"}]}  # fmt: skip
    return {"segments": [segment], "device_traces": [trace] if device_traces is None else device_traces, **top}


def dumped(value: object) -> bytes:
    return pickle.dumps(value, protocol=4)


def framed(body: bytes) -> bytes:
    return b"\x80\x04" + body


@dataclass
class Case:
    name: str
    make: Callable[[Path], list[str]]  # writes its files in the folder, returns replay's arguments
    expect: int = 2  # the exit status: 2 a refusal in one line, 0 a result
    must_say: str = ""  # what the output must hold


def _file(folder: Path, name: str, data: bytes) -> str:
    path = folder / name
    path.write_bytes(data)
    return str(path)


def _deep_tuple_key(depth: int) -> bytes:
    return framed(b"}N" + b"\x85" * depth + b"K\x01s.")


def _shared_traces(folder: Path) -> list[str]:
    """100,000 devices whose traces are one list of 10,000 events: 10^9 events from a small file."""
    one = [event("alloc", 0x7F0000000000 + 512 * i, 512) for i in range(10_000)]
    return [_file(folder, "shared.pickle", dumped({"segments": [], "device_traces": [one] * 100_000}))]


def _after_stop(folder: Path) -> list[str]:
    """A good snapshot followed by 2 GiB of nothing (a sparse file)."""
    path = folder / "tail.pickle"
    path.write_bytes(dumped(card()))
    with path.open("r+b") as out:
        out.truncate(2 * GiB)
    return [str(path)]


def _fifo(folder: Path) -> list[str]:
    path = folder / "fifo.pickle"
    os.mkfifo(path)
    return [str(path)]


def _against_device_1(folder: Path) -> list[str]:
    real = _file(folder, "card1.pickle", dumped(card(device_traces=[[], card()["device_traces"][0]])))
    ours = _file(folder, "ours.pickle", dumped(card()))
    return [real, "--against", ours]


def _huge_alloc_against(folder: Path) -> list[str]:
    trace = [event("alloc", 0x7F0000000000, 1 << 60)]
    real = _file(folder, "eib.pickle", dumped(card(device_traces=[trace])))
    return [real, "--against", _file(folder, "ours.pickle", dumped(card()))]


def _with_frames(frames: list[dict[str, Any]]) -> Callable[[Path], list[str]]:
    def make(folder: Path) -> list[str]:
        snapshot = card()
        for e in snapshot["device_traces"][0]:
            e["frames"] = frames
        return [_file(folder, "frames.pickle", dumped(snapshot)), "--capacity", "1 MiB"]

    return make


def _bad_event(**fields: Any) -> Callable[[Path], list[str]]:
    def make(folder: Path) -> list[str]:
        snapshot = card()
        snapshot["device_traces"][0][1].update(fields)
        return [_file(folder, "bad.pickle", dumped(snapshot))]

    return make


def _settings(divisions: dict[Any, Any]) -> Callable[[Path], list[str]]:
    def make(folder: Path) -> list[str]:
        settings = {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "roundup_power2_divisions": divisions}
        return [_file(folder, "settings.pickle", dumped(card(allocator_settings=settings)))]

    return make


def _same_output(*flags: str) -> Callable[[Path], list[str]]:
    def make(folder: Path) -> list[str]:
        path = _file(folder, "card.pickle", dumped(card()))
        out = str(folder / "out.txt")
        return [path, *(x for flag in flags for x in (flag, path if flag == "--json" and len(flags) == 1 else out))]

    return make


def cases() -> Iterator[Case]:
    yield Case("BUILD on a dict", lambda d: [_file(d, "b.pickle", framed(b"}}b."))])
    yield Case("APPENDS on a dict", lambda d: [_file(d, "a.pickle", framed(b"}(K\x01e."))])
    yield Case("8-byte length of 2^63", lambda d: [_file(d, "l.pickle", framed(b"\x8d" + struct.pack("<Q", 1 << 63)))])
    yield Case("a 5,000-digit key", lambda d: [_file(d, "k.pickle", dumped({10**5000: 1}))])
    yield Case("100,000-deep tuple key", lambda d: [_file(d, "t5.pickle", _deep_tuple_key(100_000))])
    yield Case("1,000,000-deep tuple key", lambda d: [_file(d, "t6.pickle", _deep_tuple_key(1_000_000))])
    yield Case("10 MB of opcodes before a TUPLE1", lambda d: [_file(d, "run.pickle", framed(b"N" * 10**7 + b"\x85."))])
    yield Case("divisions key '²'", _settings({"²": 4}))
    yield Case("divisions of 10^100", _settings({"1": 10**100}))
    yield Case("a negative size", _bad_event(size=-4096))
    yield Case("an address of 2^70", _bad_event(addr=1 << 70))
    yield Case("an alloc of 1 EiB under --against", _huge_alloc_against)
    surrogate, escapes = frame("step\udc80", "tr\ud800ain.py"), frame("\x1b]0;owned\x07", "\x1b[31mred.py")
    yield Case("a lone surrogate in a frame", _with_frames([surrogate]), 0, "tr\ufffdain.py")
    yield Case("escape sequences in a frame", _with_frames([escapes]), 0, "\u241b[31mred.py")
    yield Case("/dev/zero", lambda d: ["/dev/zero"])
    yield Case("a FIFO", _fifo)
    yield Case("a folder", lambda d: [str(d)])
    yield Case("an empty file", lambda d: [_file(d, "empty.pickle", b"")])
    yield Case("LONG_BINPUT 2^27 (9 bytes)", lambda d: [_file(d, "m.pickle", b"N" + b"r" + struct.pack("<I", 1 << 27))])
    yield Case("100,000 devices sharing one trace", _shared_traces)
    yield Case("2 GiB after the pickle's STOP", _after_stop, 0)
    yield Case("a global (os.system)", lambda d: [_file(d, "g.pickle", b"cos\nsystem\n(S'true'\ntR.")])
    yield Case("a truncated snapshot", lambda d: [_file(d, "cut.pickle", dumped(card())[:200])])
    yield Case("--json onto the snapshot", _same_output("--json"))
    yield Case("--json X --html X", _same_output("--json", "--html"))
    yield Case(
        "per_process_memory_fraction, no capacity",
        lambda d: [_file(d, "c.pickle", dumped(card())), "--alloc-conf", "per_process_memory_fraction:0.1"],
    )
    yield Case("--against a card traced on cuda:1", _against_device_1, 0, "device 1")


@dataclass
class Outcome:
    case: str
    exit: int | None  # None: killed at the time limit
    lines: int
    last_line: str
    traceback: bool
    seconds: float
    rss_mib: float
    clean: bool


def run(case: Case, folder: Path, source: Path | None) -> Outcome:
    args = case.make(folder)
    env = {**os.environ, "PYTHONPATH": str(source)} if source else dict(os.environ)
    command = [sys.executable, "-m", "pytest_gpumem", "replay", *args]
    started = time.perf_counter()
    with tempfile.TemporaryFile() as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=folder)
        code: int | None
        try:
            code = process.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            code = None
        seconds = time.perf_counter() - started
        out.seek(0)
        text = out.read().decode("utf-8", "backslashreplace")
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    lines = [line for line in text.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    traceback = "Traceback (most recent call last)" in text
    refused_in_one = code != 2 or len(lines) == 1
    clean = code == case.expect and not traceback and refused_in_one and case.must_say in text and "\x1b" not in text
    clean = clean and seconds < CLEAN_S and rss * MiB < CLEAN_RSS
    return Outcome(case.name, code, len(lines), last[:110], traceback, seconds, rss, clean)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="hostile snapshots through `pytest-gpumem replay`")
    p.add_argument("--only", default="", help="run the cases whose name holds this")
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    p.add_argument("--source", type=Path, default=None, metavar="DIR", help="run the package in DIR")
    args = p.parse_args(argv)
    outcomes = []
    print(f"{'case':<42} {'exit':>4} {'lines':>5} {'tb':>3} {'s':>6} {'MiB':>6}  last line")
    for case in cases():
        if args.only not in case.name:
            continue
        with tempfile.TemporaryDirectory() as folder:
            # each case in its own process pool: RUSAGE_CHILDREN is the most of all children so far
            o = _isolated(case, Path(folder), args.source)
        outcomes.append(o)
        code = "kill" if o.exit is None else str(o.exit)
        mark = "" if o.clean else "  <- not clean"
        row = f"{o.case:<42} {code:>4} {o.lines:>5} {'yes' if o.traceback else 'no':>3} {o.seconds:>6.2f}"
        print(f"{row} {o.rss_mib:>6.0f}  {o.last_line[:80]}{mark}")
    bad = [o for o in outcomes if not o.clean]
    print(f"{len(outcomes)} cases: {len(outcomes) - len(bad)} clean, {len(bad)} not")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=2) + "\n")
    return 1 if bad else 0


def _isolated(case: Case, folder: Path, source: Path | None) -> Outcome:
    """`run` in a child process, so that the memory figure is this case's alone."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        outcome = run(case, folder, source)
        os.write(write, json.dumps(asdict(outcome)).encode())
        os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.close(read)
    os.waitpid(pid, 0)
    return Outcome(**json.loads(data))


if __name__ == "__main__":
    sys.exit(main())
