"""Pretrained and frozen tables, as two-tower and content-feature models load them (tiny).

* ``freeze="from_pretrained"``: ``nn.Embedding.from_pretrained(vectors, freeze=True)`` for
  item content vectors (e.g. text embeddings) next to a trainable id table;
* ``freeze="requires_grad"``: an ``nn.EmbeddingBag`` whose weight the author freezes with
  ``self.tags.weight.requires_grad_(False)`` after building it;
* ``freeze="trainable"``: ``from_pretrained(vectors, freeze=False)``: fine-tuned from the
  pretrained values.

The vectors are made in the build from a seeded generator (a stand-in for a file).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec
from tests.models.probes_d.common import seeded_batch, spec_of

B, DIM, L = 8, 4, 3
ITEMS, TAGS = 30, 12


class ContentModel(nn.Module):
    def __init__(self, freeze: str) -> None:
        super().__init__()
        vectors = torch.randn(ITEMS, DIM, generator=torch.Generator().manual_seed(5)) * 0.1
        if freeze == "requires_grad":
            self.content = nn.Embedding(ITEMS, DIM)
        else:
            self.content = nn.Embedding.from_pretrained(vectors, freeze=freeze != "trainable")
        self.item = nn.Embedding(ITEMS, DIM)
        self.tags = nn.EmbeddingBag(TAGS, DIM, mode="mean")
        if freeze == "requires_grad":
            self.tags.weight.requires_grad_(False)
        self.mlp = nn.Sequential(nn.Linear(3 * DIM, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, item: torch.Tensor, tags: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.content(item), self.item(item), self.tags(tags)], dim=1)
        return F.binary_cross_entropy_with_logits(self.mlp(x).squeeze(1), label)


def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    return seeded_batch(1200 + step, device, lambda g: (
        torch.randint(0, ITEMS, (B,), generator=g), torch.randint(0, TAGS, (B, L), generator=g),
        (torch.rand(B, generator=g) < 0.4).float()))


def build(freeze: str = "from_pretrained") -> ModelSpec:
    torch.manual_seed(0)
    return spec_of(ContentModel(freeze), make_batch, B)
