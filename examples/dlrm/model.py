"""DLRM / DCNv2 reference model: dense MLP + embedding bags + cross network, one label.

The second model family gemc compiles, so that nothing in gemc is GEM-only: no history
sequence, no attention, one task. Entry point: ``build(**kwargs) -> gemc.spec.ModelSpec``
(``gemc compile examples/dlrm/model.py:build --set preset=h200``). Like the GEM example it is
plain PyTorch and self-contained (the synthetic-data helpers are duplicated on purpose: a
user copies one file).

Architecture (``forward(*inputs) -> loss``)
-------------------------------------------
bottom MLP (Linear-ReLU) over the dense features -> ``[B, D]``; one
``nn.EmbeddingBag(rows, D, mode="sum", include_last_offset=True)`` per sparse feature ->
``[B, D]`` each; then the interaction (``interaction=``):

* ``"dcn"`` (DCNv2, stacked): ``x0 = concat(bottom, pooled...)``, cross layers
  ``x_{l+1} = x0 * (W x_l + b) + x_l`` with ``W = V U`` low rank when ``cross_rank > 0``;
* ``"dot"`` (original DLRM): pairwise dot products of the ``T + 1`` vectors (strict upper
  triangle), concatenated with the bottom output;

then the top MLP to one logit and ``F.binary_cross_entropy_with_logits``.

Input layout (a flat tuple; ``T = num_tables``)
-----------------------------------------------
``0``: dense float32 ``[B, num_dense]``; ``1 + 2t`` / ``2 + 2t`` for ``t < T``: ``ids_t`` int64
``[B * pooling_t]`` and ``offsets_t`` int64 ``[B + 1]`` (interleaved per feature, as in the GEM
example); ``1 + 2T``: labels float32 ``[B, 1]`` (click). ``make_batch`` draws jagged lengths
(with forced empty bags) summing exactly to ``B * pooling_t``, so shapes never change.

Presets
-------
``tiny``  -- CPU tests: 8 tables, D=16, B=32, 2 low-rank cross layers.
``h200``  -- one H200, the MLPerf DLRM-DCNv2 architecture (13 dense features, bottom
    512-256-128, 26 tables of dim 128 with the Criteo-1TB multi-hot pooling factors, 3 cross
    layers of rank 512, top 1024-1024-512-256-1), with the Criteo table sizes capped at 1.5M
    rows (1.0e7 rows, 1.29e9 table parameters, 1.6e7 dense), so that fp32 weights + dense
    grads + Adam (1.31e9 params x 16 B = 21 GB) and the activations (~11 GB at B=65536,
    ~170 KB/sample in fp32) total ~32 GB. FLOPs (checked against torch's FLOP counter on
    meta): 3.2e7 per sample forward, 6.3 TFLOP per fwd+bwd step at B=65536 -> ~13 ms at
    500 TFLOP/s plus ~10 ms of memory-bound Adam and bag traffic: a step of ~20-30 ms.
``dlrmv2`` -- the same with the Criteo rows capped at 40M as MLPerf trains it (204M rows,
    2.6e10 table parameters; several GPUs' worth): the sparse planner's benchmark model.
``xl``    -- compile-only on meta: 1000 tables of dim 128 totalling 1.5e10 rows (Zipf 1/rank
    from 2e9 down to 2e6), x0 width 128,128, 3 rank-512 cross layers and a 4096-wide top MLP:
    9.2e8 dense parameters, B=16384. It exercises table sharding at scale without GEM's sequence part.

Any config field can be overridden with ``--set field=value``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec


@dataclass(frozen=True)
class DlrmConfig:
    """Every size of the model; presets are instances of this."""

    batch_size: int
    num_dense: int
    bottom: tuple[int, ...]  # hidden widths; the last layer outputs emb_dim
    table_rows: tuple[int, ...]  # one entry per table
    emb_dim: int
    poolings: tuple[int, ...]  # cycled over tables
    empty_frac: float
    interaction: str  # "dcn" or "dot"
    cross_layers: int
    cross_rank: int  # 0: full-rank cross layers
    top: tuple[int, ...]  # hidden widths; a final Linear to 1 logit is added

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)

    def pooling(self, t: int) -> int:
        """Mean ids per bag of table ``t`` (nnz per batch = batch_size * pooling)."""
        return self.poolings[t % len(self.poolings)]


def zipf_rows(num: int, rows_max: int, rows_min: int, exponent: float = 1.0) -> tuple[int, ...]:
    """``max(rows_min, rows_max / (t + 1) ** exponent)``: a few huge tables, many small."""
    return tuple(max(rows_min, int(rows_max / (t + 1) ** exponent)) for t in range(num))


# Criteo 1TB cardinalities (as in MLPerf DLRM-DCNv2) and its multi-hot pooling factors.
_CRITEO_ROWS = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)
_CRITEO_POOLING = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
_H200_ROW_CAP = 1_500_000

PRESETS: dict[str, DlrmConfig] = {
    "tiny": DlrmConfig(
        batch_size=32, num_dense=13, bottom=(32,), table_rows=zipf_rows(8, 2000, 100),
        emb_dim=16, poolings=(1, 2, 4, 8, 3), empty_frac=0.1, interaction="dcn",
        cross_layers=2, cross_rank=8, top=(64, 32),
    ),
    "h200": DlrmConfig(
        batch_size=65536, num_dense=13, bottom=(512, 256),
        table_rows=tuple(min(r, _H200_ROW_CAP) for r in _CRITEO_ROWS), emb_dim=128,
        poolings=_CRITEO_POOLING, empty_frac=0.02, interaction="dcn",
        cross_layers=3, cross_rank=512, top=(1024, 1024, 512, 256),
    ),
    # MLPerf DLRMv2 as trained (Criteo 1TB rows capped at 40M: 204M rows, 26.1e9 parameters);
    # the sparse planner's benchmark (benchmarks/vs_torchrec.py) uses it, with ``repeat``.
    "dlrmv2": DlrmConfig(
        batch_size=65536, num_dense=13, bottom=(512, 256), table_rows=_CRITEO_ROWS,
        emb_dim=128, poolings=_CRITEO_POOLING, empty_frac=0.02, interaction="dcn",
        cross_layers=3, cross_rank=512, top=(1024, 1024, 512, 256),
    ),
    "xl": DlrmConfig(
        batch_size=16384, num_dense=13, bottom=(512, 256),
        table_rows=zipf_rows(1000, 2_000_000_000, 1_000_000), emb_dim=128,
        poolings=(1, 2, 4, 8, 16, 30, 3, 12, 6, 20), empty_frac=0.05, interaction="dcn",
        cross_layers=3, cross_rank=512, top=(4096, 1024, 256),
    ),
}


class CrossLayer(nn.Module):
    """DCNv2 cross layer ``x0 * (W x + b) + x``; ``W = V U`` when ``rank > 0``."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.u = nn.Linear(width, rank, bias=False) if rank > 0 else None
        self.v = nn.Linear(rank if rank > 0 else width, width)

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.v(self.u(x)) if self.u is not None else self.v(x)
        return x0 * h + x


