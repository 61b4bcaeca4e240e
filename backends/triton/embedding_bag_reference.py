"""Eager PyTorch counterparts of ``BatchedEmbeddingBag``, written out for tests and benchmarks.

* ``pooled_lookup_reference``: one ``F.embedding_bag`` per table over the same KJT-style
  ``ids`` / ``offsets`` (``T*B+1``) input, concatenated to ``[B, sum(dims)]``.
* ``touched_rows``: the distinct rows of each table that a batch uses (the rows a sparse
  optimizer may update).
* ``rowwise_adagrad_step_`` and ``lazy_adam_step_``: the two optimizers applied to a *dense*
  gradient restricted to the touched rows, in plain PyTorch, in place. ``lazy_adam_step_`` is
  ``torch.optim.SparseAdam``'s arithmetic (plus optional decoupled weight decay, which
  SparseAdam lacks); the tests check that equivalence against SparseAdam itself.
* ``rounding_bound``: how far a low-precision table's stored row may lie from the exact fp32
  row the optimizer computed: one step of the storage grid (stochastic rounding picks one of
  the two neighbours), so "update = reference within the rounding" is a checkable claim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from gemc.table_precision import FP8_MAX
from gemc.table_quant import grid_step

__all__ = [
    "pooled_lookup_reference",
    "touched_rows",
    "rowwise_adagrad_step_",
    "lazy_adam_step_",
    "rounding_bound",
]


def _table_slice(offsets: torch.Tensor, table: int, batch: int) -> tuple[int, int, torch.Tensor]:
    bag_offsets = offsets[table * batch : (table + 1) * batch + 1].long()
    lo, hi = int(bag_offsets[0]), int(bag_offsets[-1])
    return lo, hi, bag_offsets - lo


def pooled_lookup_reference(
    weights: Sequence[torch.Tensor],
    ids: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    pooling: str = "sum",
) -> torch.Tensor:
    """``[B, sum(dims)]``: table ``t``'s pooled bags from ``F.embedding_bag`` (differentiable)."""
    batch = (offsets.numel() - 1) // len(weights)
    outs = []
    for t, weight in enumerate(weights):
        lo, hi, bag_offsets = _table_slice(offsets, t, batch)
        psw = None if per_sample_weights is None else per_sample_weights[lo:hi]
        outs.append(F.embedding_bag(ids[lo:hi].long(), weight, bag_offsets, mode=pooling,
                                    per_sample_weights=psw, include_last_offset=True))
    return torch.cat(outs, dim=1)


def touched_rows(ids: torch.Tensor, offsets: torch.Tensor, num_tables: int) -> list[torch.Tensor]:
    """Sorted distinct row ids of each table used by the batch."""
    batch = (offsets.numel() - 1) // num_tables
    rows = []
    for t in range(num_tables):
        lo, hi, _ = _table_slice(offsets, t, batch)
        rows.append(torch.unique(ids[lo:hi].long()))
    return rows


@torch.no_grad()
def rowwise_adagrad_step_(
    weight: torch.Tensor, grad: torch.Tensor, state_sum: torch.Tensor, rows: torch.Tensor,
    lr: float, eps: float, weight_decay: float = 0.0,
) -> None:
    """Row-wise Adagrad on ``rows``: ``acc += mean(g^2)``; ``w -= lr g / (sqrt(acc) + eps)``."""
    g = grad[rows] + weight_decay * weight[rows]
    state_sum[rows] += g.pow(2).mean(dim=1)
    weight[rows] -= lr * g / (state_sum[rows].sqrt()[:, None] + eps)


@torch.no_grad()
def lazy_adam_step_(
    weight: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    rows: torch.Tensor, step: int, lr: float, eps: float, betas: tuple[float, float],
    weight_decay: float = 0.0,
) -> None:
    """SparseAdam's update of ``rows`` (step ``step`` >= 1), decoupled weight decay first."""
    beta1, beta2 = betas
    g = grad[rows]
    exp_avg[rows] += (g - exp_avg[rows]) * (1 - beta1)
    exp_avg_sq[rows] += (g * g - exp_avg_sq[rows]) * (1 - beta2)
    step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
    weight[rows] *= 1 - lr * weight_decay
    weight[rows] -= step_size * exp_avg[rows] / (exp_avg_sq[rows].sqrt() + eps)


def rounding_bound(exact: torch.Tensor, precision: str) -> torch.Tensor:
    """Per element of fp32 ``[rows, dim]``: the grid step of the storage format at that value
    (fp8: in the row's fresh scale ``amax / 448``), with 1e-6 relative slack for the scale's
    own fp32 rounding. A stored value farther than this from ``exact`` was rounded wrongly."""
    if precision == "fp32":
        return torch.zeros_like(exact)
    if precision == "bf16":
        return grid_step(exact, "bf16")
    amax = exact.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return grid_step(exact / scale, "fp8") * scale * (1 + 1e-6) + 1e-6 * amax
