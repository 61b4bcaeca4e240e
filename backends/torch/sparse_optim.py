"""Sparse optimizers for embedding tables: only the rows a step used are touched.

Two update rules, the same formulas as the fused Triton kernel
(``gemc.backends.triton.embedding_bag``), so either can stand in for the other:

``rowwise_adagrad`` (default)
    one accumulator per row: ``g += weight_decay * w``; ``acc += mean(g ** 2)`` over the
    row's *full* width; ``w -= lr * g / (sqrt(acc) + eps)``.
``adam``
    lazy Adam (``torch.optim.SparseAdam``'s semantics): per-element moments of the used rows
    only, one global step count for the bias correction, decoupled weight decay on the used
    rows.

The row update functions compute each used row's new value in fp32 and write it back
through :class:`~gemc.backends.torch.table_storage.StoredRows` (a bf16 / fp8 table rounds
it stochastically there); its gradient is fp32 whatever the storage. They are shared by
the sharded optimizer (:class:`EmbeddingOptimizer`)
and the single-process reference, so both apply the same arithmetic. In the sharded case:

* the gradient arrives as the shard's sparse gradient (the rows requested by every rank) and
  is divided by the world size: each rank's loss is its own batch's mean, the global loss the
  mean over ranks, as in DDP;
* a ``data_parallel`` replica all-reduces its gradient and the set of used rows, so every
  replica applies the same update;
* a row split over column shards (``column_wise``, ``grid``) all-reduces the per-row sum of
  squares over the ranks holding that row's columns, so the row-wise Adagrad accumulator
  is the same mean over the full width that one process computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from gemc.backends.torch.table_storage import StoredRows

from gemc.plan import TABLE_OPTIMIZERS as EMBEDDING_OPTIMIZERS  # noqa: E402 (one list)


@dataclass(frozen=True)
class EmbeddingOptimConfig:
    """Hyperparameters of the sparse optimizer."""

    kind: str = "rowwise_adagrad"
    lr: float = 0.01
    eps: float = 1e-8
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0

    @classmethod
    def default_for(cls, kind: str, lr: float | None = None) -> EmbeddingOptimConfig:
        if kind not in EMBEDDING_OPTIMIZERS:
            raise ValueError(f"embedding optimizer must be one of {EMBEDDING_OPTIMIZERS}")
        default_lr = 0.01 if kind == "rowwise_adagrad" else 0.001
        return cls(kind=kind, lr=default_lr if lr is None else float(lr))


def coalesced_rows(grad: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(sorted unique rows, summed row gradients) of a sparse or dense gradient."""
    if grad is None:
        return None
    if grad.is_sparse:
        g = grad.coalesce()
        return g.indices()[0], g.values()
    rows = torch.nonzero(grad.abs().sum(dim=1)).flatten()
    return rows, grad[rows]


@torch.no_grad()
def rowwise_adagrad_rows_(
    weight: StoredRows,
    state_sum: torch.Tensor,
    rows: torch.Tensor,
    grad_rows: torch.Tensor,
    cfg: EmbeddingOptimConfig,
    full_dim: int,
    sq_group: dist.ProcessGroup | None = None,
) -> None:
    """Row-wise Adagrad on ``rows``; ``sq_group`` sums the squares over column shards."""
    g = grad_rows.float()
    w = weight.read(rows)
    if cfg.weight_decay:
        g = g + cfg.weight_decay * w
    sq = g.pow(2).sum(dim=1)
    if sq_group is not None:
        dist.all_reduce(sq, group=sq_group)
    state_sum.index_add_(0, rows, sq / full_dim)
    weight.write(rows, w - cfg.lr * g / (state_sum[rows].sqrt().unsqueeze(1) + cfg.eps))


@torch.no_grad()
def lazy_adam_rows_(
    weight: StoredRows,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    rows: torch.Tensor,
    grad_rows: torch.Tensor,
    step: int,
    cfg: EmbeddingOptimConfig,
) -> None:
    """SparseAdam's update of ``rows`` at global step ``step`` (>= 1)."""
    beta1, beta2 = cfg.betas
    g = grad_rows.float()
    m = exp_avg[rows]
    v = exp_avg_sq[rows]
    m += (g - m) * (1 - beta1)
    v += (g * g - v) * (1 - beta2)
    exp_avg[rows] = m
    exp_avg_sq[rows] = v
    step_size = cfg.lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
    w = weight.read(rows)
    if cfg.weight_decay:
        w = w * (1 - cfg.lr * cfg.weight_decay)
    weight.write(rows, w - step_size * m / (v.sqrt() + cfg.eps))


