"""GPU validation of the caching allocator's model: the same sequences on the card and in the model, byte for byte.

    python benchmarks/validate_allocator.py --json validate_allocator.json [--steps 300] [--seed 0]
    python benchmarks/validate_allocator.py --stand-in --json /tmp/v.json   # every code path, on CPU

For each allocator setting (PYTORCH_CUDA_ALLOC_CONF) a fresh process is started with the variable set
before torch initializes CUDA. It replays the hand-derived sequences of tests/allocator_model/ that
apply to the setting and a seeded random sequence, on the card (`torch.empty(nbytes, dtype=torch.uint8,
device="cuda")`, `del`, `torch.cuda.empty_cache()`, a side stream for stream 1, and
`torch.cuda.set_per_process_memory_fraction` for the sequences that run out of memory) and in
`CachingAllocatorModel` side by side. After every step it compares `torch.cuda.memory_stats()`'s
allocated, reserved, requested and inactive-split bytes (current and peak), `num_alloc_retries` and
`num_ooms` with the model's, and whether each raised out of memory (with the size CUDA's message says it
tried to allocate); at the end of a sequence, the segments and blocks of `torch.cuda.memory_snapshot()`
against the model's `segments()` (as multisets: the card's addresses are not the model's). One table,
and with --json every comparison. Exit status 1 when any figure differs.

No matmul runs (no cuBLAS workspace), and each sequence starts from an emptied cache with its peaks and
counters reset; a sequence that does not start from zero bytes is reported with its baseline.
Without CUDA it exits 0 with one line, unless --stand-in replaces the card with a second model (which
checks the script, not the model: every figure then agrees by construction).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout where the package is not installed
    sys.path.insert(0, str(ROOT))

from cuda_allocator_model.model import (  # noqa: E402
    AllocatorOutOfMemory,
    AllocatorSettings,
    CachingAllocatorModel,
)

KiB = 1 << 10
MiB = 1 << 20
STAND_IN = "model stand-in (no CUDA)"

Op = tuple[Any, ...]  # ("malloc", key, nbytes, stream) | ("free", key) | ("empty",) | ("limit", bytes | None)

STATS = (
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "reserved_bytes.all.current",
    "reserved_bytes.all.peak",
    "requested_bytes.all.current",
    "requested_bytes.all.peak",
    "inactive_split_bytes.all.current",
    "inactive_split_bytes.all.peak",
    "num_alloc_retries",
    "num_ooms",
)

# ---------------------------------------------------------------------------------------- sequences


class Seq:
    """A sequence of operations, with keys handed out in order."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.next = 0

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        key = self.next
        self.next += 1
        self.ops.append(("malloc", key, nbytes, stream))
        return key

    def free(self, *keys: int) -> None:
        self.ops.extend(("free", key) for key in keys)

    def empty(self) -> None:
        self.ops.append(("empty",))

    def limit(self, nbytes: int | None) -> None:
        self.ops.append(("limit", nbytes))


def default_sequences() -> Iterator[tuple[str, list[Op]]]:
    """The hand-derived cases of the tests, with the default settings."""
    yield from placement_sequences()
    yield from fragmentation_sequences()


