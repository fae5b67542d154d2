"""Command-line options and their ini twins (an ini value is read only when the option is not given)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from pytest_gpumem.budget import Budget, Limit, budget_from_marker, capacity_limit
from pytest_gpumem.constants import (
    DEFAULT_DIST_TIMEOUT,
    DEFAULT_FILENAME,
    DEFAULT_SLACK_BYTES,
    DEFAULT_TOLERANCE_PERCENT,
    PATHS,
    ROUNDINGS,
)
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.sizes import MAX_TEXT, format_size, parse_size, shorten

T = TypeVar("T")
_ORDINAL = re.compile(r"[0-9]{1,6}")


@dataclass(frozen=True)
class Options:
    backend: str
    backend_given: bool
    rounding: str
    report: bool
    json_path: Path | None
    markdown_path: Path | None
    measure_all: bool = False
    default_budget: Budget | None = None
    devices: str | tuple[int, ...] | None = None
    capacity: Limit | None = None
    leak: Limit | None = None
    snapshot_dir: Path | None = None
    explain: bool = False
    html_dir: Path | None = None
    device: str = "cpu"
    dist_timeout: float = DEFAULT_DIST_TIMEOUT
    paths: str | None = None  # the tracker's code paths (cpu, gpu); None: gpu on meta or with CUDA rounding


@dataclass(frozen=True)
class BaselineOptions:
    path: Path
    update: bool
    prune: bool
    tolerance: float
    slack: int
    strict: bool
    update_new_only: bool = False

    @property
    def wanted(self) -> bool:
        """Whether the run compares with baselines: the file exists, or recording or requiring them."""
        return self.update or self.strict or self.prune or os.path.lexists(self.path)


def backend_name(value: str) -> str:
    if not value.strip() or not value.replace("_", "").replace("-", "").isalnum():
        raise argparse.ArgumentTypeError(f"invalid backend name {shorten(value)} (auto, cuda, accelerator, tracker)")
    return value.strip()


def rounding(value: str) -> str:
    if value not in ROUNDINGS:
        raise argparse.ArgumentTypeError(f"invalid rounding {shorten(value)} (choose from {', '.join(ROUNDINGS)})")
    return value


def code_paths(value: str) -> str:
    if value.strip() not in PATHS:
        raise argparse.ArgumentTypeError(
            f"invalid paths {shorten(value)} (cpu or gpu: whose code paths the tracker runs)"
        )
    return value.strip()


def device_name(value: str) -> str:
    if value.strip() not in ("cpu", "meta"):
        raise argparse.ArgumentTypeError(f"invalid device {shorten(value)} (cpu, or meta: a prediction without data)")
    return value.strip()


def update_mode(value: str) -> str:
    if value not in ("new", "all"):
        raise argparse.ArgumentTypeError(
            f"invalid mode {shorten(value)} (new or all; or a test path, but there is no file or folder of that name)"
        )
    return value


def tolerance(value: str) -> float:
    try:
        percent = float(value.strip().removesuffix("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid tolerance {shorten(value)} (a percentage, e.g. 5 or 2.5%)") from None
    if not 0 <= percent < 1000:
        raise argparse.ArgumentTypeError(f"invalid tolerance {shorten(value)} (between 0 and 1000 percent)")
    return percent


def seconds(value: str) -> float:
    try:
        number = float(value.strip().removesuffix("s"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid timeout {shorten(value)} (seconds, e.g. 120 or 2.5)") from None
    if not (0 < number < float("inf")):
        raise argparse.ArgumentTypeError(f"invalid timeout {shorten(value)} (a number of seconds above 0)")
    return number


def devices_spec(value: str) -> str | tuple[int, ...]:
    """`auto`, or a comma-separated list of device ordinals; argparse type of --gpumem-devices."""
    text = value.strip()
    if text == "auto":
        return "auto"
    parts = [part.strip() for part in text.split(",")]
    if len(text) > MAX_TEXT or not all(_ORDINAL.fullmatch(part) for part in parts):
        raise argparse.ArgumentTypeError(f"invalid devices {shorten(value)} (auto, or ordinals like 0,1)")
    ordinals = tuple(int(part) for part in parts)
    if len(set(ordinals)) != len(ordinals):
        raise argparse.ArgumentTypeError(f"invalid devices {shorten(value)}: a device is named twice")
    return ordinals


def slack(value: str) -> int:
    try:
        return parse_size(value.strip())
    except GpuMemError as exc:
        raise argparse.ArgumentTypeError(f"invalid slack {shorten(value)}: {exc}") from None


def default_budget(value: str) -> Budget:
    """The suite-wide limit on a test's whole call, for tests whose markers set no limit of their own."""
    try:
        parse_size(value.strip())
        budget = budget_from_marker((value.strip(),), {})
    except GpuMemError as exc:
        raise argparse.ArgumentTypeError(f"invalid size {shorten(value)}: {exc}") from None
    assert budget.total is not None
    return Budget(total=dataclasses.replace(budget.total, written=f"{budget.total.written} (--gpumem-max-memory)"))


