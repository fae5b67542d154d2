"""Cards a prediction can be judged against, and the one reader of a capacity: a size, or a card's name.

A card's memory is not all the caching allocator's. The driver keeps some for itself (the total it
reports, `torch.cuda.get_device_properties().total_memory`, is already below what `nvidia-smi` shows), and
the process keeps some outside the allocator: the CUDA context with the kernels of every library loaded
into it, NCCL's buffers, libraries' own allocations. What is left is what the allocator can reserve, so a
card's capacity is its total less what lies outside the allocator (`Capacity.bytes`).

Totals are what `total_memory` reports (cudaGetDeviceProperties' totalGlobalMem, the figure
`set_per_process_memory_fraction` multiplies), the smallest value found in public printouts: it moves by
a few hundred MiB with the driver and ECC. The memory outside the allocator defaults to `_DEFAULT_OUTSIDE`
for every card: published measurements of the context with lazy module loading (torch's default since
CUDA 11.7) are 254-426 MiB, and the kernels a training step loads on first use add to it; it is larger
with `CUDA_MODULE_LOADING=EAGER` (636 MiB and more) and with NCCL. `docs/reference/cards.md` lists the
sources; `'H100-80GB:1 GiB'` overrides the figure, `'24 GiB:600 MiB'` names an unlisted card by its total.

A card's SM count and the threads one SM holds (`threads_per_sm`, from the compute capability, as CUDA's
`maxThreadsPerMultiProcessor`) size some kernels' launches, and with them the temporaries they take from the
allocator (a reduction's staging buffer: `backends/tracker/kernel_temporaries.py`).

The cuBLAS workspace is inside the allocator: one per cuBLAS handle (one per thread) and stream, of the
size `cublas_workspace_bytes` gives, allocated on the handle's first matmul and kept
(`aten/src/ATen/cuda/CublasHandlePool.cpp`, `parseChosenWorkspaceSize`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from cuda_allocator_model.errors import ModelError
from cuda_allocator_model.sizes import MAX_TEXT, format_size, parse_size, shorten

_MIB = 2**20

_DEFAULT_OUTSIDE = 512 * _MIB
"""Memory outside the allocator on a named card unless given: above every published lazy-loading figure of
the CUDA context (254-426 MiB), with room for the kernels a training step loads on first use."""

CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
"""torch's cuBLAS workspace before Hopper (`:4096:2:16:8`, 8 MiB + 128 KiB): also the size a prediction
uses when no card is named, torch's default on every other architecture."""

_CUBLAS_WORKSPACE_LARGE = 4096 * 8 * 1024
"""torch's cuBLAS workspace on compute capability 9.x, 10.x and 12.x (Hopper, Blackwell): 32 MiB."""

_LARGE_WORKSPACE_MAJORS = frozenset((9, 10, 12))
_THREADS_PER_SM = {(7, 5): 1024, (8, 6): 1536, (8, 9): 1536, (12, 0): 1536}  # 2048 on 8.0, 9.0, 10.0
_WORKSPACE_PAIR = re.compile(r":([0-9]+):([0-9]+)")
_C_INT_MAX = 2**31 - 1  # torch reads each number of CUBLAS_WORKSPACE_CONFIG with std::stoi
_SIZE_START = re.compile(r"^[-+.0-9]")


@dataclass(frozen=True)
class Card:
    """A GPU: its total memory as the driver reports it, its compute capability, the memory a process keeps
    outside the allocator on it by default, where the total comes from, and its SM count."""

    name: str
    total: int
    capability: tuple[int, int]
    source: str
    aliases: tuple[str, ...] = ()
    outside: int = _DEFAULT_OUTSIDE
    sm_count: int = 108  # an A100's, where a card does not say

    @property
    def threads_per_sm(self) -> int:
        """The most resident threads per SM on the card's compute capability (`maxThreadsPerMultiProcessor`)."""
        return _THREADS_PER_SM.get(self.capability, 2048)

    @property
    def allocator_bytes(self) -> int:
        """What the caching allocator can reserve on the card: its total less what lies outside it."""
        return self.total - self.outside

    @property
    def cublas_workspace(self) -> int:
        """torch's default cuBLAS workspace on the card's compute capability."""
        return cublas_workspace_bytes(self.capability)


def _mib(n: int) -> int:
    return n * _MIB


CARDS: tuple[Card, ...] = (
    Card(
        "T4",
        _mib(14_930),
        (7, 5),
        "torch printouts 14,930-15,109 MiB; nvidia-smi 15,360 MiB",
        ("Tesla T4",),
        sm_count=40,
    ),
    Card(
        "L4",
        23_583_784_960,
        (8, 9),
        "deviceQuery 22,491 MiB (bottlerocket-kernel-kit#139); nvidia-smi 23,034 MiB",
        sm_count=58,
    ),
    Card("A10G", _mib(22_587), (8, 6), "torch printout 22,587 MiB; nvidia-smi (A10) 23,028 MiB", sm_count=80),
    Card(
        "A100-40GB",
        42_298_834_944,
        (8, 0),
        "deviceQuery 40,339 MiB (bottlerocket#3873); torch printouts 40,536 MiB; nvidia-smi 40,960 MiB",
        ("A100-SXM4-40GB", "A100 40GB PCIe"),
        sm_count=108,
    ),
    Card(
        "A100-80GB",
        _mib(81_049),
        (8, 0),
        "A100 80GB PCIe 81,049 MiB (mixbench#47); nvidia-smi 81,920 MiB",
        ("A100-SXM4-80GB", "A100 80GB PCIe"),
        sm_count=108,
    ),
    Card(
        "H100-80GB",
        _mib(81_082),
        (9, 0),
        "torch printouts 81,082-81,090 MiB (H100 80GB HBM3); nvidia-smi 81,559 MiB",
        ("H100", "H100 80GB HBM3", "H100-SXM"),
        sm_count=132,
    ),
    Card("H200", _mib(143_156), (9, 0), "torch printout 143,156 MiB; nvidia-smi 143,771 MiB", sm_count=132),
    Card("RTX-4090", _mib(24_563), (8, 9), "torch printout 24,563 MiB", ("GeForce RTX 4090",), sm_count=128),
    Card(
        "RTX-5090",
        33_677_180_928,
        (12, 0),
        "deviceQuery 32,117 MiB (open-gpu-kernel-modules#1)",
        ("GeForce RTX 5090",),
        sm_count=170,
    ),
    Card(
        "RTX-6000-Ada",
        50_865_307_648,
        (8, 9),
        "total_memory 48,509 MiB (unsloth-zoo#1053)",
        ("RTX 6000 Ada Generation",),
        sm_count=142,
    ),
)


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


