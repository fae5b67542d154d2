"""Sizes as users write them (a byte count, or a number with an SI or binary unit) and as we print them."""

from __future__ import annotations

import pytest

from cuda_allocator_model import ModelError, format_size, parse_size
from cuda_allocator_model.sizes import shorten


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("64 MiB", 64 * 1024**2),
        ("64MiB", 64 * 1024**2),
        ("1.5 GiB", 3 * 1024**3 // 2),
        ("800 MB", 800_000_000),
        ("800mb", 800_000_000),
        ("2 kB", 2000),
        ("2 KB", 2000),
        ("0.5 KiB", 512),
        ("1 TB", 10**12),
        ("1 TiB", 1024**4),
        ("12 B", 12),
        ("  3 gib ", 3 * 1024**3),
    ],
)
def test_a_size_is_read_in_bytes_from_a_count_or_a_unit(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("2 apples", "unknown unit 'apples'"),
        ("MB", "cannot read size 'MB'"),
        ("-1 MB", "must not be negative"),
        (-5, "must not be negative"),
        ("1 MIBB", "unknown unit 'MIBB'"),
        (1.5, "must be an int (bytes) or a string"),
        (True, "must be an int (bytes) or a string"),
        (None, "must be an int (bytes) or a string"),
        ("1..5 MB", "cannot read size"),
        (2**63, "must be below 2**63 bytes, got 9223372036854775808"),
        pytest.param(10**400, "got 1000000000", id="10**400"),
        pytest.param("9" * 5000 + " GiB", "at most 100 characters, got '9999", id="5000-digits"),
        ("17179869184 GiB", "must be below 2**63 bytes, got '17179869184 GiB'"),
        pytest.param([0] * 1000, "must be an int (bytes) or a string like '64 MiB', got [0, 0, 0", id="long-list"),
    ],
)
def test_what_is_not_a_size_is_refused_naming_it(bad: object, message: str) -> None:
    with pytest.raises(ModelError) as info:
        parse_size(bad)
    assert message in str(info.value) and len(str(info.value)) < 150


def test_sizes_reach_the_largest_signed_64_bit_count() -> None:
    assert parse_size(2**63 - 1) == 2**63 - 1
    assert parse_size("8388607 TiB") == 8388607 * 1024**4  # 2**63 bytes is 8388608 TiB
    with pytest.raises(ModelError, match="below 2"):
        parse_size("8388608 TiB")


@pytest.mark.parametrize(
    ("n", "binary", "text"),
    [
        (0, True, "0 B"),
        (1023, True, "1023 B"),
        (1536, True, "1.5 KiB"),
        (41_900_000, False, "41.9 MB"),
        (-3 * 1024**3, True, "-3.0 GiB"),
        (5 * 1024**5, True, "5120.0 TiB"),
    ],
)
def test_a_size_prints_with_one_decimal_in_its_unit(n: int, binary: bool, text: str) -> None:
    assert format_size(n, binary=binary) == text


def test_a_value_named_in_a_message_is_one_short_line() -> None:
    class Lines:
        def __repr__(self) -> str:
            return "Lines(\n  a=1,\n  b=2\n)"

    assert shorten(Lines()) == "Lines( a=1, b=2 )"
    assert shorten("two\nlines") == "'two\\nlines'"


def test_a_module_or_a_tensor_named_in_a_message_is_its_kind() -> None:
    torch = pytest.importorskip("torch")  # the package imports no torch: .ci/pythons runs this folder without it
    assert shorten(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())) == "a Sequential module"
    assert shorten(torch.ones(2, 3)) == "a Tensor of float32[2, 3]"
    assert shorten([torch.ones(1)] * 3) == "a list of 3 (a Tensor of float32[1], a Tensor of float32[1], ...)"