def _keyword_limit(keyword: str, flag: str) -> Callable[[str], Limit]:
    def read(value: str) -> Limit:
        try:
            parse_size(value.strip())
            limit = getattr(budget_from_marker((), {keyword: value.strip()}), keyword)
        except GpuMemError as exc:
            raise argparse.ArgumentTypeError(f"invalid size {shorten(value)}: {exc}") from None
        assert isinstance(limit, Limit)
        return dataclasses.replace(limit, written=f"{limit.written} ({flag})")

    return read


def capacity(value: str) -> Limit:
    """A size (the allocator's limit) or a card's name, as max_memory(capacity=) reads it."""
    try:
        limit = capacity_limit(value.strip())
    except GpuMemError as exc:
        raise argparse.ArgumentTypeError(f"invalid capacity {shorten(value)}: {exc}") from None
    return dataclasses.replace(limit, written=f"{limit.written} (--gpumem-capacity)")


leak = _keyword_limit("leak", "--gpumem-leak")


@dataclass(frozen=True)
class Option:
    """One command-line option and its ini twin: the one source of addoption, addini and the options page."""

    flag: str
    help: str
    parse: Callable[[str], object] | None = None
    metavar: str | None = None
    shown_default: str | None = None
    """The default in words, for the help text and the docs; None for an option without an ini twin."""
    ini_default: str | bool = ""
    switch: bool = False
    const: str | None = None
    """The value when the option is given without one (the option then takes an optional value)."""

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def ini(self) -> str | None:
        """The ini twin's name, read when the option is not given; None when the option has none."""
        return self.dest if self.shown_default is not None else None

    @property
    def full_help(self) -> str:
        if self.ini is None:
            return self.help
        return f"{self.help} Default: {self.shown_default} (ini {self.ini})."


def switch(flag: str, help: str) -> Option:
    """An option without a value, off by default, with an ini twin of the same name."""
    return Option(flag, help, shown_default="off", ini_default=False, switch=True)


