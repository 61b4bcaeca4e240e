"""The owners' lookup on several ranks: every shard a rank owns in one fused kernel (issue 21).

Why: on several ranks the owner of a shard pools every requester's bags
(:mod:`.embedding_exchange`, step 4). Through ``F.embedding_bag(..., sparse=True)`` that
lookup's backward makes a gradient of one fp32 row per looked-up id over the world's batch
(DLRM h200 on 8 ranks: 53 GB a rank predicted; DLRM-xl fit no GPU count), which the sparse
optimizer then sums by row and applies, one eager lookup and one optimizer pass per shard.
Here the rank's shards live in :class:`~gemc.backends.triton.embedding_bag.
BatchedEmbeddingBag` modules (one per storage precision: the kernel reads one format), the
received ids of all the exchange's tables are pooled in one launch per module and bag count,
and the backward sorts the ids and applies the optimizer to each touched row in place: no
gradient tensor exists. The kernel is the one-rank batched lookup's, unchanged in its
arithmetic; gemc.table_lookup.sharded_route says which tables run here (the cost model
prices them as ``BATCHED`` by the same rule).

What keeps the arithmetic the reference's (:mod:`.reference`):

* the owner sums (``pooling="sum"``); ``mean`` bags are divided at the requester, as on the
  sparse route; padding ids never reach the owner (the requester drops them);
* the gradient is divided by the world size (each rank's loss is its own batch's mean;
  :mod:`.sparse_optim`'s doc), folded into the kernel's per-id coefficients;
* a column shard under row-wise Adagrad (the plan's ``column_wise`` or ``grid``): the row's
  accumulator takes the mean square of the *whole* row, so the backward computes each
  touched row's squares over this shard's columns only, and the optimizer's step sums them
  over the row's column group (one all-reduce per table, in table order on every rank) and
  then applies the update (``BatchedEmbeddingBag.split_rows``) -- the sparse route's
  arithmetic (``sparse_optim.rowwise_adagrad_rows_``) in the fused kernel;
* one update a step per row, at the optimizer's step count: the modules do not count steps
  themselves (``counts_steps`` False), :class:`~.sparse_optim.EmbeddingOptimizer` sets
  their count after each step and on resume (``set_step_count``), and a table looked up a
  second time in one step is refused (gemc.table_lookup keeps tables with several lookups on
  the sparse route);
* the rows and the optimizer state are the shards' own tensors (``weight.data`` and the
  optimizer's state are aliased to views of the flat buffers, as graph mode does on one
  rank), so checkpoints save and resume them unchanged.

Bag counts: the kernel takes ``T*B+1`` offsets, one bag count for every table of a launch.
Tables whose owners received different counts (an ``nn.Embedding`` over ``[B, L]`` ids is
``B*L`` bags of one id next to ``B``-bag tables) are grouped by count, one launch each,
rather than padded with empty bags: padding would make the launch's output
``[largest count, sum of widths]`` and its programs ``T x largest count``, ``L`` times the
pooled tables' own for nothing. A model whose tables all take the batch's bags (DLRM) runs
one launch per rank and exchange.

Graph mode: on several ranks a sharded table's lookup node calls the table as an eager
island (``graph_mode.lookup_call``), never the deferred ``gemc::table_lookup`` op (that is
for tables whose lookups stay on their rank), so the fused backward runs in the step's own
backward and ``replay_deferred`` has nothing of these tables to replay.

Per-sample weights: one launch reads weights for all its tables or none; a table without
them gets ones. bf16 / fp8 storage: the kernel reads and rounds the stored format itself
(stochastic rounding from its own ``(seed, step, element)`` stream, not the sparse route's
generator: the two routes agree to the storage's rounding, not bit for bit).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from gemc.backends.torch.embedding_exchange import weights_or_ones
from gemc.backends.torch.init import derive_seed

from gemc.errors import GemcUserError, PlanError
from gemc.table_lookup import BATCHED, sharded_route


def owner_routes(plan_tables: Sequence[Mapping[str, Any]], *, world_size: int,
                 optimizer: str) -> dict[str, str]:
    """fqn -> the route its owners look it up on (gemc.table_lookup.sharded_route, from the
    plan's sharding and lookup count and the run's table ``optimizer``); empty on one rank."""
    if world_size <= 1:
        return {}
    return {str(t["fqn"]): sharded_route(str(t["sharding"]), world_size=world_size,
                                         optimizer=optimizer,
                                         lookups=int(t.get("lookups", 1) or 1),
                                         fp32=str(t.get("dtype", "float32")) == "float32")
            for t in plan_tables}


def fused_owner_tables(tables: Mapping[str, Any], plan_tables: Sequence[Mapping[str, Any]], *,
                       world_size: int, optimizer: str) -> list[str]:
    """The fqns of ``tables`` (fqn -> ShardedEmbedding) this rank looks up as an owner
    through the fused kernel: :func:`owner_routes` says ``BATCHED`` and this rank holds a
    shard."""
    routes = owner_routes(plan_tables, world_size=world_size, optimizer=optimizer)
    return [f for f, m in tables.items() if routes.get(f) == BATCHED and m.local is not None]


class OwnerLookup:
    """This rank's fused-route shards (``fqns`` of ``tables``), one
    :class:`BatchedEmbeddingBag` per storage precision, adopted by ``emb_opt``."""

    def __init__(self, tables: Mapping[str, Any], fqns: Sequence[str], emb_opt: Any, *,
                 world_size: int, seed: int, stage_on_host: bool | None = None) -> None:
        """``stage_on_host`` (default: on a GPU): each shard's rows wait on the host while
        the fused buffers are allocated, so a rank needs its tables' memory once, not twice
        (see :func:`_release`)."""
        from gemc.backends.triton.embedding_bag import BatchedEmbeddingBag

        self.emb_opt = emb_opt
        self.index: dict[str, tuple[Any, int]] = {}  # fqn -> (module, table index)
        self.modules: list[Any] = []
        self.looked_up: dict[str, int] = {}  # fqn -> the optimizer step of its last lookup
        cfg = emb_opt.cfg
        by_precision: dict[str, list[str]] = defaultdict(list)
        for fqn in fqns:
            by_precision[tables[fqn].precision].append(fqn)
        for precision, names in sorted(by_precision.items()):
            members = [tables[f] for f in names]
            for m in members:
                if m.dtype != torch.float32:
                    raise PlanError(
                        f"table '{m.fqn}' is {m.dtype} in the model; the owners' fused "
                        "lookup keeps fp32 tables (or bf16/fp8 storage of fp32 tables)",
                        where=f"plan tables: {m.fqn}",
                        fix="make the model's table fp32 and set its storage precision "
                            "in the plan (gemc compile --table-precision)")
            device = members[0].weight.device
            stage = device.type != "cpu" if stage_on_host is None else stage_on_host
            staged = [_release(m, emb_opt, stage) for m in members]
            module = BatchedEmbeddingBag(
                [(m.local.rows, m.local.cols) for m in members], pooling="sum",
                optimizer=cfg.kind, lr=cfg.lr, eps=cfg.eps, betas=cfg.betas,
                weight_decay=cfg.weight_decay, device=device, precision=precision,
                seed=derive_seed(seed, "owner-lookup", precision) % (2**31 - 1))
            module.counts_steps = False  # the optimizer's count: one update a step
            module.grad_scale = 1.0 / world_size
            module.step = emb_opt.step_count
            states = module.split_optimizer_state()
            with torch.no_grad():
                for t, (m, view, scale, (values, scales)) in enumerate(zip(
                        members, module.split_weights(), module.split_row_scales(), staged)):
                    view.copy_(values)  # the stored format's bits, as initialised
                    m.weight.data = view  # checkpoints read and write the fused buffer
                    if scale is not None:  # fp8: the row scales move in with the values
                        scale.copy_(scales)
                        m.row_scale = scale
                    emb_opt.adopt_fused(m.fqn, states[t], module, table=t)
                    m.owner_lookup = self
                    self.index[m.fqn] = (module, t)
            # column shards under row-wise Adagrad: the update waits for the row's squares
            # over every shard (EmbeddingOptimizer.step sums them over the column group)
            split = {t: int(m.embedding_dim) for t, m in enumerate(members)
                     if emb_opt.column_groups.get(m.fqn) is not None}
            if split and cfg.kind == "rowwise_adagrad":
                module.split_rows(split)
            self.modules.append(module)

    def pool(self, requests: Sequence[tuple[Any, torch.Tensor, torch.Tensor,
                                            torch.Tensor | None]]) -> list[torch.Tensor]:
        """Each request's partial ``[bags, cols]`` pooled rows (sum), in request order.
        A request: (table, shard-local ids, ids per bag, per-sample weights or None), every
        requester's bags one after the other. One launch per module and bag count."""
        step = self.emb_opt.step_count
        if torch.is_grad_enabled():
            for m, *_ in requests:
                if self.looked_up.get(m.fqn) == step:
                    raise GemcUserError(
                        f"table '{m.fqn}' is looked up twice in one step on the owners' "
                        "fused route, which would update its rows once per lookup",
                        where=f"model module {m.fqn.removesuffix('.weight')}",
                        fix="compile the plan again from this model (its lookup count "
                            "sends the table to the sparse route), or look it up once a "
                            "step")
                self.looked_up[m.fqn] = step
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for k, (m, _, counts, _) in enumerate(requests):
            module, _ = self.index[m.fqn]
            groups[(id(module), counts.numel())].append(k)
        out: list[torch.Tensor | None] = [None] * len(requests)
        for members in groups.values():
            module = self.index[requests[members[0]][0].fqn][0]
            ids = torch.cat([requests[k][1] for k in members])
            counts = torch.cat([requests[k][2] for k in members])
            offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
            weights = weights_or_ones([(requests[k][3], requests[k][1].numel())
                                       for k in members], torch.float32, ids.device)
            pooled = module(ids, offsets, weights,
                            tables=[self.index[requests[k][0].fqn][1] for k in members],
                            id_counts=[requests[k][1].numel() for k in members])
            for k, part in zip(members, pooled.split([requests[k][0].local.cols
                                                      for k in members], dim=1)):
                out[k] = part
        assert all(o is not None for o in out)
        return out  # type: ignore[return-value]


def _release(m: Any, emb_opt: Any, stage: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shard ``m``'s stored rows (and fp8 row scales), handed over for the fused buffer: on
    the host when ``stage``, the shard's own device memory then released, and its optimizer
    state released either way (the fused module's own state replaces it: ``adopt_fused``).
    Why: the planner packs a rank's shards up to its memory; copying them into the fused
    buffer while they still lay on the device needed that memory twice (three times the
    tables' bytes under lazy Adam, whose two moments the shard and the module each held),
    an out-of-memory at start-up on a full rank. Through the host the device holds the
    tables once; the copy costs a host round trip at start-up only."""
    values, scales = m.weight.data, m.row_scale
    if stage:
        values = values.to("cpu")
        scales = None if scales is None else scales.to("cpu")
        m.weight.data = values.new_empty((0, values.shape[1]), device=m.weight.device)
        m.row_scale = None
    emb_opt.state[m.fqn].tensors = {}
    return values, scales
