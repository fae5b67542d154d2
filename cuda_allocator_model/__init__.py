"""A model of PyTorch's CUDA caching allocator, without torch: blocks, segments, pools and the settings of
`PYTORCH_CUDA_ALLOC_CONF`, the cards' capacities, byte sizes for people and the byte axes of their charts.
Reading and replaying a card's memory snapshot is `cuda_allocator_model.snapshots`. Names are imported on
first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cuda_allocator_model.blocks import Block as Block
    from cuda_allocator_model.blocks import Segment as Segment
    from cuda_allocator_model.cards import CARDS as CARDS
    from cuda_allocator_model.cards import CUBLAS_WORKSPACE_DEFAULT as CUBLAS_WORKSPACE_DEFAULT
    from cuda_allocator_model.cards import Capacity as Capacity
    from cuda_allocator_model.cards import Card as Card
    from cuda_allocator_model.cards import capacity_bytes as capacity_bytes
    from cuda_allocator_model.cards import cublas_workspace_bytes as cublas_workspace_bytes
    from cuda_allocator_model.cards import find_card as find_card
    from cuda_allocator_model.cards import parse_capacity as parse_capacity
    from cuda_allocator_model.chart import PlotArea as PlotArea
    from cuda_allocator_model.chart import byte_range as byte_range
    from cuda_allocator_model.chart import byte_ticks as byte_ticks
    from cuda_allocator_model.chart import nice_step as nice_step
    from cuda_allocator_model.constants import DEFAULT_POOL as DEFAULT_POOL
    from cuda_allocator_model.constants import INTERVALS as INTERVALS
    from cuda_allocator_model.constants import MIN_BLOCK as MIN_BLOCK
    from cuda_allocator_model.constants import SMALL_BUFFER as SMALL_BUFFER
    from cuda_allocator_model.constants import UNLIMITED as UNLIMITED
    from cuda_allocator_model.constants import PoolId as PoolId
    from cuda_allocator_model.errors import ModelError as ModelError
    from cuda_allocator_model.errors import exception_text as exception_text
    from cuda_allocator_model.model import CachingAllocatorModel as CachingAllocatorModel
    from cuda_allocator_model.oom import AllocatorOutOfMemory as AllocatorOutOfMemory
    from cuda_allocator_model.settings import AllocatorSettings as AllocatorSettings
    from cuda_allocator_model.sizes import MAX_BYTES as MAX_BYTES
    from cuda_allocator_model.sizes import MAX_TEXT as MAX_TEXT
    from cuda_allocator_model.sizes import format_size as format_size
    from cuda_allocator_model.sizes import integer_words as integer_words
    from cuda_allocator_model.sizes import is_binary as is_binary
    from cuda_allocator_model.sizes import parse_size as parse_size
    from cuda_allocator_model.sizes import shorten as shorten
    from cuda_allocator_model.trace import AllocatorTrace as AllocatorTrace
    from cuda_allocator_model.trace import ServedByModel as ServedByModel

_HOMES = {
    "AllocatorOutOfMemory": "cuda_allocator_model.oom",
    "AllocatorSettings": "cuda_allocator_model.settings",
    "AllocatorTrace": "cuda_allocator_model.trace",
    "Block": "cuda_allocator_model.blocks",
    "CARDS": "cuda_allocator_model.cards",
    "CUBLAS_WORKSPACE_DEFAULT": "cuda_allocator_model.cards",
    "CachingAllocatorModel": "cuda_allocator_model.model",
    "Capacity": "cuda_allocator_model.cards",
    "DEFAULT_POOL": "cuda_allocator_model.constants",
    "Card": "cuda_allocator_model.cards",
    "INTERVALS": "cuda_allocator_model.constants",
    "MAX_BYTES": "cuda_allocator_model.sizes",
    "MAX_TEXT": "cuda_allocator_model.sizes",
    "MIN_BLOCK": "cuda_allocator_model.constants",
    "ModelError": "cuda_allocator_model.errors",
    "PlotArea": "cuda_allocator_model.chart",
    "PoolId": "cuda_allocator_model.constants",
    "exception_text": "cuda_allocator_model.errors",
    "SMALL_BUFFER": "cuda_allocator_model.constants",
    "Segment": "cuda_allocator_model.blocks",
    "ServedByModel": "cuda_allocator_model.trace",
    "UNLIMITED": "cuda_allocator_model.constants",
    "byte_range": "cuda_allocator_model.chart",
    "byte_ticks": "cuda_allocator_model.chart",
    "capacity_bytes": "cuda_allocator_model.cards",
    "cublas_workspace_bytes": "cuda_allocator_model.cards",
    "find_card": "cuda_allocator_model.cards",
    "format_size": "cuda_allocator_model.sizes",
    "integer_words": "cuda_allocator_model.sizes",
    "is_binary": "cuda_allocator_model.sizes",
    "nice_step": "cuda_allocator_model.chart",
    "parse_capacity": "cuda_allocator_model.cards",
    "parse_size": "cuda_allocator_model.sizes",
    "shorten": "cuda_allocator_model.sizes",
}

__all__ = [
    "CARDS",
    "CUBLAS_WORKSPACE_DEFAULT",
    "DEFAULT_POOL",
    "INTERVALS",
    "MAX_BYTES",
    "MAX_TEXT",
    "MIN_BLOCK",
    "SMALL_BUFFER",
    "UNLIMITED",
    "AllocatorOutOfMemory",
    "AllocatorSettings",
    "AllocatorTrace",
    "Block",
    "CachingAllocatorModel",
    "Capacity",
    "Card",
    "ModelError",
    "PlotArea",
    "PoolId",
    "Segment",
    "ServedByModel",
    "byte_range",
    "byte_ticks",
    "capacity_bytes",
    "cublas_workspace_bytes",
    "exception_text",
    "find_card",
    "format_size",
    "integer_words",
    "is_binary",
    "lazy_names",
    "nice_step",
    "parse_capacity",
    "parse_size",
    "shorten",
]


def lazy_names(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's `__getattr__` that imports each of its public names on first use from its home in
    `homes` (`"module"`, or `"module:attribute"` for a name the module has under another)."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = home.partition(":")
        return getattr(importlib.import_module(module), attribute or name)

    return __getattr__


__getattr__ = lazy_names(__name__, _HOMES)
