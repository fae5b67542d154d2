"""The files the pages are made from, shipped in the package (`templates/`, `static/`): the jinja2
environment that renders the templates, the text of a static file, and the hash by which a page's
Content-Security-Policy lets exactly that text run or style it."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable
from importlib import resources

import jinja2

_HERE = resources.files("pytest_gpumem.report")


def environment(**filters: Callable[..., object]) -> jinja2.Environment:
    """An environment loading `templates/`, escaping what it writes, refusing names it is not given."""
    found = jinja2.Environment(
        loader=jinja2.FunctionLoader(lambda name: (_HERE / "templates" / name).read_text(encoding="utf-8")),
        autoescape=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    found.filters.update(filters)
    return found


def static(name: str) -> str:
    """The text of `static/name`."""
    return (_HERE / "static" / name).read_text(encoding="utf-8")


def sha256(text: str) -> str:
    """`'sha256-…'`: the source a policy names to allow exactly `text`."""
    return f"'sha256-{base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()}'"
