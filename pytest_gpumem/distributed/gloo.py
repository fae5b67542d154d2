"""gloo's worker threads, which let go of a finished collective's buffers when their scheduling decides:
waiting for them to be idle at a rank's phase boundaries (and after torch's own calls that drop their
buffers as they return) makes a rank's figures the same from run to run."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_gpumem.backends.base import Backend

_GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives each of gloo's worker threads
_GLOO_IDLE_LIMIT = 5.0  # seconds a phase boundary waits for gloo's worker threads to go idle
_QUIET = 0.001  # seconds a worker thread must not run, the GIL free, to count as idle


def _gloo_workers() -> dict[str, tuple[str, str]]:
    """Each gloo worker thread of this process: its state (R: running or runnable) and its time on a CPU."""
    found: dict[str, tuple[str, str]] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            task = f"/proc/self/task/{tid}"
            with contextlib.suppress(OSError, IndexError):
                with open(f"{task}/comm") as comm:
                    if comm.read().strip() != _GLOO_WORKER:
                        continue
                with open(f"{task}/stat") as stat:
                    state = stat.read().rpartition(")")[2].split()[0]
                with open(f"{task}/schedstat") as sched:
                    ran = sched.read().split()[0]
                found[tid] = (state, ran)
    return found


def wait_for_gloo_idle(limit: float = _GLOO_IDLE_LIMIT) -> bool:
    """Wait until gloo's worker threads are idle: none is running, and none ran while this thread slept
    without the GIL. A worker lets go of a finished collective's tensors (the last reference to an
    all-gather or broadcast buffer, often) after the collective has completed, at a moment its thread's
    scheduling decides; once it is idle, those tensors are freed. False if a worker was still busy after
    `limit` seconds."""
    before = _gloo_workers()
    if not before:
        return True
    deadline = time.monotonic() + limit
    while True:
        time.sleep(_QUIET)
        now = _gloo_workers()
        if now == before and all(state != "R" for state, _ in now.values()):
            return True
        if time.monotonic() > deadline:
            return False
        before = now


_GLOO_WAITED_CALLS = ("_broadcast_coalesced", "_verify_params_across_processes")
"""torch.distributed's calls that drop their own buffers as they return (DDP's `init_sync` broadcast and
its check of the parameters' shapes), while gloo's worker may still hold them."""


def wait_for_gloo_after_calls(dist: Any) -> None:
    """Each of `_GLOO_WAITED_CALLS` waits for gloo's worker before returning: its buffers are then gone before
    the caller's next allocation (in DDP, the reducer's gradient buckets), whatever the threads' scheduling."""
    for name in _GLOO_WAITED_CALLS:
        call = getattr(dist, name, None)
        if callable(call):
            setattr(dist, name, _waiting_for_gloo(call))


def _waiting_for_gloo(call: Callable[..., Any]) -> Callable[..., Any]:
    def waiting(*args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        finally:
            wait_for_gloo_idle()

    return waiting


class SettledBoundaries:
    """A backend's `settle`, followed by waiting for gloo's worker threads (at every phase boundary and
    at the call's start and end), counting the boundaries where they stayed busy."""

    def __init__(self, backend: Backend) -> None:
        self.settle, self.busy = backend.settle, 0

    def __call__(self) -> None:
        self.settle()
        if not wait_for_gloo_idle():
            self.busy += 1

    def notes(self) -> list[str]:
        if not self.busy:
            return []
        return [
            f"gloo's worker threads were still busy {_GLOO_IDLE_LIMIT:g} s after {self.busy} phase boundaries: when "
            "they let go of a collective's buffers varies, and so may this rank's figures"
        ]
