"""What grew, and where: growth against the baseline by module group, repeated blocks folded, modules new in
the peak or no longer in it named, ranked by growth (not by size), each group's parts adding up to its growth."""

from __future__ import annotations

from typing import Any

import pytest

from cuda_allocator_model.sizes import format_size
from pytest_gpumem.baselines.compare import Tolerance, change_text, compare_peak
from pytest_gpumem.explain.blocks import fold, repeated_blocks
from pytest_gpumem.explain.composition import OTHER_MODULES, folded_cells
from pytest_gpumem.explain.growth import compact
from pytest_gpumem.explain.growth import what_grew as what_grew_typed
from pytest_gpumem.results.baseline import check_composition
from pytest_gpumem.results.codec import encode
from pytest_gpumem.results.explanation import (
    Cell,
    Composition,
    Explanation,
    PhaseExplanation,
    SampledTimeline,
)

KIB = 1024


def what_grew(stored: dict[str, Any] | None, current: dict[str, Any] | None, phase: str) -> str | None:
    """What grew between two compositions as the baseline file stores them."""
    return what_grew_typed(_read(stored), _read(current), phase)


def _read(stored: dict[str, Any] | None) -> Composition | None:
    return None if stored is None else check_composition(stored)


def _phase(cells: list[list[Any]], folded: dict[str, int] | None = None) -> dict[str, Any]:
    categories: dict[str, int] = {}
    for category, _, size in cells:
        categories[category] = categories.get(category, 0) + size
    out: dict[str, Any] = {"categories": categories, "cells": cells}
    if folded is not None:
        out["folded"] = folded
    return out


def test_numbered_children_of_one_class_fold_into_one_group() -> None:
    kinds = {
        "(GPT)": "GPT",
        "transformer.h": "ModuleList",
        **{f"transformer.h.{i}": "Block" for i in range(4)},
        **{f"transformer.h.{i}.mlp": "MLP" for i in range(4)},
        "mixed": "Sequential",
        "mixed.0": "Linear",
        "mixed.1": "ReLU",
        "one": "ModuleList",
        "one.0": "Block",
    }
    # a list of two classes (Linear, ReLU) is not repeated blocks, and one block is not a list
    assert repeated_blocks(kinds) == {"transformer.h.*": 4}
    folds = set(repeated_blocks(kinds))
    assert fold("transformer.h.3.mlp", folds) == "transformer.h.*"
    assert fold("transformer.h", folds) == "transformer.h"
    assert fold("mixed.1", folds) == "mixed.1"
    assert fold("lm_head", folds) == "lm_head"


def test_a_root_list_folds_and_an_inner_list_folds_into_its_outer_block() -> None:
    kinds = {f"{i}": "Block" for i in range(3)} | {f"{i}.experts.{j}": "Expert" for i in range(3) for j in range(2)}
    assert repeated_blocks(kinds) == {"*": 3, **{f"{i}.experts.*": 2 for i in range(3)}}
    assert fold("2.experts.1", set(repeated_blocks(kinds))) == "*"


def test_growth_spread_over_blocks_outranks_a_larger_unchanged_part() -> None:
    """Four blocks grow 16 KiB each: 64 KiB in one group; the loss head is larger (100 KiB) but unchanged."""
    stored = {"forward": _phase([["saved", "h.*", 8 * KIB], ["temporaries", "head", 100 * KIB]], {"h.*": 4})}
    current = {"forward": _phase([["saved", "h.*", 72 * KIB], ["temporaries", "head", 100 * KIB]], {"h.*": 4})}
    assert what_grew(stored, current, "forward") == "h.* +64.0 KiB (4 blocks), saved for backward"


def test_ranked_by_growth_with_modules_new_in_the_peak_and_no_longer_in_it_named() -> None:
    stored = {
        "call": _phase(
            [["parameters", "h.*", 400 * KIB], ["parameters", "old", 1 * KIB], ["temporaries", "a", 10 * KIB]],
            {"h.*": 4},
        )
    }
    current = {
        "call": _phase(
            [
                ["parameters", "h.*", 500 * KIB],  # +100 KiB: a fifth block
                ["temporaries", "a", 11 * KIB],  # +1 KiB
                ["parameters", "extra", 2 * KIB],  # new
                ["gradients", "extra", 2 * KIB],
                ["temporaries", "b", 3 * KIB],  # new, ranked fourth: named by the list of new ones
            ],
            {"h.*": 5},
        )
    }
    assert what_grew(stored, current, "call") == (
        "h.* +100.0 KiB (5 blocks, was 4), parameters; extra +4.0 KiB (new): gradients +2.0 KiB, "
        "parameters +2.0 KiB; b +3.0 KiB (new), temporaries; no longer in the peak: old"
    )


def test_a_module_new_in_the_peak_outside_the_top_is_listed_as_new_in_the_peak() -> None:
    stored = {"call": _phase([["temporaries", m, KIB] for m in "abc"], {})}
    current = {"call": _phase([["temporaries", m, 2 * KIB] for m in "abc"] + [["saved", "d", 512]], {})}
    assert what_grew(stored, current, "call") == (
        "a +1.0 KiB, temporaries; b +1.0 KiB, temporaries; c +1.0 KiB, temporaries; new in the peak: d"
    )


