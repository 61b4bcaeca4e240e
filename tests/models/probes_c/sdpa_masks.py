"""A sequence encoder over ``(hist, lengths)``, the key mask built from the lengths in the
spellings people write, through ``F.scaled_dot_product_attention`` or torch's encoder layer.

``mask``:

* ``"layer"``: ``nn.TransformerEncoderLayer(batch_first=True, norm_first=True)`` called on
  its own with ``src_key_padding_mask=~keep`` only (no ``src_mask``);
* ``"bool"``: SDPA with ``attn_mask = keep[:, None, None, :]``, ``keep = arange(L) < lengths[:, None]``;
* ``"where"``: ``torch.where(keep, 0.0, float("-inf"))`` as an additive float mask;
* ``"masked_fill"``: ``torch.zeros(B, L).masked_fill(~keep, float("-inf"))``;
* ``"float"``: ``(1.0 - keep.float()) * -1e9`` added to the scores;
* ``"hf"``: Hugging Face's SDPA path, ``(1.0 - keep[:, None, None, :].float()) *
  torch.finfo(torch.float32).min`` (a ``[B, 1, 1, L]`` mask with no ``[B, L]`` tensor);
* ``"ge"``: ``lengths[:, None] > arange(L)`` written the other way round, the causal mask
  and-ed in (``keep & tril``, a [B, 1, L, L] boolean mask).

Every history has at least one item (SDPA's output for a row with no key is NaN). The
loss: BCE of the mean of the real positions' outputs against a target item.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

B, L, ITEMS, D, HEADS = 6, 5, 30, 8, 2


class Encoder(nn.Module):
    def __init__(self, mask: str, dropout: float) -> None:
        super().__init__()
        self.mask = mask
        self.item = nn.Embedding(ITEMS, D, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(L, D) * 0.02)
        if mask == "layer":
            self.layer = nn.TransformerEncoderLayer(D, HEADS, dim_feedforward=2 * D,
                                                    dropout=dropout, batch_first=True,
                                                    norm_first=True)
        else:
            self.qkv = nn.Linear(D, 3 * D)
            self.proj = nn.Linear(D, D)
            self.norm = nn.LayerNorm(D)

    def attention_mask(self, keep: torch.Tensor) -> torch.Tensor:
        if self.mask == "bool":
            return keep[:, None, None, :]
        if self.mask == "where":
            return torch.where(keep, 0.0, float("-inf"))[:, None, None, :]
        if self.mask == "masked_fill":
            add = torch.zeros(keep.shape, device=keep.device).masked_fill(~keep, float("-inf"))
            return add.view(keep.shape[0], 1, 1, -1)
        if self.mask == "float":
            return ((1.0 - keep.float()) * -1e9).unsqueeze(1).unsqueeze(2)
        if self.mask == "hf":  # BertSdpaSelfAttention's: the arithmetic after the unsqueezes
            extended = keep[:, None, None, :].to(torch.float32)
            return (1.0 - extended) * torch.finfo(torch.float32).min
        n = keep.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=keep.device).tril()
        return keep[:, None, None, :] & causal

    def forward(self, hist: torch.Tensor, lengths: torch.Tensor,
                target: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        n = hist.shape[1]
        if self.mask == "ge":
            keep = lengths[:, None] > torch.arange(n, device=hist.device)
        else:
            keep = torch.arange(n, device=hist.device) < lengths[:, None]
        x = self.item(hist) + self.pos
        if self.mask == "layer":
            h = self.layer(x, src_key_padding_mask=~keep)
        else:
            b = x.shape[0]
            q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
            q, k, v = (t.reshape(b, n, HEADS, -1).transpose(1, 2) for t in (q, k, v))
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=self.attention_mask(keep))
            h = x + self.proj(att.transpose(1, 2).reshape(b, n, D))
        w = keep.unsqueeze(-1).float()
        pooled = (h * w).sum(1) / w.sum(1)
        logit = (pooled * self.item(target)).sum(-1)
        return F.binary_cross_entropy_with_logits(logit, label)


def build(mask: str = "bool", seed: int = 0, dropout: float = 0.0,
          int32: bool = False) -> ModelSpec:
    """``dropout``: the encoder layer's (torch's default 0.1); ``int32``: the history and
    its lengths int32, as a loader gives them."""
    torch.manual_seed(seed)
    model = Encoder(mask, dropout)

    def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        with torch.device("cpu"):
            g = torch.Generator().manual_seed(1000 * seed + step)
            lengths = torch.randint(1, L + 1, (B,), generator=g)
            lengths[0], lengths[1] = 1, L
            real = torch.arange(L)[None, :] < lengths[:, None]
            hist = torch.randint(1, ITEMS, (B, L), generator=g) * real
            target = torch.randint(1, ITEMS, (B,), generator=g)
            label = (torch.rand(B, generator=g) < 0.4).float()
        if int32:
            hist, lengths = hist.to(torch.int32), lengths.to(torch.int32)
        return tuple(t.to(device) for t in (hist, lengths, target, label))

    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=B)
