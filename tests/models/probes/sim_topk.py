"""SIM / TWIN-like long-sequence retrieval (Pi et al., CIKM 2020; Chang et al., KDD 2023).

A long padded history is scored against the candidate by dot products; padding is masked
with ``-inf``; ``torch.topk(k)`` picks the best ``k`` positions, ``torch.gather`` their
embeddings, then DIN's MLP target attention runs over them (slots whose score is ``-inf``,
users with fewer than ``k`` behaviours, are masked out).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec
from tests.models.probes.data import history_spec

B, L, K, ITEMS, D = 8, 16, 4, 60, 8


class DinAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4 * d, 16), nn.Sigmoid(), nn.Linear(16, 1))

    def forward(self, query: torch.Tensor, keys: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        q = query.unsqueeze(1).expand_as(keys)
        w = self.mlp(torch.cat([q, keys, q - keys, q * keys], dim=-1)).squeeze(-1)
        w = w.masked_fill(~mask, 0.0)
        return (w.unsqueeze(-1) * keys).sum(1)


class SIM(nn.Module):
    def __init__(self, lookup: bool = False) -> None:
        super().__init__()
        self.lookup = lookup
        self.item_emb = nn.Embedding(ITEMS, D, padding_idx=0)
        self.attention = DinAttention(D)
        self.mlp = nn.Sequential(nn.Linear(2 * D, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, hist: torch.Tensor, target: torch.Tensor,
                label: torch.Tensor) -> torch.Tensor:
        keys = self.item_emb(hist)  # [B, L, D]
        query = self.item_emb(target)  # [B, D]
        scores = (keys * query.unsqueeze(1)).sum(-1)
        scores = scores.masked_fill(hist == 0, float("-inf"))
        top_scores, top_idx = torch.topk(scores, K, dim=1)
        if self.lookup:  # SIM's second stage looks the retrieved ids up again
            top_keys = self.item_emb(torch.gather(hist, 1, top_idx))
        else:
            top_keys = torch.gather(keys, 1, top_idx.unsqueeze(-1).expand(-1, -1, D))
        interest = self.attention(query, top_keys, torch.isfinite(top_scores))
        logit = self.mlp(torch.cat([interest, query], dim=-1)).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logit, label)


def build(seed: int = 0, lookup: bool = False) -> ModelSpec:
    """``lookup``: the top-k embeddings by a second lookup of the retrieved ids (ids the
    model computes), not by gathering the first lookup's rows."""
    torch.manual_seed(seed)
    # a user with fewer than K behaviours, one full
    return history_spec(SIM(lookup), seed, B, L, ITEMS, first=(2, L))
