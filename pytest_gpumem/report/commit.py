"""The commit a report was made at, as one ``git status`` of the work tree says: a ``--gpumem-json`` report
records it (`history/git.py` reads the rest of git)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HEAD_TIMEOUT_S", "Head", "head"]

HEAD_TIMEOUT_S = 10.0
"""The longest a report waits for ``git status`` (a huge work tree on a slow disk): then no commit."""


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
