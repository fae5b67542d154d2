"""Every version of a file along the first-parent line of HEAD (the branch being gated), as each commit
of that line holds it: one ``git log --first-parent`` of the file (a merge read against its first
parent, so a clean merge, ``-s ours`` and a resolved conflict each give what the merge holds), one
``git diff-tree -M`` where the file appears (renames followed, copies not), one ``git cat-file --batch``
for all the blobs (the commit a work tree is at, which a ``--gpumem-json`` report records, is
`report/commit.py`'s). Git's output is read NUL-separated, so no subject or file name can break a record."""

from __future__ import annotations

import os
import shutil
import subprocess
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.report.commit import Head, head
from pytest_gpumem.report.width import flatten

__all__ = ["Commit", "GitError", "Head", "Repo", "Version", "head"]

_FIELDS = 5
_FORMAT = "%H%x00%h%x00%cs%x00%P%x00%s"  # hash, short hash, committer date, parents, subject
_GIT = ["git", "-c", "core.quotePath=false", "--literal-pathspecs", "--no-pager"]


class GitError(GpuMemError):
    """Git cannot answer: not installed, not a repository, a file it never saw; one line."""


@dataclass(frozen=True)
class Commit:
    sha: str
    short: str
    date: str  # the committer date, YYYY-MM-DD
    subject: str  # on one line, control characters written as Python escapes

    def describe(self) -> str:
        return f"{self.short} {self.date} {self.subject}"


@dataclass(frozen=True)
class Version:
    """The file as one commit left it (``data`` is None where the commit deleted it)."""

    commit: Commit
    path: str  # relative to the repository's top level
    data: bytes | None


@dataclass(frozen=True)
class _Change:
    """A first-parent commit that changed the file: its first parent, the status letter, the blob."""

    commit: Commit
    parent: str | None
    status: str
    blob: str | None
    path: str


