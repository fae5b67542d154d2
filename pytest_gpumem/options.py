"""The option table: each option declared once, with its ini twin, its parser and the field it fills. The
one source of addoption, addini, `read_options` (config.py) and the options page (docs/hooks.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from cuda_allocator_model import format_size
from pytest_gpumem.constants import (
    COLUMNS,
    DEFAULT_DIST_TIMEOUT,
    DEFAULT_FILENAME,
    DEFAULT_SLACK_BYTES,
    DEFAULT_TOLERANCE_PERCENT,
)
from pytest_gpumem.report.writers import WRITERS, Writer
from pytest_gpumem.values import (
    backend_name,
    capacity,
    code_paths,
    columns,
    default_budget,
    device_name,
    devices_spec,
    file_to_write,
    folder_to_make,
    id_form,
    leak,
    rounding,
    seconds,
    slack,
    tolerance,
    update_mode,
)


class Option(NamedTuple):  # not a dataclass: every run (an idle one too) makes the table (config.py)
    """One command-line option and its ini twin (read only when the option is not given)."""

    flag: str
    field: str
    """The field of `Options` or `BaselineOptions` (config.py) that its value fills."""
    help: str
    parse: Callable[[str], object] | None = None
    """The text's value, or argparse.ArgumentTypeError (argparse's `type=`, and the ini twin's reader)."""
    metavar: str | None = None
    shown_default: str | None = None
    """The default in words, for the help text and the docs; None for an option without an ini twin."""
    ini_default: str | bool = ""
    """The ini twin's default; an option whose default is "" has no value when neither is given."""
    switch: bool = False
    const: str | None = None
    """The value when the option is given without one (the option then takes an optional value)."""
    place: Callable[[Path], Path] | None = None
    """For a file or folder: checks (or makes) it, given relative to the invocation folder, its ini twin
    relative to the rootdir."""
    writer: type[Writer] | None = None
    """For an end-of-run file: the writer its path is given to (`Options.writers` holds those asked for)."""

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def ini(self) -> str | None:
        """The ini twin's name; None when the option has none."""
        return self.dest if self.shown_default is not None else None

    @property
    def full_help(self) -> str:
        if self.ini is None:
            return self.help
        return f"{self.help} Default: {self.shown_default} (ini {self.ini})."


def switch(flag: str, field: str, help: str) -> Option:
    """An option without a value, off by default, with an ini twin of the same name."""
    return Option(flag, field, help, shown_default="off", ini_default=False, switch=True)


def file(flag: str, field: str, help: str, shown_default: str = "none") -> Option:
    """A file to write (its folder must exist)."""
    return Option(flag, field, help, metavar="PATH", shown_default=shown_default, place=file_to_write)


def written(writer: type[Writer]) -> Option:
    """The option of an end-of-run file, as its writer declares it (report/writers.py)."""
    return Option(
        writer.flag, "writers", writer.help, metavar="PATH", shown_default="none", place=file_to_write, writer=writer
    )


def folder(flag: str, field: str, help: str) -> Option:
    """A folder to write into, made if missing."""
    return Option(flag, field, help, metavar="DIR", shown_default="none", place=folder_to_make)


