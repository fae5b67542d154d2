"""Reference strategies for memory-efficient losses and training steps, in plain PyTorch, measured by
pytest-gpumem: `pytest --pyargs reference_losses --gpumem-report`."""

from __future__ import annotations

from reference_losses.losses import LOSS_STRATEGIES
from reference_losses.strategy import Expectation, NullMeter, Outcome, PhaseMeter, Strategy
from reference_losses.training import TRAINING_STRATEGIES

STRATEGIES: dict[str, Strategy] = {**LOSS_STRATEGIES, **TRAINING_STRATEGIES}

__all__ = [
    "LOSS_STRATEGIES",
    "STRATEGIES",
    "TRAINING_STRATEGIES",
    "Expectation",
    "NullMeter",
    "Outcome",
    "PhaseMeter",
    "Strategy",
]
