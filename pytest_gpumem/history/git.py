"""Every committed version of a file, read from git: one ``git log --follow`` for the commits and the
path at each (renames followed), one ``git cat-file --batch`` process for all the blobs; and the commit
a work tree is at (one ``git status``), which a ``--gpumem-json`` report records."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pytest_gpumem.errors import GpuMemError

__all__ = ["Commit", "GitError", "Head", "Repo", "Version", "head"]

_MARK = "\x1e"
_SEP = "\x1f"
_FORMAT = f"{_MARK}%H{_SEP}%h{_SEP}%cs{_SEP}%s"
HEAD_TIMEOUT_S = 10.0
"""The longest a report waits for ``git status`` (a huge work tree on a slow disk): then no commit."""


class GitError(GpuMemError):
    """Git cannot answer: not installed, not a repository, a file it never saw; one line."""


@dataclass(frozen=True)
class Commit:
    sha: str
    short: str
    date: str  # the committer date, YYYY-MM-DD
    subject: str

    def describe(self) -> str:
        return f"{self.short} {self.date} {self.subject}"


@dataclass(frozen=True)
class Version:
    """The file as one commit left it (``data`` is None where the commit deleted it)."""

    commit: Commit
    path: str  # relative to the repository's top level
    data: bytes | None


class Repo:
    """The git repository holding ``path``; raises ``GitError`` when there is none or no git."""

    def __init__(self, path: Path) -> None:
        if shutil.which("git") is None:
            raise GitError("git is not installed (history reads the baseline file's versions from git)")
        self.folder = path.parent if path.parent.is_dir() else Path.cwd()
        self.file = path.name if path.parent.is_dir() else str(path)
        top = self._git(["rev-parse", "--show-toplevel"], f"{path}: not inside a git repository", detail=False)
        self.top = top.strip()

    def _git(self, args: Sequence[str], problem: str, detail: bool = True) -> str:
        return self._run(args, problem, None, detail).decode("utf-8", "replace")

    def _run(self, args: Sequence[str], problem: str, stdin: bytes | None = None, detail: bool = True) -> bytes:
        command = ["git", "-c", "core.quotePath=false", "-C", str(self.folder), *args]
        try:
            done = subprocess.run(command, input=stdin, capture_output=True, check=False)
        except OSError as exc:
            raise GitError(f"cannot run git: {exc.strerror or exc}") from None
        if done.returncode != 0:
            reason = done.stderr.decode("utf-8", "replace").strip().splitlines()
            raise GitError(f"{problem}: {reason[-1]}" if reason and detail else problem)
        return done.stdout

    def commits(self, revisions: Sequence[str] = ()) -> list[tuple[Commit, str, str]]:
        """The commits that touched the file, newest first, each with its status letter and the path."""
        args = ["log", "--follow", "--name-status", f"--format={_FORMAT}", *revisions, "--", self.file]
        text = self._git(args, f"git log of {self.file} failed")
        found: list[tuple[Commit, str, str]] = []
        for record in text.split(_MARK)[1:]:
            head, _, names = record.partition("\n")
            sha, short, date, subject = head.split(_SEP, 3)
            lines = [line.split("\t") for line in names.splitlines() if "\t" in line]
            if lines:
                status, *paths = lines[-1]
                found.append((Commit(sha, short, date, subject), status[:1], paths[-1]))
        return found

    def versions(self, revisions: Sequence[str] = ()) -> list[Version]:
        """Every committed version of the file, oldest first, its blobs read by one ``cat-file --batch``."""
        touched = self.commits(revisions)[::-1]
        wanted = [(c, path) for c, status, path in touched if status != "D"]
        query = "".join(f"{c.sha}:{path}\n" for c, path in wanted).encode("utf-8")
        out = self._run(["cat-file", "--batch"], "git cat-file failed", query) if wanted else b""
        blobs = iter(_blobs(out))
        data = {c.sha: next(blobs, None) for c, _ in wanted}
        return [Version(c, path, data.get(c.sha)) for c, status, path in touched]

    def since(self, oldest: Commit) -> list[Commit]:
        """Every commit from ``oldest`` to HEAD (those that touched the file or not), oldest first."""
        args = ["log", f"--format={_FORMAT}", "HEAD", "--not", f"{oldest.sha}^@"]
        text = self._git(args, "git log failed")
        found = [Commit(*record.split("\n")[0].split(_SEP, 3)) for record in text.split(_MARK)[1:]]
        return found[::-1]

    def shallow(self) -> Commit | None:
        """The oldest commit reachable when the clone is shallow, else None."""
        if self._git(["rev-parse", "--is-shallow-repository"], "git rev-parse failed").strip() != "true":
            return None
        text = self._git(["log", "--max-parents=0", f"--format={_FORMAT}", "HEAD"], "git log failed")
        oldest = [r.split("\n")[0].split(_SEP, 3) for r in text.split(_MARK)[1:]]
        return min((Commit(*fields) for fields in oldest), key=lambda c: c.date, default=None)

    def is_ref(self, name: str) -> bool:
        command = ["git", "-C", str(self.folder), "rev-parse", "--verify", "--quiet", f"{name}^{{commit}}"]
        return subprocess.run(command, capture_output=True, check=False).returncode == 0


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


@dataclass(frozen=True)
class Head:
    """The commit a work tree is at, and whether its tracked files differ from it."""

    sha: str
    dirty: bool

    def to_json(self) -> dict[str, object]:
        return {"sha": self.sha, "dirty": self.dirty}


def head(folder: Path) -> Head | None:
    """What ``git status`` says of the work tree holding ``folder`` (untracked files are not changes);
    None outside one, without git, before its first commit, or when git does not answer in time."""
    command = ["git", "--no-optional-locks", "-C", str(folder), "status", "--porcelain=v2", "--branch"]
    command += ["--untracked-files=no", "--ignore-submodules=dirty"]
    try:
        done = subprocess.run(command, capture_output=True, check=False, timeout=HEAD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.decode("utf-8", "replace").splitlines()
    sha = next((line.split()[-1] for line in lines if line.startswith("# branch.oid ")), "")
    if done.returncode != 0 or len(sha) not in (40, 64) or not all(c in "0123456789abcdef" for c in sha):
        return None
    return Head(sha, any(not line.startswith("#") for line in lines))
