"""BST: Behavior Sequence Transformer (Chen et al., DLP-KDD 2019, Alibaba), SASRec-style inputs.

Follows "Behavior Sequence Transformer for E-commerce Recommendation in Alibaba": the user's
behaviour sequence (item id + category embeddings, plus a learned position embedding) with
the *target* item appended goes through a Transformer layer (multi-head self-attention,
LeakyReLU feed-forward, residual + LayerNorm), the outputs are flattened, concatenated with
the embeddings of "other features" (user profile, context) and fed to an MLP 1024-512-256 and
a sigmoid output. The history arrives the way SASRec/BST implementations take it (Kang &
McAuley 2018's ``pmixer/SASRec.pytorch`` and most BST re-implementations): a **padded**
``[B, L]`` id tensor with id 0 as padding (``nn.Embedding(..., padding_idx=0)``) and a
**boolean mask** (True = a real behaviour), turned into ``key_padding_mask=~mask`` for
``nn.MultiheadAttention(batch_first=True)``. The target token is always valid, so a user
with no history still attends to something (no all-masked softmax row).

Idioms carried (issue #15): padded history with a boolean mask input; ``nn.MultiheadAttention``
with ``key_padding_mask`` (and ``need_weights`` left at its default, as user code does);
``nn.Embedding(padding_idx=0)``; a positional embedding ``nn.Parameter`` created in
``__init__`` and drawn with ``nn.init.normal_`` (no ``reset_parameters``); example inputs
built with ``device="cpu"``.

Input layout: ``hist_items`` int64 [B, L] (0 = pad); ``hist_cates`` int64 [B, L];
``hist_mask`` bool [B, L]; ``target_item`` int64 [B]; ``target_cate`` int64 [B];
``user_feats`` int64 [B, F] (one id per profile field, each field its own table);
``label`` f32 [B].

Presets
-------
``tiny``: B=8, L=8, d=16 (item 8 + category 8), 2 heads, 1 block, 4 profile fields.
``h200``: B=2048, L=200 (50% mean fill), d=256 (item 192 + category 64), 8 heads, 2 blocks (FFN
    4x), 8 profile fields of 100,000 rows x 32, MLP 1024-512-256: 465,481,729 parameters.
    Measured (``torch.utils.flop_counter`` on meta, matmuls and attention only): 1.684 TFLOP
    forward, 5.052 TFLOP forward + backward. FLOP/step (fwd+bwd = 3 x fwd): blocks 2 x (2 x
    411,648 tokens x 786k MACs + 4 x B x 201^2 x 256) = 1.5 TFLOP fwd, the MLP's first layer 2 x
    2048 x 51,712 x 1024 = 0.22 TFLOP fwd -> ~5 TFLOP per step, ~10 ms at 500 TFLOP/s, plus the
    softmax and the averaged attention weights ``need_weights`` materialises. Memory: ~0.6e9
    parameters x 16 B = 9 GB; activations ~15 GB (the [B, 8, 201, 201] attention probabilities
    per block dominate).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec


@dataclass(frozen=True)
class Config:
    batch_size: int
    max_len: int
    num_items: int
    num_cates: int
    item_dim: int
    cate_dim: int
    num_heads: int
    num_blocks: int
    user_fields: int
    user_rows: int
    user_dim: int
    mlp: tuple[int, ...]


PRESETS = {
    "tiny": Config(8, 8, 300, 20, 8, 8, 2, 1, 4, 30, 4, (32, 16)),
    "h200": Config(2048, 200, 2_000_000, 10_000, 192, 64, 8, 2, 8, 100_000, 32, (1024, 512, 256)),
}


class TransformerLayer(nn.Module):
    """Post-LN Transformer layer as in BST (self-attention, LeakyReLU FFN)."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=0.0, batch_first=True)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
        attn_out, _ = self.self_attn(x, x, x, key_padding_mask=key_padding_mask)
        x = self.norm1(x + attn_out)
        ffn = self.linear2(F.leaky_relu(self.linear1(x)))
        return self.norm2(x + ffn)


