"""Self-attention written out by hand, as TF-era ports and tutorials do (Kang & McAuley's
SASRec TF code ported to PyTorch; the Annotated Transformer), over a right-padded history
that may be empty (a new user: every key is padding).

``mask``: ``"sdpa_bool"`` ``F.scaled_dot_product_attention`` with a boolean keep-mask
(True = attend, the opposite of ``key_padding_mask``); ``"fill_1e9"``
``scores.masked_fill(mask == 0, -1e9)`` then softmax (an all-padding row attends
uniformly to its padding); ``"where_2_32"`` SASRec-TF's ``torch.where(key_masks == 0,
-2**32 + 1, scores)``. ``loss``: ``"last"`` BCE of the pooled history against the target,
``"positions"`` SASRec's per-position BCE over real positions, selected by boolean
indexing (``logits[istarget]``); ``"masked"`` the same loss masked, not selected (the
rewrite gemc's error names).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec
from tests.models.probes.data import padded_history, target_and_label

B, L, ITEMS, D, HEADS = 8, 6, 40, 8, 2


class Block(nn.Module):
    def __init__(self, mask: str) -> None:
        super().__init__()
        self.mask = mask
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        key_keep = keep[:, None, None, :]  # [B, 1, 1, L]
        if self.mask == "sdpa_bool":
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=key_keep)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(D // HEADS)
            if self.mask == "fill_1e9":
                scores = scores.masked_fill(key_keep == 0, -1e9)
            else:
                paddings = torch.ones_like(scores) * (-2**32 + 1)
                scores = torch.where(key_keep.expand_as(scores) == 0, paddings, scores)
            att = torch.softmax(scores, dim=-1) @ v
        att = att.transpose(1, 2).reshape(b, n, D)
        return self.norm(x + self.out(att))


class HandAttention(nn.Module):
    def __init__(self, mask: str, loss: str) -> None:
        super().__init__()
        self.loss = loss
        self.item_emb = nn.Embedding(ITEMS, D, padding_idx=0)
        self.pos_emb = nn.Embedding(L, D)
        self.block = Block(mask)

    def forward(self, seq: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor,
                target: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        keep = seq != 0
        positions = torch.arange(seq.size(1), device=seq.device)
        x = (self.item_emb(seq) + self.pos_emb(positions)) * keep.unsqueeze(-1)
        h = self.block(x, keep)
        if self.loss == "masked":  # the rewrite gemc's error names: mask, not select
            mask = (pos != 0).float()
            pos_logits = (h * self.item_emb(pos)).sum(-1)
            neg_logits = (h * self.item_emb(neg)).sum(-1)
            per = (F.binary_cross_entropy_with_logits(pos_logits, torch.ones_like(pos_logits),
                                                      reduction="none")
                   + F.binary_cross_entropy_with_logits(neg_logits,
                                                        torch.zeros_like(neg_logits),
                                                        reduction="none"))
            return (per * mask).sum() / mask.sum().clamp(min=1)
        if self.loss == "positions":
            pos_logits = (h * self.item_emb(pos)).sum(-1)
            neg_logits = (h * self.item_emb(neg)).sum(-1)
            istarget = pos != 0
            return (F.binary_cross_entropy_with_logits(
                pos_logits[istarget], torch.ones_like(pos_logits[istarget]))
                + F.binary_cross_entropy_with_logits(
                neg_logits[istarget], torch.zeros_like(neg_logits[istarget])))
        pooled = h.mean(1)
        logit = (pooled * self.item_emb(target)).sum(-1)
        return F.binary_cross_entropy_with_logits(logit, label)


def build(mask: str = "fill_1e9", loss: str = "last", seed: int = 0) -> ModelSpec:
    torch.manual_seed(seed)
    model = HandAttention(mask, loss)

    def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        # a new user (no history) and a full one
        g, real, seq = padded_history(step, seed, B, L, ITEMS, first=(0, L))
        with torch.device("cpu"):
            pos = torch.randint(1, ITEMS, (B, L), generator=g) * real
            neg = torch.randint(1, ITEMS, (B, L), generator=g) * real
        target, label = target_and_label(g, B, ITEMS)
        return tuple(t.to(device) for t in (seq, pos, neg, target, label))

    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=B)
