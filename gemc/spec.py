"""The model entrypoint contract: what a user's `build(**kwargs)` returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ModelSpec:
    """A model as gemc sees it.

    ``model.forward(*example_inputs)`` returns the scalar training loss. ``example_inputs``
    may live on the meta device so that GEM-scale models compile without allocating a
    byte of weights; their shapes are the representative batch the cost model prices.
    ``make_batch(step, device)`` returns a real synthetic batch (same structure) for the
    runner and the precision probe; it must be deterministic in ``step``.
    """

    model: torch.nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    make_batch: Callable[[int, torch.device | str], tuple[torch.Tensor, ...]]
    # Optional, free-form facts the model author wants in the plan (preset, table counts).
    info: dict[str, Any] = field(default_factory=dict)
    # Samples in one batch of ``make_batch``: stated by the author, never guessed from a
    # tensor's first dimension (the first input is often flat jagged ids). samples/s, MFU
    # and the precision probe's batch scaling use it.
    batch_size: int | None = None
