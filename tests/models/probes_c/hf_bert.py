"""A session-based next-item model in the Transformers4Rec / Hugging Face BERT style.

The loader hands a dict (``{"item_id-list": int32 [B, L], "price-list": float16 [B, L],
"target": int32 [B]}``, right-padded, 0 = padding; the first session is EMPTY, a cold
start the loader kept); the model builds HF's extended attention mask

    extended = (1.0 - mask[:, None, None, :].to(dtype)) * MIN

with ``MIN`` = ``-10000.0`` (BERT's original, ``mask_value="1e4"``) or
``torch.finfo(dtype).min`` (today's transformers, ``"finfo"``), and runs hand-written
``BertSelfAttention`` / ``BertSelfOutput`` / ``BertIntermediate`` / ``BertOutput`` blocks
(``transpose_for_scores``: view + permute(0, 2, 1, 3); scores / sqrt(d) + mask; softmax;
attention-probs dropout; erf GELU; ``LayerNorm(eps=1e-12)``). The session's last real
position (``lengths - 1`` clamped at 0) is scored against the tied item table (CE).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

B, L, ITEMS, H, HEADS, LAYERS = 6, 5, 30, 8, 2, 1


class BertSelfAttention(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.num_attention_heads = HEADS
        self.attention_head_size = H // HEADS
        self.all_head_size = H
        self.query = nn.Linear(H, H)
        self.key = nn.Linear(H, H)
        self.value = nn.Linear(H, H)
        self.dropout = nn.Dropout(dropout)

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_scores = attention_scores + attention_mask
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        return context_layer.view(new_context_layer_shape)


class BertLayer(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.self_attn = BertSelfAttention(dropout)
        self.attn_dense = nn.Linear(H, H)
        self.attn_norm = nn.LayerNorm(H, eps=1e-12)
        self.intermediate = nn.Linear(H, 4 * H)
        self.output = nn.Linear(4 * H, H)
        self.out_norm = nn.LayerNorm(H, eps=1e-12)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden_states, attention_mask):
        attn = self.self_attn(hidden_states, attention_mask)
        attn = self.attn_norm(self.dropout(self.attn_dense(attn)) + hidden_states)
        inter = F.gelu(self.intermediate(attn))
        return self.out_norm(self.dropout(self.output(inter)) + attn)


class T4RecBert(nn.Module):
    def __init__(self, mask_value: str, dropout: float) -> None:
        super().__init__()
        self.mask_value = mask_value
        self.item_embeddings = nn.Embedding(ITEMS, H, padding_idx=0)
        self.position_embeddings = nn.Embedding(L, H)
        self.price_proj = nn.Linear(1, H)
        self.norm = nn.LayerNorm(H, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer(dropout) for _ in range(LAYERS))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["item_id-list"].long()
        mask = (ids != 0).long()
        price = batch["price-list"].float().unsqueeze(-1)
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        x = self.item_embeddings(ids) + self.position_embeddings(positions)
        x = self.norm(x + self.price_proj(price))
        dtype = x.dtype
        extended = mask[:, None, None, :].to(dtype=dtype)
        big = -10000.0 if self.mask_value == "1e4" else torch.finfo(dtype).min
        extended = (1.0 - extended) * big
        for layer in self.layers:
            x = layer(x, extended)
        last = (mask.sum(1) - 1).clamp(min=0)
        out = x[torch.arange(x.shape[0], device=x.device), last]
        logits = out @ self.item_embeddings.weight.t()
        return F.cross_entropy(logits, batch["target"].long())


def build(mask_value: str = "1e4", dropout: float = 0.0, seed: int = 0,
          cold_start_step: int | None = None) -> ModelSpec:
    """``cold_start_step``: the first session is empty at that step only (None: at every
    step): the readout's ``lengths - 1`` clamped at 0 then reads a padding position."""
    torch.manual_seed(seed)
    model = T4RecBert(mask_value, dropout)

    def make_batch(step: int, device: torch.device | str) -> dict[str, torch.Tensor]:
        with torch.device("cpu"):
            g = torch.Generator().manual_seed(1000 * seed + step)
            lengths = torch.randint(1, L + 1, (B,), generator=g)
            lengths[1] = L  # a full session, and a cold-start (empty) one:
            lengths[0] = 0 if cold_start_step in (None, step) else lengths[0]
            real = torch.arange(L)[None, :] < lengths[:, None]
            ids = (torch.randint(1, ITEMS, (B, L), generator=g) * real).to(torch.int32)
            price = (torch.rand(B, L, generator=g) * 5 * real).to(torch.float16)
            target = torch.randint(1, ITEMS, (B,), generator=g).to(torch.int32)
        return {"item_id-list": ids.to(device), "price-list": price.to(device),
                "target": target.to(device)}

    return ModelSpec(model=model, example_inputs=(make_batch(0, "cpu"),),
                     make_batch=lambda step, device: (make_batch(step, device),),
                     batch_size=B)
