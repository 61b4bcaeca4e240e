"""GEM reference model: sparse bags + a jagged user history through InterFormer and Wukong.

This is the model a recommendation engineer would write in plain PyTorch, with nothing
gemc-specific in it: gemc must find the structure (embedding tables, jagged attention,
interaction layers) by itself. The entrypoint is ``build(**kwargs) -> gemc.spec.ModelSpec``;
``gemc compile examples/gem/model.py:build --set preset=h200`` compiles it.

Architecture (one training step, ``forward(*inputs) -> loss``)
---------------------------------------------------------------
1. **Sparse features.** One ``nn.EmbeddingBag(rows, dim, mode, include_last_offset=True)``
   per feature (multi-hot, jagged bags). Tables have Zipf-like row counts, dims from a short
   cycle and pooling factors from 1 to 30. Each pooled embedding is projected to the common
   token width ``d_model`` by its *own* weight; tables of equal ``dim`` share one batched
   projection (``GroupedProjection``), so the graph has a few einsums, not one per table.
2. **Dense features** through an MLP into ``num_dense_tokens`` tokens.
3. **Wukong interaction stack** over the non-sequence tokens (dense + sparse). Each layer
   concatenates a factorization-machine block (low-rank ``X (X^T Y)``, flattened, through an
   MLP) with a linear compression block (a linear map over the token axis), adds a residual
   (projected over the token axis when the token count changes) and applies LayerNorm. The
   first layer also compresses the ~num_tables tokens down to ``fm_tokens + lc_tokens``.
4. **User history.** Item ids (values + offsets) through ``nn.Embedding`` and a projection,
   plus a position embedding, padded to ``[B, history_len, d_model]`` with ``index_put``.
5. **InterFormer blocks** (bidirectional sequence <-> non-sequence interaction): the sequence
   gets a summary of the non-sequence tokens added, then pre-LN self-attention with a
   key-padding mask + Linear-GELU-Linear MLP; the non-sequence tokens cross-attend to the
   sequence through the same keys/values, then their own MLP. All with residuals.
6. **Heads.** CTR and CVR MLPs over [flattened non-sequence tokens, masked-mean sequence
   summary]; ``loss = BCE(ctr) + BCE(cvr)`` (sum of two batch means).

Empty histories (length 0). The attention mask is ``arange(L)[None, :] < attn_len[:, None]``
with ``attn_len = lengths.clamp(min=1)``: a row with no history attends to its zero padding
slot 0 instead of to nothing (softmax over an all-masked row is NaN on some attention
backends). Every output read from such a row is then multiplied by ``has_hist = lengths > 0``,
so an empty history contributes exactly 0 -- the same answer a jagged attention kernel gives
for a row with no keys. Positions at or past a row's length are never read.

Input layout (a flat tuple; ``T = num_tables``)
-----------------------------------------------
========================  ==================  =======  =========================================
index                     name                dtype    shape
========================  ==================  =======  =========================================
0                         dense               float32  [B, num_dense]
1 + 2t  (t < T)           ids_t               int64    [B * pooling_t]   (all ids of feature t)
2 + 2t  (t < T)           offsets_t           int64    [B + 1]  (offsets_t[-1] == nnz_t)
1 + 2T                    seq_ids             int64    [N], N = B * round(history_len * fill)
2 + 2T                    seq_offsets         int64    [B + 1], every length <= history_len
3 + 2T                    labels              float32  [B, 2]  (CTR, CVR)
========================  ==================  =======  =========================================

Sparse features are interleaved (ids_t, offsets_t) so each feature is one self-contained
jagged tensor. nnz is fixed per feature (``B * pooling_t``); ``make_batch`` draws jagged
lengths (with forced empty rows) that sum exactly to it, so every batch has the shapes of
``example_inputs``.

Presets (``--set preset=...``)
------------------------------
``tiny``  -- CPU tests: 8 tables, B=32, history 16, d_model 32; a fwd+bwd step takes ~20 ms
    on one CPU core.
``h200``  -- one H200 in bf16 autocast. 100 tables with 1e5..4e6 rows (Zipf-like: a few large
    tables, most at the 1e5 floor; 1.7e7 rows, 1.32e9 parameters), dims 64/96/128, pooling
    1..30 (936 ids per sample), B=4096, history 256 with 50% mean fill, d_model 256, 2
    InterFormer blocks of 4 heads (MLP ratio 2), 3 Wukong layers (rank 24, 32 tokens, hidden
    1024), head MLPs 2048-1024; 6.1e7 dense parameters. FLOPs (matmul + attention, checked
    against ``torch.utils.flop_counter`` on meta to <0.1%): 3.6 TFLOP forward, 10.7 TFLOP
    fwd+bwd, ~80% of it in the two sequence blocks over the padded [4096, 256, 256]
    sequence -> ~21 ms at 500 TFLOP/s effective bf16 (half the H200's 989 dense peak).
    Memory-bound work adds ~20 ms: a dense Adam update over 1.5e9 parameters (28 B/param,
    42 GB of traffic, ~9 ms at 4.8 TB/s), LayerNorm/GELU/residual passes over the [B, L, d]
    activations (~8 ms), grad zeroing and bag lookups. Step: ~40-50 ms. Memory: parameters
    1.51e9 x 16 B (fp32 weight, dense grad, Adam m and v) = 24 GB; saved activations ~22 GB
    (~30 B per element of each [B, L, d] block tensor under autocast, ~8 GB per block, plus
    the input stage, pooling, ~2 GB for Wukong and ~1 GB for the heads); total ~46 GB,
    within the 60 GB budget with ~14 GB for workspace and allocator slack. A TorchRec-style fused row-wise optimizer for the tables (no dense table
    grads) would bring it to ~25 GB. ``info['est_*']`` repeats this arithmetic from the config.
``gem-xl`` -- GEM scale, compile-only on meta: 1000 tables totalling 1.5e10 rows (2e9 down to
    2e6, Zipf 1/rank) plus a 1e9-row item table, 2.25e12 embedding parameters, 1.6e9 dense
    parameters (mostly the Wukong FM MLPs and the heads, which is where Wukong puts its
    scaling), B=256 per rank (a global batch of 1M samples on 4096 GPUs: at B=4096 per
    rank the saved activations alone would be ~1.3 TB per GPU), history 1024 at 50% fill, d_model 1024, 4 InterFormer blocks of 16
    heads, 4 Wukong layers; ~0.1 PFLOP per fwd+bwd step on each rank. Its size is chosen to exercise the planner (table sharding across hosts,
    FSDP of the dense part), not to run on one machine.

Any config field can be overridden with ``--set field=value`` (e.g. ``--set history_len=512``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class TableConfig:
    """One sparse feature's embedding table."""

    name: str
    rows: int
    dim: int
    pooling: int  # mean ids per bag; nnz per batch is batch_size * pooling
    mode: str  # EmbeddingBag pooling: "sum" or "mean"


