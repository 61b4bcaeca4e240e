"""DLRM's dot interaction as the reference implementation and its ports write it (tiny).

``interaction``: ``torch.bmm(T, T.transpose(1, 2))`` over the dense output and the pooled
embeddings, the strictly lower triangle gathered by index lists ``li``/``lj``:

* ``index="forward"``: built in forward from Python lists (``torch.tensor([...])``, the
  reference DLRM's ``interact_features``);
* ``index="attribute"``: built once in ``__init__`` as a plain tensor attribute (not a
  registered buffer), as many ports do;
* ``index="tril"``: ``torch.tril_indices(n, n, offset=-1)`` in forward.

Sparse features are ``nn.EmbeddingBag(mode="sum")`` per table over 2-D multi-hot ids.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec
from tests.models.probes_d.common import seeded_batch, spec_of

B, DIM, L = 8, 4, 3
TABLES = (20, 15, 10)


class DLRM(nn.Module):
    def __init__(self, index: str) -> None:
        super().__init__()
        self.index = index
        self.emb_l = nn.ModuleList(nn.EmbeddingBag(n, DIM, mode="sum") for n in TABLES)
        self.bot_l = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, DIM), nn.ReLU())
        n = len(TABLES) + 1
        pairs = n * (n - 1) // 2
        self.top_l = nn.Sequential(nn.Linear(DIM + pairs, 8), nn.ReLU(), nn.Linear(8, 1))
        if index == "attribute":
            self.li = torch.tensor([i for i in range(n) for j in range(i)])
            self.lj = torch.tensor([j for i in range(n) for j in range(i)])

    def interact_features(self, x: torch.Tensor, ly: list[torch.Tensor]) -> torch.Tensor:
        (batch_size, d) = x.shape
        T = torch.cat([x] + ly, dim=1).view((batch_size, -1, d))  # noqa: N806
        Z = torch.bmm(T, torch.transpose(T, 1, 2))  # noqa: N806
        _, ni, nj = Z.shape
        if self.index == "forward":
            li = torch.tensor([i for i in range(ni) for j in range(i)])
            lj = torch.tensor([j for i in range(nj) for j in range(i)])
        elif self.index == "attribute":
            li, lj = self.li, self.lj
        else:
            li, lj = torch.tril_indices(ni, nj, offset=-1, device=x.device)
        Zflat = Z[:, li, lj]  # noqa: N806
        return torch.cat([x] + [Zflat], dim=1)

    def forward(self, dense_x: torch.Tensor, lS_i: torch.Tensor,  # noqa: N803
                target: torch.Tensor) -> torch.Tensor:
        x = self.bot_l(dense_x)
        ly = [emb(lS_i[k]) for k, emb in enumerate(self.emb_l)]
        z = self.interact_features(x, ly)
        p = torch.sigmoid(self.top_l(z))
        return F.binary_cross_entropy(p.squeeze(1), target)


def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    return seeded_batch(1100 + step, device, lambda g: (
        torch.rand(B, 3, generator=g),
        torch.stack([torch.randint(0, n, (B, L), generator=g) for n in TABLES]),
        (torch.rand(B, generator=g) < 0.3).float()))


def build(index: str = "forward") -> ModelSpec:
    torch.manual_seed(0)
    return spec_of(DLRM(index), make_batch, B)
