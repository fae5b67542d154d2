"""The options' values: `add_options` registers the option table (options.py) and `read_options` reads it,
in one loop, into `Options` and `BaselineOptions`, then refuses the combinations that cannot work."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import pytest

from pytest_gpumem.constants import (
    COLUMNS,
    DEFAULT_DIST_TIMEOUT,
    DEFAULT_FILENAME,
)
from pytest_gpumem.options import OPTIONS, Option
from pytest_gpumem.report.writers import Writer

if TYPE_CHECKING:
    from pytest_gpumem.budget import Budget, Limit


# Options, BaselineOptions and Option: named tuples, not dataclasses, which compile their methods when an idle
# run imports them (1.5 ms of its start-up)
class Options(NamedTuple):
    """The run's options but the baselines'; each field but `backend_given` is an option's (its `field`)."""

    backend: str
    backend_given: bool
    rounding: str
    report: bool
    writers: tuple[Writer, ...] = ()  # the end-of-run files asked for, in the order of `WRITERS`
    columns: tuple[str, ...] = COLUMNS  # the report table's, in its order
    id_form: str = "short"  # the report table's test ids: short (without their common prefix) or long
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


class BaselineOptions(NamedTuple):
    """The options of the baselines; each field is an option's (its `field`)."""

    path: Path
    update_mode: str | None  # --gpumem-update: None (not given), new or all
    prune: bool
    tolerance: float
    slack: int
    strict: bool

    @property
    def update(self) -> bool:
        return self.update_mode is not None

    @property
    def update_new_only(self) -> bool:
        return self.update_mode == "new"

    @property
    def wanted(self) -> bool:
        """Whether the run compares with baselines: the file exists, or recording or requiring them."""
        return self.update or self.strict or self.prune or os.path.lexists(self.path)


_TEST_PATHS_TAKEN = "gpumem_test_paths_taken"
"""Where `_ValueOrTestPath` keeps the test paths that argparse handed to an option as its value."""


class _ValueOrTestPath(argparse.Action):
    """An option whose value is optional (`const` when none is given). argparse takes whatever follows the
    flag for its value, so in `pytest --gpumem-update test_x.py` it hands over the test path: a value that
    `parse` refuses but that names a file or folder (or anything, under --pyargs) is taken for what it is,
    a test path, kept under `_TEST_PATHS_TAKEN` for `read_options` to give back to the run, and the option
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
            setattr(namespace, _TEST_PATHS_TAKEN, [*getattr(namespace, _TEST_PATHS_TAKEN, ()), values])


def _give_back_test_paths(config: pytest.Config) -> None:
    """The test paths an option took for its value (`_ValueOrTestPath`) join the run's own, which pytest
    chose without them (the configured testpaths or the current folder when they were all it was given)."""
    taken: list[str] = getattr(config.option, _TEST_PATHS_TAKEN, [])
    if not taken:
        return
    setattr(config.option, _TEST_PATHS_TAKEN, [])
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
                action=_ValueOrTestPath,
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


def _read(config: pytest.Config, option: Option) -> Any:
    """The option's value if given, else its ini twin's, else its default."""
    if option.switch:
        return _switch(config, option)
    if option.place is not None:
        return _place(config, option, option.place)
    return _value(config, option)


def _switch(config: pytest.Config, option: Option) -> bool:
    given = config.getoption(option.dest)
    if given is not None or option.ini is None:
        return bool(given)
    try:
        return bool(config.getini(option.ini))
    except (ValueError, pytest.UsageError) as exc:
        raise pytest.UsageError(f"ini option {option.ini}: {exc}") from None


def _value(config: pytest.Config, option: Option) -> Any:
    """Parsed by argparse when given; an ini twin left empty is no value unless the option has a default."""
    given = config.getoption(option.dest)
    if given is not None or option.ini is None:
        return given
    text = str(config.getini(option.ini)).strip()
    if not text and not option.ini_default:
        return None
    assert option.parse is not None, option.flag
    try:
        return option.parse(text)
    except argparse.ArgumentTypeError as exc:
        raise pytest.UsageError(f"ini option {option.ini}: {exc}") from None


def _place(config: pytest.Config, option: Option, place: Callable[[Path], Path]) -> Path | None:
    """A file or folder: given relative to the invocation folder, in the ini relative to the rootdir."""
    given = config.getoption(option.dest)
    text = given if given else str(config.getini(option.ini or "")).strip()
    if not text:
        return None
    try:
        return place(Path(config.invocation_params.dir if given else config.rootpath, text))
    except argparse.ArgumentTypeError as exc:
        name = option.flag if given else f"ini option {option.ini}"
        raise pytest.UsageError(f"{name}={text}: {exc}") from None


def read_options(config: pytest.Config) -> tuple[Options, BaselineOptions]:
    read: dict[str, Any] = {"writers": ()}
    for option in OPTIONS:  # in their order: the first bad value is the one said
        value = _read(config, option)
        if option.writer is None:
            read[option.field] = value
        elif value is not None:
            read["writers"] += (option.writer(value),)
    _give_back_test_paths(config)  # `pytest --gpumem-update test_x.py`: test_x.py is a test path
    read["path"] = read["path"] or config.rootpath / DEFAULT_FILENAME
    read["columns"] = read["columns"] or COLUMNS
    backend_given = config.getoption("gpumem_backend") is not None or config.getini("gpumem_backend") != "auto"
    options = Options(backend_given=backend_given, **_fields_of(Options, read))
    baseline = BaselineOptions(**_fields_of(BaselineOptions, read))
    _refuse_what_cannot_work(options, baseline)
    return options, baseline


def _fields_of(cls: type[Options | BaselineOptions], read: dict[str, Any]) -> dict[str, Any]:
    return {name: read[name] for name in cls._fields if name in read}


def _refuse_what_cannot_work(options: Options, baseline: BaselineOptions) -> None:
    """The combinations of options refused before anything runs."""
    _refuse_overwriting_baselines(options, baseline.path)
    if options.disabled:
        for flag, given in (("--gpumem-update", baseline.update), ("--gpumem-prune", baseline.prune)):
            if given:
                raise pytest.UsageError(f"{flag}: nothing is measured under --gpumem-disable; drop one of the two")


def _refuse_overwriting_baselines(options: Options, baseline_path: Path) -> None:
    """A report written over the baseline file, or one report over another, would destroy it."""
    from itertools import combinations

    for writer in options.writers:
        if _same_file(writer.path, baseline_path):
            said = f"{writer.flag}={writer.path}"
            raise pytest.UsageError(f"{said}: that is the baseline file; write the report elsewhere")
    for one, other in combinations(options.writers, 2):
        if _same_file(one.path, other.path):
            said = f"{one.flag}={one.path} and {other.flag}={other.path}"
            raise pytest.UsageError(f"{said} are one file; give each report its own")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except OSError:
        return False