OPTIONS: tuple[Option, ...] = (
    Option(
        "--gpumem-backend",
        "how to measure: auto (cuda, else another accelerator, else tracker), cuda, accelerator, "
        "tracker, or a name a plugin provides.",
        backend_name,
        "NAME",
        "auto",
        "auto",
    ),
    Option(
        "--gpumem-round",
        "tracker only: 'cuda' serves every tensor by a model of the CUDA caching allocator (its blocks, its "
        "reserved segments, out of memory where a card runs out), to predict GPU figures; 'none' counts the "
        "requested bytes; 'auto': cuda on meta, none on cpu.",
        rounding,
        "auto|none|cuda",
        "auto",
        "auto",
    ),
    switch("--gpumem-report", "print a table of every measured test at the end."),
    Option("--gpumem-json", "write every measured test's figures to PATH as JSON.", None, "PATH", "none"),
    Option(
        "--gpumem-markdown", "write the report table to PATH as Markdown (CI step summaries).", None, "PATH", "none"
    ),
    Option(
        "--gpumem-baseline-file",
        "stored baselines to compare with.",
        None,
        "PATH",
        f"{DEFAULT_FILENAME} in the rootdir",
    ),
    Option(
        "--gpumem-update",
        "record the baselines of the tests that ran and passed, with what made each peak (so that a regression "
        "names the modules that grew): all (the default) refreshes every one of them, new records only those "
        "that have none; other entries stay as they are, and a test that allocates nothing needs none.",
        update_mode,
        "new|all",
        const="all",
    ),
    Option("--gpumem-prune", "remove the baselines that no test used (only after a full run).", switch=True),
    Option(
        "--gpumem-tolerance",
        "growth over a baseline allowed before a test fails; max_memory(tolerance=...) overrides it per test.",
        tolerance,
        "PERCENT",
        f"{DEFAULT_TOLERANCE_PERCENT:g}",
        f"{DEFAULT_TOLERANCE_PERCENT:g}",
    ),
    Option(
        "--gpumem-slack",
        "bytes allowed over a baseline on top of the tolerance (allocator rounding).",
        slack,
        "SIZE",
        format_size(DEFAULT_SLACK_BYTES),
        f"{DEFAULT_SLACK_BYTES}",
    ),
    switch("--gpumem-strict", "fail a measured test that has no baseline."),
    switch(
        "--gpumem-all",
        "measure the call of every test, with or without the gpumem fixture or a max_memory marker.",
    ),
    Option(
        "--gpumem-max-memory",
        "limit on the whole call of every measured test whose max_memory markers set no limit.",
        default_budget,
        "SIZE",
        "none",
    ),
    Option(
        "--gpumem-devices",
        "with pytest-xdist, give each worker one device, round-robin over all the devices the caller can see "
        "(auto) or over the listed ordinals (e.g. 0,1).",
        devices_spec,
        "auto|LIST",
        "off",
    ),
    Option(
        "--gpumem-device",
        "tracker only: meta runs the tests with tensors that have sizes but no data, so a CPU runner predicts "
        "the memory of models far larger than itself (gpumem.device is meta).",
        device_name,
        "cpu|meta",
        "cpu",
        "cpu",
    ),
    Option(
        "--gpumem-paths",
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
        "fail a measured test that leaves more than SIZE allocated after its call returns and garbage is "
        "collected; max_memory(leak=...) sets it per test.",
        leak,
        "SIZE",
        "none",
    ),
    Option(
        "--gpumem-snapshot-dir",
        "a test that runs out of memory, exceeds a budget, leaks or regresses leaves its memory trace there "
        "(tracker: JSON; CUDA: a memory-history snapshot).",
        None,
        "DIR",
        "none",
    ),
    Option(
        "--gpumem-dist-timeout",
        "how long the ranks of gpumem.distributed() may run the function before all are ended and the test "
        "fails (joining the group may take at least 60 s more).",
        seconds,
        "SECONDS",
        f"{DEFAULT_DIST_TIMEOUT:g}",
        f"{DEFAULT_DIST_TIMEOUT:g}",
    ),
    switch(
        "--gpumem-explain",
        "explain the peaks of every measured test: what was alive at each phase's peak, by category "
        "(parameters, gradients, optimizer state, saved for backward, temporaries, inputs) and by module, and "
        "the largest tensors with the op and line that made them; max_memory(explain=True) does it per test.",
    ),
    Option(
        "--gpumem-html",
        "write a self-contained HTML picture of each explained test's memory over time there (stacked by "
        "category, phases shaded, the peak marked).",
        None,
        "DIR",
        "none",
    ),
)


TEST_PATHS_TAKEN = "gpumem_test_paths_taken"
"""Where `ValueOrTestPath` keeps the test paths that argparse handed to an option as its value."""


