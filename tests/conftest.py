from __future__ import annotations

import pytest
import torch
import torch._dynamo

# pytester's in-process runs drop modules first imported inside them; torch registers operator
# libraries on import (torch._dynamo -> torch._inductor.test_operators), which must not happen twice,
# so everything that inner runs may import lazily is imported here first.
torch.utils.checkpoint.checkpoint  # noqa: B018


@pytest.fixture
def tracker(pytester: pytest.Pytester) -> pytest.Pytester:
    """A pytester whose runs measure with the exact tracker, whatever the machine has."""
    pytester.makeini("[pytest]\ngpumem_backend = tracker\n")
    return pytester