def _mlp(dims: list[int], *, last_act: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2 or last_act:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM with a DCNv2 or dot interaction; ``forward(*inputs)`` returns the loss."""

    def __init__(self, cfg: DlrmConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.emb_dim
        self.bottom = _mlp([cfg.num_dense, *cfg.bottom, d], last_act=True)
        self.bags = nn.ModuleList(
            nn.EmbeddingBag(rows, d, mode="sum", include_last_offset=True)
            for rows in cfg.table_rows
        )
        n_vec = cfg.num_tables + 1
        if cfg.interaction == "dcn":
            width = n_vec * d
            self.cross = nn.ModuleList(
                CrossLayer(width, cfg.cross_rank) for _ in range(cfg.cross_layers)
            )
        else:
            self.cross = nn.ModuleList()
            width = d + n_vec * (n_vec - 1) // 2
        self.top = _mlp([width, *cfg.top, 1], last_act=False)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        num_t = len(self.bags)
        if len(inputs) != 2 + 2 * num_t:
            raise ValueError(f"expected {2 + 2 * num_t} inputs (see module doc), got {len(inputs)}")
        dense, labels = inputs[0], inputs[-1]
        x = self.bottom(dense)
        pooled = [bag(inputs[1 + 2 * t], inputs[2 + 2 * t]) for t, bag in enumerate(self.bags)]
        if self.cfg.interaction == "dcn":
            x0 = torch.cat([x, *pooled], dim=1)
            z = x0
            for layer in self.cross:
                z = layer(x0, z)
        else:
            vecs = torch.stack([x, *pooled], dim=1)  # [B, T+1, D]
            dots = torch.bmm(vecs, vecs.transpose(1, 2))
            n_vec = vecs.shape[1]
            iu = torch.triu_indices(n_vec, n_vec, offset=1, device=dots.device)
            z = torch.cat([x, dots[:, iu[0], iu[1]]], dim=1)
        logit = self.top(z).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logit, labels[:, 0])


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


def make_batch_fn(cfg: DlrmConfig, seed: int) -> Any:
    """The spec's ``make_batch(step, device)``: real data drawn on CPU from (seed, step)."""
    b = cfg.batch_size

    def make_batch(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step)
        dense = torch.randn(b, cfg.num_dense, generator=g)
        sparse: list[torch.Tensor] = []
        for t, rows in enumerate(cfg.table_rows):
            nnz = b * cfg.pooling(t)
            sparse += [_skewed_ids(g, rows, nnz), _offsets(jagged_lengths(g, b, nnz, cfg.empty_frac))]
        labels = (torch.rand(b, 1, generator=g) < 0.25).float()
        return tuple(x.to(device) for x in (dense, *sparse, labels))

    return make_batch


def example_inputs_for(cfg: DlrmConfig) -> tuple[torch.Tensor, ...]:
    """A representative batch on the default device (meta when gemc compiles); uniform bags."""
    b = cfg.batch_size
    out: list[torch.Tensor] = [torch.zeros(b, cfg.num_dense)]
    for t in range(cfg.num_tables):
        p = cfg.pooling(t)
        out += [torch.zeros(b * p, dtype=torch.long), torch.arange(b + 1, dtype=torch.long) * p]
    out.append(torch.zeros(b, 1))
    return tuple(out)


def estimate(cfg: DlrmConfig, embedding_params: int, dense_params: int) -> dict[str, float]:
    """Analytic step FLOPs (3x forward matmul FLOPs) and fp32 memory on one device.

    Activations: ~4 B per saved element -- bottom/top MLP outputs, x0, and per cross layer
    its input, the rank-r projection, the ``W x + b`` output and the product.
    """
    b, d, n_vec = cfg.batch_size, cfg.emb_dim, cfg.num_tables + 1
    dims = [cfg.num_dense, *cfg.bottom, d]
    fwd = sum(2 * b * x * y for x, y in zip(dims, dims[1:]))
    saved = sum(dims[1:])
    if cfg.interaction == "dcn":
        width = n_vec * d
        per = 2 * width * cfg.cross_rank * 2 if cfg.cross_rank else 2 * width * width
        fwd += cfg.cross_layers * b * per
        saved += width + cfg.cross_layers * (3 * width + cfg.cross_rank)
    else:
        width = d + n_vec * (n_vec - 1) // 2
        fwd += 2 * b * n_vec * n_vec * d
        saved += n_vec * d + n_vec * n_vec + width
    top = [width, *cfg.top, 1]
    fwd += sum(2 * b * x * y for x, y in zip(top, top[1:]))
    saved += 2 * sum(top[1:])  # Linear outputs and ReLU outputs
    act_bytes = 4 * b * saved
    return {
        "est_fwd_flops": float(fwd),
        "est_step_flops": float(3 * fwd),
        "est_activation_gb": act_bytes / 1e9,
        "est_memory_gb": (act_bytes + 16 * (embedding_params + dense_params)) / 1e9,
    }


def resolve_config(preset: str, batch_size: int | None, overrides: dict[str, Any]) -> DlrmConfig:
    """The preset with ``batch_size`` and any ``--set field=value`` applied, validated."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    names = {f.name for f in fields(DlrmConfig)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(
            f"unknown DLRM option(s) {', '.join(unknown)}; valid: preset, seed, {', '.join(sorted(names))}"
        )
    if batch_size is not None:
        overrides = {**overrides, "batch_size": batch_size}
    cfg = replace(PRESETS[preset], **overrides)
    if cfg.interaction not in ("dcn", "dot"):
        raise ValueError(f"interaction must be 'dcn' or 'dot', got {cfg.interaction!r}")
    if cfg.batch_size < 2:
        raise ValueError(f"batch_size must be >= 2, got {cfg.batch_size}")
    return cfg


def build(
    preset: str = "tiny", batch_size: int | None = None, seed: int = 0, repeat: int = 1,
    **overrides: Any
) -> ModelSpec:
    """Build DLRM, a representative batch and a synthetic data source.

    Called by gemc under ``torch.device("meta")``; everything follows the default device.
    ``repeat`` copies the preset's tables (rows and pooling) that many times, so the sparse
    planner can be tried on 1,000+ tables of a real distribution (``preset=dlrmv2 repeat=40``).
    """
    cfg = resolve_config(preset, batch_size, overrides)
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if repeat > 1:
        cfg = replace(cfg, table_rows=cfg.table_rows * repeat, poolings=tuple(
            cfg.pooling(t) for t in range(cfg.num_tables)) * repeat)
    torch.manual_seed(seed)
    model = DLRM(cfg)
    emb_params = sum(p.numel() for p in model.bags.parameters())
    dense_params = sum(p.numel() for p in model.parameters()) - emb_params
    info: dict[str, Any] = {
        "model": "dlrm",
        "preset": preset,
        "repeat": repeat,
        "batch_size": cfg.batch_size,
        "seed": seed,
        "num_tables": cfg.num_tables,
        "total_rows": sum(cfg.table_rows),
        "embedding_params": emb_params,
        "dense_params": dense_params,
        "history_len": 0,  # no user-history sequence in DLRM
        "mean_fill": 0.0,
        "mean_pooling": sum(cfg.pooling(t) for t in range(cfg.num_tables)) / cfg.num_tables,
        "interaction": cfg.interaction,
        "input_layout": "dense, (ids_t, offsets_t) for each table, labels",
        "config": {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in asdict(cfg).items() if k != "table_rows"
        },
    }
    info.update(estimate(cfg, emb_params, dense_params))
    return ModelSpec(
        model=model,
        example_inputs=example_inputs_for(cfg),
        make_batch=make_batch_fn(cfg, seed),
        info=info,
        batch_size=cfg.batch_size,
    )