@dataclass(frozen=True)
class GemConfig:
    """Every size of the model; presets are instances of this."""

    batch_size: int
    num_dense: int
    dense_hidden: int
    num_dense_tokens: int
    # sparse tables: rows_t = max(rows_min, rows_max / (t + 1) ** rows_zipf)
    num_tables: int
    rows_max: int
    rows_min: int
    rows_zipf: float
    dims: tuple[int, ...]  # cycled over tables
    poolings: tuple[int, ...]  # cycled over tables, not in step with dims
    empty_frac: float  # fraction of rows whose bag is empty in make_batch (missing feature)
    # user history
    item_rows: int
    item_dim: int
    history_len: int  # Lmax: the padded length of the sequence
    history_fill: float  # mean length / Lmax
    # InterFormer
    d_model: int
    num_heads: int
    num_blocks: int
    mlp_ratio: int
    # Wukong
    wukong_layers: int
    wukong_rank: int  # k of the low-rank FM: X (X^T Y), Y is [n, k]
    fm_tokens: int
    lc_tokens: int
    wukong_hidden: int
    # task heads
    head_hidden: tuple[int, ...]

    def tables(self) -> list[TableConfig]:
        """The per-feature tables, largest first (deterministic in the config)."""
        out = []
        for t in range(self.num_tables):
            rows = max(self.rows_min, int(self.rows_max / (t + 1) ** self.rows_zipf))
            out.append(
                TableConfig(
                    name=f"f{t:04d}",
                    rows=rows,
                    dim=self.dims[t % len(self.dims)],
                    # shifted every len(dims) tables so every dim meets every pooling
                    pooling=self.poolings[(3 * t + t // len(self.dims)) % len(self.poolings)],
                    mode="mean" if t % 3 == 2 else "sum",
                )
            )
        return out

    @property
    def history_nnz_per_row(self) -> int:
        """Mean history length; N = batch_size * this."""
        return max(1, round(self.history_len * self.history_fill))


_POOLINGS = (1, 2, 4, 8, 16, 30, 3, 12, 6, 20)

PRESETS: dict[str, GemConfig] = {
    "tiny": GemConfig(
        batch_size=32, num_dense=8, dense_hidden=32, num_dense_tokens=2,
        num_tables=8, rows_max=2000, rows_min=100, rows_zipf=1.0, dims=(8, 16, 16, 32),
        poolings=(1, 2, 4, 8, 3, 6), empty_frac=0.1,
        item_rows=1000, item_dim=16, history_len=16, history_fill=0.5,
        d_model=32, num_heads=2, num_blocks=2, mlp_ratio=2,
        wukong_layers=2, wukong_rank=4, fm_tokens=4, lc_tokens=4, wukong_hidden=64,
        head_hidden=(64,),
    ),
    "h200": GemConfig(
        batch_size=4096, num_dense=256, dense_hidden=1024, num_dense_tokens=4,
        num_tables=100, rows_max=4_000_000, rows_min=100_000, rows_zipf=1.5,
        dims=(64, 64, 96, 64, 128), poolings=_POOLINGS, empty_frac=0.05,
        item_rows=1_000_000, item_dim=128, history_len=256, history_fill=0.5,
        d_model=256, num_heads=4, num_blocks=2, mlp_ratio=2,
        wukong_layers=3, wukong_rank=24, fm_tokens=16, lc_tokens=16, wukong_hidden=1024,
        head_hidden=(2048, 1024),
    ),
    "gem-xl": GemConfig(
        batch_size=256, num_dense=1024, dense_hidden=4096, num_dense_tokens=24,
        num_tables=1000, rows_max=2_000_000_000, rows_min=1_000_000, rows_zipf=1.0,
        dims=(64, 128, 128, 256), poolings=_POOLINGS, empty_frac=0.05,
        item_rows=1_000_000_000, item_dim=256, history_len=1024, history_fill=0.5,
        d_model=1024, num_heads=16, num_blocks=4, mlp_ratio=4,
        wukong_layers=4, wukong_rank=32, fm_tokens=32, lc_tokens=32, wukong_hidden=4096,
        head_hidden=(4096, 1024),
    ),
}

# ----------------------------------------------------------------------------- modules


def mlp(dims: list[int], *, last_act: bool = False) -> nn.Sequential:
    """Linear-GELU-...-Linear; the activation after the last layer only if asked."""
    layers: list[nn.Module] = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2 or last_act:
            layers.append(nn.GELU())
    return nn.Sequential(*layers)


class GroupedProjection(nn.Module):
    """Per-table projections of equal-dim pooled embeddings to d_model, as one einsum.

    ``weight[t]`` is table t's own ``[dim, d_model]`` matrix: the same math as one
    ``nn.Linear`` per table, but one op in the graph instead of hundreds.
    """

    def __init__(self, num: int, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim_in, dim_out))
        self.bias = nn.Parameter(torch.empty(num, dim_out))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default init, per table (the runner calls this after ``to_empty``)."""
        bound = 1.0 / math.sqrt(self.weight.shape[1])
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, num, dim_in] -> [B, num, dim_out]
        return torch.einsum("btk,tkd->btd", x, self.weight) + self.bias


class WukongLayer(nn.Module):
    """One Wukong layer: [FM block ; linear compression block] + residual, then LayerNorm."""

    def __init__(self, n_in: int, d: int, rank: int, n_fm: int, n_lc: int, hidden: int) -> None:
        super().__init__()
        self.n_fm = n_fm
        # Low-rank FM: X (X^T Y) with Y [n_in, rank] -- the token-axis Linear is Y.
        self.fm_proj = nn.Linear(n_in, rank, bias=False)
        self.fm_norm = nn.LayerNorm(n_in * rank)
        self.fm_mlp = mlp([n_in * rank, hidden, n_fm * d])
        self.lcb = nn.Linear(n_in, n_lc, bias=False)  # linear compression over tokens
        n_out = n_fm + n_lc
        self.res_proj = nn.Linear(n_in, n_out, bias=False) if n_in != n_out else None
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, d = x.shape
        xt = x.transpose(1, 2)  # [B, d, n_in]
        fm = torch.bmm(x, self.fm_proj(xt))  # [B, n_in, rank]: pairwise dots, compressed
        fm = self.fm_mlp(self.fm_norm(fm.flatten(1))).view(b, self.n_fm, d)
        lc = self.lcb(xt).transpose(1, 2)  # [B, n_lc, d]
        res = x if self.res_proj is None else self.res_proj(xt).transpose(1, 2)
        return self.norm(torch.cat([fm, lc], dim=1) + res)


class InterFormerBlock(nn.Module):
    """Sequence self-attention + MLP, with interaction both ways with the non-seq tokens."""

    def __init__(self, d: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.heads = heads
        self.ns_to_seq = nn.Linear(d, d)  # non-seq summary -> added to every position
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = mlp([d, mlp_ratio * d, d])
        self.norm_ns = nn.LayerNorm(d)
        self.q_ns = nn.Linear(d, d)
        self.out_ns = nn.Linear(d, d)
        self.norm_ns2 = nn.LayerNorm(d)
        self.mlp_ns = mlp([d, mlp_ratio * d, d])

    def forward(
        self, seq: torch.Tensor, ns: torch.Tensor, mask: torch.Tensor, has_hist: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, seq_len, d = seq.shape
        n = ns.shape[1]
        h = self.heads
        # non-seq -> seq: every position sees a summary of the user's other features
        seq = seq + self.ns_to_seq(ns.mean(dim=1))[:, None, :]
        qkv = self.qkv(self.norm1(seq)).view(b, seq_len, 3, h, d // h).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # [B, H, L, dh]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        seq = seq + self.out(a.transpose(1, 2).reshape(b, seq_len, d))
        seq = seq + self.mlp(self.norm2(seq))
        # seq -> non-seq: the non-seq tokens read the history through this block's keys/values
        qn = self.q_ns(self.norm_ns(ns)).view(b, n, h, d // h).transpose(1, 2)
        c = F.scaled_dot_product_attention(qn, k, v, attn_mask=mask[:, None, None, :])
        ns = ns + self.out_ns(c.transpose(1, 2).reshape(b, n, d)) * has_hist
        ns = ns + self.mlp_ns(self.norm_ns2(ns))
        return seq, ns


class GemModel(nn.Module):
    """The GEM-family model; ``forward(*inputs)`` returns the training loss (see module doc)."""

    def __init__(self, cfg: GemConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.tables = cfg.tables()
        self.bags = nn.ModuleList(
            nn.EmbeddingBag(t.rows, t.dim, mode=t.mode, include_last_offset=True)
            for t in self.tables
        )
        # tables grouped by dim, each group projected by one GroupedProjection
        self.group_dims = sorted({t.dim for t in self.tables})
        self.groups = [[i for i, t in enumerate(self.tables) if t.dim == g] for g in self.group_dims]
        self.proj = nn.ModuleList(
            GroupedProjection(len(idx), g, d) for g, idx in zip(self.group_dims, self.groups)
        )
        self.dense_mlp = mlp([cfg.num_dense, cfg.dense_hidden, cfg.num_dense_tokens * d])
        n = cfg.num_tables + cfg.num_dense_tokens
        layers = []
        for _ in range(cfg.wukong_layers):
            layers.append(
                WukongLayer(n, d, cfg.wukong_rank, cfg.fm_tokens, cfg.lc_tokens, cfg.wukong_hidden)
            )
            n = cfg.fm_tokens + cfg.lc_tokens
        self.wukong = nn.ModuleList(layers)
        self.num_ns_tokens = n
        self.item_emb = nn.Embedding(cfg.item_rows, cfg.item_dim)
        self.item_proj = nn.Linear(cfg.item_dim, d)
        self.pos_emb = nn.Embedding(cfg.history_len, d)
        self.blocks = nn.ModuleList(
            InterFormerBlock(d, cfg.num_heads, cfg.mlp_ratio) for _ in range(cfg.num_blocks)
        )
        self.seq_norm = nn.LayerNorm(d)
        head_in = n * d + d
        self.ctr_head = mlp([head_in, *cfg.head_hidden, 1])
        self.cvr_head = mlp([head_in, *cfg.head_hidden, 1])

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        num_t = len(self.bags)
        if len(inputs) != 4 + 2 * num_t:
            raise ValueError(f"expected {4 + 2 * num_t} inputs (see module doc), got {len(inputs)}")
        dense = inputs[0]
        seq_ids, seq_offsets, labels = inputs[1 + 2 * num_t :]
        b = dense.shape[0]
        d = cfg.d_model
        dev = dense.device

        # --- non-sequence tokens: pooled bags projected per table, plus dense tokens
        pooled = [bag(inputs[1 + 2 * t], inputs[2 + 2 * t]) for t, bag in enumerate(self.bags)]
        tokens = [self.dense_mlp(dense).view(b, cfg.num_dense_tokens, d)]
        for proj, idx in zip(self.proj, self.groups):
            tokens.append(proj(torch.stack([pooled[i] for i in idx], dim=1)))
        ns = torch.cat(tokens, dim=1)  # [B, num_dense_tokens + num_tables, d]
        for layer in self.wukong:
            ns = layer(ns)  # [B, fm_tokens + lc_tokens, d]

        # --- user history: jagged values + offsets -> padded [B, Lmax, d]
        seq_len = cfg.history_len
        n_items = seq_ids.shape[0]
        lengths = seq_offsets[1:] - seq_offsets[:-1]
        row = torch.repeat_interleave(torch.arange(b, device=dev), lengths, output_size=n_items)
        pos = torch.arange(n_items, device=dev) - seq_offsets[row]
        x = self.item_proj(self.item_emb(seq_ids)) + self.pos_emb(pos)
        seq = x.new_zeros(b, seq_len, d).index_put((row, pos), x)
        # key-padding mask; an empty row keeps its (zero) slot 0 -- see module doc
        attn_len = lengths.clamp(min=1)
        mask = torch.arange(seq_len, device=dev)[None, :] < attn_len[:, None]
        has_hist = (lengths > 0).to(seq.dtype)[:, None, None]

        for block in self.blocks:
            seq, ns = block(seq, ns, mask, has_hist)

        # masked mean over the real positions; exactly 0 for an empty history
        seq = self.seq_norm(seq) * mask[:, :, None].to(seq.dtype)
        summary = seq.sum(dim=1) / attn_len[:, None].to(seq.dtype) * has_hist[:, :, 0]

        feat = torch.cat([ns.flatten(1), summary], dim=1)
        ctr = self.ctr_head(feat).squeeze(-1)
        cvr = self.cvr_head(feat).squeeze(-1)
        return F.binary_cross_entropy_with_logits(
            ctr, labels[:, 0]
        ) + F.binary_cross_entropy_with_logits(cvr, labels[:, 1])


# ----------------------------------------------------------------------------- synthetic data


def jagged_lengths(
    g: torch.Generator, rows: int, nnz: int, empty_frac: float, cap: int | None = None
) -> torch.Tensor:
    """Row lengths summing exactly to ``nnz``, with forced empty rows and a skewed spread.

    A fixed number of rows (at least one) is empty, as when a feature is missing for some
    users. The others share ``nnz`` in proportion to lognormal weights, so lengths are
    heavy-tailed like real bags and histories; ``cap`` (the history's Lmax) is enforced by
    water-filling (the excess of capped rows goes to the others, by weight). The shares are
    rounded down and the remainder goes, one each, to rows drawn by their fractional parts.
    O(rows), not O(nnz): a multinomial draw per id took seconds at B=65536.
    """
    n_empty = min(rows - 1, max(1, round(rows * empty_frac)))
    limit = nnz if cap is None else cap
    if nnz > limit * (rows - n_empty):
        raise ValueError(f"cannot fit {nnz} items into {rows - n_empty} rows of <= {limit}")
    weights = torch.exp(torch.randn(rows, generator=g, dtype=torch.float64))
    weights[torch.randperm(rows, generator=g)[:n_empty]] = 0.0
    share = weights * (nnz / weights.sum())
    for _ in range(100):  # water-filling; a few rounds suffice
        over = share > limit
        if not over.any():
            break
        excess = float((share[over] - limit).sum())
        share[over] = float(limit)
        free = (share < limit) & (weights > 0)
        share[free] += excess * weights[free] / weights[free].sum()
    lengths = share.floor().long().clamp_(max=limit)
    frac = share - lengths
    rest = nnz - int(lengths.sum())
    while rest != 0:  # |rest| < rows; float rounding can leave it either side of 0
        ok = ((lengths < limit) if rest > 0 else (lengths > 0)) & (weights > 0)
        p = torch.where(ok, (frac if rest > 0 else 1 - frac) + 1e-6, 0.0)
        k = min(abs(rest), int(ok.sum()))
        pick = torch.multinomial(p, k, replacement=False, generator=g)
        lengths[pick] += 1 if rest > 0 else -1
        frac[pick] = 0.0
        rest -= k if rest > 0 else -k
    return lengths


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


def _skewed_ids(g: torch.Generator, rows: int, n: int) -> torch.Tensor:
    """Ids in [0, rows) with a hot head: ``rows * u**3`` puts ~46% of draws in the first 10%
    of rows, as real categorical features have. float32 is exact enough below 2**24 rows and
    ~1.6x faster than float64 (make_batch draws ~1e7 ids per step at the h200 presets)."""
    dtype = torch.float32 if rows <= 2**24 else torch.float64
    u = torch.rand(n, generator=g, dtype=dtype)
    return u.pow_(3).mul_(rows).long().clamp_(max=rows - 1)


def make_batch_fn(cfg: GemConfig, seed: int) -> Any:
    """The spec's ``make_batch(step, device)``: real data drawn on CPU from (seed, step)."""
    tables = cfg.tables()
    b = cfg.batch_size

    def make_batch(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step)
        dense = torch.randn(b, cfg.num_dense, generator=g)
        sparse: list[torch.Tensor] = []
        for t in tables:
            lengths = jagged_lengths(g, b, b * t.pooling, cfg.empty_frac)
            sparse += [_skewed_ids(g, t.rows, b * t.pooling), _offsets(lengths)]
        n_items = b * cfg.history_nnz_per_row
        lengths = jagged_lengths(g, b, n_items, max(cfg.empty_frac, 0.05), cap=cfg.history_len)
        seq_ids = _skewed_ids(g, cfg.item_rows, n_items)
        click = (torch.rand(b, generator=g) < 0.2).float()
        convert = click * (torch.rand(b, generator=g) < 0.3).float()
        labels = torch.stack([click, convert], dim=1)
        batch = (dense, *sparse, seq_ids, _offsets(lengths), labels)
        return tuple(x.to(device) for x in batch)

    return make_batch


def example_inputs_for(cfg: GemConfig) -> tuple[torch.Tensor, ...]:
    """A representative batch on the *default* device (meta when gemc compiles).

    No generator (meta has none): ids are 0 and bags/histories have uniform lengths, so on a
    real device these inputs are also valid to run.
    """
    b = cfg.batch_size
    out: list[torch.Tensor] = [torch.zeros(b, cfg.num_dense)]
    for t in cfg.tables():
        out += [
            torch.zeros(b * t.pooling, dtype=torch.long),
            torch.arange(b + 1, dtype=torch.long) * t.pooling,
        ]
    per_row = cfg.history_nnz_per_row
    out += [
        torch.zeros(b * per_row, dtype=torch.long),
        torch.arange(b + 1, dtype=torch.long) * per_row,
        torch.zeros(b, 2),
    ]
    return tuple(out)


# ----------------------------------------------------------------------------- estimates


def estimate(cfg: GemConfig, embedding_params: int, dense_params: int) -> dict[str, float]:
    """Analytic step FLOPs (fwd+bwd = 3x fwd matmul/attention FLOPs) and H200 memory.

    Memory assumes fp32 weights, dense grads and Adam (16 B/param) and bf16 autocast
    activations: 22 + 4 * mlp_ratio bytes saved per element of each [B, L, d] tensor in a
    sequence block (LayerNorm inputs in fp32 4+4, their bf16 casts 2+2, qkv 6, attention
    output and its reshaped copy 2+2, MLP hidden and GELU output 2 * mlp_ratio * 2) plus 12 B
    for the input stage and the final masked pooling; ~12 B per element of each Wukong
    layer's input tokens and 8 B per head-MLP activation. The per-module split was checked
    against the saved tensors of a meta fwd in fp32 (autograd saved-tensor hooks).
    """
    b, seq_len, d, r = cfg.batch_size, cfg.history_len, cfg.d_model, cfg.mlp_ratio
    tok = b * seq_len
    n_items = b * cfg.history_nnz_per_row
    tables = cfg.tables()
    fwd = 2 * b * sum(t.dim for t in tables) * d  # per-table projections
    fwd += 2 * b * (cfg.num_dense * cfg.dense_hidden + cfg.dense_hidden * cfg.num_dense_tokens * d)
    n = cfg.num_tables + cfg.num_dense_tokens
    wukong_tokens_in = 0
    for _ in range(cfg.wukong_layers):
        n_out = cfg.fm_tokens + cfg.lc_tokens
        wukong_tokens_in += n
        fwd += 2 * b * d * n * cfg.wukong_rank * 2  # X^T Y and X (X^T Y)
        fwd += 2 * b * (n * cfg.wukong_rank * cfg.wukong_hidden + cfg.wukong_hidden * cfg.fm_tokens * d)
        fwd += 2 * b * d * n * (cfg.lc_tokens + (n_out if n != n_out else 0))
        n = n_out
    fwd += 2 * n_items * cfg.item_dim * d
    per_block = 2 * tok * (4 * d * d + 2 * r * d * d) + 4 * b * seq_len * seq_len * d
    per_block += 2 * b * d * d + 2 * b * n * (2 * d * d + 2 * r * d * d) + 4 * b * n * seq_len * d
    fwd += cfg.num_blocks * per_block
    head_dims = [n * d + d, *cfg.head_hidden, 1]
    fwd += 2 * 2 * b * sum(x * y for x, y in zip(head_dims, head_dims[1:]))
    act_bytes = cfg.num_blocks * tok * d * (22 + 4 * r) + tok * d * 12
    act_bytes += 12 * b * d * wukong_tokens_in + 8 * b * 2 * sum(head_dims[1:] + head_dims[:1])
    state_bytes = 16 * (embedding_params + dense_params)
    return {
        "est_fwd_flops": float(fwd),
        "est_step_flops": float(3 * fwd),
        "est_activation_gb": act_bytes / 1e9,
        "est_memory_gb": (act_bytes + state_bytes) / 1e9,
    }


# ----------------------------------------------------------------------------- entrypoint


def resolve_config(preset: str, batch_size: int | None, overrides: dict[str, Any]) -> GemConfig:
    """The preset with ``batch_size`` and any ``--set field=value`` applied, validated."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    cfg = PRESETS[preset]
    names = {f.name for f in fields(GemConfig)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(
            f"unknown GEM option(s) {', '.join(unknown)}; valid: preset, seed, {', '.join(sorted(names))}"
        )
    if batch_size is not None:
        overrides = {**overrides, "batch_size": batch_size}
    cfg = replace(cfg, **overrides)
    if cfg.batch_size < 2:
        raise ValueError(f"batch_size must be >= 2, got {cfg.batch_size}")
    if cfg.d_model % cfg.num_heads:
        raise ValueError(f"d_model {cfg.d_model} is not divisible by num_heads {cfg.num_heads}")
    if not 0 < cfg.history_fill <= 0.9:
        raise ValueError(f"history_fill must be in (0, 0.9], got {cfg.history_fill}")
    return cfg


def build(
    preset: str = "tiny", batch_size: int | None = None, seed: int = 0, **overrides: Any
) -> ModelSpec:
    """Build the GEM model, a representative batch and a synthetic data source.

    Called by gemc under ``torch.device("meta")``: everything here follows the default
    device, so a GEM-scale model costs no memory until the runner materializes it.
    ``info['embedding_params']`` counts the bag tables and the item table; the small
    position table (an ``nn.Embedding`` of history_len rows, every row trained every step)
    counts as dense.
    """
    cfg = resolve_config(preset, batch_size, overrides)
    torch.manual_seed(seed)  # parameter init (a no-op on meta)
    model = GemModel(cfg)
    tables = model.tables
    emb_params = sum(p.numel() for p in model.bags.parameters()) + model.item_emb.weight.numel()
    dense_params = sum(p.numel() for p in model.parameters()) - emb_params
    info: dict[str, Any] = {
        "model": "gem",
        "preset": preset,
        "batch_size": cfg.batch_size,
        "seed": seed,
        "num_tables": len(tables),
        "total_rows": sum(t.rows for t in tables),
        "item_rows": cfg.item_rows,
        "embedding_params": emb_params,
        "dense_params": dense_params,
        "history_len": cfg.history_len,
        "mean_fill": cfg.history_nnz_per_row / cfg.history_len,
        "mean_pooling": sum(t.pooling for t in tables) / len(tables),
        "d_model": cfg.d_model,
        "num_blocks": cfg.num_blocks,
        "wukong_layers": cfg.wukong_layers,
        "input_layout": "dense, (ids_t, offsets_t) for each table, seq_ids, seq_offsets, labels",
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()},
    }
    info.update(estimate(cfg, emb_params, dense_params))
    return ModelSpec(
        model=model,
        example_inputs=example_inputs_for(cfg),
        make_batch=make_batch_fn(cfg, seed),
        info=info,
        batch_size=cfg.batch_size,
    )
