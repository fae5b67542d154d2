"""A capacity names a size (the allocator's own limit) or a card: its total memory as the driver reports it
less what lies outside the allocator (the CUDA context, libraries' own memory), 512 MiB unless given. One
reader serves the option, the marker, gpumem.fit and gpumem.advise; a bad one is one line naming it."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from cuda_allocator_model import ModelError
from cuda_allocator_model.cards import CARDS, Capacity, find_card, parse_capacity
from pytest_gpumem import values
from pytest_gpumem.budget import budget_from_marker
from pytest_gpumem.measure.fit import BatchFit, Found
from pytest_gpumem.measure.fit_search import FIT_CAPACITY

MIB, GIB = 2**20, 2**30
H100 = 81_082 * MIB  # torch's total_memory on an H100 80GB HBM3 (the smallest printout found)


def test_a_named_card_leaves_its_total_less_what_lies_outside_the_allocator() -> None:
    capacity = parse_capacity("H100-80GB")
    assert (capacity.bytes, capacity.total, capacity.outside) == (H100 - 512 * MIB, H100, 512 * MIB)
    assert capacity.card is find_card("H100-80GB") and capacity.on_a_card


@pytest.mark.parametrize("name", ["h100-80gb", "H100", "H100 80GB HBM3", " h100_80GB "])
def test_names_are_read_whatever_their_case_and_separators(name: str) -> None:
    assert parse_capacity(name) == parse_capacity("H100-80GB")


def test_what_lies_outside_is_given_after_a_colon() -> None:
    assert parse_capacity("H100-80GB:1 GiB") == Capacity(H100 - GIB, find_card("H100"), H100, GIB)
    assert parse_capacity("H100-80GB:0") == Capacity(H100, find_card("H100"), H100, 0)
    unlisted = parse_capacity("24 GiB:600 MiB")  # a card not in the table, by its total
    assert (unlisted.bytes, unlisted.card, unlisted.total) == (24 * GIB - 600 * MIB, None, 24 * GIB)


@pytest.mark.parametrize("size", ["16 GiB", 16 * GIB, "17179869184"])
def test_a_size_keeps_its_meaning_the_allocators_limit(size: object) -> None:
    assert parse_capacity(size) == Capacity(16 * GIB)


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("H1OO", "unknown card 'H1OO': give a size like '16 GiB' or a card (T4, L4, A10G, A100-40GB,"),
        ("H100:lots", "the memory outside the allocator after ':' in 'H100:lots': cannot read size 'lots'"),
        ("T4:20 GiB", "capacity 'T4:20 GiB': 20.0 GiB outside the allocator leaves nothing of 14.6 GiB"),
        ("80 XB", "unknown unit 'XB'"),
        (True, "size must be an int (bytes)"),
    ],
)
def test_a_bad_capacity_is_one_line_naming_the_argument(value: object, said: str) -> None:
    for read, named in (
        (lambda v: budget_from_marker((), {"capacity": v}), "max_memory capacity=: "),
        (lambda v: parse_capacity(v, FIT_CAPACITY), "gpumem.fit(capacity=...): "),
    ):
        with pytest.raises(ModelError) as info:  # the marker's is a GpuMemError, the model's reader a ModelError
            read(value)
        assert str(info.value).startswith(named + said) and "\n" not in str(info.value), str(info.value)


def test_the_option_reads_the_same_spellings() -> None:
    limit = values.capacity("A100-40GB")
    assert (limit.bytes, limit.card, limit.written) == (
        42_298_834_944 - 512 * MIB,
        "A100-40GB",
        "A100-40GB (--gpumem-capacity)",
    )
    with pytest.raises(argparse.ArgumentTypeError, match=r"^invalid capacity 'A100': unknown card 'A100': give a"):
        values.capacity("A100")  # 40 or 80 GB: not a name of its own


def test_a_bad_card_stops_the_run_in_one_line(tracker: pytest.Pytester) -> None:
    tracker.makepyfile("def test_nothing(gpumem):\n    pass\n")
    result = tracker.runpytest("--gpumem-capacity=RTX-9090")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*argument --gpumem-capacity: invalid capacity 'RTX-9090': unknown card 'RTX-9090'*"])


def test_a_named_card_holds_a_prediction_to_its_memory_and_its_workspaces(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import torch

        def test_matmul(gpumem):
            a = torch.empty(1024, 1024, device=gpumem.device)
            torch.mm(a, a)
            assert gpumem.backend.capacity == 81_082 * 2**20 - 512 * 2**20  # H100-80GB less 512 MiB outside
            assert gpumem.backend.ledger.workspace_bytes == 32 * 2**20  # compute capability 9.0
        """
    )
    result = tracker.runpytest("--gpumem-device=meta", "--gpumem-capacity=H100-80GB")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["gpumem: tracker *", "  capacity H100-80GB (--gpumem-capacity): *"])


def test_the_fit_says_what_a_card_judges_in_its_sentence() -> None:
    card = parse_capacity("H100-80GB")
    fit = BatchFit((1, 2), (GIB, 2 * GIB), card.bytes, 8, 8 * GIB, Found.SEARCH, False, 0, (), "H100-80GB",
                   reserved=True, card=card)  # fmt: skip
    assert (
        "largest batch that fits H100-80GB: 8, peak 8.0 GiB reserved\n"
        "  of which 0 B was live when the fit began\n"
        "  judged on reserved memory plus what lies outside the allocator: the H100-80GB's 79.2 GiB less 512.0 MiB "
        "outside the\n"
        "    allocator (CUDA context, libraries): 78.7 GiB for reserved memory\n"
        "  searched"
    ) in fit.describe()


@pytest.mark.parametrize(("name", "workspace"), [("T4", 8_519_680), ("A100-80GB", 8_519_680), ("H200", 32 * MIB),
                                                 ("RTX-5090", 32 * MIB)])  # fmt: skip
def test_a_cards_workspace_follows_its_compute_capability(name: str, workspace: int) -> None:
    card = find_card(name)
    assert card is not None and card.cublas_workspace == workspace


def test_the_cards_page_lists_the_table() -> None:
    page = (Path(__file__).parent.parent / "docs" / "reference" / "cards.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([^`]+)` \| ([0-9,]+) \| ([0-9.]+) \|", page, re.MULTILINE)
    assert rows == [(c.name, f"{c.total:,}", f"{c.capability[0]}.{c.capability[1]}") for c in CARDS]
