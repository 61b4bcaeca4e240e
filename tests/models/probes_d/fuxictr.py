"""FiBiNET, xDeepFM's CIN and FinalMLP in FuxiCTR's / the papers' idioms (tiny sizes).

Unlike DeepCTR-Torch's (tests/models/probes_b/deepctr.py), these write:

* ``arch="fibinet"``: FuxiCTR's ``SqueezeExcitation`` (``mean`` over the embedding dim,
  ``nn.Sequential`` excitation with ``ReLU``/``ReLU``, ``feature_emb * A.unsqueeze(-1)``) and
  ``BilinearInteractionV2``: ``field_interaction`` is an ``nn.Linear(d, d, bias=False)`` per
  *pair*, ``field_each`` one per field, ``field_all`` one shared, the pairs picked by
  ``torch.triu_indices`` index tensors (``emb[:, triu[0]]``, ``emb[:, triu[1]]``) or a
  ``torch.split`` into fields;
* ``arch="cin"``: the xDeepFM authors' CIN: ``torch.split`` of the hidden and base fields
  along the embedding dim, a batched ``matmul`` of each split pair (``[D, B, H, 1] @ [D, B,
  1, m]``), a reshape/permute to ``[B, H*m, D]`` and ``F.conv1d`` with a raw filter parameter
  of kernel 1, ``sum`` pooling over the embedding dim (direct connections);
* ``arch="finalmlp"``: FinalMLP (Mao et al., AAAI 2023): two feature-selection gates
  (``2 * sigmoid(MLP(context))`` with a learned context embedding ``nn.Parameter`` repeated
  over the batch), two MLP streams, and multi-head bilinear fusion ``InteractionAggregation``
  (``torch.einsum`` over heads and an ``nn.Parameter`` weight reshaped per head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec
from tests.models.probes_d.common import spec_of

B, DIM = 8, 4
FIELDS = (25, 15, 10, 6)
NF = len(FIELDS)


class SqueezeExcitation(nn.Module):
    def __init__(self, num_fields: int, reduction_ratio: int = 2) -> None:
        super().__init__()
        reduced = max(1, int(num_fields / reduction_ratio))
        self.excitation = nn.Sequential(nn.Linear(num_fields, reduced, bias=False), nn.ReLU(),
                                        nn.Linear(reduced, num_fields, bias=False), nn.ReLU())

    def forward(self, feature_emb: torch.Tensor) -> torch.Tensor:
        Z = torch.mean(feature_emb, dim=-1)  # noqa: N806 - the paper's names
        A = self.excitation(Z)  # noqa: N806
        return feature_emb * A.unsqueeze(-1)


class BilinearInteractionV2(nn.Module):
    def __init__(self, num_fields: int, embedding_dim: int, bilinear_type: str) -> None:
        super().__init__()
        self.bilinear_type = bilinear_type
        self.interact_dim = int(num_fields * (num_fields - 1) / 2)
        if bilinear_type == "field_all":
            self.bilinear_W = nn.Parameter(torch.empty(embedding_dim, embedding_dim))
        elif bilinear_type == "field_each":
            self.bilinear_W = nn.Parameter(torch.empty(num_fields, embedding_dim, embedding_dim))
        else:  # field_interaction
            self.bilinear_W = nn.Parameter(torch.empty(self.interact_dim, embedding_dim,
                                                       embedding_dim))
        nn.init.xavier_normal_(self.bilinear_W)
        self.triu_index = nn.Parameter(torch.triu_indices(num_fields, num_fields, offset=1),
                                       requires_grad=False)

    def forward(self, feature_emb: torch.Tensor) -> torch.Tensor:
        if self.bilinear_type == "field_interaction":
            left_emb = torch.index_select(feature_emb, 1, self.triu_index[0])
            right_emb = torch.index_select(feature_emb, 1, self.triu_index[1])
            bilinear_out = torch.matmul(left_emb.unsqueeze(2), self.bilinear_W).squeeze(2)
        else:
            if self.bilinear_type == "field_all":
                hidden_emb = torch.matmul(feature_emb, self.bilinear_W)
            else:
                hidden_emb = torch.matmul(feature_emb.unsqueeze(2), self.bilinear_W).squeeze(2)
            left_emb = hidden_emb[:, self.triu_index[0], :]
            right_emb = feature_emb[:, self.triu_index[1], :]
            bilinear_out = left_emb
        return bilinear_out * right_emb


class CIN(nn.Module):
    """The authors' CIN: per-dim matmuls of field splits, a kernel-1 conv as a filter."""

    def __init__(self, num_fields: int, layers: tuple[int, ...] = (6, 4)) -> None:
        super().__init__()
        self.layers = layers
        sizes = [num_fields]
        self.filters = nn.ParameterList()
        self.biases = nn.ParameterList()
        for size in layers:
            self.filters.append(nn.Parameter(torch.randn(size, sizes[-1] * num_fields, 1) * 0.1))
            self.biases.append(nn.Parameter(torch.zeros(size)))
            sizes.append(size)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:  # [B, m, D]
        b, m, d = x0.shape
        split0 = torch.split(x0.unsqueeze(-1), 1, dim=2)  # D x [B, m, 1, 1]
        hidden, pooled = x0, []
        for filt, bias in zip(self.filters, self.biases):
            split_k = torch.split(hidden.unsqueeze(-1), 1, dim=2)  # D x [B, H, 1, 1]
            dot = torch.matmul(torch.stack(split_k, 0).squeeze(-1),           # [D, B, H, 1]
                               torch.stack(split0, 0).squeeze(-1).transpose(2, 3))  # [D, B, 1, m]
            dot = dot.reshape(d, b, -1).permute(1, 2, 0)  # [B, H*m, D]
            hidden = F.relu(F.conv1d(dot, filt, bias))  # [B, size, D]
            pooled.append(torch.sum(hidden, dim=-1))
        return torch.cat(pooled, dim=1)


