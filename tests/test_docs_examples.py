"""The README's and the guides' examples run as written, and show the output they really print.

A page's Python blocks are files (```python title="test_x.py"```), written in order into one pytester folder;
a ```console block runs each `$ pytest ...` or `$ pytest-gpumem ...` line there and checks that the lines it
shows appear in that order in the real output (run times are free; `...` stands for omitted lines). A test
file that no console block runs must pass on its own.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

RunReference = Callable[..., dict[str, Any]]  # the conftest fixture run_reference

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^```(?P<lang>[\w-]*)(?P<attrs>[^\n]*)\n(?P<body>.*?)^```\s*$", re.M | re.S)
TITLE = re.compile(r'title="(?P<name>[^"]+)"')
TIME = re.compile(r"\d+(\.\d+)?s( \(\d+:\d\d:\d\d\))?(?= =*$)")
SEPARATOR = re.compile(r"=+ (?P<text>.*\*) =+")
REFERENCE_SUITE = ["pytest", "--pyargs", "reference_losses"]


@dataclass
class Block:
    line: int
    lang: str
    title: str | None
    body: str


@dataclass
class Command:
    line: int
    argv: list[str]
    shown: list[str] = field(default_factory=list)


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        title = TITLE.search(match["attrs"])
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(line, match["lang"], title["name"] if title else None, match["body"]))
    return found


def commands(block: Block) -> list[Command]:
    result: list[Command] = []
    for offset, text in enumerate(block.body.splitlines(), start=1):
        if text.startswith("$ "):
            result.append(Command(block.line + offset, shlex.split(text[2:])))
        elif result and text.strip() and text.strip() != "...":
            result[-1].shown.append(text.rstrip())
    return result


def glob(shown: str) -> str:
    """A shown line as an fnmatch pattern: literal but for the run time at the end of a summary line, and
    the width of the `=` rules around it (pytest centres the text, so a longer time takes a `=` away)."""
    timed = TIME.sub("\0", shown)
    escaped = "".join(f"[{c}]" if c in "[]*?" else c for c in timed).replace("\0", "*")
    rule = SEPARATOR.fullmatch(escaped)
    return f"*= {rule['text']} =*" if rule else escaped


# pages whose examples take seconds: spawned ranks, each importing torch; a real step under every strategy;
# the whole reference suite; a search of batch sizes
SLOW_PAGES = (
    "docs/guides/distributed.md",
    "docs/guides/torch-snapshots.md",
    "docs/guides/advise.md",
    "docs/guides/reference-strategies.md",
    "docs/guides/fit.md",
)


def examples() -> list[object]:
    pages = [page for page in PAGES if any(b.lang == "python" or b.lang == "console" for b in blocks(page))]
    return [example(page, line) for page in pages for line in parts(page)]


def parts(page: Path) -> list[int | None]:
    """The lines of a page's commands where each runs apart (a test each, which workers share out): the
    page writes no file and every command runs the reference suite (its runs shared, none changing another's
    output); else [None], the whole page in one test."""
    found = [command for block in blocks(page) if block.lang == "console" for command in commands(block)]
    apart = not any(block.lang == "python" for block in blocks(page)) and len(found) > 1
    if apart and all(command.argv[:3] == REFERENCE_SUITE for command in found):
        return [command.line for command in found]
    return [None]


def example(page: Path, line: int | None) -> object:
    name = str(page.relative_to(ROOT))
    marks = [pytest.mark.slow] if name in SLOW_PAGES else []
    return pytest.param(page, line, id=name if line is None else f"{name}:{line}", marks=marks)


def test_the_slow_pages_are_pages() -> None:
    assert [name for name in SLOW_PAGES if not (ROOT / name).is_file()] == []


def test_every_python_block_is_a_file_that_runs() -> None:
    untitled = [
        f"{page.relative_to(ROOT)}:{block.line}"
        for page in PAGES
        for block in blocks(page)
        if block.lang == "python" and block.title is None
    ]
    assert not untitled, f'python blocks without title="FILE.py" (so never run): {", ".join(untitled)}'


def test_no_example_file_shares_a_name_with_a_test_module_of_this_suite() -> None:
    """Examples run in this suite's process (pytester), where a module name can be imported only once."""
    ours = {path.name for path in (ROOT / "tests").rglob("*.py")}  # its folders too
    clashing = [
        f"{page.relative_to(ROOT)}:{block.line} {block.title}"
        for page in PAGES
        for block in blocks(page)
        if block.title in ours and block.title != "conftest.py"
    ]
    assert not clashing, f"example files named like this suite's test modules: {', '.join(clashing)}"


