"""What a tensor is for, as an explanation counts it (see `backends/tracker/attribution.py` for how each
storage is classed): the categories in the order every explanation lists them, and how each is written."""

from __future__ import annotations

from enum import Enum


class Category(str, Enum):
    """A use of memory; the value is the key explanations and baselines store."""

    PARAMETERS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    SAVED = "saved"
    TEMPORARIES = "temporaries"
    INPUTS = "inputs"

    @property
    def label(self) -> str:
        """How reports write it: 'saved for backward'."""
        return _LABELS[self]


_LABELS = {
    Category.PARAMETERS: "parameters",
    Category.GRADIENTS: "gradients",
    Category.OPTIMIZER_STATE: "optimizer state",
    Category.SAVED: "saved for backward",
    Category.TEMPORARIES: "temporaries",
    Category.INPUTS: "inputs and other",
}

CATEGORIES: tuple[str, ...] = tuple(category.value for category in Category)
LABELS: dict[str, str] = {category.value: category.label for category in Category}
