"""mkdocs hook: the options page is written from the option table the plugin registers (pytest_gpumem.options)."""

from __future__ import annotations

from typing import Any

from pytest_gpumem.options import OPTIONS, Option

MARKER = "<!-- options table, generated from pytest_gpumem.options.OPTIONS -->"


def _usage(option: Option) -> str:
    if option.const is not None:
        return f"{option.flag}[={option.metavar or ''}]"
    return f"{option.flag}={option.metavar}" if option.metavar else option.flag


def options_table() -> str:
    """One section per option, in the order of `pytest --help`."""
    sections = []
    for option in OPTIONS:
        ini = f"ini `{option.ini}`, default {option.shown_default}" if option.ini else "no ini twin"
        sections.append(f"### `{_usage(option)}`\n\n{option.help} ({ini})\n")
    return "\n".join(sections)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, options_table())