OPTIONS: tuple[Option, ...] = (
    Option(
        "--gpumem-backend",
        "backend",
        "how to measure: auto (cuda, else another accelerator, else tracker), cuda, accelerator, "
        "tracker, or a name a plugin provides.",
        backend_name,
        "NAME",
        "auto",
        "auto",
    ),
    Option(
        "--gpumem-round",
        "rounding",
        "tracker only: 'cuda' serves every tensor by a model of the CUDA caching allocator (its blocks, its "
        "reserved segments, out of memory where a card runs out), to predict GPU figures; 'none' counts the "
        "requested bytes; 'auto': cuda on meta, none on cpu.",
        rounding,
        "auto|none|cuda",
        "auto",
        "auto",
    ),
    switch("--gpumem-report", "report", "print a table of every measured test at the end."),
    Option(
        "--gpumem-columns",
        "columns",
        f"the report table's columns, of {', '.join(COLUMNS)} (in the table's order whatever the order given); "
        "the test is always shown, and a column only where the tests have something to show in it.",
        columns,
        "LIST",
        "all",
    ),
    Option(
        "--gpumem-name",
        "id_form",
        "the report table's test ids: short leaves out the start that all share (a line above the table names "
        "it), long shows them whole; either is cut where the terminal is too narrow.",
        id_form,
        "short|long",
        "short",
        "short",
    ),
    *map(written, WRITERS),
    file("--gpumem-baseline-file", "path", "stored baselines to compare with.", f"{DEFAULT_FILENAME} in the rootdir"),
    Option(
        "--gpumem-update",
        "update_mode",
        "record the baselines of the tests that ran and passed, with what made each peak (so that a regression "
        "names the modules that grew): all (the default) refreshes every one of them, new records only those "
        "that have none; other entries stay as they are, and a test that allocates nothing needs none.",
        update_mode,
        "new|all",
        const="all",
    ),
    Option("--gpumem-prune", "prune", "remove the baselines that no test used (only after a full run).", switch=True),
    Option(
        "--gpumem-tolerance",
        "tolerance",
        "growth over a baseline allowed before a test fails; max_memory(tolerance=...) overrides it per test.",
        tolerance,
        "PERCENT",
        f"{DEFAULT_TOLERANCE_PERCENT:g}",
        f"{DEFAULT_TOLERANCE_PERCENT:g}",
    ),
    Option(
        "--gpumem-slack",
        "slack",
        "bytes allowed over a baseline on top of the tolerance (allocator rounding).",
        slack,
        "SIZE",
        format_size(DEFAULT_SLACK_BYTES),
        f"{DEFAULT_SLACK_BYTES}",
    ),
    switch(
        "--gpumem-strict",
        "strict",
        "fail a measured test that has no baseline (one that allocates nothing needs none, nor one measured only "
        "for --gpumem-all whose peaks stay within --gpumem-slack).",
    ),
    switch(
        "--gpumem-all",
        "measure_all",
        "measure the call of every test, with or without the gpumem fixture or a max_memory marker; a test "
        "measured only for this option whose peaks all stay within --gpumem-slack needs no baseline (also under "
        "--gpumem-strict) and records none.",
    ),
    switch(
        "--gpumem-disable",
        "disabled",
        "run the tests without measuring them: the gpumem fixture and the max_memory marker stay, phases measure "
        "nothing, no budget, leak or baseline is judged, and a test that reads a measurement (gpumem.peak(), "
        "result(), fit(), advise(), distributed(), simulate_rank()) is skipped there.",
    ),
    Option(
        "--gpumem-max-memory",
        "default_budget",
        "limit on the whole call of every measured test whose max_memory markers set no limit.",
        default_budget,
        "SIZE",
        "none",
    ),
    Option(
        "--gpumem-devices",
        "devices",
        "with pytest-xdist, give each worker one device, round-robin over all the devices the caller can see "
        "(auto) or over the listed ordinals (e.g. 0,1).",
        devices_spec,
        "auto|LIST",
        "off",
    ),
    Option(
        "--gpumem-device",
        "device",
        "tracker only: meta runs the tests with tensors that have sizes but no data, so a CPU runner predicts "
        "the memory of models far larger than itself (gpumem.device is meta).",
        device_name,
        "cpu|meta",
        "cpu",
        "cpu",
    ),
    Option(
        "--gpumem-paths",
        "paths",
        "tracker only: whose code paths the tests take: gpu (optimizers default to foreach; on meta,"
        " attention is counted as the fused kernels flash and memory-efficient keep it) or cpu (single-tensor"
        " optimizers; on meta, attention's math path, which saves the S x S weights).",
        code_paths,
        "cpu|gpu",
        "gpu on meta and with --gpumem-round=cuda, else cpu",
        "",
    ),
    Option(
        "--gpumem-capacity",
        "capacity",
        "run measured tests on a device of SIZE, or on a card (H100-80GB, A100-40GB, T4, ...: its memory less "
        "what lies outside the allocator, 512 MiB unless given as CARD:SIZE): the tracker raises "
        "torch.OutOfMemoryError at the allocation past it; on CUDA the process is capped with "
        "set_per_process_memory_fraction. max_memory(capacity=...) sets it per test.",
        capacity,
        "SIZE|CARD",
        "none",
    ),
    Option(
        "--gpumem-leak",
        "leak",
        "fail a measured test that leaves more than SIZE allocated after its call returns and garbage is "
        "collected; max_memory(leak=...) sets it per test.",
        leak,
        "SIZE",
        "none",
    ),
    folder(
        "--gpumem-snapshot-dir",
        "snapshot_dir",
        "a test that runs out of memory, exceeds a budget, leaks or regresses leaves its memory trace there "
        "(tracker: JSON; CUDA: a memory-history snapshot).",
    ),
    folder(
        "--gpumem-torch-snapshots",
        "torch_snapshots",
        "write every measured test's prediction there as a torch memory snapshot (a pickle that memory_viz "
        "and pytest-gpumem replay open): the tracker under the CUDA allocator's model (--gpumem-round=cuda or "
        "--gpumem-device=meta).",
    ),
    Option(
        "--gpumem-dist-timeout",
        "dist_timeout",
        "how long the ranks of gpumem.distributed() may run the function before all are ended and the test "
        "fails (joining the group may take at least 60 s more).",
        seconds,
        "SECONDS",
        f"{DEFAULT_DIST_TIMEOUT:g}",
        f"{DEFAULT_DIST_TIMEOUT:g}",
    ),
    switch(
        "--gpumem-explain",
        "explain",
        "explain the peaks of every measured test: what was alive at each phase's peak, by category "
        "(parameters, gradients, optimizer state, saved for backward, temporaries, inputs) and by module, and "
        "the largest tensors with the op and line that made them; max_memory(explain=True) does it per test.",
    ),
    folder(
        "--gpumem-html",
        "html_dir",
        "write a self-contained HTML picture of each explained test's memory over time there (stacked by "
        "category, phases shaded, the peak marked).",
    ),
)
