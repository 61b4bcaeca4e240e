"""AutoInt (Song et al., CIKM 2019), in the authors' public style.

Field embeddings ``[B, F, d]`` go through interacting layers: ``nn.MultiheadAttention``
with the default ``batch_first=False`` (so the fields are transposed to ``[F, B, d]`` and
back), no mask, plus a residual projection ``W_res`` and a ReLU; the flattened output feeds
a logit and BCE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

B, FIELDS, ROWS, D, HEADS, LAYERS = 8, 5, 40, 8, 2, 2


class InteractingLayer(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads)  # batch_first=False, the default
        self.w_res = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, F, d]
        q = x.transpose(0, 1)  # [F, B, d]
        out, _ = self.attn(q, q, q)
        out = out.transpose(0, 1)
        return F.relu(out + self.w_res(x))


class AutoInt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(ROWS, D) for _ in range(FIELDS))
        self.layers = nn.Sequential(*(InteractingLayer(D, HEADS) for _ in range(LAYERS)))
        self.out = nn.Linear(FIELDS * D, 1)

    def forward(self, ids: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        x = torch.stack([emb(ids[:, i]) for i, emb in enumerate(self.embeddings)], dim=1)
        x = self.layers(x)
        logit = self.out(x.flatten(1)).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logit, label)


def build(seed: int = 0) -> ModelSpec:
    torch.manual_seed(seed)
    model = AutoInt()

    def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(1000 * seed + step)
        ids = torch.randint(0, ROWS, (B, FIELDS), generator=g)
        label = (torch.rand(B, generator=g) < 0.4).float()
        return ids.to(device), label.to(device)

    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=B)