def placement_sequences() -> Iterator[tuple[str, list[Op]]]:
    """Rounding, pools, best fit and streams (tests/allocator_model/test_caching_allocator_rules.py)."""
    s = Seq()
    s.malloc(1), s.malloc(512), s.malloc(513), s.malloc(1024)
    yield "rounding to 512 B (randn(256) adds 1024 B)", s.ops
    s = Seq()
    s.malloc(0)
    yield "0 bytes touch nothing", s.ops
    s = Seq()
    for _ in range(3):
        s.malloc(MiB)
    yield "three 1 MiB in two 2 MiB segments", s.ops
    s = Seq()
    s.malloc(2 * MiB), s.malloc(MiB // 2), s.malloc(2 * MiB)
    yield "2 MiB, 0.5 MiB, 2 MiB: 22 MiB", s.ops
    s = Seq()
    s.malloc(27 * MiB // 2), s.malloc(25 * MiB // 2)
    yield "13.5 MiB counts 14 MiB, 12.5 MiB counts 12.5 MiB", s.ops
    s = Seq()
    keys = [s.malloc(16 * MiB) for _ in range(8)]
    s.free(*keys)
    for _ in range(4):
        s.malloc(32 * MiB)
    yield "eight 16 MiB freed, four 32 MiB: 256 MiB", s.ops
    s = Seq()
    keys = [s.malloc(32 * MiB) for _ in range(4)]
    s.free(*keys)
    for _ in range(8):
        s.malloc(16 * MiB)
    yield "four 32 MiB freed, eight 16 MiB: 128 MiB", s.ops
    s = Seq()
    a, b = s.malloc(16 * MiB), s.malloc(12 * MiB)
    s.free(a, b)
    s.malloc(11 * MiB), s.malloc(16 * MiB)
    c, d = s.malloc(12 * MiB), s.malloc(12 * MiB)
    s.free(d, c)
    s.malloc(12 * MiB)
    yield "best fit and the lower address", s.ops
    s = Seq()
    s.free(s.malloc(1024, stream=1))
    s.malloc(1024, stream=0), s.malloc(1024, stream=1)
    yield "a block freed on another stream", s.ops


def fragmentation_sequences() -> Iterator[tuple[str, list[Op]]]:
    """Merging, inactive split, empty_cache and out of memory (tests/allocator_model/), and the
    explanation's reserved memory at a peak (tests/test_explain.py)."""
    s = Seq()
    a, b, c = (s.malloc(256 * KiB) for _ in range(3))
    s.free(b, a, c)
    yield "merging and inactive split in a 2 MiB segment", s.ops
    s = Seq()
    s.malloc(2 * MiB), s.malloc(19 * MiB)
    yield "fragmentation: 19 MiB beside 18 MiB free", s.ops
    s = Seq()
    s.free(s.malloc(MiB // 2))
    s.malloc(2 * MiB)
    yield "0.5 MiB freed, 2 MiB: 22 MiB reserved, 18 MiB inactive split", s.ops
    s = Seq()
    a = s.malloc(16 * MiB)
    s.malloc(2 * MiB)
    s.free(a)
    s.empty()
    yield "empty_cache keeps the segment with a live block", s.ops
    s = Seq()
    s.limit(64 * MiB)
    s.free(s.malloc(32 * MiB))
    s.malloc(40 * MiB)
    yield "out of memory: cached block freed, retry succeeds", s.ops
    s = Seq()
    s.limit(48 * MiB)
    s.malloc(6 * MiB)
    b = s.malloc(14 * MiB)
    s.malloc(6 * MiB)
    s.free(b)
    s.malloc(15 * MiB)
    yield "out of memory after the retry (fragmented)", s.ops
    s = Seq()
    s.limit(20 * MiB)
    s.malloc(16 * MiB), s.malloc(8 * MiB)
    yield "out of memory without fragmentation", s.ops


def max_split_sequences() -> Iterator[tuple[str, list[Op]]]:
    """With max_split_size_mb:20."""
    s = Seq()
    s.free(s.malloc(40 * MiB))
    s.malloc(5 * MiB)
    yield "oversize block kept from a small request", s.ops
    s = Seq()
    s.free(s.malloc(40 * MiB))
    s.malloc(25 * MiB)
    s.free(s.malloc(56 * MiB))
    s.malloc(30 * MiB)
    yield "oversize block within 20 MiB serves unsplit", s.ops
    s = Seq()
    s.limit(150 * MiB)
    a, b = s.malloc(40 * MiB), s.malloc(90 * MiB)
    s.free(a, b)
    s.malloc(60 * MiB)
    yield "out of memory: one oversize block released", s.ops
    s = Seq()
    s.limit(100 * MiB)
    a, b = s.malloc(40 * MiB), s.malloc(50 * MiB)
    s.free(a, b)
    s.malloc(60 * MiB)
    yield "out of memory: the largest oversize blocks released", s.ops


def rounding_limit_sequences() -> Iterator[tuple[str, list[Op]]]:
    """With max_split_size_mb:32,max_non_split_rounding_mb:64."""
    s = Seq()
    s.free(s.malloc(90 * MiB))
    s.malloc(40 * MiB)
    yield "oversize block within 64 MiB serves unsplit", s.ops


def expandable_sequences() -> Iterator[tuple[str, list[Op]]]:
    """With expandable_segments:True."""
    s = Seq()
    keys = [s.malloc(16 * MiB) for _ in range(8)]
    s.free(*keys)
    for _ in range(4):
        s.malloc(32 * MiB)
    yield "eight 16 MiB freed, four 32 MiB: 140 MiB", s.ops
    s = Seq()
    for _ in range(3):
        s.malloc(MiB)
    s.malloc(27 * MiB // 2)
    yield "2 MiB small pages, splits to 512 B", s.ops
    s = Seq()
    a, b, c = (s.malloc(16 * MiB) for _ in range(3))
    s.free(a, c)
    s.empty()
    s.free(b)
    s.empty()
    yield "empty_cache unmaps whole free pages only", s.ops
    s = Seq()
    a, b, c = (s.malloc(20 * MiB) for _ in range(3))
    s.free(b)
    s.empty()
    s.malloc(20 * MiB)
    yield "an unmapped gap is refilled first", s.ops
    s = Seq()
    s.limit(60 * MiB)
    s.free(s.malloc(50 * MiB))
    s.malloc(KiB)
    yield "out of memory: the retry unmaps free pages", s.ops
    s = Seq()
    s.malloc(16 * MiB), s.malloc(10 * MiB)
    yield "the free tail before new pages", s.ops


def roundup_sequences() -> Iterator[tuple[str, list[Op]]]:
    """With roundup_power2_divisions:4."""
    s = Seq()
    s.malloc(84 * MiB), s.malloc(1200), s.malloc(3000), s.malloc(64 * MiB)
    yield "84 MiB -> 96 MiB; 1200 B -> 1536 B", s.ops


def large_segment_sequences() -> Iterator[tuple[str, list[Op]]]:
    """With large_segment_size_mb:32."""
    s = Seq()
    s.malloc(2 * MiB), s.malloc(9 * MiB), s.malloc(11 * MiB)
    yield "2 MiB from a 32 MiB segment", s.ops


def random_sequence(seed: int, steps: int, limit: int | None = None, streams: bool = True) -> list[Op]:
    """Seeded malloc/free/empty_cache, sizes from a few bytes to 90 MiB, at most 48 live."""
    rng = random.Random(seed)
    s = Seq()
    if limit is not None:
        s.limit(limit)
    live: list[int] = []
    for _ in range(steps):
        roll = rng.random()
        if roll < 0.04:
            s.empty()
        elif (roll < 0.45 or len(live) >= 48) and live:
            s.free(live.pop(rng.randrange(len(live))))
        else:
            kind = rng.random()
            if kind < 0.35:
                nbytes = rng.randint(1, 64 * KiB)
            elif kind < 0.6:
                nbytes = rng.randint(64 * KiB, 2 * MiB)
            elif kind < 0.8:
                nbytes = rng.randint(MiB, 12 * MiB)
            elif kind < 0.9:
                nbytes = rng.randint(10 * MiB, 90 * MiB)
            else:
                nbytes = rng.choice([MiB, 2 * MiB, 16 * MiB, 20 * MiB, 32 * MiB, 25 * MiB // 2])
            stream = 1 if streams and rng.random() < 0.1 else 0
            live.append(s.malloc(nbytes, stream))
    return s.ops


SETTINGS: dict[str, Callable[[], Iterator[tuple[str, list[Op]]]] | None] = {
    "": default_sequences,
    "max_split_size_mb:20": max_split_sequences,
    "max_split_size_mb:32,max_non_split_rounding_mb:64": rounding_limit_sequences,
    "expandable_segments:True": expandable_sequences,
    "roundup_power2_divisions:4": roundup_sequences,
    "roundup_power2_divisions:[1:8,16:2,>:4]": None,
    "large_segment_size_mb:32": large_segment_sequences,
    "expandable_segments:True,max_split_size_mb:24,roundup_power2_divisions:2": None,
}


def sequences(text: str, seed: int, steps: int) -> list[tuple[str, list[Op]]]:
    hand = SETTINGS[text]
    out = list(hand()) if hand is not None else []
    out.append((f"random (seed {seed})", random_sequence(seed, steps)))
    out.append((f"random within 512 MiB (seed {seed + 1})", random_sequence(seed + 1, steps, limit=512 * MiB)))
    return out


# ------------------------------------------------------------------------------------------ devices


class ModelDevice:
    """The model, and (as the card's stand-in) a second model: the script's code paths without a GPU."""

    def __init__(self, text: str) -> None:
        self.settings = AllocatorSettings.parse(text)
        self.model = CachingAllocatorModel(self.settings)

    def reset(self) -> None:
        self.model = CachingAllocatorModel(self.settings)

    def set_limit(self, nbytes: int | None) -> None:
        self.model.fraction_limit = nbytes

    def malloc(self, key: int, nbytes: int, stream: int) -> str | None:
        """None, or the out-of-memory message."""
        try:
            self.model.malloc(key, nbytes, stream)
        except AllocatorOutOfMemory as error:
            return str(error)
        return None

    def free(self, key: int) -> None:
        self.model.free(key)

    def empty_cache(self) -> None:
        self.model.empty_cache()

    def stats(self) -> dict[str, int]:
        m = self.model
        return dict(
            zip(
                STATS,
                (
                    m.allocated,
                    m.peak_allocated,
                    m.reserved,
                    m.peak_reserved,
                    m.requested,
                    m.peak_requested,
                    m.inactive_split,
                    m.peak_inactive_split,
                    m.num_alloc_retries,
                    m.num_ooms,
                ),
                strict=True,
            )
        )

    def segments(self) -> list[tuple[int, list[tuple[int, bool]]]]:
        return self.model.segments()


class TorchDevice:
    """The card, through torch's public API."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.total = torch.cuda.get_device_properties(self.device).total_memory
        self.side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self.tensors: dict[int, Any] = {}

    def reset(self) -> None:
        torch = self.torch
        self.tensors.clear()
        torch.cuda.synchronize(self.device)
        torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        torch.cuda.reset_accumulated_memory_stats(self.device)

    def limit_of(self, nbytes: int) -> int:
        """The allowed bytes torch computes for the fraction nbytes / total (static_cast<size_t>(f * total))."""
        return int((nbytes / self.total) * float(self.total))

    def set_limit(self, nbytes: int | None) -> None:
        fraction = 1.0 if nbytes is None else nbytes / self.total
        self.torch.cuda.set_per_process_memory_fraction(fraction, self.device)

    def malloc(self, key: int, nbytes: int, stream: int) -> str | None:
        torch = self.torch
        try:
            if stream:
                with torch.cuda.stream(self.side):
                    tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            else:
                tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError as error:
            return str(error).splitlines()[0]
        self.tensors[key] = tensor
        return None

    def free(self, key: int) -> None:
        self.tensors.pop(key, None)

    def empty_cache(self) -> None:
        self.torch.cuda.empty_cache()

    def stats(self) -> dict[str, int]:
        stats = self.torch.cuda.memory_stats(self.device)
        return {name: int(stats.get(name, 0)) for name in STATS}

    def segments(self) -> list[tuple[int, list[tuple[int, bool]]]]:
        out = []
        for segment in self.torch.cuda.memory_snapshot():  # type: ignore[no-untyped-call]
            blocks = [(int(b["size"]), b["state"] == "active_allocated") for b in segment["blocks"]]
            out.append((int(segment["total_size"]), blocks))
        return out


def cuda_size(nbytes: int) -> str:
    """torch's format_size for the sizes of these sequences (as in CUDA's messages)."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= MiB:
        return f"{nbytes / KiB:.2f} KiB"
    if nbytes <= 1 << 30:
        return f"{nbytes / MiB:.2f} MiB"
    return f"{nbytes / (1 << 30):.2f} GiB"


# -------------------------------------------------------------------------------------- the replay


def replay(name: str, ops: list[Op], card: TorchDevice | ModelDevice, text: str) -> dict[str, Any]:
    card.reset()
    model = ModelDevice(text)
    baseline = card.stats()
    steps: list[dict[str, Any]] = []
    mismatches = 0
    for index, op in enumerate(ops):
        card_oom = model_oom = None
        if op[0] == "malloc":
            _, key, nbytes, stream = op
            card_oom = card.malloc(key, nbytes, stream)
            model_oom = model.malloc(key, nbytes, stream)
        elif op[0] == "free":
            card.free(op[1])
            model.free(op[1])
        elif op[0] == "empty":
            card.empty_cache()
            model.empty_cache()
        elif op[0] == "limit":
            card.set_limit(op[1])
            allowed = op[1] if op[1] is None or isinstance(card, ModelDevice) else card.limit_of(op[1])
            model.set_limit(allowed)
        got = card.stats()
        expected = {k: v + (baseline[k] if "num_" not in k else 0) for k, v in model.stats().items()}
        differ = sorted(k for k in STATS if got[k] != expected[k])
        step: dict[str, Any] = {"step": index, "op": list(op), "card": got, "model": expected, "differ": differ}
        if (card_oom is None) != (model_oom is None):
            differ.append("out_of_memory")
        if card_oom is not None or model_oom is not None:
            step["card_oom"], step["model_oom"] = card_oom, model_oom
            if card_oom is not None and model_oom is not None and isinstance(card, TorchDevice):
                segment = model.model.allocation_size(model.model.round_size(op[2]))
                step["card_tried"] = card_oom.split("Tried to allocate ", 1)[-1].split(". ", 1)[0]
                step["model_tried"] = cuda_size(segment)
                step["model_request"] = cuda_size(model.model.round_size(op[2]))
                if step["card_tried"] != step["model_tried"]:
                    differ.append("tried_to_allocate")
        mismatches += bool(differ)
        steps.append(step)
    card_segments = sorted(card.segments())
    model_segments = sorted(model.segments())
    if card_segments != model_segments:
        mismatches += 1
    return {
        "name": name,
        "baseline": baseline,
        "steps": steps,
        "mismatches": mismatches,
        "segments_match": card_segments == model_segments,
        "card_segments": card_segments,
        "model_segments": model_segments,
    }


def child(text: str, seed: int, steps: int, stand_in: bool, out: Path) -> int:
    """One process, PYTORCH_CUDA_ALLOC_CONF already set: every sequence of the setting."""
    started = time.perf_counter()
    result: dict[str, Any] = {"settings": text, "env": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    card: TorchDevice | ModelDevice
    if stand_in:
        card = ModelDevice(text)
        result["torch"] = None
    else:
        import torch

        result["torch"] = torch.__version__
        result["device"] = torch.cuda.get_device_name()
        try:
            card = TorchDevice()
            card.reset()
            probe = torch.empty(1, dtype=torch.uint8, device=card.device)  # reads the allocator settings
            del probe
        except Exception as error:  # a setting this torch does not know, say
            result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            out.write_text(json.dumps(result), encoding="utf-8")
            return 0
    result["sequences"] = [replay(name, ops, card, text) for name, ops in sequences(text, seed, steps)]
    result["seconds"] = time.perf_counter() - started
    out.write_text(json.dumps(result), encoding="utf-8")
    return 0


def run_child(text: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": text}
        env.pop("PYTORCH_ALLOC_CONF", None)
        command = [sys.executable, __file__, "--child", text, "--json", str(out)]
        command += ["--seed", str(args.seed), "--steps", str(args.steps)]
        if args.stand_in:
            command.append("--stand-in")
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0 or not out.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"settings": text, "error": f"child exited {done.returncode}: {tail[0]}"}
        result: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
        return result


def first_difference(sequence: dict[str, Any]) -> str:
    for step in sequence["steps"]:
        if step["differ"]:
            parts = [f"step {step['step']} {step['op']}"]
            for name in step["differ"]:
                if name in STATS:
                    parts.append(f"{name} card {step['card'][name]} model {step['model'][name]}")
                elif name == "tried_to_allocate":
                    parts.append(f"tried card {step['card_tried']} model {step['model_tried']}")
                else:
                    parts.append(
                        f"oom card {step.get('card_oom') is not None} model {step.get('model_oom') is not None}"
                    )
            return "; ".join(parts)
    if not sequence["segments_match"]:
        return "segments differ at the end"
    return ""


def table_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    """One row per sequence of each setting (one for a setting whose process did not run)."""
    rows: list[list[str]] = []
    for result in results:
        label = result["settings"] or "(defaults)"
        if "error" in result:
            rows.append([label, "-", "-", "-", f"not run: {result['error']}"])
            continue
        for sequence in result["sequences"]:
            steps, differing = str(len(sequence["steps"])), str(sequence["mismatches"])
            rows.append([label, sequence["name"], steps, differing, first_difference(sequence) or "byte for byte"])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the caching allocator's model against the card, step by step")
    p.add_argument("--json", metavar="PATH", type=Path, default=None, help="also write the figures as JSON")
    p.add_argument("--steps", type=int, default=300, help="steps of each random sequence (default 300)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random sequences (default 0)")
    p.add_argument("--stand-in", action="store_true", help="without CUDA, a second model stands in for the card")
    p.add_argument("--only", action="append", default=None, help="run only this setting (repeatable)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per setting's process (default 240)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args: argparse.Namespace = p.parse_args(argv)
    if args.child is not None:
        return child(args.child, args.seed, args.steps, args.stand_in, Path(args.json))
    if not args.stand_in:
        import torch

        if not torch.cuda.is_available():
            print(
                "validate_allocator: no CUDA device here (torch.cuda.is_available() is False); nothing to validate "
                "(--stand-in runs the script's code paths against a second model)."
            )
            return 0
    import benchlib  # the parent's table and JSON (the children need neither)

    started = time.perf_counter()
    chosen = args.only or list(SETTINGS)
    results = [run_child(text, args) for text in chosen]
    rows = table_rows(results)
    differing = sum(sequence["mismatches"] > 0 for result in results for sequence in result.get("sequences", []))
    card = STAND_IN if args.stand_in else next((r.get("device") for r in results if r.get("device")), "cuda")
    torch_version = next((r.get("torch") for r in results if r.get("torch")), None)
    benchlib.show(
        f"caching allocator model vs {card} (torch {torch_version})",
        ["settings", "sequence", "steps", "differing", "first difference"],
        rows,
        [
            "compared after every step: " + ", ".join(STATS) + "; out of memory and its 'Tried to allocate'",
            "at the end: the snapshot's segments and blocks against the model's, as multisets",
            f"{differing} sequence(s) differ; total {time.perf_counter() - started:.1f} s",
        ],
    )
    benchlib.write_json(
        args.json,
        {"validate_allocator": {"card": card, "torch": torch_version, "steps": args.steps, "results": results}},
    )
    crashed = sum(str(result.get("error", "")).startswith("child exited") for result in results)
    return 1 if differing or crashed else 0


if __name__ == "__main__":
    sys.exit(main())
