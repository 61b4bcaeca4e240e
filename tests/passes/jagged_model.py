"""A jagged history padded to ``[B, L, D]`` through one self-attention, small enough to
read its dump: the pattern match-jagged-attention and pack-jagged-tokens look for, with the
key-padding mask spelled in the ways the passes must tell apart."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

B, L, D, HEADS = 3, 4, 8, 2
LENGTHS = (1, 4, 2)

MASKS = {
    "lengths": "arange(L) < lengths.clamp(min=1) over the padding's offsets: proven",
    "unclamped": "arange(L) < lengths: proven, empty rows not clamped",
    "complement": "arange(L) >= lengths: keeps the padding, not the history",
    "other_offsets": "arange(L) < lengths of another offsets input than the padding's",
    "input": "a boolean [B, L] keep-mask input: checked at run time",
    "queries": "a boolean [B, L, L] input: varies over the queries, no key-padding mask",
    "dropout": "the proven mask, but attention dropout",
}


class Jagged(nn.Module):
    """``tail``: what reads the block's output: ``"masked"`` pools it under the mask (the
    padding rows never reach the loss), ``"mean"`` averages every position (padding
    included), ``"cumsum"`` mixes positions along the sequence before the masked pool,
    ``"side"`` adds an unmasked mean of a projection of the padded history itself (its
    padding rows hold the projection's bias) beside the masked pool."""

    def __init__(self, mask: str = "lengths", tail: str = "masked") -> None:
        super().__init__()
        assert mask in MASKS, mask
        self.mask, self.tail = mask, tail
        self.proj = nn.Linear(D, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.side = nn.Linear(D, D)

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, other: torch.Tensor,
                keep: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        b, n = offsets.shape[0] - 1, values.shape[0]
        lengths = offsets[1:] - offsets[:-1]
        row = torch.repeat_interleave(torch.arange(b), lengths, output_size=n)
        pos = torch.arange(n) - offsets[row]
        seq = values.new_zeros(b, L, D).index_put((row, pos), self.proj(values))
        positions = torch.arange(L)[None, :]
        if self.mask in ("lengths", "dropout"):
            mask = positions < lengths.clamp(min=1)[:, None]
        elif self.mask == "unclamped":
            mask = positions < lengths[:, None]
        elif self.mask == "complement":
            mask = positions >= lengths[:, None]
        elif self.mask == "other_offsets":
            mask = positions < (other[1:] - other[:-1])[:, None]
        else:
            mask = keep
        attn_mask = pairs[:, None] if self.mask == "queries" else mask[:, None, None, :]
        q, k, v = self.qkv(seq).view(b, L, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                           dropout_p=0.1 if self.mask == "dropout" else 0.0)
        y = self.out(a.transpose(1, 2).reshape(b, L, D))
        if self.tail == "mean":
            return y.mean(1).sum()
        if self.tail == "cumsum":
            y = y.cumsum(1)
        pooled = (y * mask[:, :, None].to(y.dtype)).sum()
        return pooled + self.side(seq).mean(1).sum() if self.tail == "side" else pooled


def inputs() -> tuple[torch.Tensor, ...]:
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    keep = torch.arange(L)[None, :] < torch.tensor(LENGTHS)[:, None]
    return (torch.randn(sum(LENGTHS), D), offsets, offsets.clone(), keep,
            keep[:, None, :].expand(B, L, L).clone())
