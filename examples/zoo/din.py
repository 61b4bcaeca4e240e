"""DIN: Deep Interest Network (Zhou et al., KDD 2018, Alibaba).

Follows "Deep Interest Network for Click-Through Rate Prediction" and the layout of its
public code (zhougr1993/DeepInterestNetwork; re-implementations such as DeepCTR-Torch): the
candidate ad's embedding (goods id + category id) attends over the user's behaviour
sequence through the **local activation unit**, an MLP over ``[h, c, h - c, h * c]`` with
Dice activations giving one *unnormalised* weight per behaviour (no softmax, as the paper
insists, so the pooled vector keeps the intensity of interest); the weights are masked by the
history's length and the behaviours are **sum-pooled**. The pooled interest, the candidate,
and the user profile go through an MLP 200-80 (Dice) to one logit, BCE loss.

The history is padded ``[B, L]`` with its ``lengths`` ``[B]`` (the jagged input is lengths
here), and the mask is built the way DIN's code builds it: ``sequence_mask`` as a float
tensor multiplied into the attention scores. User profile fields are multi-hot *weighted*
bags (e.g. a user's tag affinities: ids + weights): ``nn.EmbeddingBag(mode="sum")`` called
with start offsets and ``per_sample_weights``.

Dice (the paper's adaptive activation): ``p = sigmoid((x - E[x]) / sqrt(Var[x] + eps))``,
``f(x) = p * x + (1 - p) * alpha * x``, with the batch statistics of the training step (no
running averages here) and ``alpha`` an ``nn.Parameter`` made in ``__init__``.

Idioms carried (issue #15): lengths as the jagged input and a float mask; ``EmbeddingBag``
with start offsets (``include_last_offset=False``) and ``per_sample_weights``; parameters
created in ``__init__`` (Dice's ``alpha``) without ``reset_parameters``; example inputs from
plain factory calls in a ``torch.device("cpu")`` block.

Input layout: ``hist_goods`` int64 [B, L]; ``hist_cates`` int64 [B, L]; ``hist_len`` int64 [B];
``cand_goods`` int64 [B]; ``cand_cate`` int64 [B]; then per profile field f: ``ids_f`` int64
[nnz_f], ``offsets_f`` int64 [B] (starts), ``weights_f`` f32 [nnz_f]; ``label`` f32 [B].

Presets
-------
``tiny``: B=8, L=8, goods 200 x 8, cates 20 x 8, 3 weighted profile bags of 50 x 8.
``h200``: B=2048, L=512 (50% mean fill), goods 4,000,000 x 64, cates 100,000 x 64 (d=128 per
    item), 16 weighted profile bags of 1,000,000 x 64 with 20 ids each, activation unit
    512-256-1 (the paper's 80-40 widened), MLP 1024-512: 1,288,633,602 parameters (nearly
    all tables). Measured (``torch.utils.flop_counter`` on meta, matmuls only): 0.833 TFLOP
    forward, 2.498 TFLOP forward + backward: the activation unit runs on every (sample,
    behaviour) pair, 2 x B x L x (4 x 128 x 512 + 512 x 256 + 256) MACs = 0.82 TFLOP forward.
    ~5 ms at 500 TFLOP/s, plus Dice's batch statistics (memory bound, over [B x L, 512]) and
    the weighted bags: ~10-20 ms. Memory: 1.3e9 x 16 B = 21 GB if tables are updated
    densely; activations ~10 GB (the [B, L, 512] and [B, L, 256] unit activations).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from gemc.spec import ModelSpec


@dataclass(frozen=True)
class Config:
    batch_size: int
    max_len: int
    num_goods: int
    num_cates: int
    emb_dim: int  # per goods / cate embedding: an item is 2 * emb_dim wide
    profile_fields: int
    profile_rows: int
    profile_pooling: int
    att_hidden: tuple[int, ...]
    mlp_hidden: tuple[int, ...]


PRESETS = {
    "tiny": Config(8, 8, 200, 20, 8, 3, 50, 3, (16, 8), (32, 16)),
    "h200": Config(2048, 512, 4_000_000, 100_000, 64, 16, 1_000_000, 20, (512, 256), (1024, 512)),
}


class Dice(nn.Module):
    """Data-adaptive activation (DIN, eq. 9); statistics over all but the last dimension."""

    def __init__(self, num_features: int, eps: float = 1e-8) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(num_features))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.size(-1))
        mean = flat.mean(dim=0)
        var = flat.var(dim=0, unbiased=False)
        p = torch.sigmoid((x - mean) / torch.sqrt(var + self.eps))
        return p * x + (1 - p) * self.alpha * x


class LocalActivationUnit(nn.Module):
    """MLP over [behaviour, candidate, behaviour - candidate, behaviour * candidate]."""

    def __init__(self, dim: int, hidden: tuple[int, ...]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        prev = 4 * dim
        for h in hidden:
            layers += [nn.Linear(prev, h), Dice(h)]
            prev = h
        self.dnn = nn.Sequential(*layers)
        self.dense = nn.Linear(prev, 1)

    def forward(self, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        queries = query.unsqueeze(1).expand(-1, keys.size(1), -1)  # [B, L, d]
        att_in = torch.cat([keys, queries, keys - queries, keys * queries], dim=-1)
        return self.dense(self.dnn(att_in))  # [B, L, 1]


class DIN(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.goods_emb = nn.Embedding(cfg.num_goods, cfg.emb_dim)
        self.cate_emb = nn.Embedding(cfg.num_cates, cfg.emb_dim)
        nn.init.normal_(self.goods_emb.weight, std=1e-4)
        nn.init.normal_(self.cate_emb.weight, std=1e-4)
        self.profile = nn.ModuleList(
            nn.EmbeddingBag(cfg.profile_rows, cfg.emb_dim, mode="sum")
            for _ in range(cfg.profile_fields))
        item_dim = 2 * cfg.emb_dim
        self.attention = LocalActivationUnit(item_dim, cfg.att_hidden)
        layers: list[nn.Module] = []
        prev = 2 * item_dim + cfg.profile_fields * cfg.emb_dim
        for h in cfg.mlp_hidden:
            layers += [nn.Linear(prev, h), Dice(h)]
            prev = h
        layers.append(nn.Linear(prev, 1))
        self.mlp = nn.Sequential(*layers)
        self.loss = nn.BCEWithLogitsLoss()

    def forward(self, hist_goods: torch.Tensor, hist_cates: torch.Tensor, hist_len: torch.Tensor,
                cand_goods: torch.Tensor, cand_cate: torch.Tensor,
                *profile_and_label: torch.Tensor) -> torch.Tensor:
        label = profile_and_label[-1]
        keys = torch.cat([self.goods_emb(hist_goods), self.cate_emb(hist_cates)], dim=-1)
        query = torch.cat([self.goods_emb(cand_goods), self.cate_emb(cand_cate)], dim=-1)

        scores = self.attention(query, keys).squeeze(-1)  # [B, L], unnormalised
        max_len = hist_goods.size(1)
        mask = (torch.arange(max_len, device=hist_len.device)[None, :] < hist_len[:, None]).float()
        scores = scores * mask
        interest = torch.sum(scores.unsqueeze(-1) * keys, dim=1)  # sum pooling

        profile = []
        for f, bag in enumerate(self.profile):
            ids, offsets, weights = profile_and_label[3 * f: 3 * f + 3]
            profile.append(bag(ids, offsets, per_sample_weights=weights))
        logit = self.mlp(torch.cat([interest, query, *profile], dim=-1)).squeeze(-1)
        return self.loss(logit, label)


def _batch(cfg: Config, step: int, seed: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1_000_003 * seed + step)
    b, length = cfg.batch_size, cfg.max_len
    hist_len = torch.randint(0, length + 1, (b,), generator=g)
    hist_len[0], hist_len[1] = 0, length  # an empty and a full history in every batch
    valid = torch.arange(length)[None, :] < hist_len[:, None]
    goods = torch.randint(0, cfg.num_goods, (b, length), generator=g) * valid
    cates = torch.randint(0, cfg.num_cates, (b, length), generator=g) * valid
    out = [goods, cates, hist_len, torch.randint(0, cfg.num_goods, (b,), generator=g),
           torch.randint(0, cfg.num_cates, (b,), generator=g)]
    for _ in range(cfg.profile_fields):
        nnz = b * cfg.profile_pooling
        out.append(torch.randint(0, cfg.profile_rows, (nnz,), generator=g))
        out.append(torch.arange(b) * cfg.profile_pooling)  # start offsets
        out.append(torch.rand(nnz, generator=g))
    out.append((torch.rand(b, generator=g) < 0.3).float())
    return tuple(t.to(device) for t in out)


def build(preset: str = "tiny", batch_size: int | None = None, seed: int = 0) -> ModelSpec:
    """DIN at ``preset`` ("tiny" or "h200")."""
    cfg = PRESETS[preset]
    if batch_size is not None:
        cfg = replace(cfg, batch_size=batch_size)
    torch.manual_seed(seed)
    model = DIN(cfg)

    def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        with torch.device("cpu"):  # data is made on the CPU, then moved
            return _batch(cfg, step, seed, device)

    info = {"preset": preset, "model": "din", "batch_size": cfg.batch_size,
            "max_len": cfg.max_len, "num_profile_bags": cfg.profile_fields}
    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=cfg.batch_size, info=info)
