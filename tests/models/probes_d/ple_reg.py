"""PLE (Tang et al., RecSys 2020) with a classification and a regression task, losses summed
with weights, in the idiom of the open multi-task libraries (MTReclib / PaddleRec, tiny).

Idioms: experts as one ``nn.ModuleList`` per kind (task-specific per task, shared), each
level's experts stacked ``[B, E, H]`` and mixed by a softmax gate through
``torch.einsum("be,beh->bh", ...)``; two extraction levels (the first also gates the shared
experts for the next level); towers per task; ``loss = w_ctr * BCE(sigmoid(ctr)) +
w_time * MSE(watch_time)`` with the weights as Python floats (``weights``), the regression
target ``log1p``-scaled in forward, and one task's loss optionally scaled by a
non-trainable ``register_buffer`` (``buffer_weight``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec
from tests.models.probes_d.common import spec_of

B, DIM, H = 8, 4, 8
FIELDS = (30, 20, 8)
N_TASKS, N_SPEC, N_SHARED = 2, 2, 1


def expert(i: int) -> nn.Module:
    return nn.Sequential(nn.Linear(i, H), nn.ReLU())


class ExtractionLayer(nn.Module):
    def __init__(self, in_dim: int, last: bool) -> None:
        super().__init__()
        self.last = last
        self.task_experts = nn.ModuleList(nn.ModuleList(expert(in_dim) for _ in range(N_SPEC))
                                          for _ in range(N_TASKS))
        self.shared_experts = nn.ModuleList(expert(in_dim) for _ in range(N_SHARED))
        self.task_gates = nn.ModuleList(
            nn.Sequential(nn.Linear(in_dim, N_SPEC + N_SHARED), nn.Softmax(dim=-1))
            for _ in range(N_TASKS))
        if not last:
            self.shared_gate = nn.Sequential(
                nn.Linear(in_dim, N_TASKS * N_SPEC + N_SHARED), nn.Softmax(dim=-1))

    def forward(self, task_in: list[torch.Tensor], shared_in: torch.Tensor
                ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        shared_out = [e(shared_in) for e in self.shared_experts]
        task_out, all_out = [], []
        for i in range(N_TASKS):
            spec = [e(task_in[i]) for e in self.task_experts[i]]
            all_out += spec
            stacked = torch.stack(spec + shared_out, dim=1)
            task_out.append(torch.einsum("be,beh->bh", self.task_gates[i](task_in[i]), stacked))
        if self.last:
            return task_out, None
        stacked = torch.stack(all_out + shared_out, dim=1)
        return task_out, torch.einsum("be,beh->bh", self.shared_gate(shared_in), stacked)


class PLE(nn.Module):
    def __init__(self, weights: tuple[float, float], buffer_weight: bool) -> None:
        super().__init__()
        self.w_ctr, self.w_time = weights
        self.embeddings = nn.ModuleList(nn.Embedding(r, DIM) for r in FIELDS)
        d = DIM * len(FIELDS)
        self.levels = nn.ModuleList([ExtractionLayer(d, last=False), ExtractionLayer(H, last=True)])
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(H, 4), nn.ReLU(), nn.Linear(4, 1))
                                    for _ in range(N_TASKS))
        self.register_buffer("time_scale", torch.tensor(0.5) if buffer_weight else torch.tensor(1.0))

    def forward(self, x: torch.Tensor, click: torch.Tensor, watch_time: torch.Tensor
                ) -> torch.Tensor:
        emb = torch.cat([e(x[:, i]) for i, e in enumerate(self.embeddings)], dim=-1)
        task_in, shared = [emb] * N_TASKS, emb
        for level in self.levels:
            task_in, shared = level(task_in, shared)
        ctr_logit, time_pred = (t(h).squeeze(-1) for t, h in zip(self.towers, task_in))
        ctr_loss = F.binary_cross_entropy(torch.sigmoid(ctr_logit), click)
        time_loss = F.mse_loss(time_pred, torch.log1p(watch_time)) * self.time_scale
        return self.w_ctr * ctr_loss + self.w_time * time_loss


def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(900 + step)
    with torch.device("cpu"):
        x = torch.stack([torch.randint(0, r, (B,), generator=g) for r in FIELDS], 1)
        click = (torch.rand(B, generator=g) < 0.5).float()
        watch_time = click * torch.rand(B, generator=g) * 30.0
    return tuple(t.to(device) for t in (x, click, watch_time))


def build(weights: tuple[float, float] = (1.0, 0.3), buffer_weight: bool = True) -> ModelSpec:
    torch.manual_seed(0)
    return spec_of(PLE(tuple(weights), buffer_weight), make_batch, B)
