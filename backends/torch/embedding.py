"""Sharded embedding tables on torch.distributed, built from the plan's shards.

One :class:`ShardedEmbedding` replaces one ``nn.EmbeddingBag`` or ``nn.Embedding`` of the
user's model (same call signature, same output), holding only the rows and columns the plan
gives this rank. All sharding types run through one routing scheme
(:mod:`.embedding_exchange`): the requester (every rank, for its own batch) sends each shard
owner the ids in that shard's row range, the owner sum-pools them on its shard with one
``F.embedding_bag(..., sparse=True)``, and the partial pooled rows come back through a
differentiable ``all_to_all_single``; the requester adds each owner's partial into its
columns and divides ``mean`` bags by their length. On several hosts (the plan topology's
``gpus_per_host``), a table's row shards on one host first sum their partials there and
send each requester one block (:mod:`.host_reduce`).

So table-wise is one owner with the whole table, row-wise and table-row-wise are owners of
row ranges, column-wise owners of column ranges, grid both. Gradients flow back through the
same exchange to the owner's ``embedding_bag``, whose sparse gradient lists exactly the
rows used this step (over all ranks' batches): the sparse optimizer updates only those.
Where gemc.table_lookup.sharded_route says so (most shards), the owner instead looks its
shards up in one fused kernel whose backward applies the optimizer (:mod:`.owner_lookup`).

A table called with the model's own input tensors is looked up ahead of the forward, with
every other such table in one exchange (:mod:`.table_prefetch`); the forward then hands
out the result. A table whose ids the model computes exchanges on its own when called.

A table the plan stores ``bf16`` or ``fp8`` (``precision``, gemc.table_precision) holds
its shard in that format (fp8: e4m3 values and one fp32 scale per row). A lookup reads the
used rows dequantised into a small fp32 leaf and pools that, so the lookup and its
gradient are fp32; the optimizer takes the leaf's gradient (:meth:`take_row_grads`) and
writes the new rows back rounded (:meth:`stored_rows`, stochastic rounding).

The pooled rows and their gradients cross ranks at the plan's exchange precision
(``exchange``, a gemc.exchange_precision.WirePrecision: fp32, bf16, or fp8 with a scale
per row forward and bf16 backward), cast back on arrival (:mod:`.embedding_exchange`).

``data_parallel`` tables are local replicas: a local lookup with a sparse gradient, which
:mod:`.sparse_optim` all-reduces. On several ranks the replicas of one width and pooling
share one storage and are looked up ahead of the forward by one lookup a group
(:mod:`.replica_groups`); the forward then hands out the table's rows of it.
``nn.Embedding`` (one vector per id, no pooling) is routed as bags of one id each; split by
rows, each row shard returns only the rows of the ids it owns, and the requester lays them
back in id order (:mod:`.owned_rows`).

``max`` pooling runs only where the lookup is local (one rank, or ``data_parallel``, where
gemc places such tables): partial maxima of row shards do not add up. Torch has no sparse
gradient of a max pool, so its gradient is dense (the sparse optimizer reads its non-zero
rows).

Not supported (a named error at setup): a table the plan marks ``replicated_only`` (the
model reads it outside its lookups) sharded over several ranks, ``max`` pooling of a
sharded table, ``max_norm`` and
``scale_grad_by_freq`` (gemc.passes.collect_tables keeps such a table a dense module, so
only a hand-edited plan names one), per-sample weights that require grad, and a rank
holding two shards of one table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gemc.backends.torch.embedding_exchange import Bags, exchange_lookups
from gemc.backends.torch.host_reduce import host_groups
from gemc.backends.torch.init import derive_seed, fill_table_slice_
from gemc.backends.torch.owned_rows import owned_rows_enabled
from gemc.backends.torch.padded_lookup import padded_sparse_lookup
from gemc.backends.torch.table_storage import StoredRows
from torch import nn

from gemc.errors import GemcUserError, PlanError
from gemc.exchange_precision import FP32_WIRE, WirePrecision
from gemc.init_recipes import Recipe
from gemc.sharding import SHARDINGS
from gemc.table_precision import TABLE_PRECISIONS
from gemc.table_quant import quantize_rows, storage_dtype


@dataclass(frozen=True)
class Shard:
    """One rectangle of a table and the rank holding it."""

    rank: int
    row_offset: int
    rows: int
    col_offset: int
    cols: int

    @classmethod
    def from_plan(cls, entry: dict[str, Any]) -> Shard:
        return cls(
            int(entry["rank"]),
            int(entry["row_offset"]),
            int(entry["rows"]),
            int(entry["col_offset"]),
            int(entry["cols"]),
        )


def module_fqn(table_fqn: str) -> str:
    """``bags.3.weight`` -> ``bags.3``: the module the plan's table entry names."""
    if not table_fqn.endswith(".weight"):
        raise PlanError(
            f"table fqn '{table_fqn}' does not name a weight",
            where=f"plan tables: {table_fqn}",
            fix="compile the plan again; table fqns end in '.weight'",
        )
    return table_fqn[: -len(".weight")]


