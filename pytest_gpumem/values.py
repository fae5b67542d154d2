"""The checkers of option and ini values: each turns the text given (or the path it names) into its value,
or raises argparse.ArgumentTypeError with one line naming the value and what was expected."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from cuda_allocator_model import MAX_TEXT, ModelError, parse_size, shorten
from pytest_gpumem.constants import (
    COLUMNS,
    ID_FORMS,
    PATHS,
    ROUNDINGS,
)

if TYPE_CHECKING:
    from pytest_gpumem.budget import Budget, Limit

_ORDINAL = re.compile(r"[0-9]{1,6}")


def backend_name(value: str) -> str:
    if not value.strip() or not value.replace("_", "").replace("-", "").isalnum():
        raise argparse.ArgumentTypeError(f"invalid backend name {shorten(value)} (auto, cuda, accelerator, tracker)")
    return value.strip()


def rounding(value: str) -> str:
    if value not in ROUNDINGS:
        raise argparse.ArgumentTypeError(f"invalid rounding {shorten(value)} (choose from {', '.join(ROUNDINGS)})")
    return value


def columns(value: str) -> tuple[str, ...]:
    """A comma-separated list of the report table's columns, in the table's order (--gpumem-columns); `all`:
    every one (the default)."""
    if value.strip() == "all":
        return COLUMNS
    names = [name.strip() for name in value.split(",")]
    wrong = next((name for name in names if name not in COLUMNS), None)
    if wrong is not None:
        raise argparse.ArgumentTypeError(f"invalid column {shorten(wrong)} (choose from {', '.join(COLUMNS)}, or all)")
    return tuple(name for name in COLUMNS if name in names)


def id_form(value: str) -> str:
    if value.strip() not in ID_FORMS:
        raise argparse.ArgumentTypeError(f"invalid id form {shorten(value)} (choose from {', '.join(ID_FORMS)})")
    return value.strip()


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
    except ModelError as exc:
        raise argparse.ArgumentTypeError(f"invalid slack {shorten(value)}: {exc}") from None


def default_budget(value: str) -> Budget:
    """The suite-wide limit on a test's whole call, for tests whose markers set no limit of their own."""
    from pytest_gpumem.budget import Budget, budget_from_marker  # read where given: an idle run makes no Budget

    try:
        parse_size(value.strip())
        budget = budget_from_marker((value.strip(),), {})
    except ModelError as exc:
        raise argparse.ArgumentTypeError(f"invalid size {shorten(value)}: {exc}") from None
    assert budget.total is not None
    return Budget(total=dataclasses.replace(budget.total, written=f"{budget.total.written} (--gpumem-max-memory)"))


def _keyword_limit(keyword: str, flag: str) -> Callable[[str], Limit]:
    def read(value: str) -> Limit:
        from pytest_gpumem.budget import Limit, budget_from_marker

        try:
            parse_size(value.strip())
            limit = getattr(budget_from_marker((), {keyword: value.strip()}), keyword)
        except ModelError as exc:
            raise argparse.ArgumentTypeError(f"invalid size {shorten(value)}: {exc}") from None
        assert isinstance(limit, Limit)
        return dataclasses.replace(limit, written=f"{limit.written} ({flag})")

    return read


def capacity(value: str) -> Limit:
    """A size (the allocator's limit) or a card's name, as max_memory(capacity=) reads it."""
    from pytest_gpumem.budget import capacity_limit

    try:
        limit = capacity_limit(value.strip())
    except ModelError as exc:
        raise argparse.ArgumentTypeError(f"invalid capacity {shorten(value)}: {exc}") from None
    return dataclasses.replace(limit, written=f"{limit.written} (--gpumem-capacity)")


leak = _keyword_limit("leak", "--gpumem-leak")


def file_to_write(path: Path) -> Path:
    try:
        is_folder, folder_exists = path.is_dir(), path.parent.is_dir()
    except OSError as exc:  # a name too long for the file system, say
        raise argparse.ArgumentTypeError(f"cannot write a file there: {exc.strerror or exc}") from None
    if is_folder:
        raise argparse.ArgumentTypeError(f"{path} is a folder, not a file")
    if not folder_exists:
        raise argparse.ArgumentTypeError(f"folder {path.parent} does not exist")
    return path


def folder_to_make(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot make folder {path}: {exc.strerror or exc}") from None
    return path
