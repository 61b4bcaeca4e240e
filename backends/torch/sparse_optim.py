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
and the single-process reference, so both apply the same arithmetic.

The sharded optimizer reads a step's gradient without making the host wait for the device
(issue 16: the H200 profiles of DIN and HSTU showed 18 and 11 blocking syncs a step here,
the GPU idle behind each while the host refilled its queue): a sparse gradient's rows are
summed by sort and segment into static slots (:func:`summed_rows`, not ``coalesce``),
a table-sized one (``dense_grad``) is updated in one masked pass
(:mod:`gemc.backends.triton.masked_row_update`, not ``nonzero``). The rows updated are the
reference's (:func:`coalesced_rows`): the rows a sparse gradient lists (never the padding
row), the rows of a dense gradient that are not all zero. In the sharded case:

* the gradient arrives as the shard's sparse gradient (the rows requested by every rank) and
  is divided by the world size: each rank's loss is its own batch's mean, the global loss the
  mean over ranks, as in DDP (a shard on the owners' fused route, :mod:`.owner_lookup`, is
  updated in its lookup's backward with the same division, and is skipped here);
* every ``data_parallel`` replica's gradient and used-row flags go into one flat fp32
  buffer (:class:`ReplicaBucket`), reduced by ONE all-reduce a step whatever the number of
  replicas (as DDP and TorchRec bucket a data-parallel table's gradient), and each replica
  is then updated in one masked pass over its table (the rows whose flag is set, no
  ``nonzero``), so every replica applies the same update without a host sync; replicas
  that share a storage (:mod:`.replica_groups`) have one segment, one gradient add and
  one masked pass a group;
* a row split over column shards (``column_wise``, ``grid``) all-reduces the per-row sum of
  squares over the ranks holding that row's columns, so the row-wise Adagrad accumulator
  is the same mean over the full width that one process computes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
    """(sorted unique rows, summed row gradients) of a sparse or dense gradient.

    The single-process reference's reading (:mod:`.reference`); it syncs with the host
    (``coalesce`` and ``nonzero`` must know how many rows there are). The sharded optimizer
    reads a gradient without a sync: :func:`summed_rows`, :func:`masked_row_update_`."""
    if grad is None:
        return None
    if grad.is_sparse:
        g = grad.coalesce()
        return g.indices()[0], g.values()
    rows = torch.nonzero(grad.abs().sum(dim=1)).flatten()
    return rows, grad[rows]


@dataclass(frozen=True)
class RowGrads:
    """A step's gradient of one table as rows: ``rows[i]`` gets ``grads[i]`` (fp32).

    Of static shape when made by :func:`summed_rows`: ``rows`` then repeats a row (the
    slots past the distinct rows repeat the last one, with its gradient), so the row
    updates gather, compute and write back (never accumulate) and apply each row once.
    ``live``: a 0-d bool tensor, False when the step used no row at all (the slots then
    point at an arbitrary row, which must not be written); None when rows are known used."""

    rows: torch.Tensor
    grads: torch.Tensor
    live: torch.Tensor | None = None


def summed_rows(ids: torch.Tensor, values: torch.Tensor, num_rows: int,
                skip_row: int | None = None) -> RowGrads | None:
    """The distinct rows of ``ids`` and their summed ``values`` (one ``[dim]`` row per id),
    with no host sync: a sparse gradient read without ``coalesce``.

    Why: ``coalesce`` (like ``unique`` and ``nonzero``) returns as many rows as there are
    distinct ids, so the host waits for the GPU to count them before it can queue the next
    kernel (HSTU h200: the GPU idle 26 ms a step behind such syncs). Here every shape is
    ``len(ids)`` (the rows returned: ``min(len(ids), num_rows)``): sort the ids, mark where
    each run of one id starts, number the runs (cumsum) and add each value into its run's
    slot; the slots past the last run repeat it. A row's duplicates contend in the add
    (atomics on a GPU), as ``coalesce`` summed them in sequence. ``skip_row`` (the padding
    row): its ids get keys past every row, one each (no run of them, so no contended
    adds), and are left out like ids never looked up."""
    n = ids.numel()
    if n == 0:
        return None
    keys = ids.reshape(-1).long()
    pos = torch.arange(n, device=keys.device)
    if skip_row is not None:
        keys = torch.where(keys == skip_row, num_rows + pos, keys)
    sorted_keys, perm = torch.sort(keys)
    head = torch.ones(n, dtype=torch.bool, device=keys.device)
    head[1:] = sorted_keys[1:] != sorted_keys[:-1]
    run = torch.cumsum(head, 0) - 1
    # each id's run, in the ids' own order: the values are added where they lie (no
    # ordered copy of them)
    run_of_id = torch.empty_like(run).scatter_(0, perm, run)
    summed = torch.zeros((n, values.shape[1]), dtype=torch.float32, device=values.device)
    summed.index_add_(0, run_of_id, values.float())
    # every id of a run writes the run's key: equal values, so duplicates do not race
    run_key = sorted_keys.new_full((n,), num_rows).scatter_(0, run, sorted_keys)
    distinct = (head & (sorted_keys < num_rows)).sum()  # the used rows' runs come first
    # at most one slot per row of the table: the rest could only repeat the last run
    slot = torch.minimum(pos[:num_rows], (distinct - 1).clamp(min=0))
    return RowGrads(run_key[slot].clamp(max=num_rows - 1), summed[slot], distinct > 0)


def _kept(live: torch.Tensor | None, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new``, or ``old`` where the step used no row (``live`` False: a 0-d flag, see
    RowGrads, or one flag a row, a low-precision replica's :meth:`ReplicaBucket.update`)."""
    if live is None:
        return new
    return torch.where(live.reshape(live.shape + (1,) * (new.dim() - live.dim())), new, old)


@torch.no_grad()
def rowwise_adagrad_rows_(
    weight: StoredRows,
    state_sum: torch.Tensor,
    rows: torch.Tensor,
    grad_rows: torch.Tensor,
    cfg: EmbeddingOptimConfig,
    full_dim: int,
    sq_group: dist.ProcessGroup | None = None,
    live: torch.Tensor | None = None,
) -> None:
    """Row-wise Adagrad on ``rows``; ``sq_group`` sums the squares over column shards.
    A row listed twice must come with the same gradient (see RowGrads)."""
    g = grad_rows.float()
    w = weight.read(rows)
    if cfg.weight_decay:
        g = g + cfg.weight_decay * w
    sq = g.pow(2).sum(dim=1)
    if sq_group is not None:
        dist.all_reduce(sq, group=sq_group)
    old = state_sum[rows]
    acc = old + sq / full_dim
    state_sum[rows] = _kept(live, acc, old)
    weight.write(rows, _kept(live, w - cfg.lr * g / (acc.sqrt().unsqueeze(1) + cfg.eps), w),
                 live)


def adam_step_size(cfg: EmbeddingOptimConfig, step: int) -> float:
    """Lazy Adam's bias-corrected learning rate at global step ``step`` (>= 1)."""
    beta1, beta2 = cfg.betas
    return cfg.lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)


@torch.no_grad()
def lazy_adam_rows_(
    weight: StoredRows,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    rows: torch.Tensor,
    grad_rows: torch.Tensor,
    step: int,
    cfg: EmbeddingOptimConfig,
    live: torch.Tensor | None = None,
) -> None:
    """SparseAdam's update of ``rows`` at global step ``step`` (>= 1). A row listed twice
    must come with the same gradient (see RowGrads)."""
    beta1, beta2 = cfg.betas
    g = grad_rows.float()
    m0 = exp_avg[rows]
    v0 = exp_avg_sq[rows]
    m = m0 + (g - m0) * (1 - beta1)
    v = v0 + (g * g - v0) * (1 - beta2)
    exp_avg[rows] = _kept(live, m, m0)
    exp_avg_sq[rows] = _kept(live, v, v0)
    w = weight.read(rows)
    new = w * (1 - cfg.lr * cfg.weight_decay) if cfg.weight_decay else w
    weight.write(rows, _kept(live, new - adam_step_size(cfg, step) * m / (v.sqrt() + cfg.eps),
                             w), live)


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
        live: torch.Tensor | None = None,
    ) -> None:
        """Update ``rows`` of ``weight`` (a plain tensor, or a shard's stored rows);
        ``live``: see RowGrads."""
        if isinstance(weight, torch.Tensor):
            weight = StoredRows(weight)
        if cfg.kind == "rowwise_adagrad":
            rowwise_adagrad_rows_(
                weight, self.tensors["sum"], rows, grad_rows, cfg, full_dim, sq_group, live
            )
        else:
            lazy_adam_rows_(
                weight, self.tensors["exp_avg"], self.tensors["exp_avg_sq"], rows, grad_rows,
                step, cfg, live
            )

    def apply_dense(self, weight: torch.Tensor, grad: torch.Tensor,
                    cfg: EmbeddingOptimConfig, step: int,
                    used: torch.Tensor | None = None) -> None:
        """Update the rows of the fp32 ``weight`` whose table-sized ``grad`` row is not all
        zero (or whose ``used`` flag is not), in one pass and without a host sync
        (:mod:`gemc.backends.triton.masked_row_update`; the rows :func:`coalesced_rows`
        finds, the same formulas)."""
        from gemc.backends.triton.masked_row_update import masked_row_update_

        masked_row_update_(
            weight, grad, self.tensors, optimizer=cfg.kind, lr=cfg.lr, eps=cfg.eps,
            betas=cfg.betas, weight_decay=cfg.weight_decay,
            step_size=adam_step_size(cfg, step) if cfg.kind == "adam" else 0.0, used=used)


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
        batched_replicas: bool | None = None,
    ) -> None:
        """``batched_replicas``: on several ranks, put the data-parallel replicas that can
        share one storage in groups (:mod:`.replica_groups`); None reads
        ``GEMC_BATCHED_REPLICAS`` (unset: on)."""
        from gemc.backends.torch.replica_groups import (
            BATCHED_REPLICAS_ENV,
            batched_replicas_from_env,
            form_groups,
        )

        self.tables = tables  # fqn -> ShardedEmbedding
        self.cfg = cfg
        self.world_size = world_size
        self.column_groups = column_groups or {}
        self.step_count = 0
        self.fused: dict[str, Any] = {}  # fqn -> module whose backward applies the update
        self.fused_index: dict[str, int] = {}  # fqn -> its table index in that module
        self._bucket: ReplicaBucket | None = None  # several ranks: see _replica_bucket
        self.state: dict[str, RowState] = {
            fqn: RowState(m.weight, cfg.kind)
            for fqn, m in tables.items()
            if m.weight is not None
        }
        # replica groups: one storage, one state (each member's state a view of its rows)
        self.groups: list[Any] = []
        self.not_grouped: dict[str, str] = {}  # replica fqn -> why it is on its own
        self.group_state: dict[str, RowState] = {}
        if batched_replicas is None:
            batched_replicas = batched_replicas_from_env()
        replicas = {fqn: m for fqn, m in tables.items()
                    if m.weight is not None and m.replicated}
        if world_size > 1 and replicas:
            if batched_replicas:
                self.groups, self.not_grouped = form_groups(replicas)
            else:
                self.not_grouped = dict.fromkeys(replicas, f"{BATCHED_REPLICAS_ENV}=0")
        for g in self.groups:
            state = self.group_state[g.name] = RowState(g.weight, cfg.kind)
            for m in g.members:
                first, rows = g.rows_of(m.fqn)
                self.state[m.fqn].tensors = {k: v[first:first + rows]
                                             for k, v in state.tensors.items()}

    def adopt_fused(self, fqn: str, tensors: dict[str, torch.Tensor], module: Any,
                    table: int | None = None) -> None:
        """Table ``fqn`` is updated inside ``module``'s backward (a fused kernel; ``table``:
        its index there); its state lives there (``tensors`` are views of it) and
        :meth:`step` leaves it alone, but for a column shard's pending update
        (:meth:`_finish_fused`)."""
        self.state[fqn].tensors = dict(tensors)
        self.fused[fqn] = module
        if table is not None:
            self.fused_index[fqn] = table

    def _fused_modules(self) -> list[Any]:
        """Each module holding fused tables, once (one module holds many)."""
        return list({id(m): m for m in self.fused.values()}.values())

    def _finish_fused(self) -> None:
        """The fused modules' pending updates (column shards under row-wise Adagrad,
        ``BatchedEmbeddingBag.split_rows``): each table's row squares summed over its column
        group, in table order (every rank walks the same tables, so the all-reduces pair
        up), then applied. A table whose launch had no id sends nothing, as every shard of
        it received the same ids."""
        modules = {id(m): m for m in self._fused_modules() if m.pending}
        if not modules:
            return
        for fqn in self.tables:  # the model's order, every rank's; not adoption order
            module, group = self.fused.get(fqn), self.column_groups.get(fqn)
            if group is None or module is None or id(module) not in modules:
                continue
            for squares in module.pending_squares(self.fused_index[fqn]):
                if squares.numel():
                    dist.all_reduce(squares, group=group)
        for module in modules.values():
            module.apply_pending()

    def set_step_count(self, count: int) -> None:
        """After a resume: the bias-correction step of Adam, here and in fused modules."""
        self.step_count = count
        for module in self._fused_modules():
            module.step = count

    def zero_grad(self) -> None:
        for module in self._fused_modules():
            module.discard_pending()  # a backward whose step was not taken
        for m in self.tables.values():
            if m.weight is not None:
                m.weight.grad = None
            m.working.clear()
            m.deferred.clear()
        for g in self.groups:
            g.weight.grad = None

    def warm_dense(self, fqns: list[str]) -> None:
        """Run the dense-gradient step of tables ``fqns`` on ``meta`` tensors of their
        shapes (the warm-up's derivation, :mod:`gemc.backends.triton.warm`: the masked row
        update's launches are recorded, nothing is updated). Only the tables :meth:`step`
        updates that way: fp32, not fused into a batched lookup; on one rank ``fqns``, on
        several every data-parallel replica (its masked pass with used-row flags,
        :class:`ReplicaBucket`), whatever ``fqns`` says."""
        import copy

        from gemc.backends.triton.warm import meta_like

        replicas = self._replicas()
        grouped = {m.fqn for g in self.groups for m in g.members}
        units: list[tuple[RowState, torch.Tensor]] = [
            (self.group_state[g.name], g.weight.data) for g in self.groups]
        for fqn in replicas or (fqns if self.world_size == 1 else []):
            m = self.tables.get(fqn)
            if m is None or m.weight is None or fqn in self.fused or m.precision != "fp32" \
                    or m.weight.dtype != torch.float32 or fqn in grouped:
                continue
            units.append((self.state[fqn], m.weight.data))
        for state, data in units:
            twin = copy.copy(state)
            twin.tensors = {k: meta_like(v) for k, v in state.tensors.items()}
            weight = meta_like(data)
            used = torch.empty(weight.shape[0], device="meta") if replicas else None
            twin.apply_dense(weight, torch.empty_like(weight), self.cfg, 1, used)

    @torch.no_grad()
    def step(self) -> None:
        """Apply each table's step gradient. No host sync on one rank: a sparse gradient is
        read by :func:`summed_rows`, a table-sized one (``dense_grad``) updated by
        :meth:`RowState.apply_dense`. On several ranks the data-parallel replicas go
        through one bucketed all-reduce and masked updates (:class:`ReplicaBucket`, no
        sync); the shards on the owners' fused route were updated in their backward; the
        other sharded tables still sync where a collective needs counts."""
        self._finish_fused()  # at the backward's step count, before it moves on
        self.set_step_count(self.step_count + 1)  # the fused modules' count follows
        bucket = self._replica_bucket()
        for g in self.groups:  # graph mode's deferred lookups: one replay a group
            g.replay_deferred()
        for fqn, m in self.tables.items():
            if m.weight is None or fqn in self.fused:
                continue
            m.replay_deferred()  # lookups compiled as gemc::table_lookup: their gradient
            w = m.weight
            grad = w.grad if m.precision == "fp32" else None
            if bucket is not None and bucket.holds(fqn):
                bucket.add(fqn, m, grad)
                continue
            if grad is not None and not grad.is_sparse and self.world_size == 1:
                self.state[fqn].apply_dense(w.data, grad, self.cfg, self.step_count)
                continue
            got = self._row_grads(m, grad)
            if got is None or got.rows.numel() == 0:
                continue
            self.state[fqn].apply(
                m.stored_rows(self.step_count),
                got.rows,
                got.grads / self.world_size,
                self.cfg,
                self.step_count,
                m.embedding_dim,
                self.column_groups.get(fqn),
                got.live,
            )
        if bucket is not None:
            for g in self.groups:
                bucket.add_group(g)
            bucket.reduce(self.world_size)
            groups = {g.name: g for g in self.groups}
            for unit in bucket.segments:
                if unit in groups:
                    bucket.update_group(groups[unit], self.group_state[unit], self.cfg,
                                        self.step_count)
                else:
                    bucket.update(unit, self.tables[unit], self.state[unit], self.cfg,
                                  self.step_count)

    def _replica_bucket(self) -> ReplicaBucket | None:
        """The step's bucket of data-parallel replicas (made at the first step, once the
        fused tables are known), None on one rank or without replicas."""
        if self._bucket is None and self.world_size > 1:
            self._bucket = ReplicaBucket({fqn: self.tables[fqn] for fqn in self._replicas()},
                                         self.groups)
        return self._bucket if self._bucket is not None and self._bucket.segments else None

    def _replicas(self) -> list[str]:
        """The data-parallel tables this optimizer steps through the bucket (several
        ranks; not fused into a batched lookup), in the tables' order."""
        if self.world_size == 1:
            return []
        return [fqn for fqn, m in self.tables.items()
                if m.weight is not None and m.replicated and fqn not in self.fused]

    @staticmethod
    def _row_grads(m: Any, grad: torch.Tensor | None) -> RowGrads | None:
        """The rows table ``m``'s step used and their gradients: a bf16 / fp8 shard's from
        its lookups' leaves, a sparse gradient's without a sync (the padding row left out:
        its ids may reach the gradient, :mod:`.padded_lookup`), a dense one's (several
        ranks only) as the reference reads it."""
        if m.precision != "fp32":
            got = m.take_row_grads()
            return None if got is None else RowGrads(*got)
        if grad is None:
            return None
        if grad.is_sparse:
            return summed_rows(grad._indices()[0], grad._values(), grad.shape[0],
                               m.local_padding_row())
        rows, g = coalesced_rows(grad)
        return RowGrads(rows, g)


class ReplicaBucket:
    """Every data-parallel replica's step gradient in one flat fp32 buffer, reduced by ONE
    all-reduce a step, then each replica updated in one masked pass: no per-table
    collective, no host sync.

    Layout, in the tables' order (the plan's, the same on every rank): per replica of
    ``rows`` x ``dim``, its gradient rows (``rows * dim``), then ``rows`` used-row flags; a
    group of replicas in one storage (:mod:`.replica_groups`) has one such segment over its
    stacked rows, at its first member's place, each member's rows a slice of it.
    Why the flags and not the masked update's own rule (a row is used when its gradient is
    not all zero): the reference's sparse gradient lists every row a step looked up
    (:func:`coalesced_rows`), and a row whose summed gradient is exactly zero (opposite
    contributions, a zero per-sample weight) is still updated there: lazy Adam decays its
    moments and moves it, weight decay moves it. The flags cost one fp32 a row (1/(dim+1)
    of the buffer); they go in the same buffer so one collective carries both. Why one
    dense buffer and not the used rows: the replicas are the small tables (the planner
    replicates where the bytes pay) and a dense buffer keeps every shape static (no count
    of used rows to wait for), as DDP's and TorchRec's data-parallel tables do.

    What a replica's step issues on its own: the add of its gradient rows into its
    segment and the set of its flags (two kernels; its padding row cleared: two more), and
    its update: one masked pass over the table (fp32, :func:`RowState.apply_dense`), or a
    bf16 / fp8 replica's row update over every row, writing back only the flagged ones
    (:meth:`StoredRows.write`'s ``keep``). The bucket's zero-fill, all-reduce and division
    by the world are issued once a step. A group issues its add, its flags and its masked
    pass once for all its members (:meth:`add_group`, :meth:`update_group`). Priced so by
    ``gemc.cost_model``
    (``kernels.replica_update_bytes``, ``step_model.replica_reduce_bytes``)."""

    def __init__(self, tables: dict[str, Any], groups: Sequence[Any] = ()) -> None:
        # unit (a replica's fqn, or a group's name) -> (offset, rows, dim); a group's
        # segment is its stacked rows' gradient, then their flags
        self.segments: dict[str, tuple[int, int, int]] = {}
        self.member_of: dict[str, tuple[str, int, int]] = {}  # fqn -> (group, first, rows)
        group_of = {m.fqn: g for g in groups for m in g.members}
        offset = 0
        device = None
        for fqn, m in tables.items():  # the plan's order: the same layout on every rank
            g = group_of.get(fqn)
            unit, (rows, dim) = (fqn, m.weight.shape) if g is None else (g.name, (g.rows, g.dim))
            if g is not None:
                self.member_of[fqn] = (g.name, *g.rows_of(fqn))
            if unit in self.segments:
                continue
            self.segments[unit] = (offset, int(rows), int(dim))
            offset += int(rows) * (int(dim) + 1)
            device = m.weight.device
        self.buffer = torch.zeros(offset, dtype=torch.float32, device=device) \
            if self.segments else None
        self._filled = False
        self._all_rows: dict[str, torch.Tensor] = {}  # low-precision replicas' arange

    def holds(self, fqn: str) -> bool:
        """Whether replica ``fqn`` has rows in the bucket (its own segment or its group's)."""
        return fqn in self.segments or fqn in self.member_of

    def views(self, fqn: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(gradient ``[rows, dim]``, used flags ``[rows]``) of replica ``fqn`` (its rows of
        its group's segment when it is a member), or of group ``fqn``."""
        assert self.buffer is not None
        first = count = None
        if fqn in self.member_of:
            fqn, first, count = self.member_of[fqn]
        offset, rows, dim = self.segments[fqn]
        grad = self.buffer[offset:offset + rows * dim].view(rows, dim)
        used = self.buffer[offset + rows * dim:offset + rows * (dim + 1)]
        if first is not None:
            return grad[first:first + count], used[first:first + count]
        return grad, used

    def _begin(self) -> None:
        assert self.buffer is not None
        if not self._filled:
            self.buffer.zero_()
            self._filled = True

    def add_group(self, g: Any) -> None:
        """Put group ``g``'s lookup gradient (one sparse gradient over its stacked rows)
        into its segment: one add of its rows at their ids and one fill of their flags
        (members the model did not call left unflagged). A member looked up on its own
        (:meth:`add`) adds into its rows of the same segment."""
        got = g.take_grad()
        if got is None:
            return
        self._begin()
        ids, values, keep = got
        seg, used = self.views(g.name)
        seg.index_add_(0, ids, values.float())
        if keep is None:
            used.index_fill_(0, ids, 1.0)
        else:  # a row's ids all come from one member: one value a row, no race
            used.index_put_((ids,), keep)

    def update_group(self, g: Any, state: RowState, cfg: EmbeddingOptimConfig,
                     step: int) -> None:
        """Group ``g``'s reduced gradient applied in one masked pass over its rows."""
        grad, used = self.views(g.name)
        state.apply_dense(g.weight.data, grad, cfg, step, used)

    def add(self, fqn: str, m: Any, grad: torch.Tensor | None) -> None:
        """Put replica ``fqn``'s step gradient into its segment: a sparse gradient's rows
        added at their ids (its duplicates summed there, in the ids' order as
        :func:`summed_rows` sums them), a table-sized one added whole (its not-all-zero
        rows flagged, the reference's reading), a bf16 / fp8 replica's summed rows
        written. The padding row is never used by a lookup (torch's sparse gradient leaves
        it out); a table-sized gradient's padding row is a whole read's and is kept."""
        self._begin()
        seg, used = self.views(fqn)
        if m.precision != "fp32":
            got = m.take_row_grads()
            if got is not None:
                seg.index_copy_(0, got[0], got[1].float())
                used.index_fill_(0, got[0], 1.0)
        elif grad is not None and grad.is_sparse:
            ids = grad._indices()[0]
            seg.index_add_(0, ids, grad._values().float())
            used.index_fill_(0, ids, 1.0)
        elif grad is not None:
            # table-sized: a read of the whole weight (a tied projection) added to the
            # lookups' gradient. Their part of the padding row is zero (torch's and the
            # padded lookup's backward), so what that row holds is the whole read's, which
            # eager PyTorch applies: kept, flagged where non-zero (the reference's reading)
            seg.add_(grad.float())
            used.masked_fill_(grad.ne(0).any(dim=1), 1.0)
            return
        pad = m.local_padding_row()
        if pad is not None:
            seg[pad] = 0.0
            used[pad] = 0.0

    def reduce(self, world: int) -> None:
        """The step's one all-reduce of every replica's segment, then the mean over ranks
        (each rank's loss is its own batch's mean, as in DDP); the flags stay non-zero
        exactly where some rank used the row."""
        assert self.buffer is not None
        if not self._filled:  # no replica had a gradient call: the buffer is stale
            self.buffer.zero_()
        dist.all_reduce(self.buffer)
        self.buffer.div_(world)
        self._filled = False

    def update(self, fqn: str, m: Any, state: RowState, cfg: EmbeddingOptimConfig,
               step: int) -> None:
        """Apply replica ``fqn``'s reduced gradient to the rows some rank used: fp32 in one
        masked pass; bf16 / fp8 through the stored rows (rounded as every replica rounds:
        the draw is seeded by table and step), unflagged rows kept as stored; a model's own
        narrower weights (precision "fp32" of a bf16 model) through the rows, cast back."""
        grad, used = self.views(fqn)
        if m.precision == "fp32" and m.weight.dtype == torch.float32:
            state.apply_dense(m.weight.data, grad, cfg, step, used)
            return
        rows = self._all_rows.get(fqn)
        if rows is None:
            rows = self._all_rows[fqn] = torch.arange(grad.shape[0], device=grad.device)
        state.apply(m.stored_rows(step), rows, grad, cfg, step, m.embedding_dim,
                    live=used.ne(0))
