"""DeepFM, xDeepFM and FiBiNET as DeepCTR-Torch writes them (tiny sizes).

DeepCTR-Torch's idioms (``deepctr_torch/models/basemodel.py``, ``layers/interaction.py``):
one ``nn.Embedding`` per sparse field in an ``nn.ModuleDict`` keyed by the feature's name,
the whole input as ONE float tensor ``X`` whose columns ``feature_index`` maps to
features (ids are ``X[:, a:b].long()``); a linear part with 1-d embeddings; FM's second
order ``0.5 * ((sum e)^2 - sum e^2)``; CIN with ``torch.einsum`` outer products and
``nn.Conv1d``; SENet and bilinear interaction over ``itertools.combinations``; a DNN with
``use_bn`` (``nn.BatchNorm1d``) and dropout; ``PredictionLayer`` sigmoid, then
``F.binary_cross_entropy(..., reduction="sum")`` plus the L2 regularisation of the
embedding tables, as ``BaseModel.fit`` adds ``get_regularization_loss()``.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

B, EMB = 8, 4
SPARSE = {"user_id": 30, "item_id": 40, "cate_id": 10, "city": 7}
DENSE = ("price", "age")


def feature_index() -> dict[str, tuple[int, int]]:
    idx, start = {}, 0
    for name in [*SPARSE, *DENSE]:
        idx[name] = (start, start + 1)
        start += 1
    return idx


class DNN(nn.Module):
    def __init__(self, inputs_dim: int, hidden_units: tuple[int, ...], use_bn: bool,
                 dropout_rate: float, init_std: float = 1e-4) -> None:
        super().__init__()
        dims = [inputs_dim, *hidden_units]
        self.dropout = nn.Dropout(dropout_rate)
        self.use_bn = use_bn
        self.linears = nn.ModuleList(nn.Linear(dims[i], dims[i + 1]) for i in range(len(dims) - 1))
        if use_bn:
            self.bn = nn.ModuleList(nn.BatchNorm1d(dims[i + 1]) for i in range(len(dims) - 1))
        self.activation_layers = nn.ModuleList(nn.ReLU(inplace=True) for _ in hidden_units)
        for name, tensor in self.linears.named_parameters():
            if "weight" in name:
                nn.init.normal_(tensor, mean=0, std=init_std)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        deep_input = inputs
        for i in range(len(self.linears)):
            fc = self.linears[i](deep_input)
            if self.use_bn:
                fc = self.bn[i](fc)
            fc = self.activation_layers[i](fc)
            fc = self.dropout(fc)
            deep_input = fc
        return deep_input


class CIN(nn.Module):
    def __init__(self, field_size: int, layer_size: tuple[int, ...] = (8, 8),
                 split_half: bool = True) -> None:
        super().__init__()
        self.layer_size = layer_size
        self.field_nums = [field_size]
        self.split_half = split_half
        self.conv1ds = nn.ModuleList()
        for size in layer_size:
            self.conv1ds.append(nn.Conv1d(self.field_nums[-1] * self.field_nums[0], size, 1))
            self.field_nums.append(size // 2 if split_half else size)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        batch_size, dim = inputs.shape[0], inputs.shape[-1]
        hidden_nn_layers, final_result = [inputs], []
        for i, size in enumerate(self.layer_size):
            x = torch.einsum("bhd,bmd->bhmd", hidden_nn_layers[-1], hidden_nn_layers[0])
            x = x.reshape(batch_size, hidden_nn_layers[-1].shape[1] * hidden_nn_layers[0].shape[1], dim)
            curr_out = F.relu(self.conv1ds[i](x))
            if self.split_half and i != len(self.layer_size) - 1:
                next_hidden, direct_connect = torch.split(curr_out, 2 * [size // 2], 1)
            else:
                direct_connect, next_hidden = curr_out, 0
            final_result.append(direct_connect)
            hidden_nn_layers.append(next_hidden)
        return torch.sum(torch.cat(final_result, dim=1), -1)


class SENETLayer(nn.Module):
    def __init__(self, filed_size: int, reduction_ratio: int = 3) -> None:
        super().__init__()
        reduction_size = max(1, filed_size // reduction_ratio)
        self.excitation = nn.Sequential(nn.Linear(filed_size, reduction_size, bias=False), nn.ReLU(),
                                        nn.Linear(reduction_size, filed_size, bias=False), nn.ReLU())

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        Z = torch.mean(inputs, dim=-1, out=None)  # noqa: N806 - the paper's names
        A = self.excitation(Z)  # noqa: N806
        return torch.mul(inputs, torch.unsqueeze(A, dim=2))


class BilinearInteraction(nn.Module):
    """``field_each`` / ``field_all`` weights as ``nn.Parameter``s (FiBiNET's paper form)."""

    def __init__(self, filed_size: int, embedding_size: int, bilinear_type: str) -> None:
        super().__init__()
        self.bilinear_type = bilinear_type
        n = filed_size if bilinear_type == "each" else 1
        self.W = nn.Parameter(torch.empty(n, embedding_size, embedding_size))
        nn.init.xavier_normal_(self.W)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        fields = torch.split(inputs, 1, dim=1)
        if self.bilinear_type == "all":
            p = [torch.mul(torch.matmul(v_i, self.W[0]), v_j)
                 for v_i, v_j in itertools.combinations(fields, 2)]
        else:
            p = [torch.mul(torch.matmul(fields[i], self.W[i]), fields[j])
                 for i, j in itertools.combinations(range(len(fields)), 2)]
        return torch.cat(p, dim=1)


class BaseModel(nn.Module):
    def __init__(self, arch: str, use_bn: bool, dropout: float, l2_reg_embedding: float,
                 init_std: float = 1e-4, sparse: bool = False) -> None:
        super().__init__()
        self.arch = arch
        self.feature_index = feature_index()
        # create_embedding_matrix(..., sparse=sparse)
        self.embedding_dict = nn.ModuleDict({f: nn.Embedding(v, EMB, sparse=sparse)
                                             for f, v in SPARSE.items()})
        self.linear_embedding_dict = nn.ModuleDict({f: nn.Embedding(v, 1, sparse=sparse)
                                                    for f, v in SPARSE.items()})
        for tensor in [*self.embedding_dict.values(), *self.linear_embedding_dict.values()]:
            nn.init.normal_(tensor.weight, mean=0, std=init_std)
        self.dense_weight = nn.Parameter(torch.Tensor(len(DENSE), 1))
        nn.init.normal_(self.dense_weight, mean=0, std=init_std)
        self.l2_reg_embedding = l2_reg_embedding
        n = len(SPARSE)
        if arch == "xdeepfm":
            self.cin = CIN(n)
            self.cin_linear = nn.Linear(8 // 2 + 8, 1, bias=False)
        if arch.startswith("fibinet"):
            self.se_net = SENETLayer(n)
            self.bilinear = BilinearInteraction(n, EMB, arch.split("_")[1])
            dnn_in = 2 * (n * (n - 1) // 2) * EMB + len(DENSE)
        else:
            dnn_in = n * EMB + len(DENSE)
        self.dnn = DNN(dnn_in, (16, 8), use_bn, dropout, init_std)
        self.dnn_linear = nn.Linear(8, 1, bias=False)
        self.bias = nn.Parameter(torch.zeros((1,)))

    def input_from_feature_columns(self, X: torch.Tensor, embedding_dict: nn.ModuleDict  # noqa: N803
                                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        sparse = [embedding_dict[f](X[:, self.feature_index[f][0]:self.feature_index[f][1]].long())
                  for f in SPARSE]
        dense = [X[:, self.feature_index[f][0]:self.feature_index[f][1]] for f in DENSE]
        return sparse, dense

    def get_regularization_loss(self) -> torch.Tensor:
        total = torch.zeros((1,), device=self.bias.device)
        for w in self.embedding_dict.parameters():
            total = total + self.l2_reg_embedding * torch.sum(torch.square(w))
        return total

    def forward(self, X: torch.Tensor) -> torch.Tensor:  # noqa: N803
        sparse, dense = self.input_from_feature_columns(X, self.embedding_dict)
        lin_sparse, _ = self.input_from_feature_columns(X, self.linear_embedding_dict)
        logit = torch.sum(torch.cat(lin_sparse, dim=-1), dim=-1, keepdim=False)
        logit = logit + torch.cat(dense, dim=-1).matmul(self.dense_weight)
        fm_input = torch.cat(sparse, dim=1)  # [B, F, E]
        if self.arch == "deepfm":
            square_of_sum = torch.pow(torch.sum(fm_input, dim=1, keepdim=True), 2)
            sum_of_square = torch.sum(fm_input * fm_input, dim=1, keepdim=True)
            logit = logit + 0.5 * torch.sum(square_of_sum - sum_of_square, dim=2, keepdim=False)
        if self.arch == "xdeepfm":
            logit = logit + self.cin_linear(self.cin(fm_input))
        if self.arch.startswith("fibinet"):
            senet = self.se_net(fm_input)
            fm_input = torch.cat([self.bilinear(fm_input), self.bilinear(senet)], dim=1)
        dnn_input = torch.cat([torch.flatten(fm_input, start_dim=1), *dense], dim=-1)
        logit = logit + self.dnn_linear(self.dnn(dnn_input))
        return torch.sigmoid(logit + self.bias)


class Fit(nn.Module):
    """``BaseModel.fit``'s loss as the forward: BCE (sum) + the embeddings' L2."""

    def __init__(self, model: BaseModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # noqa: N803
        y_pred = self.model(X).squeeze()
        loss = F.binary_cross_entropy(y_pred, y.squeeze(), reduction="sum")
        return loss + self.model.get_regularization_loss().squeeze()


def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + step)
    cols = [torch.randint(0, v, (B, 1), generator=g).float() for v in SPARSE.values()]
    cols += [torch.rand(B, 1, generator=g) for _ in DENSE]
    y = (torch.rand(B, 1, generator=g) < 0.3).float()
    return torch.cat(cols, dim=1).to(device), y.to(device)


def build(arch: str = "deepfm", use_bn: bool = False, dropout: float = 0.0,
          l2_reg_embedding: float = 1e-5, init_std: float = 1e-4, sparse: bool = False
          ) -> ModelSpec:
    """``arch``: deepfm, xdeepfm, fibinet_each, fibinet_all; ``sparse``: sparse gradients
    of the tables (``nn.Embedding(sparse=True)``)."""
    torch.manual_seed(1024)
    model = Fit(BaseModel(arch, use_bn, dropout, l2_reg_embedding, init_std, sparse))
    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=B)
