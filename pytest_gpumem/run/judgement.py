"""A test's comparison with its stored baseline (`BaselineRun.judge`), in a module of its own: only runs that
compare baselines import it, so an idle run does not pay for the methods its dataclass generates."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pytest_gpumem.results.baseline import Entry, Verdict


@dataclass
class Judgement:
    """A test's comparison with its baseline, and the entry to record if the test passes."""

    verdict: Verdict
    entry: Entry
    fails: bool
    stored_composition: bool = False  # the stored baseline says what its peaks were made of
    selection: Sequence[str] = ()  # selection_flags() of the run: a command for this test needs them

    def failure_message(self) -> str:
        """The verdict's line; a regression also says how to learn what grew, when it cannot say it."""
        from pytest_gpumem.results.baseline import BaselineStatus

        message = self.verdict.failure_message()
        if self.verdict.status != BaselineStatus.REGRESSED:
            return message
        if not self.stored_composition:  # recorded before updates stored it, or not explainable then
            how = shlex.join(["pytest", *self.selection, self.verdict.nodeid, "--gpumem-update"])
            return f"{message} (to see what grew, record the baseline with its composition: {how})"
        if self.entry.composition is None:
            how = shlex.join(["pytest", *self.selection, self.verdict.nodeid, "--gpumem-explain"])
            return f"{message} (see what made it: {how})"
        return message
