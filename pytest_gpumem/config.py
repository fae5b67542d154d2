"""Command-line options and their ini twins (an ini value is read only when the option is not given)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from pytest_gpumem.budget import Budget, Limit
from pytest_gpumem.constants import (
    DEFAULT_DIST_TIMEOUT,
    DEFAULT_FILENAME,
)
from pytest_gpumem.options import OPTIONS

T = TypeVar("T")


@dataclass(frozen=True)
class Options:
    backend: str
    backend_given: bool
    rounding: str
    report: bool
    json_path: Path | None
    markdown_path: Path | None
    measure_all: bool = False
    disabled: bool = False  # --gpumem-disable: nothing is measured or judged
    default_budget: Budget | None = None
    devices: str | tuple[int, ...] | None = None
    capacity: Limit | None = None
    leak: Limit | None = None
    snapshot_dir: Path | None = None
    torch_snapshots: Path | None = None
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
        disabled=_read(config, "gpumem_disable"),
        default_budget=_read(config, "gpumem_max_memory"),
        devices=_read(config, "gpumem_devices"),
        capacity=_read(config, "gpumem_capacity"),
        leak=_read(config, "gpumem_leak"),
        snapshot_dir=_read(config, "gpumem_snapshot_dir"),
        torch_snapshots=_read(config, "gpumem_torch_snapshots"),
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