def test_a_peak_moved_to_another_moment_shows_the_parts_that_shrank_so_that_the_parts_add_up() -> None:
    """The peak moved from the end of backward (gradients) to the forward's end (saved activations): the
    blocks grew 8 KiB net, 50 KiB saved for backward and 18 KiB temporaries against 60 KiB of gradients."""
    before = [["gradients", "h.*", 60 * KIB], ["saved", "h.*", 0], ["temporaries", "h.*", 2 * KIB]]
    after = [["saved", "h.*", 50 * KIB], ["temporaries", "h.*", 20 * KIB]]
    stored, current = {"call": _phase(before, {"h.*": 4})}, {"call": _phase(after, {"h.*": 4})}
    assert what_grew(stored, current, "call") == (
        "h.* +8.0 KiB (4 blocks): gradients -60.0 KiB, saved for backward +50.0 KiB, temporaries +18.0 KiB"
    )


def test_past_three_parts_the_rest_of_a_groups_change_is_summed() -> None:
    cells = [["saved", "h.*", 8 * KIB], ["temporaries", "h.*", 4 * KIB], ["gradients", "h.*", 2 * KIB]]
    stored = {"call": _phase([*cells, ["inputs", "h.*", 3 * KIB], ["parameters", "h.*", 2 * KIB]], {"h.*": 4})}
    current = {"call": _phase([["saved", "h.*", 16 * KIB], ["temporaries", "h.*", 8 * KIB]], {"h.*": 4})}
    # +8 saved, +4 temporaries, -2 gradients, then -3 inputs and -2 parameters summed: +5 KiB in all
    assert what_grew(stored, current, "call") == (
        "h.* +5.0 KiB (4 blocks): saved for backward +8.0 KiB, temporaries +4.0 KiB, inputs and other -3.0 KiB, "
        "the rest -4.0 KiB"
    )


def test_an_unfolded_baseline_is_folded_like_the_run_and_compared_where_both_list_a_part() -> None:
    """A baseline made before folding lists its 8 largest cells, by module: they are folded with the run's
    groups, and a part it does not list is never called new (it may have been just off the list)."""
    stored = {"forward": {"categories": {"saved": 8 * KIB}, "cells": [["saved", f"h.{i}", 2 * KIB] for i in range(4)]}}
    current = {"forward": _phase([["saved", "h.*", 16 * KIB], ["saved", "z", KIB]], {"h.*": 4})}
    assert what_grew(stored, current, "forward") == "h.* +8.0 KiB (4 blocks), saved for backward"


def test_growth_outside_every_listed_part_names_the_category() -> None:
    stored = {"call": _phase([["temporaries", "a", 100]], {})}
    stored["call"]["categories"]["unattributed"] = 0
    current = {"call": _phase([["temporaries", "a", 100]], {})}
    current["call"]["categories"]["unattributed"] = 4096
    assert what_grew(stored, current, "call") == "unattributed +4.0 KiB"
    assert what_grew(stored, None, "call") is None
    assert what_grew(stored, current, "forward") is None


def test_compact_keeps_every_folded_part_and_the_store_reads_it_back() -> None:
    groups = [Cell("saved", "h.*", 4096), Cell("inputs", "x", 8)]
    call = PhaseExplanation(4104, {"saved": 4096, "inputs": 8}, {}, [], [], live={}, entries=1, groups=groups)
    explanation = Explanation(
        "t.py::t", "tracker", [], {}, {"call": call}, SampledTimeline(0, []), {"h.*": 4, "unused.*": 2}
    )
    stored = encode(compact(explanation), Composition)
    assert stored == {
        "call": {
            "categories": {"saved": 4096, "inputs": 8},
            "cells": [["saved", "h.*", 4096], ["inputs", "x", 8]],
            "folded": {"h.*": 4},
        }
    }
    assert check_composition(stored) == compact(explanation)


@pytest.mark.parametrize("bad", [{"h.*": 0}, {"h.*": "4"}, [1], {"h.*": True}])
def test_the_store_refuses_a_bad_block_count(bad: object) -> None:
    with pytest.raises(ValueError, match=r"composition\[\"call\"\]\.folded: expected an object of module group"):
        check_composition({"call": {"categories": {}, "cells": [], "folded": bad}})


def test_past_the_stored_parts_the_rest_of_each_category_is_one_part() -> None:
    """29 parts of 100 to 128 B: the 24 largest are kept, the 5 smallest (100 to 104 B) become one."""
    cells = {("temporaries", f"m{i:02}"): 100 + i for i in range(29)}
    kept = folded_cells(cells, set())
    assert len(kept) == 25
    assert sum(c.size for c in kept) == sum(cells.values())  # the sum stays exact
    assert kept[-1] == Cell("temporaries", OTHER_MODULES, 100 + 101 + 102 + 103 + 104)


