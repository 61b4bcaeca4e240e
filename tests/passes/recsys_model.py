"""A recommendation model in a few ops, for the annotation passes' intent checks: a mean
bag and a plain embedding summed, a tower module (Linear, GELU, LayerNorm), a head Linear,
a view and a BCE loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.up(x)))


class Recsys(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(50, 8, mode="mean")
        self.emb = nn.Embedding(30, 8)
        self.tower = Tower()
        self.head = nn.Linear(16, 1)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, tokens: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        h = self.bag(ids, offsets) + self.emb(tokens).sum(1)
        return F.binary_cross_entropy_with_logits(self.head(self.tower(h)).view(-1), labels)


def inputs() -> tuple[torch.Tensor, ...]:
    """10 ids in 3 bags, 3 x 5 tokens, 3 labels."""
    return (torch.randint(0, 30, (10,)), torch.tensor([0, 3, 7]), torch.randint(0, 30, (3, 5)),
            torch.rand(3))