class RowState:
    """The optimizer state of one table's local shard (or of a whole reference table)."""

    def __init__(self, weight: torch.Tensor, kind: str) -> None:
        dev = weight.device
        if kind == "rowwise_adagrad":
            self.tensors = {"sum": torch.zeros(weight.shape[0], device=dev)}
        else:
            self.tensors = {
                "exp_avg": torch.zeros(weight.shape, device=dev),
                "exp_avg_sq": torch.zeros(weight.shape, device=dev),
            }

    def apply(
        self,
        weight: torch.Tensor | StoredRows,
        rows: torch.Tensor,
        grad_rows: torch.Tensor,
        cfg: EmbeddingOptimConfig,
        step: int,
        full_dim: int,
        sq_group: dist.ProcessGroup | None = None,
    ) -> None:
        """Update ``rows`` of ``weight`` (a plain tensor, or a shard's stored rows)."""
        if isinstance(weight, torch.Tensor):
            weight = StoredRows(weight)
        if cfg.kind == "rowwise_adagrad":
            rowwise_adagrad_rows_(
                weight, self.tensors["sum"], rows, grad_rows, cfg, full_dim, sq_group
            )
        else:
            lazy_adam_rows_(
                weight, self.tensors["exp_avg"], self.tensors["exp_avg_sq"], rows, grad_rows, step, cfg
            )


class EmbeddingOptimizer:
    """Steps every sharded table of a model; see the module doc for what is reduced where.

    ``column_groups`` maps a table fqn to the process group of the ranks that hold the other
    columns of this rank's rows (``None`` when this rank holds whole rows).
    """

    def __init__(
        self,
        tables: dict[str, Any],
        cfg: EmbeddingOptimConfig,
        *,
        world_size: int,
        column_groups: dict[str, dist.ProcessGroup | None] | None = None,
    ) -> None:
        self.tables = tables  # fqn -> ShardedEmbedding
        self.cfg = cfg
        self.world_size = world_size
        self.column_groups = column_groups or {}
        self.step_count = 0
        self.fused: dict[str, Any] = {}  # fqn -> module whose backward applies the update
        self.state: dict[str, RowState] = {
            fqn: RowState(m.weight, cfg.kind)
            for fqn, m in tables.items()
            if m.weight is not None
        }

    def adopt_fused(self, fqn: str, tensors: dict[str, torch.Tensor], module: Any) -> None:
        """Table ``fqn`` is updated inside ``module``'s backward (a fused kernel); its state
        lives there (``tensors`` are views of it) and :meth:`step` leaves it alone."""
        self.state[fqn].tensors = dict(tensors)
        self.fused[fqn] = module

    def set_step_count(self, count: int) -> None:
        """After a resume: the bias-correction step of Adam, here and in fused modules."""
        self.step_count = count
        for module in {id(m): m for m in self.fused.values()}.values():
            module.step = count

    def zero_grad(self) -> None:
        for m in self.tables.values():
            if m.weight is not None:
                m.weight.grad = None
            m.working.clear()

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        for fqn, m in self.tables.items():
            if m.weight is None or fqn in self.fused:
                continue
            w = m.weight
            got = coalesced_rows(w.grad) if m.precision == "fp32" else m.take_row_grads()
            if m.replicated and self.world_size > 1:
                got = self._all_reduce_replica(w, got)
            if got is None:
                continue
            rows, g = got
            if rows.numel() == 0:
                continue
            g = g / self.world_size
            self.state[fqn].apply(
                m.stored_rows(self.step_count),
                rows,
                g,
                self.cfg,
                self.step_count,
                m.embedding_dim,
                self.column_groups.get(fqn),
            )

    def _all_reduce_replica(
        self, w: torch.Tensor, got: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum a replica's gradient and its used rows over all ranks (dense: DP tables are small)."""
        dense = torch.zeros(w.shape, device=w.device, dtype=torch.float32)
        used = torch.zeros(w.shape[0], device=w.device, dtype=torch.float32)
        if got is not None:
            rows, g = got
            dense.index_add_(0, rows, g.float())
            used[rows] = 1.0
        dist.all_reduce(dense)
        dist.all_reduce(used)
        rows = torch.nonzero(used).flatten()
        return rows, dense[rows]
