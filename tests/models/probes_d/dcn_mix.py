"""DCN-V2's low-rank mixture-of-experts cross network ("DCN-Mix", Wang et al., WWW 2021),
as TorchRec's ``LowRankMixtureCrossNet`` / DeepCTR-Torch's ``CrossNetMix`` write it (tiny).

Per layer ``l`` and expert ``e``: ``U_l^e`` (in x r), ``V_l^e`` (in x r), ``C_l^e`` (r x r) as
``nn.ParameterList``s of raw parameters, ``x_l_e = x0 * (U @ g(C @ g(V^T x_l)) + b_l)`` with
``g = tanh``, a gate per expert (``nn.Linear(in, 1, bias=False)``) over ``x_l``, experts
stacked and mixed by ``softmax`` over the experts (``torch.matmul(outputs, gates)``), then the
residual ``+ x_l``. The stacked and parallel structures (``structure``): cross then deep, or
cross and deep side by side, concatenated; embeddings of the sparse fields and the dense
features concatenated into ``x0``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec
from tests.models.probes_d.common import seeded_batch, spec_of

B, DIM, RANK, EXPERTS, LAYERS = 8, 4, 2, 3, 2
FIELDS = (30, 20, 10)
N_DENSE = 3


class CrossNetMix(nn.Module):
    def __init__(self, in_features: int, low_rank: int, num_experts: int, layer_num: int) -> None:
        super().__init__()
        self.layer_num, self.num_experts = layer_num, num_experts
        self.U_list = nn.ParameterList(nn.Parameter(nn.init.xavier_normal_(
            torch.empty(num_experts, in_features, low_rank))) for _ in range(layer_num))
        self.V_list = nn.ParameterList(nn.Parameter(nn.init.xavier_normal_(
            torch.empty(num_experts, in_features, low_rank))) for _ in range(layer_num))
        self.C_list = nn.ParameterList(nn.Parameter(nn.init.xavier_normal_(
            torch.empty(num_experts, low_rank, low_rank))) for _ in range(layer_num))
        self.gating = nn.ModuleList(nn.Linear(in_features, 1, bias=False)
                                    for _ in range(num_experts))
        self.bias = nn.ParameterList(nn.Parameter(nn.init.zeros_(
            torch.empty(in_features, 1))) for _ in range(layer_num))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x_0 = inputs.unsqueeze(2)  # (bs, in_features, 1)
        x_l = x_0
        for i in range(self.layer_num):
            output_of_experts, gating_score_of_experts = [], []
            for expert_id in range(self.num_experts):
                gating_score_of_experts.append(self.gating[expert_id](x_l.squeeze(2)))
                v_x = torch.matmul(self.V_list[i][expert_id].t(), x_l)  # (bs, low_rank, 1)
                v_x = torch.tanh(v_x)
                v_x = torch.matmul(self.C_list[i][expert_id], v_x)
                v_x = torch.tanh(v_x)
                uv_x = torch.matmul(self.U_list[i][expert_id], v_x)  # (bs, in_features, 1)
                dot_ = uv_x + self.bias[i]
                dot_ = x_0 * dot_  # Hadamard-product
                output_of_experts.append(dot_.squeeze(2))
            output_of_experts = torch.stack(output_of_experts, 2)  # (bs, in_features, E)
            gating_score_of_experts = torch.stack(gating_score_of_experts, 1)  # (bs, E, 1)
            moe_out = torch.matmul(output_of_experts, gating_score_of_experts.softmax(1))
            x_l = moe_out + x_l  # (bs, in_features, 1)
        return x_l.squeeze()


class DCNMix(nn.Module):
    def __init__(self, structure: str) -> None:
        super().__init__()
        self.structure = structure
        self.embedding_dict = nn.ModuleDict({f"C{i}": nn.Embedding(rows, DIM)
                                             for i, rows in enumerate(FIELDS)})
        d = len(FIELDS) * DIM + N_DENSE
        self.crossnet = CrossNetMix(d, RANK, EXPERTS, LAYERS)
        self.dnn = nn.Sequential(nn.Linear(d, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        out = 8 if structure == "stacked" else d + 8
        self.dnn_linear = nn.Linear(out, 1, bias=False)

    def forward(self, sparse: torch.Tensor, dense: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        emb = [self.embedding_dict[f"C{i}"](sparse[:, i]) for i in range(len(FIELDS))]
        x = torch.cat([*emb, dense], dim=-1)
        if self.structure == "stacked":
            h = self.dnn(self.crossnet(x))
        else:
            h = torch.cat([self.crossnet(x), self.dnn(x)], dim=-1)
        return F.binary_cross_entropy(torch.sigmoid(self.dnn_linear(h)).squeeze(-1), y)


def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    return seeded_batch(400 + step, device, lambda g: (
        torch.stack([torch.randint(0, r, (B,), generator=g) for r in FIELDS], 1),
        torch.randn(B, N_DENSE, generator=g), (torch.rand(B, generator=g) < 0.3).float()))


def build(structure: str = "parallel") -> ModelSpec:
    torch.manual_seed(0)
    return spec_of(DCNMix(structure), make_batch, B)