class FeatureSelection(nn.Module):
    def __init__(self, feature_dim: int, ctx_dim: int, hidden: int) -> None:
        super().__init__()
        self.ctx1 = nn.Parameter(torch.zeros(1, ctx_dim))  # "no context": a learned vector
        self.ctx2 = nn.Parameter(torch.zeros(1, ctx_dim))
        self.gate1 = nn.Sequential(nn.Linear(ctx_dim, hidden), nn.ReLU(),
                                   nn.Linear(hidden, feature_dim), nn.Sigmoid())
        self.gate2 = nn.Sequential(nn.Linear(ctx_dim, hidden), nn.ReLU(),
                                   nn.Linear(hidden, feature_dim), nn.Sigmoid())

    def forward(self, flat_emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx1 = self.ctx1.repeat(flat_emb.size(0), 1)
        ctx2 = self.ctx2.repeat(flat_emb.size(0), 1)
        return flat_emb * self.gate1(ctx1) * 2, flat_emb * self.gate2(ctx2) * 2


class InteractionAggregation(nn.Module):
    def __init__(self, x_dim: int, y_dim: int, output_dim: int = 1, num_heads: int = 2) -> None:
        super().__init__()
        self.num_heads, self.output_dim = num_heads, output_dim
        self.head_x_dim, self.head_y_dim = x_dim // num_heads, y_dim // num_heads
        self.w_x = nn.Linear(x_dim, output_dim)
        self.w_y = nn.Linear(y_dim, output_dim)
        self.w_xy = nn.Parameter(torch.empty(num_heads * self.head_x_dim * self.head_y_dim,
                                             output_dim))
        nn.init.xavier_normal_(self.w_xy)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        output = self.w_x(x) + self.w_y(y)
        head_x = x.view(-1, self.num_heads, self.head_x_dim)
        head_y = y.view(-1, self.num_heads, self.head_y_dim)
        xy = torch.matmul(torch.matmul(head_x.unsqueeze(2),
                                       self.w_xy.view(self.num_heads, self.head_x_dim, -1))
                          .view(-1, self.num_heads, self.output_dim, self.head_y_dim),
                          head_y.unsqueeze(-1)).squeeze(-1)
        return output + xy.sum(dim=1)


def mlp(i: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, o), nn.BatchNorm1d(o), nn.ReLU())


class Model(nn.Module):
    def __init__(self, arch: str, bilinear_type: str) -> None:
        super().__init__()
        self.arch = arch
        self.embedding_layer = nn.ModuleList(nn.Embedding(r, DIM) for r in FIELDS)
        flat = NF * DIM
        if arch == "fibinet":
            self.senet = SqueezeExcitation(NF)
            self.bilinear = BilinearInteractionV2(NF, DIM, bilinear_type)
            pairs = NF * (NF - 1) // 2
            self.dnn = nn.Sequential(nn.Linear(2 * pairs * DIM, 8), nn.ReLU(), nn.Linear(8, 1))
        elif arch == "cin":
            self.cin = CIN(NF)
            self.lr = nn.Linear(flat, 1)
            self.fc = nn.Linear(10, 1)
        else:  # finalmlp
            self.fs = FeatureSelection(flat, ctx_dim=4, hidden=8)
            self.mlp1 = nn.Sequential(mlp(flat, 8), mlp(8, 8))
            self.mlp2 = nn.Sequential(mlp(flat, 6), mlp(6, 6))
            self.fusion = InteractionAggregation(8, 6, output_dim=1, num_heads=2)

    def forward(self, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # noqa: N803
        feature_emb = torch.stack([emb(X[:, i]) for i, emb in enumerate(self.embedding_layer)], 1)
        if self.arch == "fibinet":
            senet_emb = self.senet(feature_emb)
            bilinear_p = self.bilinear(feature_emb)
            bilinear_q = self.bilinear(senet_emb)
            comb = torch.flatten(torch.cat([bilinear_p, bilinear_q], dim=1), start_dim=1)
            logit = self.dnn(comb)
        elif self.arch == "cin":
            logit = self.lr(feature_emb.flatten(1)) + self.fc(self.cin(feature_emb))
        else:
            flat = feature_emb.flatten(start_dim=1)
            x1, x2 = self.fs(flat)
            logit = self.fusion(self.mlp1(x1), self.mlp2(x2))
        y_pred = torch.sigmoid(logit)
        return F.binary_cross_entropy(y_pred, y.view(-1, 1))


def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(800 + step)
    with torch.device("cpu"):
        X = torch.stack([torch.randint(0, r, (B,), generator=g) for r in FIELDS], 1)  # noqa: N806
        y = (torch.rand(B, generator=g) < 0.4).float()
    return X.to(device), y.to(device)


def build(arch: str = "fibinet", bilinear_type: str = "field_interaction") -> ModelSpec:
    torch.manual_seed(0)
    return spec_of(Model(arch, bilinear_type), make_batch, B)


