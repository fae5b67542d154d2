"""Replacing a file whole: through a temporary file in its folder, renamed over it, so that a failure (a
full disk, an interrupt) leaves the old file as it was. Both the baseline file and every report use it."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path


def replace_atomically(target: Path, data: bytes, *, durable: bool = False) -> None:
    """Write `data` over `target` through `.NAME.PID.XXXX.tmp` beside it, keeping the mode `target` had (a
    new file: 0o666 less the umask); `durable`: the bytes reach the disk before the rename. The temporary
    file is removed whatever fails."""
    mode = _mode_for(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _mode_for(target: Path) -> int:
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
