"""Reference strategies for memory-efficient losses and training steps, in plain PyTorch, measured by
pytest-gpumem: `pytest --pyargs reference_losses --gpumem-report`.

pytest-gpumem never imports this package unless asked (`--pyargs reference_losses`, or a user's
`-p reference_losses.fixtures`); even then the strategies (and torch) are imported only when one of
these names is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "LOSS_STRATEGIES": "reference_losses.losses",
    "TRAINING_STRATEGIES": "reference_losses.training",
    "Expectation": "reference_losses.strategy",
    "NullMeter": "reference_losses.strategy",
    "Outcome": "reference_losses.strategy",
    "PhaseMeter": "reference_losses.strategy",
    "Strategy": "reference_losses.strategy",
}

__all__ = ["STRATEGIES", *_NAMES]


def __getattr__(name: str) -> Any:
    if name == "STRATEGIES":
        return {**__getattr__("LOSS_STRATEGIES"), **__getattr__("TRAINING_STRATEGIES")}
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'reference_losses' has no attribute {name!r}")
