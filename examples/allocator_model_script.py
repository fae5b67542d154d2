"""The allocator's model from a plain script, without pytest or torch: serve a few requests as a card's
caching allocator would, ask what they reserve and where a card runs out, then replay a card's snapshot.

    python examples/allocator_model_script.py [SNAPSHOT.pickle]
"""

from __future__ import annotations

import sys

from cuda_allocator_model import AllocatorOutOfMemory, AllocatorSettings, CachingAllocatorModel, format_size
from cuda_allocator_model.snapshots import card_figures, read_snapshot

MiB = 1024**2


def serve(settings: AllocatorSettings, capacity: int | None = None) -> CachingAllocatorModel:
    """Three 12 MiB activations, the middle one freed, then a 20 MiB request that none of the holes fits."""
    model = CachingAllocatorModel(settings)
    model.capacity = capacity
    for key in range(3):
        model.malloc(key, 12 * MiB)
    model.free(1)
    model.malloc(3, 20 * MiB)
    return model


def main(argv: list[str]) -> None:
    for text in ("", "expandable_segments:True"):
        model = serve(AllocatorSettings.parse(text))
        print(
            f"{text or 'defaults':<26} allocated {format_size(model.peak_allocated):>9}"
            f"  reserved {format_size(model.peak_reserved):>9}"
        )
    try:
        serve(AllocatorSettings(), capacity=40 * MiB)
    except AllocatorOutOfMemory as exc:
        print(f"capacity 40 MiB: {exc}")
    for path in argv:
        figures = card_figures(read_snapshot(path))
        print(
            f"{path}: the card's peaks: allocated {format_size(figures.peak_allocated)}, "
            f"reserved {format_size(figures.peak_reserved)}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
