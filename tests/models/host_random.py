"""A forward that draws from the host's generators while traced, as Pinterest's published
TransAct draws its random time window (``random.randint`` in ``forward``): the drawn
value masks the targets. ``how`` picks the generator and the spelling."""

from __future__ import annotations

import random
from random import randint as bound_randint

import numpy as np
import torch
from torch import nn

from gemc.spec import ModelSpec


class WindowedRegression(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.how == "random":
            window = random.randint(0, 100)
        elif self.how == "numpy":
            window = int(np.random.randint(0, 100))
        elif self.how == "bound":
            window = bound_randint(0, 100)
        else:  # "torch": drawn in the graph, fresh each step
            window = torch.randint(0, 101, (1,), device=t.device)
        keep = (t >= window).float()
        return ((self.linear(x).squeeze(-1) * keep - y) ** 2).mean()


def build(how: str = "random", batch_size: int = 8) -> ModelSpec:
    def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(step)
        batch = (torch.randn(batch_size, 4, generator=g), 100 * torch.rand(batch_size, generator=g),
                 torch.randn(batch_size, generator=g))
        return tuple(t.to(device) for t in batch)

    return ModelSpec(model=WindowedRegression(how), example_inputs=make_batch(0, "cpu"),
                     make_batch=make_batch, batch_size=batch_size)
