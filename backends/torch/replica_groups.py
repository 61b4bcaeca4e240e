"""Data-parallel replicas batched: one storage, one lookup and one update per group (issue 19).

Why: on several ranks each ``data_parallel`` replica used to cost the host its own lookup,
its own sparse backward, its own adds into the step's bucket and its own masked update
(the H200's fifteenth session: 0.356 ms of wall a replica a step, 9 launches at the
graph-mode launch cost, against 0.040 ms of device time), so gemc's planner rightly
refused the replicas TorchRec's plan makes, whose runner batches every data-parallel
table into one FBGEMM kernel. Here the replicas that can share one storage are one
*group*:

* **storage**: one fp32 ``[sum of rows, dim]`` leaf (``ReplicaGroup.weight``, not a
  module parameter: the dense optimizer never sees it); each member's ``weight`` is a
  view of its rows (``base`` to ``base + rows``), so checkpoints, the initial values and
  the optimizer state (per-table views of the group's, :class:`~.sparse_optim.
  EmbeddingOptimizer`) still see every table by its own name and rows;
* **lookup**: every member the model calls with the batch's own tensors (recorded at the
  first step, as :mod:`.table_prefetch` records the routed tables) is looked up ahead of
  the forward by ONE ``F.embedding_bag`` over the stacked rows, each table's ids offset by
  its base row and its bags one after the other (:meth:`ReplicaGroup.lookup`); the
  forward then hands each table its rows of the output;
* **gradient**: that lookup's backward makes ONE sparse gradient for the group, added
  into the group's segment of the step's one bucket (:class:`~.sparse_optim.
  ReplicaBucket`) by one add and one flag fill; the bucket's one all-reduce stays;
* **update**: one masked pass over the group's rows (not one per table).

Graph mode looks the same members up ahead of its compiled graph, by the same one lookup
a group, and hands each member's rows to the graph as an input in place of its lookup node
(:mod:`.replica_ahead`: which members is read off the graph). A member the graph looks up
otherwise (its ids computed in the model) stays inside the compiled graph
(``gemc::table_lookup``), its gradient deferred to the optimizer's step: there the group
replays its members' deferred lookups as one lookup and one backward
(:meth:`ReplicaGroup.replay_deferred`).

The arithmetic is the per-table path's: each bag pools the same rows in the same order
(the stacked rows are the tables' rows), the sparse gradient lists the same rows with the
same values, the bucket adds them in the same order, and the masked pass computes each row
on its own (its width is the group's). Tests compare the two bit for bit.

Which replicas group: fp32 tables stored fp32 (a bf16 / fp8 replica's rows go through its
own rounding), pooled ``sum`` or ``mean`` (``mean`` tables form their own groups; an
``nn.Embedding`` is a ``sum`` bag of one id each), without a padding row (the stacked
lookup has one padding index at most), of one width and device, on several ranks (one
rank keeps its own paths). The optimizer and its hyper-parameters are the run's, the
same for every table. A group needs two members. The others stay on today's path: that
is normal, and the run report counts them (``replica_batch``), as it lists the members
looked up when called (their ids computed in the model, or called twice a step).

``GEMC_BATCHED_REPLICAS=0`` keeps every replica on its own (A/B; ``1`` or unset: grouped).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from gemc.backends.torch.table_prefetch import ABSENT, Prefetched, Recording, why_not_prefetched

BATCHED_REPLICAS_ENV = "GEMC_BATCHED_REPLICAS"


def batched_replicas_from_env() -> bool:
    """``GEMC_BATCHED_REPLICAS`` = 1 / 0 (unset: on). Anything else is refused by name
    rather than read as either."""
    value = os.environ.get(BATCHED_REPLICAS_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{BATCHED_REPLICAS_ENV}={value!r}: set it to 1 (data-parallel "
                         "replicas batched by group) or 0 (each replica on its own), or "
                         "unset it")
    return value == "1"


def why_not_grouped(m: Any) -> str | None:
    """Why replica ``m`` (a ShardedEmbedding) cannot share a group's storage; None if it can."""
    if m.precision != "fp32" or m.weight.dtype != torch.float32:
        return f"stored {m.precision if m.precision != 'fp32' else m.weight.dtype}"
    if m.mode == "max":
        return "max pooling (a dense gradient)"
    if m.padding_idx is not None:
        return "a padding row"
    return None


