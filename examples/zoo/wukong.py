"""Wukong: stacked factorization machines for recommendation scaling (Zhang et al., ICML 2024).

Follows "Wukong: Towards a Scaling Law for Large-Scale Recommendation" (Meta), written the
way its pseudocode reads: every feature becomes a ``d``-wide embedding (sparse features
through their tables, dense features through an MLP into a few embeddings), stacked into
``X_0`` of ``n`` embeddings, then ``l`` Wukong layers

    X_{i+1} = LN(concat(FMB(X_i), LCB(X_i)) + residual(X_i))
    FMB(X)  = reshape(MLP(LN(flatten(X (X^T Y)))), n_F x d)     # optimized low-rank FM
    LCB(X)  = W_L X                                              # linear compress, n_L x n

with ``Y`` an ``n x k`` projection, ``W_L`` an ``n_L x n`` matrix and the residual projected
over the embedding axis when ``n`` changes (``n_F + n_L`` embeddings out). Written with
``torch.einsum`` / ``torch.bmm`` on ``[B, n, d]`` like the equations; ``Y``, ``W_L`` and the
residual projection are ``nn.Parameter``s drawn with ``nn.init.xavier_uniform_`` in
``__init__``. The flattened output feeds an MLP and one logit per task (click, conversion);
the loss is the sum of the tasks' BCEs.

Sparse features are multi-hot with a fixed bag size per feature, passed as ``[B, P]`` id
matrices to ``nn.EmbeddingBag(mode="mean")`` (the 2-D form of a bag: no offsets at all).

Idioms carried (issue #15): ``einsum``/``bmm`` interaction layers; parameters created in
``__init__`` with ``nn.init.*`` and no ``reset_parameters``; 2-D ``EmbeddingBag`` input;
labels for several tasks (``[B, 2]``); many sparse features; example inputs built with
``device="cpu"``.

Input layout: ``dense`` f32 [B, num_dense]; ``sparse_f`` int64 [B, P_f] for each feature f;
``labels`` f32 [B, 2].

Presets
-------
``tiny``: B=8, 8 sparse features (rows 40, d=8), 2 dense embeddings, 2 layers, n_F=n_L=4,
    k=3, MLP hidden 16.
``h200``: B=8192, 64 sparse features of 125,000 rows (bag sizes 1..8), d=128, 8 dense embeddings
    (n_0 = 72), 8 layers with n_F = n_L = 32, k = 24, FMB MLP 2048-2048, top MLP 2048-1024.
    Parameters: 1,169,760,578 (1.0e9 in tables). Measured (``torch.utils.flop_counter`` on meta,
    matmuls and attention only): 2.483 TFLOP forward, 7.449 TFLOP forward + backward. FLOP/step
    (fwd+bwd = 3 x fwd): per sample and layer ~16.4M MACs (the FMB MLP: 1536x2048 + 2048x2048 +
    2048x4096, the FM and LCB ~0.7M), 8 layers + top MLP 19M -> ~150M MACs = 0.3 GFLOP fwd per
    sample, x 8192 x 3 = 7.4 TFLOP -> ~15 ms at 500 TFLOP/s. Memory: ~1.2e9 x 16 B = 19 GB;
    activations ~6 GB ([B, 64, 128] per layer and the MLPs).
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
    num_dense: int
    num_sparse: int
    rows: int
    max_bag: int  # bag size of feature f: 1 + f % max_bag
    d: int
    num_dense_emb: int
    num_layers: int
    n_f: int
    n_l: int
    k: int
    fmb_hidden: tuple[int, ...]
    top_hidden: tuple[int, ...]
    num_tasks: int = 2

    def bag_size(self, f: int) -> int:
        return 1 + f % self.max_bag


PRESETS = {
    "tiny": Config(8, 13, 8, 40, 3, 8, 2, 2, 4, 4, 3, (16,), (16,)),
    "h200": Config(8192, 13, 64, 125_000, 8, 128, 8, 8, 32, 32, 24, (2048, 2048), (2048, 1024)),
}


def mlp(dims: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if last_relu or i < len(dims) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class WukongLayer(nn.Module):
    def __init__(self, n_in: int, d: int, n_f: int, n_l: int, k: int, hidden: tuple[int, ...]) -> None:
        super().__init__()
        self.n_f, self.d = n_f, d
        self.Y = nn.Parameter(torch.empty(n_in, k))  # noqa: N815 - the paper's symbols
        self.W_L = nn.Parameter(torch.empty(n_l, n_in))  # noqa: N815
        nn.init.xavier_uniform_(self.Y)
        nn.init.xavier_uniform_(self.W_L)
        self.fm_norm = nn.LayerNorm(n_in * k)
        self.fmb_mlp = mlp([n_in * k, *hidden, n_f * d], last_relu=False)
        if n_in != n_f + n_l:
            self.W_res = nn.Parameter(torch.empty(n_f + n_l, n_in))  # noqa: N815
            nn.init.xavier_uniform_(self.W_res)
        else:
            self.W_res = None
        self.norm = nn.LayerNorm(d)

    def forward(self, X: torch.Tensor) -> torch.Tensor:  # noqa: N803 - X is [B, n, d]
        B = X.size(0)  # noqa: N806
        XtY = torch.einsum("bnd,nk->bdk", X, self.Y)  # noqa: N806 - X^T Y: [B, d, k]
        fm = torch.bmm(X, XtY)  # X (X^T Y): [B, n, k]
        fmb = self.fmb_mlp(self.fm_norm(fm.flatten(1))).view(B, self.n_f, self.d)
        lcb = torch.einsum("mn,bnd->bmd", self.W_L, X)
        res = X if self.W_res is None else torch.einsum("mn,bnd->bmd", self.W_res, X)
        return self.norm(torch.cat([fmb, lcb], dim=1) + res)


class Wukong(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embedding_bags = nn.ModuleList(
            nn.EmbeddingBag(cfg.rows, cfg.d, mode="mean") for _ in range(cfg.num_sparse))
        for bag in self.embedding_bags:
            nn.init.uniform_(bag.weight, -0.01, 0.01)
        self.dense_mlp = mlp([cfg.num_dense, 4 * cfg.d, cfg.num_dense_emb * cfg.d], last_relu=False)
        n = cfg.num_sparse + cfg.num_dense_emb
        layers = []
        for _ in range(cfg.num_layers):
            layers.append(WukongLayer(n, cfg.d, cfg.n_f, cfg.n_l, cfg.k, cfg.fmb_hidden))
            n = cfg.n_f + cfg.n_l
        self.interaction = nn.Sequential(*layers)
        self.top_mlp = mlp([n * cfg.d, *cfg.top_hidden, cfg.num_tasks], last_relu=False)

    def forward(self, dense: torch.Tensor, *sparse_and_labels: torch.Tensor) -> torch.Tensor:
        *sparse, labels = sparse_and_labels
        B = dense.size(0)  # noqa: N806
        dense_emb = self.dense_mlp(dense).view(B, self.cfg.num_dense_emb, self.cfg.d)
        sparse_emb = torch.stack([bag(ids) for bag, ids in zip(self.embedding_bags, sparse)], dim=1)
        X = torch.cat([dense_emb, sparse_emb], dim=1)  # noqa: N806
        logits = self.top_mlp(self.interaction(X).flatten(1))
        return sum(F.binary_cross_entropy_with_logits(logits[:, t], labels[:, t])
                   for t in range(self.cfg.num_tasks))


def _batch(cfg: Config, step: int, seed: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cpu").manual_seed(1_000_003 * seed + step)
    b = cfg.batch_size
    dense = torch.randn(b, cfg.num_dense, generator=g, device="cpu")
    sparse = [torch.randint(0, cfg.rows, (b, cfg.bag_size(f)), generator=g, device="cpu")
              for f in range(cfg.num_sparse)]
    click = torch.rand(b, generator=g, device="cpu") < 0.3
    convert = click & (torch.rand(b, generator=g, device="cpu") < 0.2)
    labels = torch.stack([click, convert], dim=1).float()
    return tuple(t.to(device) for t in (dense, *sparse, labels))


def build(preset: str = "tiny", batch_size: int | None = None, seed: int = 0) -> ModelSpec:
    """Wukong at ``preset`` ("tiny" or "h200")."""
    cfg = PRESETS[preset]
    if batch_size is not None:
        cfg = replace(cfg, batch_size=batch_size)
    torch.manual_seed(seed)
    model = Wukong(cfg)

    def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        return _batch(cfg, step, seed, device)

    info = {"preset": preset, "model": "wukong", "batch_size": cfg.batch_size,
            "num_tables": cfg.num_sparse, "num_tasks": cfg.num_tasks}
    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=cfg.batch_size, info=info)
