"""HSTU: Hierarchical Sequential Transduction Units (Zhai et al., ICML 2024).

Follows "Actions Speak Louder than Words: Trillion-Parameter Sequential Transducers for
Generative Recommendations" and the layout of its public code (facebookresearch/
generative-recommenders): a user's history is a *jagged* tensor, the token values ``x``
``[N, D]`` with ``x_offsets`` ``[B + 1]``; each layer is a ``SequentialTransductionUnitJagged``
that projects the layer-normed tokens with one fused ``_uvqk`` weight (an ``nn.Parameter``
drawn with ``nn.init.normal_`` in ``__init__``), ``silu`` on it, splits U, V, Q, K, pads Q, K,
V to ``[B, n, H, d]`` for the attention, and computes **pointwise** attention

    A = silu(Q K^T + rab(pos, time)) / n * causal_mask         (no softmax)
    y = x + O(U * layer_norm(A V))                             (U-gating)

with ``rab`` a relative bias learned per position distance and per log-bucketed time
distance (``RelativeBucketedTimeAndPositionBasedBias`` in the paper's code: buckets
``floor(log(|dt|) / 0.301)``). The causal mask is a lower-triangular float matrix multiplied
into the attention weights, as the authors do. Padded keys contribute nothing because the
padded V is zero there. Plain PyTorch stands in for FBGEMM's ``jagged_to_padded_dense`` /
``dense_to_jagged`` (``index_put`` / advanced indexing with positions built by
``repeat_interleave(..., output_size=N)``).

Training objective (the paper's autoregressive next-item loss with sampled softmax):
every token predicts the next item of its sequence; logits are cosine similarities / 0.05
between the l2-normalised output and the l2-normalised embeddings of the target and of
``num_negatives`` sampled items shared by the batch; CE with the target in column 0,
averaged over the tokens that have a next item (``supervision_weights``).

Idioms carried (issue #15): jagged input as values + offsets (``seq_ids``, ``seq_offsets``,
``seq_timestamps`` aligned with ``seq_ids``); parameters made in ``__init__`` without
``reset_parameters`` (``_uvqk``, the bias tables ``_ts_w``/``_pos_w``); ``nn.Embedding(...,
padding_idx=0)`` for items (as the authors' ``LocalEmbeddingModule``); a float
multiplicative causal mask; example inputs built with ``device="cpu"``.

Input layout: ``seq_ids`` int64 [N]; ``seq_offsets`` int64 [B + 1]; ``seq_timestamps`` int64
[N] (seconds, increasing within a sequence); ``target_ids`` int64 [N] (next item, 0 at a
sequence's last token); ``supervision_weights`` f32 [N]; ``negatives`` int64 [R].
``N = B * max_seq_len * fill`` is fixed; lengths vary per row (some empty, some full).

Presets
-------
``tiny``: B=8, n=8, D=16, 2 heads, 2 layers, 200 items; 6,000 parameters.
``h200``: B=128, n=512 (50% fill: N=32,768 tokens), D=512, 4 heads of 128, 8 layers, 1,000,000
    items, R=1024 negatives. Parameters: 512,000,512 (item table) + 8 x (1,048,576 uvqk + 2,048
    uvqk bias + 262,656 O + 1,152 bias tables) = 522,515,968. Measured
    (``torch.utils.flop_counter`` on meta, matmuls and attention only): 1.271 TFLOP forward,
    3.814 TFLOP forward + backward. FLOP/step (fwd+bwd = 3 x fwd): per layer fwd 2*N*D*(4D)
    (uvqk) + 2*N*D*D (O) + 4*B*H*n*n*d (QK^T and AV, padded) = 86 + 17 + 69 GFLOP; x 8 layers x
    3 = 4.1 TFLOP, plus the loss ~0.1 TFLOP -> ~9 ms of matmul at 500 TFLOP/s; the pointwise
    work on the [B, H, n, n] attention (134M elements per layer: bias add, silu, scale, mask,
    and their backward) brings the step to a few tens of ms. Memory: 525M params x 16 B
    (weights, grads, Adam) = 8.4 GB; saved activations ~2.5 GB per layer (a few [B, H, n, n]
    tensors in bf16 and the int64 time buckets) -> ~20 GB; total ~30 GB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec


@dataclass(frozen=True)
class Config:
    batch_size: int
    max_seq_len: int
    fill: float
    num_items: int
    embedding_dim: int
    num_heads: int
    attention_dim: int  # per head, Q and K
    linear_dim: int  # per head, U and V
    num_blocks: int
    num_time_buckets: int
    num_negatives: int

    @property
    def num_tokens(self) -> int:
        return round(self.batch_size * self.max_seq_len * self.fill)


PRESETS = {
    "tiny": Config(8, 8, 0.5, 200, 16, 2, 8, 8, 2, 16, 16),
    "h200": Config(128, 512, 0.5, 1_000_000, 512, 4, 128, 128, 8, 128, 1024),
}


def jagged_to_padded_dense(values: torch.Tensor, row: torch.Tensor, col: torch.Tensor,
                           batch: int, n: int) -> torch.Tensor:
    """``[N, D]`` jagged values -> ``[B, n, D]``, zeros past each row's length."""
    out = values.new_zeros(batch, n, values.size(-1))
    return out.index_put((row, col), values)