class BST(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        d = cfg.item_dim + cfg.cate_dim
        self.item_emb = nn.Embedding(cfg.num_items + 1, cfg.item_dim, padding_idx=0)
        self.cate_emb = nn.Embedding(cfg.num_cates + 1, cfg.cate_dim, padding_idx=0)
        self.pos_emb = nn.Parameter(torch.empty(cfg.max_len + 1, d))
        nn.init.normal_(self.pos_emb, std=0.02)
        self.user_embs = nn.ModuleList(
            nn.Embedding(cfg.user_rows, cfg.user_dim) for _ in range(cfg.user_fields))
        self.blocks = nn.ModuleList(
            TransformerLayer(d, cfg.num_heads, 4 * d) for _ in range(cfg.num_blocks))
        dims = [(cfg.max_len + 1) * d + cfg.user_fields * cfg.user_dim, *cfg.mlp]
        layers: list[nn.Module] = []
        for i in range(len(dims) - 1):
            layers += [nn.Linear(dims[i], dims[i + 1]), nn.LeakyReLU()]
        layers.append(nn.Linear(dims[-1], 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, hist_items: torch.Tensor, hist_cates: torch.Tensor, hist_mask: torch.Tensor,
                target_item: torch.Tensor, target_cate: torch.Tensor, user_feats: torch.Tensor,
                label: torch.Tensor) -> torch.Tensor:
        items = torch.cat([hist_items, target_item.unsqueeze(1)], dim=1)
        cates = torch.cat([hist_cates, target_cate.unsqueeze(1)], dim=1)
        x = torch.cat([self.item_emb(items), self.cate_emb(cates)], dim=-1) + self.pos_emb
        valid = torch.cat([hist_mask, torch.ones_like(hist_mask[:, :1])], dim=1)
        for block in self.blocks:
            x = block(x, key_padding_mask=~valid)
        x = x * valid.unsqueeze(-1)  # padded positions carry nothing into the MLP
        other = [emb(user_feats[:, i]) for i, emb in enumerate(self.user_embs)]
        logit = self.mlp(torch.cat([x.flatten(1), *other], dim=1)).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logit, label)


# ----------------------------------------------------------------------------- synthetic data
# (kept in this file: gemc loads ``FILE.py:build`` by path, so a model file imports no sibling)


def _generator(step: int, seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(1_000_003 * seed + step)


def _lengths(gen: torch.Generator, batch: int, max_len: int, total: int) -> torch.Tensor:
    """``batch`` lengths in ``[0, max_len]`` summing to ``total``: row 0 empty, row 1 full,
    the rest uniform, then nudged one at a time at random rows until the sum is right."""
    lengths = torch.randint(0, max_len + 1, (batch,), generator=gen)
    free = torch.ones(batch, dtype=torch.bool)
    if batch >= 2 and max_len <= total <= (batch - 1) * max_len:
        lengths[0], lengths[1] = 0, max_len
        free[:2] = False
    while (diff := total - int(lengths.sum())) != 0:
        rows = (free & ((lengths < max_len) if diff > 0 else (lengths > 0))).nonzero().flatten()
        rows = rows[torch.randperm(rows.numel(), generator=gen)[: abs(diff)]]
        lengths[rows] += 1 if diff > 0 else -1
    return lengths


def _batch(cfg: Config, step: int, seed: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    g = _generator(step, seed)
    b, length = cfg.batch_size, cfg.max_len
    lengths = _lengths(g, b, length, b * length // 2)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    items = torch.randint(1, cfg.num_items + 1, (b, length), generator=g) * mask
    cates = torch.randint(1, cfg.num_cates + 1, (b, length), generator=g) * mask
    target_item = torch.randint(1, cfg.num_items + 1, (b,), generator=g)
    target_cate = torch.randint(1, cfg.num_cates + 1, (b,), generator=g)
    user = torch.randint(0, cfg.user_rows, (b, cfg.user_fields), generator=g)
    label = (torch.rand(b, generator=g) < 0.3).float()
    return tuple(t.to(device) for t in (items, cates, mask, target_item, target_cate, user, label))


def build(preset: str = "tiny", batch_size: int | None = None, seed: int = 0) -> ModelSpec:
    """BST over a padded, boolean-masked history at ``preset`` ("tiny" or "h200")."""
    cfg = PRESETS[preset]
    if batch_size is not None:
        cfg = replace(cfg, batch_size=batch_size)
    torch.manual_seed(seed)
    model = BST(cfg)

    def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        with torch.device("cpu"):  # data is made on the CPU, then moved
            return _batch(cfg, step, seed, device)

    info = {"preset": preset, "model": "sasrec_bst", "batch_size": cfg.batch_size,
            "max_len": cfg.max_len}
    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=cfg.batch_size, info=info)