@pytest.mark.parametrize(("page", "only"), examples())
def test_page_examples_print_what_they_show(
    pytester: pytest.Pytester, run_reference: RunReference, page: Path, only: int | None
) -> None:
    """`only`: the line of the one command to run (`parts`), or None for all of the page."""
    pytester.makeini("[pytest]\ngpumem_backend = tracker\n")
    ran: set[str] = set()
    written: list[str] = []
    for block in blocks(page):
        if block.lang == "python" and block.title:
            path = pytester.path / block.title
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.body, encoding="utf-8")
            written.append(block.title)
        elif block.lang == "console":
            for command in commands(block):
                if only is not None and command.line != only:
                    continue
                where = f"{page.relative_to(ROOT)}:{command.line}"
                output = printed(pytester, run_reference, command.argv, where, shared=not written)
                ran.update(arg for arg in command.argv if arg in written)
                if command.argv[0] == "pytest" and not any(arg in written for arg in command.argv[1:]):
                    ran.update(written)
                missing = first_missing(output, command.shown)
                assert missing is None, f"{where}: shown line not printed: {missing!r}\n--- printed:\n{output}"
    for name in written:
        if Path(name).name.startswith("test_") and name not in ran:
            result = pytester.runpytest("-p", "no:cacheprovider", name)
            assert result.ret == 0, f"{page.relative_to(ROOT)}: {name} fails:\n{result.stdout.str()}"


def printed(
    pytester: pytest.Pytester, run_reference: RunReference, argv: list[str], where: str, *, shared: bool
) -> str:
    """What a command prints. A run of the reference suite is shared with the tests that read the same run
    (conftest's run_reference) where no file of the page is there to change it."""
    if shared and argv[:3] == REFERENCE_SUITE:
        return "\n".join(run_reference(pytester, *argv[3:])["lines"])
    return run(pytester, argv, where)


def run(pytester: pytest.Pytester, argv: list[str], where: str) -> str:
    if argv[0] == "pytest":
        result = pytester.runpytest("-p", "no:cacheprovider", *argv[1:])
    elif argv[0] == "pytest-gpumem":
        result = pytester.run(sys.executable, "-m", "pytest_gpumem", *argv[1:])
    else:
        pytest.fail(f"{where}: only pytest and pytest-gpumem commands run: {' '.join(argv)}", pytrace=False)
    return "\n".join([*result.outlines, *result.errlines])


def first_missing(output: str, shown: list[str]) -> str | None:
    """The first shown line that the output does not print after the lines before it, or None."""
    lines = [line.rstrip() for line in output.splitlines()]
    position = 0
    for expected in shown:
        wanted = glob(expected)
        while position < len(lines) and not fnmatch.fnmatchcase(lines[position], wanted):
            position += 1
        if position == len(lines):
            return expected
        position += 1
    return None


@pytest.mark.parametrize(
    ("shown", "printed"),
    [
        ("=== 1 failed in 7.96s ===", "=== 1 failed in 0.51s ==="),
        ("== 1 failed in 23.26s ==", "=== 1 failed in 4.61s ==="),
        ("x float32[1000] *", "x float32[1000] *"),
        ("gpumem: 1 measured", "gpumem: 1 measured   "),
    ],
)
def test_shown_lines_match_the_printed_ones_but_for_time(shown: str, printed: str) -> None:
    assert first_missing(printed, [shown]) is None


def test_a_changed_figure_is_missing() -> None:
    assert first_missing("forward: peak 256.0 KiB", ["forward: peak 255.0 KiB"]) == "forward: peak 255.0 KiB"
    assert first_missing("=== 2 failed in 0.51s ===", ["=== 1 failed in 0.51s ==="]) == "=== 1 failed in 0.51s ==="
