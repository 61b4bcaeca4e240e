"""MMoE (Ma et al., KDD 2018) with losses weighted by learned task uncertainty (Kendall et
al., CVPR 2018), as multi-task libraries write them (tiny).

Idioms: the batch is ``(features, labels)`` with both dicts keyed by name; experts stacked
``[B, H, E]`` and gated per task with ``torch.einsum("bhe,be->bh", ...)``; towers in an
``nn.ModuleDict`` keyed by task; per-task losses from a dict of loss modules
(``nn.BCEWithLogitsLoss`` for "click", ``nn.MSELoss`` for "stay"); the total
``sum(exp(-s_t) * L_t + s_t)`` with ``s = nn.Parameter(torch.zeros(T))``; a multi-hot tag
field pooled by ``nn.EmbeddingBag(mode="mean", padding_idx=0)`` over padded 2-D ids (the
padding excluded from the mean).
"""

from __future__ import annotations

import torch
from torch import nn

from gemc.spec import ModelSpec
from tests.models.probes_d.common import spec_of

B, DIM, H, E, L = 8, 4, 6, 3, 4
TASKS = ("click", "stay")


class MMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Embedding(20, DIM)
        self.item = nn.Embedding(30, DIM)
        self.tags = nn.EmbeddingBag(15, DIM, mode="mean", padding_idx=0)
        d = 3 * DIM
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, H), nn.ReLU()) for _ in range(E))
        self.gates = nn.ModuleDict({t: nn.Linear(d, E) for t in TASKS})
        self.towers = nn.ModuleDict({t: nn.Sequential(nn.Linear(H, 4), nn.ReLU(), nn.Linear(4, 1))
                                     for t in TASKS})
        self.losses = nn.ModuleDict({"click": nn.BCEWithLogitsLoss(), "stay": nn.MSELoss()})
        self.log_vars = nn.Parameter(torch.zeros(len(TASKS)))

    def forward(self, features: dict[str, torch.Tensor], labels: dict[str, torch.Tensor]
                ) -> torch.Tensor:
        x = torch.cat([self.user(features["user"]), self.item(features["item"]),
                       self.tags(features["tags"])], dim=-1)
        experts = torch.stack([e(x) for e in self.experts], dim=-1)  # [B, H, E]
        total = x.new_zeros(())
        for i, task in enumerate(TASKS):
            gate = torch.softmax(self.gates[task](x), dim=-1)
            out = self.towers[task](torch.einsum("bhe,be->bh", experts, gate)).squeeze(-1)
            loss = self.losses[task](out, labels[task])
            total = total + torch.exp(-self.log_vars[i]) * loss + self.log_vars[i]
        return total


def make_batch(step: int, device: torch.device | str) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(1300 + step)
    with torch.device("cpu"):
        n = torch.randint(0, L + 1, (B,), generator=g)
        tags = torch.randint(1, 15, (B, L), generator=g) * (torch.arange(L)[None] < n[:, None])
        features = {"user": torch.randint(0, 20, (B,), generator=g),
                    "item": torch.randint(0, 30, (B,), generator=g), "tags": tags}
        click = (torch.rand(B, generator=g) < 0.4).float()
        labels = {"click": click, "stay": click * torch.rand(B, generator=g) * 3}
    return ({k: v.to(device) for k, v in features.items()},
            {k: v.to(device) for k, v in labels.items()})


def build() -> ModelSpec:
    torch.manual_seed(0)
    return spec_of(MMoE(), make_batch, B)