class Repo:
    """The git repository holding ``path``; raises ``GitError`` when there is none or no git."""

    def __init__(self, path: Path) -> None:
        if shutil.which("git") is None:
            raise GitError("git is not installed (history reads the baseline file's versions from git)")
        self.folder = path.parent if path.parent.is_dir() else Path.cwd()
        name = path.name if path.parent.is_dir() else str(path)
        where = self._text(
            ["rev-parse", "--show-toplevel", "--show-prefix"], f"{path}: not inside a git repository", False
        )
        top, _, prefix = where.removesuffix("\n").partition("\n")
        self.folder = Path(top)  # every command from here on runs at the top, on paths relative to it
        self.path = os.path.normpath(prefix + name)

    def _text(self, args: Sequence[str], problem: str, detail: bool = True) -> str:
        return os.fsdecode(self._run(args, problem, None, detail))

    def _run(self, args: Sequence[str], problem: str, stdin: bytes | None = None, detail: bool = True) -> bytes:
        command = [*_GIT, "-C", str(self.folder), *args]
        try:
            done = subprocess.run(command, input=stdin, capture_output=True, check=False)
        except OSError as exc:
            raise GitError(f"cannot run git: {exc.strerror or exc}") from None
        if done.returncode != 0:
            reason = done.stderr.decode("utf-8", "replace").strip().splitlines()
            raise GitError(f"{problem}: {flatten(reason[-1])}" if reason and detail else problem)
        return done.stdout

    def versions(self) -> list[Version]:
        """The file at each first-parent commit of HEAD that changed it, oldest first, its blobs read by
        one ``cat-file --batch``."""
        changes = list(self._changes())[::-1]
        wanted = list(dict.fromkeys(c.blob for c in changes if c.blob is not None))
        query = "".join(f"{blob}\n" for blob in wanted).encode("ascii")
        out = self._run(["cat-file", "--batch"], "git cat-file failed", query) if wanted else b""
        data = dict(zip(wanted, _blobs(out), strict=True))
        return [Version(c.commit, c.path, None if c.blob is None else data[c.blob]) for c in changes]

    def _changes(self) -> Iterator[_Change]:
        """Newest first: the commits of HEAD's first-parent line that changed the file, under the name
        it had at each; where a commit renamed it, on under its old name from that commit's parent."""
        start: str | None = "HEAD"
        path = self.path
        while start is not None:
            changes, start = self._log(start, path), None
            for change in changes:
                yield change
                source = self._renamed_from(change)
                if source is not None:
                    start, path = change.parent, source
                    break

    def _log(self, start: str, path: str) -> list[_Change]:
        args = ["log", "--first-parent", "--diff-merges=first-parent", "--no-renames", "--raw"]
        args += ["-z", f"--format={_FORMAT}", start, "--", path]
        changes = []
        for commit, parents, raw in _records(self._run(args, f"git log of {self.path} failed")):
            if raw:
                fields = raw[-1][0].decode("ascii", "replace").split()
                blob = fields[3].rstrip(".")  # abbreviated (unique), as the short hash; zeros where deleted
                parent = parents[0] if parents else None
                changes.append(_Change(commit, parent, fields[4][:1], blob if blob.strip("0") else None, path))
        return changes

    def _renamed_from(self, change: _Change) -> str | None:
        """The file's name in the parent of a commit that renamed it to its name there (a copy is no
        rename); None for any other change."""
        if change.status != "A" or change.parent is None:
            return None
        args = ["diff-tree", "-r", "-z", "-M", "--diff-filter=R", "--no-commit-id", change.parent, change.commit.sha]
        tokens = self._run(args, f"git diff-tree of {change.commit.short} failed").split(b"\0")
        for at in range(0, len(tokens) - 2, 3):
            if os.fsdecode(tokens[at + 2]) == change.path:
                return os.fsdecode(tokens[at + 1])
        return None

    def since(self, oldest: Commit) -> list[Commit]:
        """Every commit of HEAD's first-parent line from ``oldest`` on (those that changed the file or
        not), oldest first."""
        args = ["log", "--first-parent", "-z", f"--format={_FORMAT}", "HEAD", "--not", f"{oldest.sha}^@"]
        return [commit for commit, _, _ in _records(self._run(args, "git log failed"))][::-1]

    def at(self, ref: str) -> Version | None:
        """The file as commit ``ref`` holds it, under its name now (a tag of a merged release branch is off
        the first-parent line); None where ``ref`` holds no file of that name."""
        out = self._run(["log", "-1", "--no-walk", "-z", f"--format={_FORMAT}", f"{ref}^{{commit}}"], "git log failed")
        commit = next(_records(out))[0]
        answer = self._run(["cat-file", "--batch"], "git cat-file failed", f"{commit.sha}:{self.path}\n".encode())
        (data,) = _blobs(answer)
        return None if data is None else Version(commit, self.path, data)

    def inside(self, revisions: Sequence[str]) -> set[str]:
        """The hashes of the first-parent commits that ``git rev-list`` selects with ``revisions``."""
        text = self._text(["rev-list", "--first-parent", *revisions], "git rev-list failed")
        return set(text.split())

    def shallow(self) -> Commit | None:
        """The oldest commit reachable when the clone is shallow, else None."""
        if self._text(["rev-parse", "--is-shallow-repository"], "git rev-parse failed").strip() != "true":
            return None
        out = self._run(["log", "--max-parents=0", "-z", f"--format={_FORMAT}", "HEAD"], "git log failed")
        return min((commit for commit, _, _ in _records(out)), key=lambda c: c.date, default=None)

    def is_ref(self, name: str) -> bool:
        command = [*_GIT, "-C", str(self.folder), "rev-parse", "--verify", "--quiet", f"{name}^{{commit}}"]
        return subprocess.run(command, capture_output=True, check=False).returncode == 0


def _records(out: bytes) -> Iterator[tuple[Commit, list[str], list[tuple[bytes, bytes]]]]:
    """The commits of a ``git log -z --format=_FORMAT`` answer, each with its parents and its ``--raw``
    lines (each line's fields and path)."""
    tokens = out.split(b"\0")
    at = 0
    while at + _FIELDS <= len(tokens) and tokens[at].strip():
        sha, short, date, parents, subject = (t.decode("utf-8", "replace") for t in tokens[at : at + _FIELDS])
        at += _FIELDS
        raw = []
        while at + 1 < len(tokens) and tokens[at].lstrip(b"\n").startswith(b":"):
            raw.append((tokens[at].lstrip(b"\n"), tokens[at + 1]))
            at += 2
        yield Commit(sha.strip(), short, date, _printable(subject)), parents.split(), raw


def _printable(text: str) -> str:
    """``text`` with every control character (a record separator, an escape sequence) written as its
    Python escape, so that no output it reaches obeys it or breaks on it."""
    if text.isprintable():
        return text
    return "".join(c.encode("unicode_escape").decode("ascii") if unicodedata.category(c) == "Cc" else c for c in text)


def _blobs(out: bytes) -> list[bytes | None]:
    """The contents in a ``cat-file --batch`` answer, in order; None for a ``missing`` object."""
    found: list[bytes | None] = []
    at = 0
    while at < len(out):
        end = out.index(b"\n", at)
        header = out[at:end].split()
        if len(header) == 3 and header[1] == b"blob":
            size = int(header[2])
            found.append(out[end + 1 : end + 1 + size])
            at = end + 1 + size + 1
        else:
            found.append(None)
            at = end + 1
    return found