_BY_KEY: dict[str, Card] = {_key(alias): card for card in CARDS for alias in (card.name, *card.aliases)}
_NAMES = ", ".join(card.name for card in CARDS)


def find_card(name: str) -> Card | None:
    """The card called `name` (case, spaces, '-' and '_' do not matter), or None."""
    return _BY_KEY.get(_key(name))


def cublas_workspace_bytes(capability: tuple[int, int] | None, environ: Mapping[str, str] | None = None) -> int:
    """The bytes of one cuBLAS workspace, as torch chooses them: `CUBLAS_WORKSPACE_CONFIG` (`:SIZE:COUNT`
    pairs, SIZE in KiB, summed) where it is set and readable, else 32 MiB on compute capability 9.x, 10.x
    and 12.x, else 8 MiB + 128 KiB (also when no card is named: `capability` None)."""
    default = CUBLAS_WORKSPACE_DEFAULT
    if capability is not None and capability[0] in _LARGE_WORKSPACE_MAJORS:
        default = _CUBLAS_WORKSPACE_LARGE
    config = (environ or {}).get("CUBLAS_WORKSPACE_CONFIG")
    pairs = _WORKSPACE_PAIR.findall(config or "")
    if not pairs:  # torch warns and takes its default where the variable is set but unreadable
        return default
    for number in (number for pair in pairs for number in pair):
        if len(number.lstrip("0")) > len(str(_C_INT_MAX)) or int(number) > _C_INT_MAX:
            raise ModelError(
                f"CUBLAS_WORKSPACE_CONFIG={shorten(config)}: {shorten(number)} is past what torch reads there (a C "
                f"int, at most {_C_INT_MAX:,}): on a card the first matmul fails"
            )
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


@dataclass(frozen=True)
class Capacity:
    """A capacity as the allocator is held to it (`bytes`): a size as given, or a card's total less what lies
    outside the allocator on it (`total`, `outside`; `card` when it is a listed card)."""

    bytes: int
    card: Card | None = None
    total: int | None = None
    outside: int = 0

    @property
    def on_a_card(self) -> bool:
        """Whether the capacity is a card's (a name, or a total with what lies outside the allocator)."""
        return self.total is not None

    def describe(self) -> str:
        """'the H100-80GB's 79.2 GiB less 512.0 MiB outside the allocator (CUDA context, libraries): 78.7 GiB
        for reserved memory', or the size alone."""
        if self.total is None:
            return format_size(self.bytes)
        card = f"the {self.card.name}'s" if self.card is not None else "the card's"
        return (
            f"{card} {format_size(self.total)} less {format_size(self.outside)} outside the allocator (CUDA context, "
            f"libraries): {format_size(self.bytes)} for reserved memory"
        )


def parse_capacity(value: object, where: str = "") -> Capacity:
    """A capacity from an int or a size ('16 GiB': the allocator's own limit), a card's name ('H100-80GB':
    its total less `_DEFAULT_OUTSIDE`), a name or a total with what lies outside the allocator after a colon
    ('H100-80GB:1 GiB', '24 GiB:600 MiB'). Raises ModelError in one line, starting with `where` (the
    option or argument) when given, listing the cards for a name it does not know."""
    try:
        return _capacity(value)
    except ModelError as exc:
        if not where:
            raise
        raise ModelError(f"{where}: {exc}") from None


def _capacity(value: object) -> Capacity:
    if not isinstance(value, str):
        return Capacity(parse_size(value))
    if len(value) > MAX_TEXT:
        raise ModelError(f"capacity text must be at most {MAX_TEXT} characters, got {shorten(value)}")
    text, colon, after = (part.strip() for part in value.partition(":"))
    if not colon:
        if _SIZE_START.match(text):
            return Capacity(parse_size(text))
        named = _card(text)
        return Capacity(named.allocator_bytes, named, named.total, named.outside)
    card = None if _SIZE_START.match(text) else _card(text)
    total = card.total if card is not None else parse_size(text)
    try:
        outside = parse_size(after)
    except ModelError as exc:
        raise ModelError(f"the memory outside the allocator after ':' in {value!r}: {exc}") from None
    if outside >= total:
        raise ModelError(
            f"capacity {value!r}: {format_size(outside)} outside the allocator leaves nothing of {format_size(total)}"
        )
    return Capacity(total - outside, card, total, outside)


def _card(name: str) -> Card:
    card = find_card(name)
    if card is None:
        raise ModelError(
            f"unknown card {name!r}: give a size like '16 GiB' or a card ({_NAMES}), optionally with ':SIZE' "
            "outside the allocator"
        )
    return card


def capacity_bytes(value: object, where: str = "") -> int:
    """The bytes the allocator is held to for a capacity (`parse_capacity(value, where).bytes`)."""
    return parse_capacity(value, where).bytes
