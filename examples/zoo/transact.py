"""TransAct in a Pinnability-style ranker (Xia et al., KDD 2023, Pinterest).

Follows "TransAct: Transformer-based Realtime User Action Model for Recommendation at
Pinterest" and the layout of Pinterest's published module (pinterest/transformer_user_action,
``transact.py``): the user's latest ``S`` actions, most recent first, each an action-type
embedding concatenated with the acted-on item's PinSage embedding (a dense input) and,
"early fusion", with the candidate item's embedding, go through
``nn.TransformerEncoder(nn.TransformerEncoderLayer(batch_first=True))`` under a
``src_key_padding_mask``; the output keeps the first ``latest_n`` tokens flattened and a
max pool over all ``S`` positions through a Linear. The key mask is built the way the
published forward builds it: padding (``action_type <= 0``) OR'd with a **random time
window** (actions less than ``w`` ms before the request, ``w`` uniform in ``[0, 1 h]``, drawn
per step in training so the model does not lean on the very last actions), then
``mask[:, 0] = 0`` (the latest action is never masked) and turned into an additive float mask
(``zeros_like(...).masked_fill_(mask, -inf)``). The window masks the *most recent*
positions, so the key mask is in general **not a prefix**; padding sits at the end.

The ranker around it is Pinnability's shape (the paper's Figure 2): the TransAct output,
multi-hot sparse features (``nn.EmbeddingBag(mode="sum")``), dense features and the candidate
embedding, concatenated into a full-rank DCNv2 cross network and an MLP, then one logit per
engagement head (click, repin, hide) with a weighted BCE.

One departure, named: the published forward draws the window with Python's
``random.randint``, which ``torch.export`` would bake into the graph as one constant
(``gemc compile`` refuses it and names the line: ``gemc.host_randomness``); this port draws it
with ``torch.randint`` on the batch's device, the change that error suggests, so eager,
torch.compile and gemc all draw a fresh window each step. ``dropout=0.0`` where the
published module keeps ``nn.TransformerEncoderLayer``'s default 0.1, as the zoo's other
transformers do, so loss curves compare with eager exactly.

Idioms carried: ``nn.TransformerEncoder`` with an additive float ``src_key_padding_mask``
built by ``masked_fill_`` on ``zeros_like``; a key mask that is no prefix (time window) with an
in-place ``mask[:, 0] = 0``; a buffer lookup of raw action ids (``register_buffer`` +
indexing); ``expand`` of the candidate over the sequence and ``cat`` on the feature
dimension; an un-masked max pool and a slice of the first tokens (both read padded
positions' outputs, as the published module does); multi-hot ``EmbeddingBag`` with 2-D
input; a full-rank DCNv2 ``x0 * W(x) + x`` in ``nn.Linear``.

Input layout: ``action_types`` int64 [B, S] (raw action ids, 0 = padding); ``action_items``
f32 [B, S, item_dim] (PinSage, zero on padding); ``action_times`` int64 [B, S] (ms);
``request_time`` int64 [B]; ``candidate`` f32 [B, item_dim]; ``sparse_ids`` int64 [B, F, hot];
``dense`` f32 [B, dense_dim]; ``labels`` f32 [B, 3].

Presets
-------
``tiny``: B=8, S=12, 20 action types x 8, item 8, 2 layers of 2 heads, FFN 16, latest 3,
    3 multi-hot fields of 50 x 8 (2 ids each), dense 5, 2 cross layers, MLP 32-16.
``h200``: B=4,096, S=100, the published config (20 action types x 32, PinSage 32, 2 layers
    of 2 heads, FFN 32, latest 10, 1 h window), 24 multi-hot fields of 1,000,000 x 64
    (4 ids each), dense 64, 3 full-rank cross layers, MLP 1024-512-256, 3 heads:
    1,561,192,323 parameters (1,536,000,000 in the tables). Measured
    (``torch.utils.flop_counter`` on meta, matmuls and attention): 0.307 TFLOP forward,
    0.922 TFLOP forward + backward: the cross layers, 3 x 2 x B x 2,688^2 = 0.18 TFLOP, and
    the MLP's first layer, 2 x B x 2,688 x 1,024 = 0.023 TFLOP, lead; the encoder's
    409,600 tokens of d = 96 are a few percent. Memory: tables 6.1 GB fp32 (sparse row
    updates), dense ~30M parameters; activations a few GB.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

HEADS = ("click", "repin", "hide")
HEAD_WEIGHTS = (1.0, 1.0, 0.5)
HOUR_MS = 60 * 60 * 1000


@dataclass(frozen=True)
class Config:
    batch_size: int
    seq_len: int
    num_actions: int
    action_dim: int
    item_dim: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    latest_n: int
    time_window_ms: int
    sparse_fields: int
    sparse_rows: int
    sparse_dim: int
    sparse_hot: int
    dense_dim: int
    cross_layers: int
    mlp: tuple[int, ...]


PRESETS = {
    "tiny": Config(8, 12, 20, 8, 8, 2, 2, 16, 3, HOUR_MS, 3, 50, 8, 2, 5, 2, (32, 16)),
    "h200": Config(4096, 100, 20, 32, 32, 2, 2, 32, 10, HOUR_MS, 24, 1_000_000, 64, 4, 64, 3,
                   (1024, 512, 256)),
}


class TransAct(nn.Module):
    """The realtime action encoder (the published module's structure)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.seq_len = cfg.seq_len
        self.latest_n = cfg.latest_n
        self.time_window_ms = cfg.time_window_ms
        d = cfg.action_dim + 2 * cfg.item_dim  # early fusion: the candidate on every token
        # raw action ids -> embedding rows (row 0 is padding)
        lookup = torch.zeros(cfg.num_actions + 2, dtype=torch.long)
        lookup[1:] = torch.arange(cfg.num_actions + 1)
        self.register_buffer("action_type_lookup", lookup)
        self.action_emb = nn.Embedding(cfg.num_actions + 1, cfg.action_dim, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d_model=d, nhead=cfg.num_heads,
                                           dim_feedforward=cfg.ffn_dim, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=cfg.num_layers,
                                             enable_nested_tensor=False)
        self.out_linear = nn.Linear(d, d)
        self.out_dim = (cfg.latest_n + 1) * d

    def forward(self, action_types: torch.Tensor, action_items: torch.Tensor,
                action_times: torch.Tensor, request_time: torch.Tensor,
                candidate: torch.Tensor) -> torch.Tensor:
        action_types = self.action_type_lookup[action_types + 1]
        action_emb = self.action_emb(action_types)
        key_padding_mask = action_types <= 0
        request_time = request_time.unsqueeze(-1).expand(-1, self.seq_len)
        if self.training:  # a fresh window each step (the published code: random.randint)
            window = torch.randint(0, self.time_window_ms + 1, (1,), device=action_times.device)
        else:
            window = torch.zeros(1, dtype=torch.long, device=action_times.device)
        recent = (request_time - action_times) < window
        key_padding_mask = torch.bitwise_or(key_padding_mask, recent)
        key_padding_mask[:, 0] = torch.zeros(key_padding_mask.shape[0],
                                             dtype=key_padding_mask.dtype,
                                             device=key_padding_mask.device)
        attn_mask = torch.zeros_like(key_padding_mask, dtype=torch.float)
        attn_mask.masked_fill_(key_padding_mask, float("-inf"))
        tokens = torch.cat((action_emb, action_items), dim=2)
        cand = candidate.unsqueeze(1).expand(-1, self.seq_len, -1)
        tokens = torch.cat((tokens, cand), dim=-1)
        out = self.encoder(src=tokens, src_key_padding_mask=attn_mask)
        pooled = self.out_linear(out.max(dim=1).values)
        latest = out[:, : self.latest_n]
        return torch.cat([pooled, latest.flatten(1)], dim=1)


class CrossNetV2(nn.Module):
    """DCNv2's full-rank cross layers: ``x_{l+1} = x0 * W_l(x_l) + x_l``."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for linear in self.layers:
            x = x0 * linear(x) + x
        return x


class Pinnability(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.transact = TransAct(cfg)
        self.sparse = nn.ModuleList(nn.EmbeddingBag(cfg.sparse_rows, cfg.sparse_dim, mode="sum")
                                    for _ in range(cfg.sparse_fields))
        d0 = (self.transact.out_dim + cfg.sparse_fields * cfg.sparse_dim + cfg.dense_dim
              + cfg.item_dim)
        self.cross = CrossNetV2(d0, cfg.cross_layers)
        dims = [d0, *cfg.mlp]
        layers: list[nn.Module] = []
        for i in range(len(dims) - 1):
            layers += [nn.Linear(dims[i], dims[i + 1]), nn.ReLU()]
        self.mlp = nn.Sequential(*layers)
        self.heads = nn.Linear(dims[-1], len(HEADS))
        self.register_buffer("head_weights", torch.tensor(HEAD_WEIGHTS))

    def forward(self, action_types: torch.Tensor, action_items: torch.Tensor,
                action_times: torch.Tensor, request_time: torch.Tensor,
                candidate: torch.Tensor, sparse_ids: torch.Tensor, dense: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        user_seq = self.transact(action_types, action_items, action_times, request_time,
                                 candidate)
        sparse = [bag(sparse_ids[:, i]) for i, bag in enumerate(self.sparse)]
        x = torch.cat([user_seq, *sparse, dense, candidate], dim=1)
        logits = self.heads(self.mlp(self.cross(x)))
        per_head = F.binary_cross_entropy_with_logits(logits, labels, reduction="none").mean(0)
        return (per_head * self.head_weights).sum()


# ----------------------------------------------------------------------------- synthetic data
# (kept in this file: gemc loads ``FILE.py:build`` by path, so a model file imports no sibling)


def synthetic_batch(cfg: Config, step: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Lengths uniform in ``[0, S]`` (row 0 empty: its one padded row stays unmasked, as
    ``mask[:, 0] = 0`` keeps it; row 1 full); gaps between actions exponential with a
    10-minute mean, so the 1-hour window masks a few latest actions."""
    g = torch.Generator(device="cpu").manual_seed(1_000_003 * seed + step)
    b, s = cfg.batch_size, cfg.seq_len
    lengths = torch.randint(0, s + 1, (b,), generator=g)
    if b >= 2:
        lengths[0], lengths[1] = 0, s
    real = torch.arange(s)[None, :] < lengths[:, None]
    types = torch.randint(1, cfg.num_actions + 1, (b, s), generator=g) * real
    items = torch.randn(b, s, cfg.item_dim, generator=g) * real[..., None]
    gaps = (-torch.log(torch.rand(b, s, generator=g)) * (10 * 60 * 1000)).long() + 1
    request_time = torch.randint(10**12, 2 * 10**12, (b,), generator=g)
    times = request_time[:, None] - gaps.cumsum(1)
    candidate = torch.randn(b, cfg.item_dim, generator=g)
    sparse_ids = torch.randint(0, cfg.sparse_rows, (b, cfg.sparse_fields, cfg.sparse_hot),
                               generator=g)
    dense = torch.randn(b, cfg.dense_dim, generator=g)
    labels = (torch.rand(b, len(HEADS), generator=g) < 0.3).float()
    return types, items, times, request_time, candidate, sparse_ids, dense, labels


def build(preset: str = "tiny", batch_size: int | None = None, seed: int = 0) -> ModelSpec:
    """TransAct inside a Pinnability-style ranker at ``preset`` ("tiny" or "h200")."""
    cfg = PRESETS[preset]
    if batch_size is not None:
        cfg = replace(cfg, batch_size=batch_size)
    torch.manual_seed(seed)
    model = Pinnability(cfg)

    def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        with torch.device("cpu"):  # data is made on the CPU, then moved
            return tuple(t.to(device) for t in synthetic_batch(cfg, step, seed))

    info = {"preset": preset, "model": "transact", "batch_size": cfg.batch_size,
            "tasks": list(HEADS), "max_len": cfg.seq_len}
    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=cfg.batch_size, info=info)