class ValueOrTestPath(argparse.Action):
    """An option whose value is optional (`const` when none is given). argparse takes whatever follows the
    flag for its value, so in `pytest --gpumem-update test_x.py` it hands over the test path: a value that
    `parse` refuses but that names a file or folder (or anything, under --pyargs) is taken for what it is,
    a test path, kept under `TEST_PATHS_TAKEN` for `read_options` to give back to the run, and the option
    gets `const`. Any other refused value stays a usage error."""

    def __init__(self, *args: Any, parse: Callable[[str], object], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parse = parse

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        if values is None:
            setattr(namespace, self.dest, self.const)
            return
        assert isinstance(values, str), values  # nargs="?": one string
        try:
            setattr(namespace, self.dest, self.parse(values))
        except argparse.ArgumentTypeError as exc:
            if not (getattr(namespace, "pyargs", False) or os.path.lexists(values.split("::", 1)[0])):
                raise argparse.ArgumentError(self, str(exc)) from None
            setattr(namespace, self.dest, self.const)
            setattr(namespace, TEST_PATHS_TAKEN, [*getattr(namespace, TEST_PATHS_TAKEN, ()), values])


def _give_back_test_paths(config: pytest.Config) -> None:
    """The test paths an option took for its value (`ValueOrTestPath`) join the run's own, which pytest
    chose without them (the configured testpaths or the current folder when they were all it was given)."""
    taken: list[str] = getattr(config.option, TEST_PATHS_TAKEN, [])
    if not taken:
        return
    setattr(config.option, TEST_PATHS_TAKEN, [])
    given = config.args if config.args_source == pytest.Config.ArgsSource.ARGS else []
    config.args = [*taken, *given]
    config.args_source = pytest.Config.ArgsSource.ARGS


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpumem", "GPU memory budgets (pytest-gpumem)")
    for option in OPTIONS:
        if option.switch:
            group.addoption(
                option.flag, action="store_true", default=None if option.ini else False, help=option.full_help
            )
        elif option.const is not None:
            assert option.parse is not None, option.flag
            group.addoption(
                option.flag,
                action=ValueOrTestPath,
                parse=option.parse,
                nargs="?",
                const=option.const,
                default=None,
                metavar=option.metavar,
                help=option.full_help,
            )
        else:
            group.addoption(option.flag, default=None, type=option.parse, metavar=option.metavar, help=option.full_help)
        if option.ini is None:
            continue
        if option.switch:
            parser.addini(option.ini, f"default for {option.flag}", type="bool", default=option.ini_default)
        else:
            parser.addini(option.ini, f"default for {option.flag}", default=option.ini_default)


def _ini(config: pytest.Config, name: str, check: Callable[[str], T]) -> T:
    value = str(config.getini(name)).strip()
    try:
        return check(value)
    except argparse.ArgumentTypeError as exc:
        raise pytest.UsageError(f"ini option {name}: {exc}") from None


def _given(config: pytest.Config, name: str, check: Callable[[str], T]) -> T:
    value: Any = config.getoption(name)
    return value if value is not None else _ini(config, name, check)


def _optional(config: pytest.Config, name: str, check: Callable[[str], T]) -> T | None:
    """An option whose ini twin may be left empty (no value)."""
    value: Any = config.getoption(name)
    if value is not None:
        return value  # type: ignore[no-any-return]
    return _ini(config, name, check) if str(config.getini(name)).strip() else None


def _folder(config: pytest.Config, name: str) -> Path | None:
    """A folder to write into, made if missing: relative to the invocation folder (option) or rootdir (ini)."""
    given = config.getoption(name)
    text = given if given else str(config.getini(name)).strip()
    if not text:
        return None
    path = Path(config.invocation_params.dir if given else config.rootpath, text)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        flag = f"--{name.replace('_', '-')}" if given else f"ini option {name}"
        raise pytest.UsageError(f"{flag}={text}: cannot make folder {path}: {exc.strerror or exc}") from None
    return path


def _path(config: pytest.Config, name: str, base: Path) -> Path | None:
    """A file to write: relative to the invocation folder (option) or the rootdir (ini)."""
    given = config.getoption(name)
    text, base = (given, config.invocation_params.dir) if given else (str(config.getini(name)).strip(), base)
    if not text:
        return None
    path = Path(base, text)
    if not path.parent.is_dir() or path.is_dir():
        flag = f"--{name.replace('_', '-')}" if given else f"ini option {name}"
        problem = f"{path} is a folder, not a file" if path.is_dir() else f"folder {path.parent} does not exist"
        raise pytest.UsageError(f"{flag}={text}: {problem}")
    return path


def _flag(config: pytest.Config, name: str) -> bool:
    given = config.getoption(name)
    if given is not None:
        return bool(given)
    try:
        return bool(config.getini(name))
    except (ValueError, pytest.UsageError) as exc:
        raise pytest.UsageError(f"ini option {name}: {exc}") from None


def _read(config: pytest.Config, name: str) -> Any:
    """The value of the option whose dest is `name`, else of its ini twin, read as OPTIONS declares it: a
    switch, a file to write (PATH), a folder to make (DIR), or a value its parser checks (None when its
    ini twin has no default and is left empty)."""
    option = _BY_DEST[name]
    if option.switch:
        return _flag(config, name) if option.ini is not None else bool(config.getoption(name))
    if option.metavar == "PATH":
        return _path(config, name, config.rootpath)
    if option.metavar == "DIR":
        return _folder(config, name)
    assert option.parse is not None and option.ini is not None, name
    return _given(config, name, option.parse) if option.ini_default else _optional(config, name, option.parse)


_BY_DEST = {option.dest: option for option in OPTIONS}


def read_options(config: pytest.Config) -> tuple[Options, BaselineOptions]:
    options = Options(
        backend=_read(config, "gpumem_backend"),
        backend_given=config.getoption("gpumem_backend") is not None or config.getini("gpumem_backend") != "auto",
        rounding=_read(config, "gpumem_round"),
        report=_read(config, "gpumem_report"),
        json_path=_read(config, "gpumem_json"),
        markdown_path=_read(config, "gpumem_markdown"),
        measure_all=_read(config, "gpumem_all"),
        default_budget=_read(config, "gpumem_max_memory"),
        devices=_read(config, "gpumem_devices"),
        capacity=_read(config, "gpumem_capacity"),
        leak=_read(config, "gpumem_leak"),
        snapshot_dir=_read(config, "gpumem_snapshot_dir"),
        explain=_read(config, "gpumem_explain"),
        html_dir=_read(config, "gpumem_html"),
        device=_read(config, "gpumem_device"),
        dist_timeout=_read(config, "gpumem_dist_timeout"),
        paths=_read(config, "gpumem_paths"),
    )
    _give_back_test_paths(config)  # `pytest --gpumem-update test_x.py`: test_x.py is a test path
    update = config.getoption("gpumem_update")  # no ini twin: "all" when given bare (its const)
    baseline = BaselineOptions(
        path=_read(config, "gpumem_baseline_file") or config.rootpath / DEFAULT_FILENAME,
        update=update is not None,
        update_new_only=update == "new",
        prune=_read(config, "gpumem_prune"),
        tolerance=_read(config, "gpumem_tolerance"),
        slack=_read(config, "gpumem_slack"),
        strict=_read(config, "gpumem_strict"),
    )
    _refuse_overwriting_baselines(options, baseline.path)
    return options, baseline


def _refuse_overwriting_baselines(options: Options, baseline_path: Path) -> None:
    """A report written over the baseline file, or one report over the other, would destroy it: refuse
    before anything runs."""
    for flag, path in (("--gpumem-json", options.json_path), ("--gpumem-markdown", options.markdown_path)):
        if path is not None and _same_file(path, baseline_path):
            raise pytest.UsageError(f"{flag}={path}: that is the baseline file; write the report elsewhere")
    json_path, markdown_path = options.json_path, options.markdown_path
    if json_path is not None and markdown_path is not None and _same_file(json_path, markdown_path):
        raise pytest.UsageError(
            f"--gpumem-json={json_path} and --gpumem-markdown={markdown_path} are one file; give each report its own"
        )


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except OSError:
        return False
