"""Small models for the precision tests: every dim a multiple of 16 where fp8 could apply.

``build``: a tower (Linear 32->64, GELU, LayerNorm, Linear 64->32, residual add) and a
hand-written attention over 4 tokens (q/k/v Linear, ``q @ k^T`` -> softmax -> ``@ v``), then
a Linear to one logit and BCE. It has every kind of site the rule must tell apart: fp8-able
linears, attention-score matmuls, a norm, a residual add, the logits and the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

B, T, D = 32, 4, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.norm = nn.LayerNorm(2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.norm(F.gelu(self.up(x))))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(1, 2) / D**0.5
        return torch.softmax(scores, dim=-1) @ v


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.attn = Attention()
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.block(x)  # [B, T, D]
        h = h + self.attn(h)
        logits = self.head(h.mean(dim=1)).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logits, labels)


def _batch(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(B, T, D, generator=g)
    x[:, :, 3] *= 20.0  # an outlier feature, as real activations have
    labels = (torch.rand(B, generator=g) < 0.3).float()
    return x.to(device), labels.to(device)


def build() -> ModelSpec:
    return ModelSpec(
        model=Model(),
        example_inputs=(torch.zeros(B, T, D), torch.zeros(B)),
        make_batch=_batch,
        info={"batch_size": B},
    )
