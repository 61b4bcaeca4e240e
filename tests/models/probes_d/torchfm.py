"""Field-aware and product models as pytorch-fm (rixwew/pytorch-fm) writes them (tiny).

Idioms: every field's ids share ONE id space, shifted per field by a NumPy offsets array
kept as a plain attribute and turned into a tensor inside forward
(``x + x.new_tensor(self.offsets).unsqueeze(0)``); ``FeaturesLinear`` as an
``nn.Embedding(sum(field_dims), 1)`` summed over fields plus a bias ``nn.Parameter``;

* ``arch="ffm"``: field-aware FM, one ``nn.Embedding(sum(field_dims), dim)`` *per field* in
  an ``nn.ModuleList``, every one looked up with the whole id matrix, pairs
  ``xs[j][:, i] * xs[i][:, j]`` stacked over ``i < j``;
* ``arch="opnn"``: the outer-product PNN's kernel (``torch.sum(torch.sum(p.unsqueeze(1) *
  kernel, dim=-1).permute(0, 2, 1) * q, -1)`` over ``row``/``col`` index lists);
* ``arch="afn"``: the adaptive factorization network's logarithmic neurons
  (``torch.log`` of the absolute embeddings clamped away from 0, a linear layer, ``exp``),
  with ``nn.BatchNorm1d`` before and after.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec
from tests.models.probes_d.common import spec_of

B, DIM = 8, 4
FIELD_DIMS = (12, 9, 7, 5)


class FeaturesLinear(nn.Module):
    def __init__(self, field_dims: tuple[int, ...], output_dim: int = 1) -> None:
        super().__init__()
        self.fc = nn.Embedding(sum(field_dims), output_dim)
        self.bias = nn.Parameter(torch.zeros((output_dim,)))
        self.offsets = np.array((0, *np.cumsum(field_dims)[:-1]), dtype=np.int64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + x.new_tensor(self.offsets).unsqueeze(0)
        return torch.sum(self.fc(x), dim=1) + self.bias


class FieldAwareFactorizationMachine(nn.Module):
    def __init__(self, field_dims: tuple[int, ...], embed_dim: int) -> None:
        super().__init__()
        self.num_fields = len(field_dims)
        self.embeddings = nn.ModuleList(nn.Embedding(sum(field_dims), embed_dim)
                                        for _ in range(self.num_fields))
        self.offsets = np.array((0, *np.cumsum(field_dims)[:-1]), dtype=np.int64)
        for embedding in self.embeddings:
            nn.init.xavier_uniform_(embedding.weight.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + x.new_tensor(self.offsets).unsqueeze(0)
        xs = [self.embeddings[i](x) for i in range(self.num_fields)]
        ix = []
        for i in range(self.num_fields - 1):
            for j in range(i + 1, self.num_fields):
                ix.append(xs[j][:, i] * xs[i][:, j])
        return torch.stack(ix, dim=1)


class FeaturesEmbedding(nn.Module):
    def __init__(self, field_dims: tuple[int, ...], embed_dim: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(sum(field_dims), embed_dim)
        self.offsets = np.array((0, *np.cumsum(field_dims)[:-1]), dtype=np.int64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + x.new_tensor(self.offsets).unsqueeze(0)
        return self.embedding(x)


class OuterProductNetwork(nn.Module):
    def __init__(self, num_fields: int, embed_dim: int) -> None:
        super().__init__()
        num_ix = num_fields * (num_fields - 1) // 2
        self.kernel = nn.Parameter(torch.zeros((embed_dim, num_ix, embed_dim)))
        nn.init.xavier_uniform_(self.kernel.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_fields = x.shape[1]
        row, col = [], []
        for i in range(num_fields - 1):
            for j in range(i + 1, num_fields):
                row.append(i), col.append(j)
        p, q = x[:, row], x[:, col]
        kp = torch.sum(p.unsqueeze(1) * self.kernel, dim=-1).permute(0, 2, 1)
        return torch.sum(kp * q, -1)


class LNN(nn.Module):
    """AFN's logarithmic transformation layer."""

    def __init__(self, num_fields: int, embed_dim: int, log_neurons: int) -> None:
        super().__init__()
        self.embed_dim, self.log_neurons = embed_dim, log_neurons
        self.weight = nn.Parameter(torch.Tensor(log_neurons, num_fields))
        self.bias = nn.Parameter(torch.Tensor(log_neurons, embed_dim))
        stdv = 1.0 / np.sqrt(num_fields)
        self.weight.data.uniform_(-stdv, stdv)
        self.bias.data.uniform_(-stdv, stdv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embed_x_abs = torch.abs(x)
        embed_x_afn = torch.add(embed_x_abs, 1e-7)
        embed_x_log = torch.log1p(embed_x_afn)
        lnn_out = torch.matmul(self.weight, embed_x_log) + self.bias
        lnn_exp = torch.expm1(lnn_out)
        return F.relu(lnn_exp).contiguous().view(-1, self.log_neurons * self.embed_dim)


class Model(nn.Module):
    def __init__(self, arch: str) -> None:
        super().__init__()
        self.arch = arch
        self.linear = FeaturesLinear(FIELD_DIMS)
        nf = len(FIELD_DIMS)
        if arch == "ffm":
            self.ffm = FieldAwareFactorizationMachine(FIELD_DIMS, DIM)
        elif arch == "opnn":
            self.embedding = FeaturesEmbedding(FIELD_DIMS, DIM)
            self.pn = OuterProductNetwork(nf, DIM)
            self.mlp = nn.Sequential(nn.Linear(nf * (nf - 1) // 2 + nf * DIM, 8), nn.ReLU(),
                                     nn.Linear(8, 1))
        else:  # afn
            self.embedding = FeaturesEmbedding(FIELD_DIMS, DIM)
            self.lnn = LNN(nf, DIM, log_neurons=3)
            self.mlp = nn.Sequential(nn.BatchNorm1d(3 * DIM), nn.Linear(3 * DIM, 8),
                                     nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.arch == "ffm":
            ffm_term = torch.sum(torch.sum(self.ffm(x), dim=1), dim=1, keepdim=True)
            out = self.linear(x) + ffm_term
        elif self.arch == "opnn":
            embed_x = self.embedding(x)
            cross = self.pn(embed_x)
            out = self.linear(x) + self.mlp(torch.cat([embed_x.view(-1, embed_x.shape[1] * DIM),
                                                       cross], dim=1))
        else:
            out = self.linear(x) + self.mlp(self.lnn(self.embedding(x)))
        pred = torch.sigmoid(out.squeeze(1))
        return nn.BCELoss()(pred, target.float())


def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    with torch.device("cpu"):
        x = torch.stack([torch.randint(0, d, (B,), generator=g) for d in FIELD_DIMS], 1)
        target = torch.randint(0, 2, (B,), generator=g)
    return x.to(device), target.to(device)


def build(arch: str = "ffm") -> ModelSpec:
    torch.manual_seed(0)
    return spec_of(Model(arch), make_batch, B)