class ShardedEmbedding(nn.Module):
    """A drop-in for one ``nn.EmbeddingBag``/``nn.Embedding``, sharded as the plan says."""

    def __init__(
        self,
        source: nn.Module,
        table: dict[str, Any],
        *,
        rank: int,
        world_size: int,
        seed: int,
        group: dist.ProcessGroup | None = None,
        exchange: WirePrecision = FP32_WIRE,
        gpus_per_host: int | None = None,
    ) -> None:
        super().__init__()
        self.exchange = exchange  # the pooled exchange's wire precision, both directions
        fqn = table["fqn"]
        where = f"plan tables: {fqn}"
        self.fqn = fqn
        self.is_bag = isinstance(source, nn.EmbeddingBag)
        if not self.is_bag and not isinstance(source, nn.Embedding):
            raise PlanError(
                f"table '{fqn}' is a {type(source).__name__}, not nn.Embedding/EmbeddingBag",
                where=where,
                fix="the runner shards nn.Embedding and nn.EmbeddingBag modules only",
            )
        self.num_embeddings = int(source.num_embeddings)
        self.dtype = source.weight.dtype  # known on every rank, shard or not
        self.embedding_dim = int(source.embedding_dim)
        if (self.num_embeddings, self.embedding_dim) != (int(table["rows"]), int(table["dim"])):
            raise PlanError(
                f"table '{fqn}' is {self.num_embeddings} x {self.embedding_dim} in the model "
                f"but {table['rows']} x {table['dim']} in the plan",
                where=where,
                fix="compile the plan again for this model",
            )
        self.mode = source.mode if self.is_bag else "none"
        self.include_last_offset = bool(getattr(source, "include_last_offset", False))
        self.padding_idx = source.padding_idx
        unsupported = []
        if source.max_norm is not None:
            unsupported.append("max_norm")
        if source.scale_grad_by_freq:
            unsupported.append("scale_grad_by_freq")
        if unsupported:
            raise GemcUserError(
                f"table '{fqn}' uses {', '.join(unsupported)}, which the sharded runner "
                "does not support",
                where=f"model module {module_fqn(fqn)}",
                fix="compile the plan again with this gemc (it keeps such a table the "
                    "model's dense nn.Embedding), or leave max_norm / scale_grad_by_freq "
                    "out of the table",
            )
        self.sharding = table["sharding"]
        self.shards = [Shard.from_plan(s) for s in table["shards"]]
        self.rank, self.world_size, self.seed, self.group = rank, world_size, seed, group
        mine = [s for s in self.shards if s.rank == rank]
        if len(mine) > 1:
            raise GemcUserError(
                f"rank {rank} holds {len(mine)} shards of table '{fqn}'; the runner supports "
                "at most one shard of a table per rank",
                where=where,
                fix="give each of a table's shards a different rank",
            )
        self.local: Shard | None = mine[0] if mine else None
        self.replicated = SHARDINGS[self.sharding].replicated
        if self.replicated and (
            self.local is None or (self.local.rows, self.local.cols) != (self.num_embeddings, self.embedding_dim)
        ):
            raise PlanError(
                f"data_parallel table '{fqn}' has no full replica on rank {rank}",
                where=where,
                fix="a data_parallel table needs one whole-table shard on every rank",
            )
        # A lookup is local when this rank holds the whole table and nobody else needs it.
        self.local_only = self.replicated or (
            world_size == 1 and self.local is not None
        )
        if table.get("replicated_only") and world_size > 1 and not self.replicated:
            # the model reads the weight outside its lookups (a tied projection, a
            # penalty over the table): a shard holder would see its rows only, a rank
            # without one no weight at all
            raise PlanError(
                f"the model reads table '{fqn}' outside its lookups (the plan marks it "
                f"replicated_only), but the plan shards it {self.sharding}",
                where=where,
                fix="compile the plan again (gemc keeps such a table data_parallel on "
                    "several ranks), or make it data_parallel with a whole-table shard on "
                    "every rank")
        if self.mode == "max" and not self.local_only:
            # the exchange adds the owners' partial pools: partial maxima do not add up
            raise GemcUserError(
                f"table '{fqn}' uses mode='max', which the runner pools only over a whole "
                f"table on the rank (one rank, or data_parallel), but the plan shards it "
                f"{self.sharding}",
                where=where,
                fix="compile the plan again with this gemc (it places max-pooled tables "
                    "data_parallel), or pool with mode='sum' / 'mean'",
            )
        self.precision = table.get("precision", "fp32")
        if self.precision not in TABLE_PRECISIONS:
            raise PlanError(f"table '{fqn}' has precision {self.precision!r}",
                            where=f"{where}.precision",
                            fix=f"use one of {TABLE_PRECISIONS} (compile the plan again)")
        # the stored dtype, the same on every rank (a checkpoint's shards must agree)
        self.storage_dtype = (source.weight.dtype if self.precision == "fp32"
                              else storage_dtype(self.precision))
        if self.local is not None:
            # bf16 / fp8 shards get no .grad: their lookups differentiate an fp32 copy
            self.weight = nn.Parameter(
                torch.empty(self.local.rows, self.local.cols, device="meta",
                            dtype=self.storage_dtype),
                requires_grad=self.precision == "fp32",
            )
        else:
            self.register_parameter("weight", None)
        self.owners = {s.rank: s for s in self.shards}
        # row shards that sum their partials inside a host before crossing hosts
        # (.host_reduce); None on one host (gpus_per_host None: the whole world)
        self.host_groups = (None if self.replicated
                            else host_groups(self.shards, gpus_per_host, world_size))
        self.row_scale: torch.Tensor | None = None  # fp8: one scale per local row
        self.working: list[tuple[torch.Tensor, torch.Tensor]] = []  # see rows_for_lookup
        # lookups whose output gradient came through gemc::table_lookup's backward
        self.deferred: list[tuple[torch.Tensor, ...]] = []  # see defer_backward
        # set by table_prefetch.TablePrefetch: the first step's record of this table's
        # arguments, and this step's result looked up ahead of the forward
        self.recording: Any = None
        self.prefetched: Any = None
        self.route_cache: dict[torch.device, Any] = {}  # embedding_exchange's, per device
        # the owners' fused lookup holding this rank's shard (owner_lookup.OwnerLookup),
        # None on the sparse route
        self.owner_lookup: Any = None
        # the author's initial distribution (gemc.init_recipes), set by materialize_
        self.init_recipe: Recipe | None = None
        self.padding_row: torch.Tensor | None = None  # see _drawn_padding_row

    # -- initialization --------------------------------------------------------------

    @torch.no_grad()
    def reset_parameters(self, given: torch.Tensor | None = None) -> None:
        """Fill the local shard with its slice of the deterministic whole-table init, or of
        ``given``, the whole table's values from the author's build (pretrained vectors);
        a bf16 / fp8 shard: that slice rounded to nearest, fp8 with one scale per row."""
        self.padding_row = self._drawn_padding_row(given)
        if self.weight is None or self.local is None:
            return
        values = self.weight if self.precision == "fp32" else torch.empty(
            self.weight.shape, device=self.weight.device)
        if given is not None:
            loc = self.local
            values.copy_(given[loc.row_offset:loc.row_offset + loc.rows,
                               loc.col_offset:loc.col_offset + loc.cols])
        else:
            self._fill(values)
        if self.precision != "fp32":
            stored, scale = quantize_rows(values, self.precision, stochastic=False)
            self.weight.copy_(stored)
            self.row_scale = scale

    def _drawn_padding_row(self, given: torch.Tensor | None) -> torch.Tensor | None:
        """The padding row's values where the author's init left it drawn (not zero) and
        this is an ``nn.Embedding`` looked up through the exchange: eager's lookup returns
        that row at padding ids (with no gradient, so it never changes), while the
        exchange drops padding ids. Every rank draws it itself (or reads ``given``)."""
        recipe = self.init_recipe
        if self.is_bag or self.local_only or self.padding_idx is None or (
                given is None and (recipe is None or recipe.zeroes_padding_row())):
            return None
        device = self.weight.device if self.weight is not None else torch.device("cpu")
        if given is not None:
            return given[int(self.padding_idx)].detach().to(device, torch.float32)
        row = torch.empty(1, self.embedding_dim, device=device)
        return fill_table_slice_(row, fqn=self.fqn, rows=self.num_embeddings,
                                 dim=self.embedding_dim, row_offset=int(self.padding_idx),
                                 col_offset=0, seed=self.seed, recipe=recipe)[0]

    def _fill(self, values: torch.Tensor) -> None:
        assert self.local is not None
        fill_table_slice_(
            values,
            fqn=self.fqn,
            rows=self.num_embeddings,
            dim=self.embedding_dim,
            row_offset=self.local.row_offset,
            col_offset=self.local.col_offset,
            seed=self.seed,
            padding_idx=self.padding_idx,
            recipe=self.init_recipe,
        )

    # -- low-precision storage -------------------------------------------------------

    def rows_for_lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the weight a lookup reads, the ids into it). fp32: the shard and the ids.
        bf16 / fp8: the used rows dequantised into an fp32 leaf (kept, with their row
        numbers, until :meth:`take_row_grads`) and each id's index into it."""
        assert self.weight is not None
        if self.precision == "fp32":
            return self.weight, ids
        used, inverse = torch.unique(ids, return_inverse=True)
        work = StoredRows(self.weight.data, self.precision, self.row_scale).read(used)
        if torch.is_grad_enabled():
            work.requires_grad_()
            self.working.append((used, work))
        return work, inverse.view(ids.shape)

    def take_row_grads(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(sorted distinct rows, their summed fp32 gradients) of this step's lookups of a
        bf16 / fp8 shard; None when none got a gradient. Clears the record."""
        got = [(rows, w.grad) for rows, w in self.working if w.grad is not None]
        self.working.clear()
        if not got:
            return None
        rows = torch.cat([r for r, _ in got])
        grads = torch.cat([g.to_dense() if g.is_sparse else g for _, g in got])
        distinct, inverse = torch.unique(rows, return_inverse=True)
        summed = torch.zeros(distinct.numel(), grads.shape[1], device=grads.device)
        summed.index_add_(0, inverse, grads.float())
        return distinct, summed

    def local_padding_row(self) -> int | None:
        """The padding row's index in this rank's shard, None when it holds none. Its ids
        may reach the local lookups' gradient (:mod:`.padded_lookup`); the optimizer
        leaves it alone, as torch's sparse gradient does."""
        if self.padding_idx is None or self.local is None:
            return None
        row = int(self.padding_idx) - self.local.row_offset
        return row if 0 <= row < self.local.rows else None

    def stored_rows(self, step: int) -> StoredRows:
        """The local shard's rows as fp32, written back rounded with step ``step``'s draw
        (seeded by table and step, not rank: replicas round alike)."""
        assert self.weight is not None
        gen = None
        if self.precision != "fp32":
            gen = torch.Generator(device=self.weight.device)
            gen.manual_seed(derive_seed(self.seed, "table-rounding", self.fqn, step))
        return StoredRows(self.weight.data, self.precision, self.row_scale, gen)

    def extra_repr(self) -> str:
        local = self.local
        held = (
            f"rows {local.row_offset}:{local.row_offset + local.rows}, "
            f"cols {local.col_offset}:{local.col_offset + local.cols}"
            if local
            else "none"
        )
        return (
            f"{self.fqn}, {self.num_embeddings}x{self.embedding_dim}, {self.sharding}, "
            f"mode={self.mode}, precision={self.precision}, rank {self.rank} holds {held}"
        )

    # -- forward ---------------------------------------------------------------------

    def forward(
        self,
        input: torch.Tensor,  # noqa: A002 - nn.EmbeddingBag's own argument name
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.local_only:
            if self.prefetched is not None:  # a replica looked up by its group's one lookup
                out = self.prefetched.take(self.fqn, input, offsets, per_sample_weights)
                self.prefetched = None
                return out
            if self.recording is not None:
                self.recording.note(input, offsets, per_sample_weights)
            return self._local(input, offsets, per_sample_weights)
        if self.prefetched is not None:
            out = self.prefetched.take(self.fqn, input, offsets, per_sample_weights)
            self.prefetched = None
            return self._with_padding_row(out, input)
        if self.recording is not None:
            self.recording.note(input, offsets, per_sample_weights)
        ids, offsets, weights, out_shape = self.as_bags(input, offsets, per_sample_weights)
        bags = self.routed_bags(ids, offsets, weights)
        out = exchange_lookups([self], [bags], world=self.world_size, group=self.group)[0]
        return self._with_padding_row(out.view(out_shape), input)

    def _with_padding_row(self, out: torch.Tensor, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        """``out`` with the drawn padding row at padding ids (see _drawn_padding_row)."""
        if self.padding_row is None:
            return out
        at_pad = (input == self.padding_idx).unsqueeze(-1)
        return torch.where(at_pad, self.padding_row.to(out.dtype), out)

    def _local(self, input, offsets, per_sample_weights) -> torch.Tensor:  # noqa: ANN001
        weight, ids = self.rows_for_lookup(input)
        padding_idx = self.padding_idx
        if padding_idx is not None and ids is input and self.mode != "max" and not (
                per_sample_weights is not None and per_sample_weights.requires_grad):
            # torch's sparse gradient would drop the padding ids with a host sync
            if not self.is_bag:
                return padded_sparse_lookup(weight, ids, padding_idx)
            ids, offsets, weights, out_shape = self.as_bags(input, offsets, per_sample_weights)
            return padded_sparse_lookup(weight, ids.long(), padding_idx, offsets=offsets,
                                        per_sample_weights=weights,
                                        mode=self.mode).view(out_shape)
        if padding_idx is not None and ids is not input:  # the padding row's new index
            hit = (input.reshape(-1) == padding_idx).nonzero()
            padding_idx = int(ids.reshape(-1)[hit[0, 0]]) if hit.numel() else None
        if not self.is_bag:
            return F.embedding(ids, weight, padding_idx, sparse=True)
        return F.embedding_bag(
            ids,
            weight,
            offsets,
            mode=self.mode,
            sparse=self.mode != "max",  # torch has no sparse gradient of a max pool
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
            padding_idx=padding_idx,
        )

    def defer_backward(self, grad: torch.Tensor, input: torch.Tensor,  # noqa: A002
                       offsets: torch.Tensor | None,
                       per_sample_weights: torch.Tensor | None) -> None:
        """Keep a lookup's output gradient that arrived in ``gemc::table_lookup``'s backward
        for :meth:`replay_deferred`.

        Why deferred: that backward runs inside a custom op, where autograd records
        nothing, so the table's own sparse gradient (``weight.grad``, or a bf16 / fp8
        table's working rows) cannot be made there. Copies, because the compiled backward
        may reuse the buffers it passed once the op returns."""
        self.deferred.append(tuple(
            t.detach().clone() if t is not None else None
            for t in (grad, input, offsets, per_sample_weights)))

    def replay_deferred(self) -> None:
        """Each deferred lookup again under grad and its backward: the table's gradient is
        then exactly the one the eager lookup leaves (the sparse optimizer reads it). The
        gather repeated is a small part of a sparse lookup's backward."""
        pending, self.deferred = self.deferred, []
        with torch.enable_grad():
            for grad, input, offsets, weights in pending:
                out = self(input, offsets, weights)
                out.backward(grad.to(out.dtype))

    @torch.no_grad()
    def per_sample_weight_grad(self, grad: torch.Tensor, input: torch.Tensor,  # noqa: A002
                               offsets: torch.Tensor | None,
                               per_sample_weights: torch.Tensor) -> torch.Tensor:
        """The per-sample weights' gradient of a sum-pooled lookup: each id's row dotted with
        its bag's output gradient, zero at the padding row (torch's embedding_bag backward).
        Made where :meth:`defer_backward` is called: autograd needs it in the backward."""
        ids, offs, _, _ = self.as_bags(input, offsets, None)
        weight, index = self.rows_for_lookup(ids)
        rows = F.embedding(index.long(), weight).float()
        if self.padding_idx is not None:
            rows = rows.masked_fill((ids == self.padding_idx).unsqueeze(1), 0.0)
        position = torch.arange(ids.numel(), device=ids.device)
        bag = torch.searchsorted(offs, position, right=True) - 1
        out = grad.reshape(-1, self.embedding_dim).float()
        return (out[bag] * rows).sum(1).to(per_sample_weights.dtype).view_as(
            per_sample_weights)

    def as_bags(self, input, offsets, per_sample_weights):  # noqa: ANN001, ANN202
        """(ids [n], offsets [B+1], weights or None, output shape) for every call form."""
        if per_sample_weights is not None and per_sample_weights.requires_grad:
            raise GemcUserError(
                f"table '{self.fqn}': per_sample_weights that require grad are not supported "
                "by the sharded runner (they would get no gradient)",
                where=f"model module {module_fqn(self.fqn)}",
                fix="detach the per-sample weights or keep this table data_parallel",
            )
        if not self.is_bag:
            ids = input.reshape(-1)
            n = ids.numel()
            offs = torch.arange(n + 1, device=ids.device, dtype=torch.long)
            return ids, offs, None, (*input.shape, self.embedding_dim)
        if input.dim() == 2:
            b, length = input.shape
            ids = input.reshape(-1)
            offs = torch.arange(b + 1, device=ids.device, dtype=torch.long) * length
            weights = None if per_sample_weights is None else per_sample_weights.reshape(-1)
            return ids, offs, weights, (b, self.embedding_dim)
        if offsets is None:
            raise ValueError("EmbeddingBag with 1-D input needs offsets")
        offs = offsets.long()
        if not self.include_last_offset:
            offs = torch.cat([offs, offs.new_full((1,), input.numel())])
        return input, offs, per_sample_weights, (offs.numel() - 1, self.embedding_dim)

    def routed_bags(self, ids: torch.Tensor, offsets: torch.Tensor,
                    weights: torch.Tensor | None) -> Bags:
        """The routed form of one call's bags: padding ids dropped (neither pooled nor
        counted), each id's bag index."""
        batch = offsets.numel() - 1
        lengths = offsets[1:] - offsets[:-1]
        bag = torch.repeat_interleave(
            torch.arange(batch, device=ids.device), lengths, output_size=ids.numel()
        )
        ids = ids.long()
        if self.padding_idx is not None:
            keep = ids != self.padding_idx
            ids, bag = ids[keep], bag[keep]
            weights = None if weights is None else weights[keep]
            lengths = torch.bincount(bag, minlength=batch)
        return Bags(ids=ids, bag=bag, batch=batch, weights=weights, lengths=lengths,
                    owned_rows=self.answers_owned_rows())

    def answers_owned_rows(self) -> bool:
        """Whether this table's row shards return only the rows of the ids they own
        (:mod:`.owned_rows`): an unpooled lookup of a row-split table, the switch on."""
        return (not self.is_bag and SHARDINGS[self.sharding].row_split
                and owned_rows_enabled())


def shard_tables(
    model: nn.Module,
    tables: list[dict[str, Any]],
    *,
    rank: int,
    world_size: int,
    seed: int,
    group: dist.ProcessGroup | None = None,
    exchange: WirePrecision = FP32_WIRE,
    gpus_per_host: int | None = None,
) -> dict[str, ShardedEmbedding]:
    """Replace every table module of ``model`` (still on meta) by its sharded version,
    exchanging pooled rows at ``exchange`` (the plan's, :func:`gemc.exchange_precision.
    wire_of_plan`); ``gpus_per_host``: the plan topology's (None: one host), where row
    shards sum their partials before crossing hosts (:mod:`.host_reduce`)."""
    out: dict[str, ShardedEmbedding] = {}
    for table in tables:
        name = module_fqn(table["fqn"])
        try:
            source = model.get_submodule(name)
        except AttributeError as exc:
            raise PlanError(
                f"the plan's table '{table['fqn']}' is not a module of the model",
                where=f"plan tables: {table['fqn']}",
                fix="compile the plan again for this model",
            ) from exc
        sharded = ShardedEmbedding(
            source, table, rank=rank, world_size=world_size, seed=seed, group=group,
            exchange=exchange, gpus_per_host=gpus_per_host)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, sharded)
        out[table["fqn"]] = sharded
    return out
