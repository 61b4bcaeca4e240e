"""DLRM-DCNv2 as in the MLPerf Training recommendation benchmark (Criteo 1TB multi-hot).

Follows the public description of MLPerf's DLRM-DCNv2 reference (Naumov et al. 2019, "Deep
Learning Recommendation Model for Personalization and Recommendation Systems"; Wang et al.
2021, "DCN V2: Improved Deep & Cross Network", the low-rank mixture-free variant TorchRec
calls ``LowRankCrossNet``; MLPerf Training v3.0 ``recommendation_v2``), written the way
``facebookresearch/dlrm``'s ``dlrm_s_pytorch.py`` is: ``create_emb`` / ``create_mlp`` build
``nn.ModuleList``s, the weights are drawn in ``__init__``, and ``forward(dense_x, lS_o, lS_i)``
takes the *start* offsets (``lS_o``) before the indices (``lS_i``), one pair per table, and
calls each ``nn.EmbeddingBag(n, m, mode="sum")`` as ``E(indices, offsets)``.

Model: 13 dense features -> bottom MLP 512-256-128; 26 multi-hot sparse features -> sum-pooled
128-d embeddings; the 27 vectors are concatenated (3,456 wide) and go through 3 DCNv2
low-rank cross layers ``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l`` (rank 512); then the top
MLP 1024-1024-512-256-1; loss ``BCEWithLogits`` against the click label.

Every sample carries exactly ``MULTI_HOT_SIZES[t]`` ids of table ``t`` (MLPerf's synthetic
multi-hot Criteo has fixed sizes 3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1:
214 ids per sample), so the offsets are ``arange(B) * size``.

Idioms carried (issue #15): ``nn.EmbeddingBag`` called with start offsets
(``include_last_offset=False``, the default) and offsets passed *before* the ids; parameters
created in ``__init__`` as ``nn.Parameter(nn.init.xavier_normal_(torch.empty(...)))`` in a
``nn.ParameterList`` with no ``reset_parameters``; ``nn.init.*`` re-drawing ``nn.Linear``
and table weights in ``__init__`` (dlrm_s_pytorch's scheme); example inputs are a real batch
built with ``device="cpu"``.

Input layout (flat tuple): ``dense_x`` f32 [B, 13]; ``lS_o[t]`` int64 [B] (start offsets) for
t < 26; ``lS_i[t]`` int64 [B * size_t] for t < 26; ``target`` f32 [B].

Presets
-------
``tiny``: B=16, 26 tables with rows capped at 100, dim 8, bottom 16-8, top 32-16-1, rank 4;
    30,721 parameters.
``h200``: B=16384, MLPerf dims (128-d, MLPs and cross net as above) with the 40M-row Criteo
    tables capped at 2,000,000 rows (the MLPerf sizes would need ~26e9 parameters, far past one
    H200): 13,116,632 rows, 1,678,928,896 table parameters + 16,044,545 dense = 1,694,973,441
    parameters. Measured (``torch.utils.flop_counter`` on meta, matmuls and attention only):
    0.525 TFLOP forward, 1.576 TFLOP forward + backward. Memory: 27 GB for weights, grads and
    Adam moments if every table is updated densely (a row-wise sparse optimizer halves it),
    activations ~3 GB. FLOP/step (fwd+bwd, matmuls): ~3 x 2 x B x (bottom 0.17M + cross 10.6M +
    top 5.2M MACs) = 1.6 TFLOP -> ~3 ms at 500 TFLOP/s; the step is dominated by the 3.5M bag
    lookups per step (0.9 GB read forward, the scatter backward) and the table optimizer: ~10-20
    ms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from gemc.spec import ModelSpec

# Criteo 1TB rows per feature with MLPerf's --max-ind-range=40000000.
MLPERF_ROWS = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)
MULTI_HOT_SIZES = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)


@dataclass(frozen=True)
class Config:
    batch_size: int
    row_cap: int
    m_spa: int  # embedding dim
    ln_bot: tuple[int, ...]  # bottom MLP, 13 -> ... -> m_spa
    ln_top: tuple[int, ...]  # top MLP after the cross net, ... -> 1
    dcn_num_layers: int
    dcn_low_rank_dim: int

    @property
    def ln_emb(self) -> list[int]:
        return [min(n, self.row_cap) for n in MLPERF_ROWS]


PRESETS = {
    "tiny": Config(16, 100, 8, (13, 16, 8), (32, 16, 1), 3, 4),
    "h200": Config(16384, 2_000_000, 128, (13, 512, 256, 128), (1024, 1024, 512, 256, 1), 3, 512),
}


class LowRankCrossNet(nn.Module):
    """DCNv2 cross layers with the low-rank kernel ``W (V x)`` (no mixture of experts)."""

    def __init__(self, in_features: int, num_layers: int, low_rank: int) -> None:
        super().__init__()
        self.num_layers = num_layers
        self.W_kernels = nn.ParameterList(
            nn.Parameter(nn.init.xavier_normal_(torch.empty(in_features, low_rank)))
            for _ in range(num_layers)
        )
        self.V_kernels = nn.ParameterList(
            nn.Parameter(nn.init.xavier_normal_(torch.empty(low_rank, in_features)))
            for _ in range(num_layers)
        )
        self.bias = nn.ParameterList(
            nn.Parameter(nn.init.zeros_(torch.empty(in_features))) for _ in range(num_layers)
        )

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x_l = x0
        for layer in range(self.num_layers):
            x_l_v = torch.matmul(x_l, self.V_kernels[layer].t())
            x_l_w = torch.matmul(x_l_v, self.W_kernels[layer].t())
            x_l = x0 * (x_l_w + self.bias[layer]) + x_l
        return x_l


class DLRM_DCN(nn.Module):  # noqa: N801 - the name the MLPerf reference uses
    """Bottom MLP + 26 sum bags -> DCNv2 cross net -> top MLP -> BCE loss."""

    def __init__(self, m_spa: int, ln_emb: list[int], ln_bot: list[int], ln_top: list[int],
                 dcn_num_layers: int, dcn_low_rank_dim: int) -> None:
        super().__init__()
        self.ndevices = -1
        self.emb_l = self.create_emb(m_spa, ln_emb)
        self.bot_l = self.create_mlp(ln_bot, sigmoid_layer=-1)
        num_f = len(ln_emb) + 1
        self.crossnet = LowRankCrossNet(num_f * m_spa, dcn_num_layers, dcn_low_rank_dim)
        self.top_l = self.create_mlp([num_f * m_spa, *ln_top], sigmoid_layer=-1, last_act=False)
        self.loss_fn = nn.BCEWithLogitsLoss(reduction="mean")

    @staticmethod
    def create_mlp(ln: list[int], sigmoid_layer: int, last_act: bool = True) -> nn.Sequential:
        layers: list[nn.Module] = []
        for i in range(len(ln) - 1):
            n, m = ln[i], ln[i + 1]
            LL = nn.Linear(n, m, bias=True)  # noqa: N806 - dlrm_s_pytorch's names
            nn.init.normal_(LL.weight, 0.0, math.sqrt(2 / (m + n)))  # Xavier-like, as dlrm
            nn.init.normal_(LL.bias, 0.0, math.sqrt(1 / m))
            layers.append(LL)
            if i == sigmoid_layer:
                layers.append(nn.Sigmoid())
            elif last_act or i < len(ln) - 2:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    @staticmethod
    def create_emb(m: int, ln: list[int]) -> nn.ModuleList:
        emb_l = nn.ModuleList()
        for n in ln:
            EE = nn.EmbeddingBag(n, m, mode="sum")  # noqa: N806
            nn.init.uniform_(EE.weight, -math.sqrt(1 / n), math.sqrt(1 / n))
            emb_l.append(EE)
        return emb_l

    def apply_emb(self, lS_o: list[torch.Tensor], lS_i: list[torch.Tensor]) -> list[torch.Tensor]:  # noqa: N803
        ly = []
        for k, sparse_index_group_batch in enumerate(lS_i):
            sparse_offset_group_batch = lS_o[k]
            E = self.emb_l[k]  # noqa: N806
            V = E(sparse_index_group_batch, sparse_offset_group_batch, per_sample_weights=None)  # noqa: N806
            ly.append(V)
        return ly

    def forward(self, dense_x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        n = len(self.emb_l)
        lS_o, lS_i, target = list(args[:n]), list(args[n:2 * n]), args[2 * n]  # noqa: N806
        x = self.bot_l(dense_x)
        ly = self.apply_emb(lS_o, lS_i)
        z = torch.cat([x] + ly, dim=1)
        z = self.crossnet(z)
        p = self.top_l(z).squeeze(-1)
        return self.loss_fn(p, target)


# ----------------------------------------------------------------------------- synthetic data
# (kept in this file: gemc loads ``FILE.py:build`` by path, so a model file imports no sibling)


def _generator(step: int, seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(1_000_003 * seed + step)


def _batch(cfg: Config, step: int, seed: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    g = _generator(step, seed)
    b = cfg.batch_size
    dense_x = torch.log1p(torch.rand(b, 13, generator=g) * 100.0)
    lS_o, lS_i = [], []  # noqa: N806
    for rows, size in zip(cfg.ln_emb, MULTI_HOT_SIZES, strict=True):
        lS_o.append(torch.arange(b) * size)
        lS_i.append(torch.randint(0, rows, (b * size,), generator=g))
    target = (torch.rand(b, generator=g) < 0.25).float()
    return tuple(t.to(device) for t in (dense_x, *lS_o, *lS_i, target))


def build(preset: str = "tiny", batch_size: int | None = None, seed: int = 0) -> ModelSpec:
    """DLRM-DCNv2 (MLPerf) at ``preset`` ("tiny" or "h200")."""
    cfg = PRESETS[preset]
    if batch_size is not None:
        cfg = replace(cfg, batch_size=batch_size)
    torch.manual_seed(seed)
    model = DLRM_DCN(cfg.m_spa, cfg.ln_emb, list(cfg.ln_bot), list(cfg.ln_top),
                     cfg.dcn_num_layers, cfg.dcn_low_rank_dim)

    def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        with torch.device("cpu"):  # data is made on the CPU, then moved
            return _batch(cfg, step, seed, device)

    example_inputs = make_batch(0, "cpu")  # a real batch on the CPU, as a user has one
    info = {"preset": preset, "model": "dlrm_dcnv2", "num_tables": len(cfg.ln_emb),
            "batch_size": cfg.batch_size, "ids_per_sample": sum(MULTI_HOT_SIZES)}
    return ModelSpec(model=model, example_inputs=example_inputs, make_batch=make_batch,
                     batch_size=cfg.batch_size, info=info)
