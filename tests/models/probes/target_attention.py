"""Target attention with ``nn.MultiheadAttention`` (BST / DIN ports): the candidate item is
the one query, the padded history the keys, ``key_padding_mask = hist == 0``; a new user
has no history at all, so every key of that row is masked. ``empty``: ``"nan_to_num"``
cleans the all-masked row's output (NaN in eager PyTorch) with ``torch.nan_to_num``,
``"keep_first"`` unmasks position 0 for such rows (``mask[:, 0] = False``, TransAct's
way). ``cell``: DIEN's AUGRU written as a Python loop of a GRU cell whose update gate is
scaled by the attention score, state kept at padded steps by ``torch.where``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec
from tests.models.probes.data import history_spec

B, L, ITEMS, D, HEADS = 8, 6, 40, 8, 2


class AUGRUCell(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.x2h = nn.Linear(d, 3 * d)
        self.h2h = nn.Linear(d, 3 * d, bias=False)

    def forward(self, x: torch.Tensor, h: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        xr, xz, xn = self.x2h(x).chunk(3, -1)
        hr, hz, hn = self.h2h(h).chunk(3, -1)
        r = torch.sigmoid(xr + hr)
        z = torch.sigmoid(xz + hz) * att.unsqueeze(-1)  # the attention-scaled update gate
        n = torch.tanh(xn + r * hn)
        return (1 - z) * h + z * n


class TargetAttention(nn.Module):
    def __init__(self, empty: str, cell: bool) -> None:
        super().__init__()
        self.empty, self.cell = empty, cell
        self.item_emb = nn.Embedding(ITEMS, D, padding_idx=0)
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.augru = AUGRUCell(D)
        self.mlp = nn.Sequential(nn.Linear(3 * D, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, hist: torch.Tensor, target: torch.Tensor,
                label: torch.Tensor) -> torch.Tensor:
        keys = self.item_emb(hist)
        query = self.item_emb(target).unsqueeze(1)
        pad = hist == 0
        if self.empty == "keep_first":
            pad = pad.clone()
            pad[:, 0] = False
        out, weights = self.attn(query, keys, keys, key_padding_mask=pad)
        if self.empty == "nan_to_num":
            out = torch.nan_to_num(out)
            weights = torch.nan_to_num(weights)
        interest = out.squeeze(1)
        if self.cell:
            h = torch.zeros_like(interest)
            att = weights.squeeze(1)  # [B, L], averaged over heads
            for t in range(hist.size(1)):
                h_new = self.augru(keys[:, t], h, att[:, t])
                h = torch.where(pad[:, t : t + 1], h, h_new)
        else:
            h = keys.sum(1)
        logit = self.mlp(torch.cat([interest, h, query.squeeze(1)], -1)).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logit, label)


def build(empty: str = "nan_to_num", cell: bool = False, seed: int = 0) -> ModelSpec:
    torch.manual_seed(seed)
    # a new user and a full history
    return history_spec(TargetAttention(empty, cell), seed, B, L, ITEMS, first=(0, L))
