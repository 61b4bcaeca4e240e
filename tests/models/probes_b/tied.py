"""Next-item prediction with the item table shared by the output layer (weight tying).

``tie="alias"``: ``self.out.weight = self.item.weight`` (the language-model idiom);
``tie="matmul"``: ``logits = h @ self.item.weight.T`` (SASRec / YouTube-DNN's sampled-free
softmax over the item table). Either way the item table is read whole outside its lookups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

B, ROWS, DIM, L = 6, 40, 8, 4


class NextItem(nn.Module):
    def __init__(self, tie: str) -> None:
        super().__init__()
        self.tie = tie
        self.item = nn.Embedding(ROWS, DIM)
        self.history = nn.EmbeddingBag(ROWS, DIM, mode="mean")
        self.proj = nn.Linear(2 * DIM, DIM)
        self.out = nn.Linear(DIM, ROWS, bias=False)
        if tie == "alias":
            self.out.weight = self.item.weight

    def forward(self, hist: torch.Tensor, last: torch.Tensor, target: torch.Tensor
                ) -> torch.Tensor:
        h = self.proj(torch.cat([self.history(hist), self.item(last)], dim=1))
        logits = self.out(h) if self.tie == "alias" else h @ self.item.weight.T
        return F.cross_entropy(logits, target)


def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(90 + step)
    with torch.device("cpu"):
        batch = (torch.randint(0, ROWS, (B, L), generator=g),
                 torch.randint(0, ROWS, (B,), generator=g),
                 torch.randint(0, ROWS, (B,), generator=g))
    return tuple(t.to(device) for t in batch)


def build(tie: str = "alias") -> ModelSpec:
    torch.manual_seed(0)
    return ModelSpec(model=NextItem(tie), example_inputs=make_batch(0, "cpu"),
                     make_batch=make_batch, batch_size=B)