def dense_to_jagged(padded: torch.Tensor, row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """``[B, n, D]`` -> the ``[N, D]`` values at the jagged positions."""
    return padded[row, col]


class RelativeBucketedTimeAndPositionBasedBias(nn.Module):
    """rab(i, j) = w_pos[j - i] + w_ts[bucket(t_i - t_j)], one bias for all heads."""

    def __init__(self, max_seq_len: int, num_buckets: int) -> None:
        super().__init__()
        self._max_seq_len = max_seq_len
        self._num_buckets = num_buckets
        self._ts_w = nn.Parameter(torch.empty(num_buckets + 1).normal_(mean=0, std=0.02))
        self._pos_w = nn.Parameter(torch.empty(2 * max_seq_len - 1).normal_(mean=0, std=0.02))

    def forward(self, all_timestamps: torch.Tensor) -> torch.Tensor:
        n = all_timestamps.size(1)
        idx = torch.arange(n, device=all_timestamps.device)
        rel_pos = idx[None, :] - idx[:, None] + (self._max_seq_len - 1)
        rel_pos_bias = self._pos_w[rel_pos]  # [n, n]
        dt = all_timestamps[:, :, None] - all_timestamps[:, None, :]
        buckets = (torch.log(dt.abs().clamp(min=1).float()) / 0.301).long()
        buckets = torch.clamp(buckets, min=0, max=self._num_buckets)
        rel_ts_bias = torch.index_select(self._ts_w, 0, buckets.view(-1)).view(dt.shape)
        return rel_pos_bias.unsqueeze(0) + rel_ts_bias  # [B, n, n]


class SequentialTransductionUnitJagged(nn.Module):
    def __init__(self, embedding_dim: int, linear_hidden_dim: int, attention_dim: int,
                 num_heads: int, max_seq_len: int, num_buckets: int,
                 dropout_ratio: float = 0.0, epsilon: float = 1e-6) -> None:
        super().__init__()
        self._embedding_dim = embedding_dim
        self._linear_dim = linear_hidden_dim
        self._attention_dim = attention_dim
        self._num_heads = num_heads
        self._eps = epsilon
        self._rel_attn_bias = RelativeBucketedTimeAndPositionBasedBias(max_seq_len, num_buckets)
        self._uvqk = nn.Parameter(torch.empty(
            embedding_dim, linear_hidden_dim * 2 * num_heads + attention_dim * 2 * num_heads))
        nn.init.normal_(self._uvqk, mean=0, std=0.02)
        self._uvqk_bias = nn.Parameter(torch.zeros(
            linear_hidden_dim * 2 * num_heads + attention_dim * 2 * num_heads))
        self._o = nn.Linear(linear_hidden_dim * num_heads, embedding_dim)
        nn.init.xavier_uniform_(self._o.weight)
        self._dropout_ratio = dropout_ratio

    def _norm_input(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, normalized_shape=[self._embedding_dim], eps=self._eps)

    def _norm_attn_output(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, normalized_shape=[self._linear_dim * self._num_heads], eps=self._eps)

    def forward(self, x: torch.Tensor, row: torch.Tensor, col: torch.Tensor, batch: int, n: int,
                all_timestamps: torch.Tensor, invalid_attn_mask: torch.Tensor) -> torch.Tensor:
        normed_x = self._norm_input(x)
        batched_mm_output = torch.addmm(self._uvqk_bias, normed_x, self._uvqk)
        batched_mm_output = F.silu(batched_mm_output)
        h, dv, dqk = self._num_heads, self._linear_dim, self._attention_dim
        u, v, q, k = torch.split(batched_mm_output, [dv * h, dv * h, dqk * h, dqk * h], dim=1)

        padded_q = jagged_to_padded_dense(q, row, col, batch, n).view(batch, n, h, dqk)
        padded_k = jagged_to_padded_dense(k, row, col, batch, n).view(batch, n, h, dqk)
        padded_v = jagged_to_padded_dense(v, row, col, batch, n).view(batch, n, h, dv)
        qk_attn = torch.einsum("bnhd,bmhd->bhnm", padded_q, padded_k)
        qk_attn = qk_attn + self._rel_attn_bias(all_timestamps).unsqueeze(1)
        qk_attn = F.silu(qk_attn) / n
        qk_attn = qk_attn * invalid_attn_mask.unsqueeze(0).unsqueeze(0)
        attn_output = torch.einsum("bhnm,bmhd->bnhd", qk_attn, padded_v)
        attn_output = dense_to_jagged(attn_output.reshape(batch, n, h * dv), row, col)

        o_input = u * self._norm_attn_output(attn_output)
        o_input = F.dropout(o_input, p=self._dropout_ratio, training=self.training)
        return self._o(o_input) + x


class HSTU(nn.Module):
    """Item embeddings -> HSTU layers over the jagged history -> sampled-softmax loss."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self._max_seq_len = cfg.max_seq_len
        self._item_embedding_dim = cfg.embedding_dim
        self._embedding_module = nn.Embedding(cfg.num_items + 1, cfg.embedding_dim, padding_idx=0)
        nn.init.trunc_normal_(self._embedding_module.weight, std=0.02)
        self._attention_layers = nn.ModuleList(
            SequentialTransductionUnitJagged(
                cfg.embedding_dim, cfg.linear_dim, cfg.attention_dim, cfg.num_heads,
                cfg.max_seq_len, cfg.num_time_buckets,
            )
            for _ in range(cfg.num_blocks)
        )
        self._temperature = 0.05

    def forward(self, seq_ids: torch.Tensor, seq_offsets: torch.Tensor,
                seq_timestamps: torch.Tensor, target_ids: torch.Tensor,
                supervision_weights: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
        batch, n, total = seq_offsets.numel() - 1, self._max_seq_len, seq_ids.numel()
        lengths = seq_offsets[1:] - seq_offsets[:-1]
        row = torch.repeat_interleave(
            torch.arange(batch, device=seq_ids.device), lengths, output_size=total)
        col = torch.arange(total, device=seq_ids.device) - seq_offsets[:-1][row]

        x = self._embedding_module(seq_ids) * math.sqrt(self._item_embedding_dim)
        ts = jagged_to_padded_dense(seq_timestamps.unsqueeze(-1), row, col, batch, n).squeeze(-1)
        invalid_attn_mask = torch.tril(torch.ones(n, n, device=x.device))
        for layer in self._attention_layers:
            x = layer(x, row, col, batch, n, ts, invalid_attn_mask)

        out = F.normalize(x, dim=-1)
        pos = F.normalize(self._embedding_module(target_ids), dim=-1)
        neg = F.normalize(self._embedding_module(negatives), dim=-1)
        pos_logits = (out * pos).sum(-1, keepdim=True)
        neg_logits = out @ neg.t()
        logits = torch.cat([pos_logits, neg_logits], dim=1) / self._temperature
        loss = F.cross_entropy(logits, torch.zeros_like(target_ids), reduction="none")
        return (loss * supervision_weights).sum() / supervision_weights.sum().clamp(min=1.0)


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
    lengths = _lengths(g, cfg.batch_size, cfg.max_seq_len, cfg.num_tokens)
    offsets = torch.zeros(cfg.batch_size + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    n = cfg.num_tokens
    ids = torch.randint(1, cfg.num_items + 1, (n,), generator=g)
    gaps = torch.exp(torch.rand(n, generator=g) * 12.0).long()  # 1 s .. 2 days
    row = torch.repeat_interleave(torch.arange(cfg.batch_size), lengths, output_size=n)
    start = torch.cumsum(gaps, 0)
    ts = 1_700_000_000 + start - (start - gaps)[offsets[:-1][row]]  # restart per user
    last = torch.zeros(n, dtype=torch.bool)
    last[offsets[1:][lengths > 0] - 1] = True
    target_ids = torch.where(last, 0, torch.roll(ids, -1))
    weights = (~last).float()
    negatives = torch.randint(1, cfg.num_items + 1, (cfg.num_negatives,), generator=g)
    return tuple(t.to(device) for t in (ids, offsets, ts, target_ids, weights, negatives))


def build(preset: str = "tiny", batch_size: int | None = None, seed: int = 0) -> ModelSpec:
    """HSTU at ``preset`` ("tiny" or "h200")."""
    cfg = PRESETS[preset]
    if batch_size is not None:
        cfg = replace(cfg, batch_size=batch_size)
    torch.manual_seed(seed)
    model = HSTU(cfg)

    def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        with torch.device("cpu"):  # data is made on the CPU, then moved
            return _batch(cfg, step, seed, device)

    info = {"preset": preset, "model": "hstu", "batch_size": cfg.batch_size,
            "max_seq_len": cfg.max_seq_len, "num_tokens": cfg.num_tokens,
            "num_items": cfg.num_items}
    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=cfg.batch_size, info=info)
