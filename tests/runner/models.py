"""A tiny model with one table of every kind the runner shards, for the runner's tests.

Six tables cover the call forms of ``nn.EmbeddingBag`` and ``nn.Embedding``: sum and mean
pooling, ``include_last_offset`` both ways, per-sample weights, ``padding_idx``, 2-D input,
and a non-pooled lookup. Odd dims (5, 6) make column-wise splits uneven. Two dense regions
(``bottom``, ``top``) get strategies of their own. A step takes about a millisecond.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

B = 6  # samples per rank and step


class MultiTable(nn.Module):
    def __init__(self, computed_ids: bool = False) -> None:
        super().__init__()
        # t0 gets a copy of its ids made in the forward: the runner can't look it up ahead
        self.computed_ids = computed_ids
        self.t0 = nn.EmbeddingBag(40, 8, mode="sum", include_last_offset=True)
        self.t1 = nn.EmbeddingBag(30, 6, mode="mean", include_last_offset=True)
        self.t2 = nn.EmbeddingBag(25, 8, mode="sum")  # offsets without the last one
        self.t3 = nn.Embedding(20, 4)  # non-pooled: [B, L] -> [B, L, 4]
        self.t4 = nn.EmbeddingBag(50, 8, mode="mean", padding_idx=0)  # 2-D input
        self.t5 = nn.EmbeddingBag(33, 5, mode="sum", include_last_offset=True)
        self.bottom = nn.Sequential(nn.Linear(3, 8), nn.ReLU())
        width = 8 + 8 + 6 + 8 + 4 + 8 + 5
        self.top = nn.Sequential(
            nn.Linear(width, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 1)
        )

    def forward(
        self,
        dense: torch.Tensor,
        ids0: torch.Tensor,
        off0: torch.Tensor,
        ids1: torch.Tensor,
        off1: torch.Tensor,
        ids2: torch.Tensor,
        off2: torch.Tensor,
        w2: torch.Tensor,
        seq: torch.Tensor,
        ids4: torch.Tensor,
        ids5: torch.Tensor,
        off5: torch.Tensor,
        labels: torch.Tensor,
    ) -> torch.Tensor:
        feats = [
            self.bottom(dense),
            self.t0(ids0.clone() if self.computed_ids else ids0, off0),
            self.t1(ids1, off1),
            self.t2(ids2, off2, per_sample_weights=w2),
            self.t3(seq).mean(dim=1),
            self.t4(ids4),
            self.t5(ids5, off5),
        ]
        logits = self.top(torch.cat(feats, dim=1)).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, labels)


def _jagged(g: torch.Generator, rows: int, nnz: int, with_last: bool = True):
    cuts = torch.sort(torch.randint(0, nnz + 1, (B - 1,), generator=g)).values
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([nnz])])
    ids = torch.randint(0, rows, (nnz,), generator=g)
    return ids, (offsets if with_last else offsets[:-1])


def make_batch(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1000 + step)
    dense = torch.randn(B, 3, generator=g)
    ids0, off0 = _jagged(g, 40, 14)
    ids1, off1 = _jagged(g, 30, 9)
    ids2, off2 = _jagged(g, 25, 11, with_last=False)
    w2 = torch.rand(11, generator=g)
    seq = torch.randint(0, 20, (B, 3), generator=g)
    ids4 = torch.randint(0, 50, (B, 4), generator=g)
    ids4[0, :2] = 0  # padding entries
    ids4[1] = 0  # a bag of padding only
    ids5, off5 = _jagged(g, 33, 7)
    labels = torch.randint(0, 2, (B,), generator=g).float()
    batch = (dense, ids0, off0, ids1, off1, ids2, off2, w2, seq, ids4, ids5, off5, labels)
    return tuple(t.to(device) for t in batch)


def _example() -> tuple[torch.Tensor, ...]:
    return (
        torch.zeros(B, 3),
        torch.zeros(14, dtype=torch.long),
        torch.arange(B + 1) * 2,
        torch.zeros(9, dtype=torch.long),
        torch.arange(B + 1),
        torch.zeros(11, dtype=torch.long),
        torch.arange(B),
        torch.ones(11),
        torch.zeros(B, 3, dtype=torch.long),
        torch.ones(B, 4, dtype=torch.long),
        torch.zeros(7, dtype=torch.long),
        torch.arange(B + 1),
        torch.zeros(B),
    )


def _idle_t5_on_odd(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """``make_batch`` whose odd batches look ``t5`` up with no id (every bag empty): on two
    ranks, rank 1's batch (``step * 2 + 1``) never touches it."""
    batch = list(make_batch(step, device))
    if step % 2:
        batch[10] = batch[10][:0]
        batch[11] = torch.zeros_like(batch[11])
    return tuple(batch)


def build(computed_ids: bool = False, idle_t5_on_odd: bool = False) -> ModelSpec:
    return ModelSpec(
        model=MultiTable(computed_ids), example_inputs=_example(),
        make_batch=_idle_t5_on_odd if idle_t5_on_odd else make_batch, info={"batch_size": B}
    )