def _kind(m: Any) -> tuple[int, str, str]:
    """The group a replica joins: its width, its pooling (nn.Embedding pools a bag of one
    by sum) and its device."""
    return (int(m.embedding_dim), "mean" if m.mode == "mean" else "sum", str(m.weight.device))


def form_groups(replicas: dict[str, Any]) -> tuple[list[ReplicaGroup], dict[str, str]]:
    """(the groups of ``replicas`` (fqn -> ShardedEmbedding, the plan's order: the same on
    every rank), fqn -> why a replica stays on its own). Moves each member's rows into its
    group's storage."""
    alone: dict[str, str] = {}
    kinds: dict[tuple[int, str, str], list[Any]] = defaultdict(list)
    for fqn, m in replicas.items():
        why = why_not_grouped(m)
        if why is None:
            kinds[_kind(m)].append(m)
        else:
            alone[fqn] = why
    groups = []
    for members in kinds.values():
        if len(members) < 2:
            alone[members[0].fqn] = "no other replica of its width and pooling"
            continue
        groups.append(ReplicaGroup(len(groups), members))
    return groups, alone


class ReplicaGroup:
    """Data-parallel replicas of one width and pooling in one storage (see the module doc)."""

    def __init__(self, index: int, members: Sequence[Any]) -> None:
        self.name = f"replica-group-{index}"  # its key in the bucket; never a table's fqn
        self.members = list(members)
        self.mode = "mean" if members[0].mode == "mean" else "sum"
        self.dim = int(members[0].embedding_dim)
        self.base: dict[str, int] = {}
        rows = 0
        for m in self.members:
            self.base[m.fqn] = rows
            rows += int(m.weight.shape[0])
        self.rows = rows
        device = members[0].weight.device
        stack = torch.empty(rows, self.dim, device=device)
        with torch.no_grad():
            for m in self.members:
                b = self.base[m.fqn]
                view = stack[b:b + m.weight.shape[0]]
                view.copy_(m.weight.data)
                m.weight.data = view  # the table's rows are the group's: one storage
        self.weight = stack.requires_grad_()
        # this step's lookup: the ids of its gradient that came from members the model did
        # not call (their rows' flags stay clear, see :meth:`forget`), else None
        self.skipped: torch.Tensor | None = None
        self._shifts: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._starts: dict[tuple, torch.Tensor] = {}
        self._ones: dict[int, torch.Tensor] = {}
        self._spans: list[tuple[str, int, int]] = []  # (fqn, first id, ids) of the lookup

    def rows_of(self, fqn: str) -> tuple[int, int]:
        """(first row, rows) of member ``fqn`` in the group's storage."""
        m = next(m for m in self.members if m.fqn == fqn)
        return self.base[fqn], int(m.weight.shape[0])

    # -- the one lookup ----------------------------------------------------------------

    def lookup(self, calls: Sequence[tuple[Any, tuple[Any, Any, Any]]]) -> list[torch.Tensor]:
        """Each call's output (``(member, (input, offsets, per_sample_weights))``, the
        member's own call forms), from ONE ``F.embedding_bag`` over the stacked rows.

        Per call only views and cached index tensors: each table's bag starts are its
        offsets (or a cached ``arange`` for 2-D input and ``nn.Embedding``); its ids and
        starts are shifted to the stack by one add each over the concatenation, with the
        shifts cached by the calls' id and bag counts (fixed batches reuse them)."""
        device = self.weight.device
        ids, starts, weights, shapes, counts, bags = [], [], [], [], [], []
        for m, (input, offsets, psw) in calls:  # noqa: A001 - nn.EmbeddingBag's name
            flat, start, shape = self._bag_starts(m, input, offsets)
            ids.append(flat)
            starts.append(start)
            weights.append(psw if psw is None else psw.reshape(-1))
            shapes.append(shape)
            counts.append(flat.numel())
            bags.append(start.numel())
        key = (tuple(m.fqn for m, _ in calls), tuple(counts), tuple(bags))
        id_shift, start_shift = self._shift(key, device)
        zero = self._start(("zero",), device)
        index = torch.cat(ids) + id_shift
        offsets = torch.cat([*starts, zero]) + start_shift
        per_sample = None
        if any(w is not None for w in weights):
            per_sample = torch.cat([w if w is not None else self._ones_of(c, device)
                                    for w, c in zip(weights, counts)])
        out = F.embedding_bag(index, self.weight, offsets, mode=self.mode, sparse=True,
                              per_sample_weights=per_sample, include_last_offset=True)
        first, self._spans = 0, []
        for (m, _), c in zip(calls, counts):
            self._spans.append((m.fqn, first, c))
            first += c
        self.skipped = None
        return [part.view(shape) for part, shape in zip(out.split(bags), shapes)]

    def replay_deferred(self) -> None:
        """The members' deferred lookups (graph mode: their output gradients arrived in
        ``gemc::table_lookup``'s backward, :meth:`ShardedEmbedding.defer_backward`) again
        under grad, as ONE lookup and one backward for the group, not one a table: the
        group's gradient is then the per-table replays' (:meth:`ShardedEmbedding.
        replay_deferred`), the same rows and values."""
        calls, grads = [], []
        for m in self.members:
            pending, m.deferred = m.deferred, []
            for grad, input, offsets, weights in pending:  # noqa: A001
                calls.append((m, (input, offsets, weights)))
                grads.append(grad)
        if not calls:
            return
        with torch.enable_grad():
            outs = self.lookup(calls)
            torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(grads, outs)])

    def forget(self, fqns: set[str]) -> None:
        """Members looked up this step whose output the model never asked for: their ids
        are in the group's gradient (with zero rows) but the per-table path never looked
        them up, so their rows must not count as used (lazy Adam would move them)."""
        spans = [(first, c) for f, first, c in self._spans if f in fqns and c]
        if not spans:
            return
        device = self.weight.device
        total = sum(c for _, _, c in self._spans)
        skip = torch.zeros(total, dtype=torch.bool, device=device)
        for first, c in spans:
            skip[first:first + c] = True
        self.skipped = skip

    def _bag_starts(self, m: Any, input: torch.Tensor,  # noqa: A002
                    offsets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """(ids [n], each bag's first id [bags], the output's shape) of one call."""
        device = self.weight.device
        if not m.is_bag:
            flat = input.reshape(-1)
            return flat, self._start(("arange", flat.numel(), 1), device), \
                (*input.shape, self.dim)
        if input.dim() == 2:
            b, length = input.shape
            return input.reshape(-1), self._start(("arange", b, length), device), (b, self.dim)
        if offsets is None:
            raise ValueError("EmbeddingBag with 1-D input needs offsets")
        start = offsets[:-1] if m.include_last_offset else offsets
        return input, start, (start.numel(), self.dim)

    def _start(self, key: tuple, device: torch.device) -> torch.Tensor:
        got = self._starts.get(key)
        if got is None:
            if key[0] == "zero":
                got = torch.zeros(1, dtype=torch.long, device=device)
            else:
                got = torch.arange(key[1], dtype=torch.long, device=device) * key[2]
            self._starts[key] = got
        return got

    def _ones_of(self, count: int, device: torch.device) -> torch.Tensor:
        got = self._ones.get(count)
        if got is None:
            got = self._ones[count] = torch.ones(count, device=device)
        return got

    def _shift(self, key: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(each id's base row, each bag start's first id in the concatenation, the last
        entry the total) for calls of these members with these id and bag counts."""
        got = self._shifts.get(key)
        if got is None:
            # filled on the device (a copy from the host would wait for the GPU's queue):
            # two fills a table, only when the counts change (jagged batches: every step)
            if len(self._shifts) >= 8:
                self._shifts.clear()
            fqns, counts, bags = key
            firsts = [0]
            for c in counts:
                firsts.append(firsts[-1] + c)

            def fill(n: int, value: int) -> torch.Tensor:
                return torch.full((n,), value, dtype=torch.long, device=device)

            got = self._shifts[key] = (
                torch.cat([fill(c, self.base[f]) for f, c in zip(fqns, counts)]),
                torch.cat([fill(b, s) for b, s in zip(bags, firsts)] + [fill(1, firsts[-1])]))
        return got

    # -- its gradient into the bucket --------------------------------------------------

    def take_grad(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """(row ids, gradient rows, which ids to flag or None: all) of this step's lookup;
        None when it made no gradient."""
        grad = self.weight.grad
        if grad is None:
            return None
        keep = None if self.skipped is None else (~self.skipped).float()
        return grad._indices()[0], grad._values(), keep


@dataclass
class ReplicaLookups:
    """The runner's per-step hook for the groups' lookups (as :class:`.table_prefetch.
    TablePrefetch` for the routed tables): ``begin_step(batch)`` before the forward,
    ``end_step()`` after the backward. The first step runs every member on its own and
    records where its arguments sit in the batch; from the second on, the members called
    once a step with batch entries are looked up by their group's one lookup. No
    collective depends on it (a replica's lookup is local; the bucket's layout is the
    groups'), so each rank decides alone."""

    groups: list[ReplicaGroup]
    alone: dict[str, str] = field(default_factory=dict)  # fqn -> why not in a group
    off: str | None = None  # why no group is looked up ahead (graph mode), or None
    agreed: list[tuple[ReplicaGroup, list[tuple[Any, tuple[int, int, int]]]]] | None = None
    on_call: dict[str, str] = field(default_factory=dict)  # member fqn -> why

    def begin_step(self, batch: Sequence[Any]) -> None:
        if self.off is not None:
            return
        if self.agreed is None:
            for g in self.groups:
                for m in g.members:
                    m.recording = Recording(batch)
            return
        for g, entries in self.agreed:
            calls = []
            for m, positions in entries:
                call = tuple(None if p == ABSENT else batch[p] for p in positions)
                if call[2] is not None and call[2].requires_grad:
                    continue  # its weights want a gradient: looked up when called
                calls.append((m, call))
            if not calls:
                continue
            for (m, call), out in zip(calls, g.lookup(calls)):
                m.prefetched = Prefetched(call, out)

    def end_step(self) -> None:
        if self.off is not None:
            return
        if self.agreed is not None:
            for g, entries in self.agreed:
                idle = {m.fqn for m, _ in entries if m.prefetched is not None}
                for m, _ in entries:
                    m.prefetched = None
                if idle:
                    g.forget(idle)
            return
        self.agreed = []
        for g in self.groups:
            entries = []
            for m in g.members:
                rec, m.recording = m.recording, None
                row = [*rec.positions, rec.calls]
                why = why_not_prefetched(row, row)
                if why is None:
                    entries.append((m, rec.positions))
                else:
                    self.on_call[m.fqn] = why
            if entries:
                self.agreed.append((g, entries))

    def report(self) -> dict[str, Any]:
        """The run report's ``replica_batch``: each group's members, the replicas on their
        own (and why), the members looked up when called (and why)."""
        return {"groups": {g.name: [m.fqn for m in g.members] for g in self.groups},
                "batched_lookup": None if self.off else sorted(
                    m.fqn for _, entries in self.agreed or [] for m, _ in entries),
                "not_grouped": dict(sorted(self.alone.items())),
                "on_call": dict(sorted(self.on_call.items())),
                "lookups_ahead": self.off or "on"}