BLOCKS = """
import pytest, torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

CHECKPOINT = True
EXTRA = False
B, N = 8, 64  # a block's input and output: 8 x 64 float32 = 2 KiB; its hidden activation 8 x 256: 8 KiB


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(N, 4 * N, bias=False), nn.Linear(4 * N, N, bias=False)

    def forward(self, x):
        return self.down(self.up(x).tanh())


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        if EXTRA:
            self.extra = nn.Linear(N, N, bias=False)

    def forward(self, x):
        if EXTRA:
            x = self.extra(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if CHECKPOINT else block(x)
        return x


@pytest.mark.max_memory(tolerance=5)
def test_train(gpumem):
    model = Model()
    x = torch.randn(B, N, requires_grad=True)
    with gpumem.phase("forward"):
        loss = model(x).sum()
    loss.backward()
"""


def test_blocks_without_checkpointing_name_the_block_list_and_the_new_module(tracker: pytest.Pytester) -> None:
    """Checkpointed, the forward peak is in block 3: the inputs of blocks 1-3 kept for recomputing (6 KiB)
    and its hidden activation before and after tanh (16 KiB): 22 KiB. Not checkpointed, at the same moment:
    blocks 0-2 keep tanh's output (8 KiB, saved by `down`) and their output (2 KiB, saved by the next `up`),
    block 3 its two hidden activations (16 KiB), and `extra` its output (2 KiB, saved by block 0): 48 KiB.
    Blocks: +32 KiB saved for backward, -8 KiB temporaries, both said; all measured once, without
    --gpumem-explain."""
    tracker.makepyfile(test_blocks=BLOCKS)
    first = tracker.runpytest("--gpumem-update", "--gpumem-explain", "--gpumem-slack=0")
    first.assert_outcomes(passed=1)
    tracker.makepyfile(
        test_blocks=BLOCKS.replace("CHECKPOINT = True", "CHECKPOINT = False").replace("EXTRA = False", "EXTRA = True")
    )
    second = tracker.runpytest("--gpumem-slack=0")
    second.assert_outcomes(failed=1)
    second.stdout.fnmatch_lines(
        [
            "forward peak 48.0 KiB is 118.2% above baseline 22.0 KiB (tolerance 5%):",  # and what grew below it
            "  blocks.* +24.0 KiB (4 blocks): saved for backward +32.0 KiB, temporaries -8.0 KiB; "
            "extra +2.0 KiB (new),",
            "    saved for backward",
        ]
    )


# ------------------------------------------------------- how much it grew: in percent, or in bytes

MIB = 1024 * KIB


@pytest.mark.parametrize(
    ("stored", "current", "shown"),
    [
        (1000, 1256, "+25.6%"),
        (1000, 500, "-50.0%"),
        (1000, 11_000, "+1000.0%"),  # ten times the baseline: still a percent
        (1000, 11_001, "+9.8 KiB"),  # past it: 10,001 B
        (8, 8 * MIB, "+8.0 MiB"),  # 8,388,600 B: not 104857500.0%
        (0, 512, "+512 B"),  # from nothing: no ratio at all
    ],
)
def test_a_change_is_in_percent_up_to_ten_times_its_baseline_and_in_bytes_beyond(
    stored: int, current: int, shown: str
) -> None:
    assert change_text(stored, current) == shown


def test_a_regression_from_a_tiny_baseline_says_how_many_bytes_it_grew() -> None:
    tolerance = Tolerance(5, MIB)
    tiny = compare_peak(None, 8, 8 * MIB, tolerance, format_size)
    assert tiny.message == "call peak 8.0 MiB is 8.0 MiB above baseline 8 B (tolerance 5% + 1.0 MiB)"
    assert compare_peak("forward", 0, 2 * MIB, tolerance, format_size).message == (
        "forward peak 2.0 MiB is 2.0 MiB above baseline 0 B (tolerance 5% + 1.0 MiB)"
    )
    grew = compare_peak(None, 4 * MIB, 16 * MIB, tolerance, format_size)  # 12 MiB: three times 4 MiB
    assert grew.message == "call peak 16.0 MiB is 300.0% above baseline 4.0 MiB (tolerance 5% + 1.0 MiB)"


TINY = """
import os, torch

def test_tiny(gpumem):
    torch.ones(int(os.environ.get("N", "2")))  # 2 float32: 8 B; then 2 Mi of them: 8 MiB
"""


def test_the_failure_line_and_the_report_say_a_tiny_baselines_growth_in_bytes(
    tracker: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracker.makepyfile(test_tiny=TINY)
    tracker.runpytest("--gpumem-update").assert_outcomes(passed=1)
    monkeypatch.setenv("N", str(2 * MIB))
    result = tracker.runpytest("--gpumem-report", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "call peak 8.0 MiB is 8.0 MiB above baseline 8 B (tolerance 5% + 1.0 MiB): (outside modules) +8.0 MiB*",
            "*gpumem report*",
            "test_tiny.py::test_tiny  *8.0 MiB  *8 B  +8.0 MiB  REGRESSED  *",
        ]
    )
    assert "%" not in result.stdout.str().split("gpumem report")[1]
