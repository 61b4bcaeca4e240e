"""Multi-task heads: PLE (Tang et al., RecSys 2020) and ESMM (Ma et al., SIGIR 2018).

Idioms: PLE's task-specific and shared experts with softmax gates mixed by ``torch.stack``
and ``torch.bmm``; ESMM's ``pCTCVR = pCTR * pCVR`` with both losses summed; label masks
(``mask="where"``: ``torch.where(present, loss, 0).sum() / present.sum()``; ``"index"``:
``loss[present].mean()``, a data-dependent shape); ``nn.BCEWithLogitsLoss(pos_weight=...)``;
``returns``: ``"loss"`` (one scalar), ``"dict"`` (a dict of per-task losses) or ``"tuple"``
(``(loss, logits)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

B, ROWS, DIM, FIELDS, H = 8, 40, 4, 3, 8
TASKS = ("ctr", "cvr")


def mlp(i: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, o), nn.ReLU())


class CGC(nn.Module):
    """One PLE extraction layer: per-task experts + shared experts, a gate per task (and
    one for the shared output unless it is the last layer)."""

    def __init__(self, in_dim: int, n_spec: int, n_shared: int, last: bool) -> None:
        super().__init__()
        self.n_spec, self.last = n_spec, last
        self.spec = nn.ModuleList(nn.ModuleList(mlp(in_dim, H) for _ in range(n_spec)) for _ in TASKS)
        self.shared = nn.ModuleList(mlp(in_dim, H) for _ in range(n_shared))
        self.gates = nn.ModuleList(nn.Linear(in_dim, n_spec + n_shared) for _ in TASKS)
        if not last:
            self.shared_gate = nn.Linear(in_dim, len(TASKS) * n_spec + n_shared)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        shared = [e(xs[-1]) for e in self.shared]
        outs = []
        for t, x in enumerate(xs[:-1]):
            experts = torch.stack([e(x) for e in self.spec[t]] + shared, dim=1)  # [B, E, H]
            gate = F.softmax(self.gates[t](x), dim=-1).unsqueeze(1)  # [B, 1, E]
            outs.append(torch.bmm(gate, experts).squeeze(1))
        if not self.last:
            every = torch.stack([e(x) for t, x in enumerate(xs[:-1]) for e in self.spec[t]]
                                + shared, dim=1)
            gate = F.softmax(self.shared_gate(xs[-1]), dim=-1).unsqueeze(1)
            outs.append(torch.bmm(gate, every).squeeze(1))
        return outs


class MultiTask(nn.Module):
    def __init__(self, arch: str, mask: str | None, pos_weight: float | None, returns: str) -> None:
        super().__init__()
        self.arch, self.mask, self.returns = arch, mask, returns
        self.emb = nn.ModuleList(nn.Embedding(ROWS, DIM) for _ in range(FIELDS))
        d = FIELDS * DIM
        if arch == "ple":
            self.layers = nn.ModuleList([CGC(d, 2, 1, last=False), CGC(H, 2, 1, last=True)])
            self.towers = nn.ModuleList(nn.Linear(H, 1) for _ in TASKS)
        else:  # esmm: two towers over the shared embeddings
            self.towers = nn.ModuleList(nn.Sequential(mlp(d, H), nn.Linear(H, 1)) for _ in TASKS)
        pw = None if pos_weight is None else torch.tensor([pos_weight])
        self.bce = nn.BCEWithLogitsLoss(pos_weight=pw, reduction="none" if mask else "mean")

    def task_loss(self, logit: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        loss = self.bce(logit, label.clamp(min=0.0))
        if self.mask == "where":
            present = label >= 0
            return torch.where(present, loss, torch.zeros_like(loss)).sum() / present.sum().clamp(min=1)
        if self.mask == "index":
            return loss[label >= 0].mean()
        return loss

    def forward(self, ids: torch.Tensor, ctr: torch.Tensor, cvr: torch.Tensor):  # noqa: ANN201
        x = torch.cat([e(ids[:, i]) for i, e in enumerate(self.emb)], dim=1)
        if self.arch == "ple":
            xs = [x] * (len(TASKS) + 1)
            for layer in self.layers:
                xs = layer(xs)
            logits = [tower(h).squeeze(-1) for tower, h in zip(self.towers, xs)]
            losses = {t: self.task_loss(lg, y) for t, lg, y in zip(TASKS, logits, (ctr, cvr))}
        else:
            p_ctr, p_cvr = (torch.sigmoid(t(x).squeeze(-1)) for t in self.towers)
            p_ctcvr = p_ctr * p_cvr
            logits = [p_ctr, p_ctcvr]
            losses = {"ctr": F.binary_cross_entropy(p_ctr, ctr),
                      "ctcvr": F.binary_cross_entropy(p_ctcvr, ctr * cvr)}
        loss = sum(losses.values())
        if self.returns == "dict":
            return losses
        if self.returns == "tuple":
            return loss, torch.stack(logits, 1)
        return loss


def make_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, ROWS, (B, FIELDS), generator=g)
    ctr = (torch.rand(B, generator=g) < 0.5).float()
    cvr = ctr * (torch.rand(B, generator=g) < 0.5).float()
    cvr = torch.where(ctr > 0, cvr, torch.full_like(cvr, -1.0))  # -1: no label (no click)
    return ids.to(device), ctr.to(device), cvr.to(device)


def build(arch: str = "ple", mask: str | None = None, pos_weight: float | None = None,
          returns: str = "loss") -> ModelSpec:
    """``arch``: ple or esmm (esmm's CVR is learned through CTCVR; ``mask`` applies to ple)."""
    torch.manual_seed(0)
    model = MultiTask(arch, mask, pos_weight, returns)
    return ModelSpec(model=model, example_inputs=make_batch(0, "cpu"), make_batch=make_batch,
                     batch_size=B)
