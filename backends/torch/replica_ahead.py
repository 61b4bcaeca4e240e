"""Graph mode: the replica groups looked up ahead of the compiled graph, their rows its inputs.

Why: graph mode looked each data-parallel replica up inside the compiled graph
(``gemc::table_lookup``: the op's lookup in the forward; in the backward its own op, a
zero for its anchor and three copies of the output gradient, ids and offsets kept for the
optimizer's replay), so a group's members each still cost the host about four launches a
step (``cost_model.launches.REPLICA_GROUPED_TABLE_LAUNCHES`` until the twenty-fifth
session), and the 16-rank DLRMv2 step is host-bound in gemc's model. Module mode already
looked a group up once ahead of the forward (:class:`.replica_groups.ReplicaLookups`).
Here graph mode does the same: before the compiled graph runs, each group's members the
graph calls with the batch's own tensors are looked up by the group's ONE
``F.embedding_bag`` (:meth:`.replica_groups.ReplicaGroup.lookup`, under autograd), and each
member's rows (a view of that output) are an input of the compiled graph in place of its
lookup node. The compiled backward hands back those inputs' gradients; autograd then runs
the group lookup's one backward (the split's one ``cat`` and ATen's sparse bag backward)
into the group's gradient, which the optimizer adds into the bucket as before. No op runs a
member: what is left per member is views and Python bookkeeping.

Which lookups: read off the captured graph, not recorded at run time (the compiled graph's
inputs are not the batch's tensor objects): a member of a group looked up by exactly one
node whose ids, offsets and per-sample weights are each a batch input of the graph (or
absent). The others stay in the graph as before, their gradients deferred and replayed by
their group at the optimizer's step (:meth:`.replica_groups.ReplicaGroup.replay_deferred`):
ids computed in the model, a table looked up twice. A per-sample weight that requires a
gradient cannot be read off the graph; it is checked at each step and such a lookup then
runs in the graph (another compiled variant, counted in the report's ``in_graph_steps``).

The arithmetic is the per-table path's (the rows pooled in the same order, the same sparse
gradient rows in the same order per member, members' rows disjoint in the bucket); tests
compare them bit for bit. ``GEMC_BATCHED_REPLICAS=0`` (no groups) leaves every replica in
the graph.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from gemc import ir


@dataclass(frozen=True)
class AheadLookup:
    """One member's lookup node, fed from the batch: its group looks it up ahead."""

    node: str  # the lookup node's name in the captured graph
    member: Any  # the ShardedEmbedding
    group: Any  # its ReplicaGroup
    positions: tuple[int | None, int | None, int | None]  # ids, offsets, weights: from the end
    is_bag: bool


@dataclass
class ReplicaAhead:
    """The groups' lookups ahead of one compiled step (see the module doc)."""

    lookups: list[AheadLookup]
    in_graph: dict[str, str] = field(default_factory=dict)  # member fqn -> why
    in_graph_steps: dict[str, int] = field(default_factory=dict)  # fqn -> run-time fallbacks

    def now(self, batch: Sequence[torch.Tensor]) -> tuple[str, ...]:
        """The lookup nodes looked up ahead at this step: all but those whose per-sample
        weights want a gradient (the graph's lookup makes it; counted)."""
        out = []
        for a in self.lookups:
            w = a.positions[2]
            if w is not None and batch[len(batch) + w].requires_grad:
                fqn = a.member.fqn
                self.in_graph_steps[fqn] = self.in_graph_steps.get(fqn, 0) + 1
                continue
            out.append(a.node)
        return tuple(out)

    def rows(self, batch: Sequence[torch.Tensor], names: tuple[str, ...]) -> list[torch.Tensor]:
        """Each named lookup's rows (in ``names``' order, which follows ``lookups``), from
        one lookup a group."""
        chosen = set(names)
        by_group: dict[int, list[AheadLookup]] = {}
        for a in self.lookups:
            if a.node in chosen:
                by_group.setdefault(id(a.group), []).append(a)
        got: dict[str, torch.Tensor] = {}
        for entries in by_group.values():
            calls = [(a.member, tuple(None if p is None else batch[len(batch) + p]
                                      for p in a.positions)) for a in entries]
            for a, out in zip(entries, entries[0].group.lookup(calls)):
                got[a.node] = out
        return [got[n] for n in names]

    def report(self) -> dict[str, Any]:
        return {"ahead": sorted(a.member.fqn for a in self.lookups),
                "in_graph": dict(sorted(self.in_graph.items())),
                "in_graph_steps": dict(sorted(self.in_graph_steps.items()))}


def ahead_lookups(gm: fx.GraphModule, calls: Mapping[str, Any], groups: Sequence[Any],
                  inputs: Sequence[str]) -> ReplicaAhead:
    """The groups' members ``gm`` looks up with batch inputs only (see the module doc).
    ``calls``: the lookup nodes the sharded tables answer (by name); ``inputs``: the batch's
    placeholders, in the batch's order (positions are kept from the end, as the executor's
    shape check pairs them)."""
    from gemc.backends.torch.graph_mode import _arguments

    member_of = {m.fqn: (m, g) for g in groups for m in g.members}
    nodes: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.name not in calls:
            continue
        weight = node.args[0]
        fqn = weight.meta.get(ir.PARAM) if isinstance(weight, fx.Node) else None
        if fqn in member_of:
            nodes.setdefault(fqn, []).append(node)
    at = {name: i - len(inputs) for i, name in enumerate(inputs)}
    found: dict[str, AheadLookup] = {}
    in_graph: dict[str, str] = {}
    for fqn, (m, g) in member_of.items():
        got = nodes.get(fqn, [])
        if len(got) != 1:
            if got:
                in_graph[fqn] = f"looked up {len(got)} times in a step"
            continue
        node = got[0]
        args = _arguments(node)
        is_bag = node.target is not torch.ops.aten.embedding.default
        named = (("ids", args.get("indices")), ("offsets", args.get("offsets") if is_bag else None),
                 ("per-sample weights", args.get("per_sample_weights") if is_bag else None))
        computed = [n for n, v in named if v is not None
                    and not (isinstance(v, fx.Node) and v.op == "placeholder" and v.name in at)]
        if computed:
            in_graph[fqn] = f"its {' and '.join(computed)} are computed in the model"
            continue
        found[fqn] = AheadLookup(node.name, m, g, tuple(  # type: ignore[arg-type]
            None if v is None else at[v.name] for _, v in named), is_bag)
    ordered = [found[m.fqn] for g in groups for m in g.members if m.fqn in found]
    return ReplicaAhead(ordered, in_graph)

