"""A BST-style post-LN Transformer block over a padded history with a bool mask input,
written the way hand-rolled blocks are: one qkv projection split into q, k, v by indexing
(``select`` over a non-token dim), SDPA under the key mask, a residual and LayerNorm, a
feed-forward with LeakyReLU and ELU (activations the fusion vocabulary does not hold) and
a dropout, pooled under the same mask. For pack-jagged-tokens' tests: every op of the
tower keeps its ``[B, L, ...]`` token axis, so the whole tower is one guarded region."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec
from tests.fusion import key_padding_models as km


class TokenwiseTower(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        e, h = km.E, km.H
        self.h = h
        self.qkv = nn.Linear(e, 3 * e)
        self.out = nn.Linear(e, e)
        self.norm1 = nn.LayerNorm(e)
        self.norm2 = nn.LayerNorm(e)
        self.ffn1 = nn.Linear(e, 2 * e)
        self.ffn2 = nn.Linear(2 * e, e)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(e, 1)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, length, e = x.shape
        qkv = self.qkv(x).view(b, length, 3, self.h, e // self.h).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        x = self.norm1(x + self.drop(self.out(o.transpose(1, 2).reshape(b, length, e))))
        ffn = self.ffn2(F.elu(F.leaky_relu(self.ffn1(x), 0.1)))
        x = self.norm2(x + self.drop(ffn))
        pooled = (x * keep.unsqueeze(-1)).sum(1)
        return self.head(pooled).square().mean()


def build(dropout: float = 0.0) -> ModelSpec:
    def make(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        return tuple(t.to(device) for t in km.batch("bool", [2, 0, 6, 3],
                                                    torch.Generator().manual_seed(step)))

    x, m = make(0)
    return ModelSpec(model=TokenwiseTower(dropout), example_inputs=(x, m), make_batch=make)
