"""The notes a tracker's measurement carries about what it could not see as a card would: fake tensors'
outputs, and compiled code run otherwise than a card's plan (each note one sentence, a user's figure's
caveat)."""

from __future__ import annotations

from pytest_gpumem.backends.tracker.patches import Patches


def fake_outputs_note(count: int) -> list[str]:
    if not count:
        return []
    return [
        f"{count} op outputs were fake tensors (FakeTensorMode): they hold no memory and were not counted; "
        "the figures are what the test's real tensors used"
    ]


COMPILED_UNFUSED = (
    "compiled: Inductor's partition run unfused, not its CUDA plan: an upper bound (fusion only drops buffers)"
)
"""The note of a prediction in which compiled functions ran (`Patches.unfused_compiled`)."""
COMPILED_EAGERLY = (
    "compiled: ran eagerly where torch's partition on meta lost a gradient: not a bound (--gpumem-round=cuda gives one)"
)
"""The note of a prediction on meta in which a compiled graph ran eagerly (`compiled`)."""
COMPILED_FOR_CPU = "compiled: Inductor's plan for the CPU ran (compiled before the call), not a card's: no bound"
"""The note of a prediction in which compiled programs made buffers (`patches.count_compiled_allocations`):
compiled before the measurement and reached without Dynamo (a compiled forward's backward)."""


COMPILED_CUDA_GRAPHS = (
    "compiled: Inductor's partition run unfused, not its CUDA graphs (a private pool, copies of the inputs): no bound"
)
"""The note of a prediction in which a function compiled for CUDA graphs ran (`mode="reduce-overhead"`)."""


def compiled_as_chosen_note(names: set[str]) -> str:
    """The note of a prediction in which functions compiled by other compilers than Inductor ran."""
    chosen = ", ".join(sorted(names))
    return f"compiled: the chosen backend ({chosen}) ran as on this device, not a card's plan: no bound"


def compiled_note(patches: Patches | None, buffers: int) -> list[str]:
    """Where a card is predicted, what the figures of compiled code are: Inductor's partition unfused (no
    bound where Inductor would run CUDA graphs), eager where torch lost a gradient, other compilers as
    chosen, or the CPU's Inductor plan."""
    if patches is None:
        return [COMPILED_FOR_CPU] if buffers else []
    notes = [compiled_as_chosen_note(patches.compiled_as_chosen)] if patches.compiled_as_chosen else []
    notes += [COMPILED_FOR_CPU] if buffers else []
    if patches.compiled_eagerly:
        return [COMPILED_EAGERLY, *notes]
    if patches.compiled_cuda_graphs:
        return [COMPILED_CUDA_GRAPHS, *notes]
    return [COMPILED_UNFUSED, *notes] if patches.compiled_unfused else notes
