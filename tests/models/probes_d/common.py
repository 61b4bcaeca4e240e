"""What every probe here shares: its spec from a model and a seeded batch maker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gemc.spec import ModelSpec


def spec_of(model: torch.nn.Module, make_batch: Callable[[int, Any], tuple], batch_size: int
            ) -> ModelSpec:
    """The probe's spec; the example batch is step 0's, on the CPU (the compile prices
    shapes and reads a few values, e.g. a KJT's lengths)."""
    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=batch_size)


def seeded_batch(seed: int, device: torch.device | str,
                 make: Callable[[torch.Generator], tuple[torch.Tensor, ...]]
                 ) -> tuple[torch.Tensor, ...]:
    """``make(generator)``'s tensors, drawn on the CPU from ``seed`` (a data pipeline's
    batch is real even while gemc builds on meta), moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        batch = make(g)
    return tuple(t.to(device) for t in batch)
