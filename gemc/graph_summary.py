"""What the annotated graph says per table and per dense region, priced as the plan runs.

The planner's facts stage: typed facts the solver plans with and the plan records
(:class:`TableFacts`, :class:`RegionFacts`, both from :func:`graph_facts`), and the
per-node times under the plan's kernels and autocast (``kernel_adjusted_ms``,
``gradient_accumulation_ms``) that both sum. One place, below the solver and the plan
builder, so the step a plan predicts is the step its planner optimised (the solver prices
the facts through ``gemc.costing`` into ``gemc.solver.problem``'s ``Problem``, the plan
builder writes each one's ``entry()`` into the plan and ``gemc.costing`` prices the same
objects for its ``predicted`` block).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx

from gemc import ir, packed_rules
from gemc.cost_model import inductor_fusion, op_cost
from gemc.cost_model.activations import (
    activation_profile,
    packed_fill,
    plan_autocast,
    runtime_itemsize,
    view_base,
)
from gemc.cost_model.step_model import shard_compute_s
from gemc.cost_model.types import StepOptions, TableCost
from gemc.guard_sample import SAMPLE
from gemc.ir import OpKind
from gemc.kernel_kinds import graph_kinds
from gemc.sharding import REPLICATED_DENSE, make_shards
from gemc.table_lookup import DENSE_GRAD, SPARSE, captured_sparse, cheaper_route, lookup_paths


def table_lookup_paths(gm: fx.GraphModule) -> dict[str, str]:
    """Each table's lookup path as the runner will run the plan built from ``gm``
    (gemc.table_lookup's rule): its batched kernel groups, the tables' storage precisions
    (``gemc.placement``), the world size it was priced for, whether the plan has graph
    kernels at all, the lookups captured ``sparse=True``, and, for a table that would run
    ``DENSE_GRAD``, which of its two routes the cost model prices cheaper
    (:func:`table_route_prices`; only once predict-time has set the pricing)."""
    return _routes(gm)[0]


def runs_graph_mode(gm: fx.GraphModule) -> bool:
    """Whether the plan built from ``gm`` puts the runner in graph mode: it lists a kernel
    of a graph kind (a kernel group's ``gemc.kernel``, or a packed token region: its
    layout entry, a graph-mode kind too), as the runner's ``graph_kinds`` check reads the
    plan's kernels. What the runner executes then is narrower
    (``gemc.sharding.runner_executes``), so the solver reads this before it offers a
    strategy."""
    kinds = graph_kinds()
    return any((isinstance(f := n.meta.get(ir.KERNEL), dict) and f.get("kind") in kinds)
               or ir.PACKED_REGION in n.meta for n in gm.graph.nodes)


def padded_ids(node: fx.Node) -> int:
    """Ids an unpooled lookup reads from a padded grid (an id tensor of 2 or more dims,
    [batch, length]: its padding repeats one id, kernels.hottest_row_ids); 0 otherwise. A
    bag lookup's 2-D ids are fixed-size bags, not padding."""
    facts = node.meta.get(ir.TABLE) or {}
    if "embedding_bag" in str(node.target) or len(node.args) < 2:
        return 0
    shape = ir.shape_of(node.args[1]) if isinstance(node.args[1], fx.Node) else None
    return int(facts.get("nnz", 0)) if shape is not None and len(shape) >= 2 else 0


def padding_row(node: fx.Node) -> bool:
    """A lookup op naming a padding row (``aten.embedding``'s 3rd argument, or
    ``aten.embedding_bag``'s 9th, >= 0)."""
    index = 8 if "embedding_bag" in str(node.target) else 2
    value = node.args[index] if len(node.args) > index else node.kwargs.get("padding_idx")
    return isinstance(value, int) and value >= 0


def gathered_lookups(gm: fx.GraphModule) -> dict[str, tuple[float, int]]:
    """Lookup node -> (the share of its padded ids it looks up, the padding ids among
    them) for the lookups packed regions gather the ids of (their ``lookups``:
    gemc.packed_rules.gathered_lookup), where the region is priced at a sample batch's
    fill: its tokens (``fill``, the real ones bucketed as the compiled graph runs them,
    plus the representatives) and, with padding representatives, one padding id per row
    with padding (``sample_reps``), without none. On one rank only: on several, the
    runners keep the padded lookup (a sharded table's exchange may be prefetched from the
    batch's own ids: ``GraphRunner._padded_ids_why``)."""
    if int((gm.meta.get(ir.PRICING) or {}).get("world_size", 1)) != 1:
        return {}
    out: dict[str, tuple[float, int]] = {}
    for node in gm.graph.nodes:
        f = node.meta.get(ir.PACKED_REGION)
        if not isinstance(f, dict) or f.get("fill_source") != SAMPLE:
            continue
        for name in f.get("lookups") or ():
            out[str(name)] = (float(f["fill"]), int(f.get("sample_reps", 0)))
    return out


def _table_costs(gm: fx.GraphModule) -> dict[str, TableCost]:
    """Each table's TableCost on one rank as the graph looks it up (lookups summed); a
    lookup of a packed region's gathered ids at the region's tokens, its padding ids the
    representatives' (:func:`gathered_lookups`)."""
    out: dict[str, TableCost] = {}
    gathered = gathered_lookups(gm)
    for node in gm.graph.nodes:
        facts = node.meta.get(ir.TABLE)
        if facts is None:
            continue
        fqn = facts["fqn"]
        old = out.get(fqn) or TableCost(fqn, int(facts["rows"]), int(facts["dim"]), 0,
                                        int(facts["batch"]), pooled=facts["mode"] != "none",
                                        lookups=0)
        nnz, padded, pads = int(facts["nnz"]), padded_ids(node), 0
        if node.name in gathered:
            share, pads = gathered[node.name]
            nnz, padded = max(1, round(nnz * share)), 0
        out[fqn] = replace(old, nnz=old.nnz + nnz, lookups=old.lookups + 1,
                           padded_nnz=old.padded_nnz + padded, pad_ids=old.pad_ids + pads,
                           padding_row=old.padding_row or padding_row(node),
                           batch_fed=old.lookups == 0 and batch_fed(node))
    return out


def batch_fed(node: fx.Node) -> bool:
    """A lookup op whose ids, offsets and per-sample weights are each an input of the graph
    (or absent): the runner can look it up ahead of the compiled graph
    (backends/torch/replica_ahead.py reads the same args off the runner's graph)."""
    bag = "embedding_bag" in str(node.target)
    named = [node.args[1] if len(node.args) > 1 else node.kwargs.get("indices")]
    if bag:
        named.append(node.args[2] if len(node.args) > 2 else node.kwargs.get("offsets"))
        named.append(node.args[6] if len(node.args) > 6
                     else node.kwargs.get("per_sample_weights"))
    return all(v is None or (isinstance(v, fx.Node) and v.op == "placeholder") for v in named)


def table_route_prices(gm: fx.GraphModule, fqns: Iterable[str]) -> dict[str, dict[str, float]]:
    """Milliseconds a step of each table in ``fqns`` costs on each route outside the
    batched kernel on one rank (``{SPARSE: ms, DENSE_GRAD: ms}``: lookups, gradient,
    the sparse optimizer's step; cost_model.step_model.shard_compute_s), at the GPU and
    calibration predict-time priced the graph with. Empty before predict-time."""
    pricing = gm.meta.get(ir.PRICING)
    if not pricing or not fqns:
        return {}
    costs = _table_costs(gm)
    optimizer = StepOptions.table_optimizer
    return {f: {path: 1e3 * shard_compute_s(replace(costs[f], lookup=path, routed=True),
                                            costs[f].rows,
                                            costs[f].dim, 1, pricing["gpu"],
                                            pricing["calibration"], optimizer)
                for path in (SPARSE, DENSE_GRAD)}
            for f in fqns if f in costs}


def _routes(gm: fx.GraphModule) -> tuple[dict[str, str], dict[str, dict[str, float]], bool]:
    """(table_lookup_paths, the route prices of the tables the cost model chose for,
    whether the runner runs the captured graph: its SPARSE lookups are then routed)."""
    kinds: dict[str, str] = {}
    precision: dict[str, str] = {}
    members: dict[str, set[str]] = defaultdict(set)
    sparse: dict[str, bool] = {}
    shardings: dict[str, str] = {}
    lookups: dict[str, int] = defaultdict(int)
    not_fp32: set[str] = set()  # tables the model holds in another dtype
    graph_mode = False
    for node in gm.graph.nodes:
        facts = node.meta.get(ir.KERNEL)
        if facts:
            kinds[str(facts.get("id"))] = str(facts.get("kind"))
        graph_mode = graph_mode or bool(facts) or ir.PACKED_REGION in node.meta
        table = node.meta.get(ir.TABLE)
        if table is None:
            continue
        fqn = table["fqn"]
        placement = node.meta.get(ir.PLACEMENT) or {}
        precision[fqn] = placement.get("precision", precision.get(fqn, "fp32"))
        shardings[fqn] = placement.get("sharding", "table_wise")
        weight = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if weight is not None and weight.dtype != torch.float32:
            not_fp32.add(fqn)
        lookups[fqn] += 1
        sparse[fqn] = sparse.get(fqn, True) and captured_sparse(node)
        gid = node.meta.get(ir.GROUP)
        if gid is not None:
            members[str(gid)].add(fqn)
    batched = [fqns for gid, fqns in members.items() if kinds.get(gid) == "batched_embedding_bag"]
    world = int((gm.meta.get(ir.PRICING) or {}).get("world_size", 1))
    captured = {f for f, s in sparse.items() if s}
    # several ranks: the owners' route by sharding (gemc.table_lookup.sharded_route)
    sharded = {"shardings": shardings, "lookups": dict(lookups), "not_fp32": not_fp32,
               "optimizer": gm.meta.get(ir.TABLE_OPTIMIZER) or StepOptions.table_optimizer}
    paths = lookup_paths(precision, batched, world_size=world, graph_mode=graph_mode,
                         captured_sparse=captured, **sharded)
    prices = table_route_prices(gm, [f for f, p in paths.items() if p == DENSE_GRAD])
    priced = {f for f, p in prices.items() if cheaper_route(p) == SPARSE}
    if priced:
        paths = lookup_paths(precision, batched, world_size=world, graph_mode=graph_mode,
                             captured_sparse=captured, priced_sparse=priced, **sharded)
    return paths, prices, graph_mode


@dataclass(frozen=True)
class TableFacts:
    """One embedding table as the graph states it and as it is placed: the planner's facts
    stage. The solver prices it (``gemc.costing.table_costs`` -> ``TableCost``) and the
    plan records it (:meth:`entry`), so both read one typed object instead of each
    reading keys of a dict. Summarised before the placement (the placeholder placement:
    table-wise on rank 0, as the solver starts) and again after it, because the lookup
    path (``lookup``, ``routed``, ``route_ms``, ``lookup_alive_bytes``) depends on the
    storage precision the placement chose."""

    fqn: str
    rows: int
    dim: int
    nnz: int  # ids a step looks up, all its lookups summed
    batch: int
    pooling: str  # the lookup's mode: "sum", "mean", "max", or "none" (unpooled)
    weighted: bool
    dtype: str  # torch dtype name of its weight, as captured
    lookups: int  # lookup ops reading it
    predicted_ms: float | None  # its lookups' own times (predict-time), None before
    sharding: str
    shards: tuple[dict[str, Any], ...]  # gemc.sharding.make_shards' row/column ranges
    lookup: str  # the runner's lookup path (gemc.table_lookup)
    padded_nnz: int  # of nnz, ids read from padded [batch, length] grids
    padding_row: bool  # a lookup names a padding row
    routed: bool  # its lookups are called out of the compiled graph (one rank)
    cost: Mapping[str, Any] | None = None  # the parallelize pass's per-shard estimate
    precision: str | None = None  # storage precision, where the placement chose one
    precision_reason: str = ""  # why that precision (where one was chosen)
    route_ms: Mapping[str, float] | None = None  # both routes' prices, where chosen
    lookup_alive_bytes: tuple[int, ...] = ()  # per dense_grad lookup, live saved bytes
    # only a whole replica runs it right (collect-tables' ``replicated`` reasons)
    replicated_only: bool = False
    # looked up once with batch inputs only (graph_summary.batch_fed): not in the plan,
    # a fact of the graph for the cost model (TableCost.batch_fed)
    batch_fed: bool = True
    # padding ids its lookups of packed regions' gathered ids read (gathered_lookups)
    pad_ids: int = 0

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks holding its shards, in shard order."""
        return tuple(int(s["rank"]) for s in self.shards)

    def entry(self) -> dict[str, Any]:
        """The plan's ``tables[]`` entry (an optional fact that is None or empty is absent)."""
        out: dict[str, Any] = {
            "fqn": self.fqn, "rows": self.rows, "dim": self.dim, "nnz": self.nnz,
            "batch": self.batch, "pooling": self.pooling, "weighted": self.weighted,
            "dtype": self.dtype, "lookups": self.lookups, "predicted_ms": self.predicted_ms,
            "sharding": self.sharding, "shards": list(self.shards), "lookup": self.lookup,
            "padded_nnz": self.padded_nnz, "padding_row": self.padding_row,
            "routed": self.routed,
        }
        if self.cost is not None:
            out["cost"] = self.cost
        if self.precision is not None:
            out["precision"] = self.precision
            out["precision_reason"] = self.precision_reason
        if self.route_ms is not None:
            out["route_ms"] = dict(self.route_ms)
        if self.lookup_alive_bytes:
            out["lookup_alive_bytes"] = list(self.lookup_alive_bytes)
        if self.replicated_only:  # the runner refuses a hand-edited plan that shards it
            out["replicated_only"] = True
        if self.pad_ids:
            out["pad_ids"] = self.pad_ids
        return out


@dataclass(frozen=True)
class RegionFacts:
    """One dense region as the graph states it and as it is placed (its strategy): the
    facts stage's other half, priced by ``gemc.costing.region_costs`` and recorded by
    :meth:`entry`. Its tables' weights are not its parameters."""

    name: str
    params: int
    param_bytes: int
    fwd_flops: int
    fwd_bytes: int
    ops: Mapping[str, int]  # op kind -> count (``param`` for its weights)
    strategy: str
    predicted_ms: float | None  # forward+backward as the plan runs it, None before
    shard_group: int | None = None  # the solver's, where it set one
    checkpoint: bool | None = None

    def entry(self) -> dict[str, Any]:
        """The plan's ``regions[]`` entry (``shard_group`` and ``checkpoint`` only where
        the placement set them)."""
        out: dict[str, Any] = {
            "name": self.name, "params": self.params, "param_bytes": self.param_bytes,
            "fwd_flops": self.fwd_flops, "fwd_bytes": self.fwd_bytes, "ops": dict(self.ops),
            "strategy": self.strategy, "predicted_ms": self.predicted_ms,
        }
        if self.shard_group is not None:
            out["shard_group"] = self.shard_group
        if self.checkpoint is not None:
            out["checkpoint"] = self.checkpoint
        return out


@dataclass(frozen=True)
class GraphFacts:
    """The facts stage's output: every table and dense region of an annotated graph,
    sorted by name (what the solver's ``Problem`` and the plan builder both start from)."""

    tables: tuple[TableFacts, ...]
    regions: tuple[RegionFacts, ...]


def graph_facts(gm: fx.GraphModule, param_dtypes: Mapping[str, str]) -> GraphFacts:
    """The tables and regions of ``gm`` as it is placed now (see :class:`TableFacts`)."""
    tables = table_facts(gm, param_dtypes)
    return GraphFacts(tuple(tables), tuple(region_facts(gm, {t.fqn for t in tables})))


def table_facts(gm: fx.GraphModule, param_dtypes: Mapping[str, str]) -> list[TableFacts]:
    """One :class:`TableFacts` per table FQN, sorted: size, lookups per batch, pooling, its
    dtype (``param_dtypes``: parameter FQN -> torch dtype name, as capture records them),
    its placement (``gemc.placement``; table-wise on rank 0 where none is set yet), and
    the path the runner looks it up on (``lookup``: table_lookup_paths), with both
    routes' prices where the cost model chose between them (``route_ms``), and the ids
    read from padded grids (``padded_nnz``)."""
    paths, prices, graph_mode = _routes(gm)
    world = int((gm.meta.get(ir.PRICING) or {}).get("world_size", 1))
    costs = _table_costs(gm)  # per table, its lookups summed (padded ids, a padding row)
    # where each dense_grad lookup's table-sized gradient lands in the backward
    alive = activation_profile(gm).alive_at_lookup if DENSE_GRAD in paths.values() else {}
    first: dict[str, fx.Node] = {}  # the table's first lookup: its facts and placement
    alive_bytes: dict[str, list[int]] = defaultdict(list)
    predicted: dict[str, float] = defaultdict(float)
    for node in gm.graph.nodes:
        facts = node.meta.get(ir.TABLE)
        if facts is None:
            continue
        fqn = facts["fqn"]
        first.setdefault(fqn, node)
        if paths.get(fqn) == DENSE_GRAD and node.name in alive:
            alive_bytes[fqn].append(int(alive[node.name]))
        predicted[fqn] += float(node.meta.get(ir.PREDICTED_MS, 0.0))
    tables = []
    for fqn in sorted(first):
        node = first[fqn]
        facts = node.meta[ir.TABLE]
        placement = node.meta.get(ir.PLACEMENT) or {"sharding": "table_wise", "ranks": [0]}
        cost = costs[fqn]
        tables.append(TableFacts(
            fqn=fqn, rows=facts["rows"], dim=facts["dim"], nnz=cost.nnz,
            batch=facts["batch"], pooling=facts["mode"], weighted=facts["weighted"],
            dtype=param_dtypes.get(fqn, "float32"), lookups=cost.lookups,
            predicted_ms=round(predicted[fqn], 6) if predicted[fqn] else None,
            sharding=placement["sharding"],
            shards=tuple(make_shards(placement["sharding"], list(placement["ranks"]),
                                     facts["rows"], facts["dim"], placement.get("grid"))),
            lookup=paths[fqn], padded_nnz=cost.padded_nnz, padding_row=cost.padding_row,
            # a lookup called out of the compiled graph on one rank; on several ranks
            # every rank calls every table's lookup, held or not, which a holder's price
            # cannot say (those graph splits are not priced there)
            routed=graph_mode and world == 1 and paths[fqn] == SPARSE,
            cost=placement.get("cost"),  # the parallelize pass's per-shard estimate
            # the storage precision chosen with the sharding
            precision=placement.get("precision"),
            precision_reason=placement.get("precision_reason", ""),
            route_ms={k: round(v, 6) for k, v in prices[fqn].items()}
            if fqn in prices else None,
            lookup_alive_bytes=tuple(alive_bytes[fqn]),
            replicated_only=bool(facts.get("replicated")),
            batch_fed=cost.batch_fed,
            pad_ids=int(cost.pad_ids),
        ))
    return tables


def kernel_adjusted_ms(gm: fx.GraphModule) -> dict[fx.Node, float]:
    """Each node's forward+backward ms as the plan runs it (``gemc.predicted_ms`` is the node
    run alone, as ATen would): a kernel group's members scaled by its after/before,
    and, inside a packed token region, by the region's fill (the token-wise work shrinks
    with the real tokens; the jagged attention is already priced over them; a guarded
    region's attention that runs on its tokens, its ``in_place``, by the share of the padded
    scores over kept keys, ``attention_fill``, which the sample batch gives). Why: the step
    the plan predicts, and the placement the solver picks, are for the plan's kernels, not
    for the graph without them (the GEM h200 plan predicted 175 ms where its run measured
    82 ms before this).

    Attention runs under the plan's autocast: an fp32-captured attention is repriced at
    the autocast dtype (SDPA and the jagged kernel both run bf16 there), the jagged one on
    its real tokens (``fill``; inside a packed region it reads q/k/v in place). Why: at
    the captured fp32 the GEM h200 plan priced its two jagged attentions at 23.2 ms each
    and the cross attentions at 9.3 ms, where the profile of the run
    (benchmarks/results/e2e_h200_de5d649_gemc_alone.gemc.kernels.txt) shows ~3 ms and
    ~2 ms. Autocast also casts every fp32 operand of a GEMM or attention to bf16 in the
    forward and the gradient back in the backward (the run's profile: 130 bf16 casts,
    2.8 ms): each such node carries those copies. A packed region carries its boundary
    gathers and scatters (its after_ms less before_ms x fill) on its source node. (The
    backward's gradient additions are not a node's: gradient_accumulation_ms.)

    What the runner leaves to Inductor (every memory-bound node outside gemc's attention,
    embedding and packed-token kernels, generated groups included, since their default
    choice is Inductor's code) is priced as Inductor's fused kernels
    (cost_model.inductor_fusion.fused_ms: the bytes entering and leaving each fused
    group, at the runtime element size and packed token count), the GEMM of such a group
    alone (an extern cuBLAS call), and an operand's autocast cast only where no fused
    kernel writes it (weights, batch inputs). Why: priced op by op, the zoo's plans were
    15-35% above their runs (BENCHMARKS.md, issue 18's table)."""
    pricing = gm.meta.get(ir.PRICING)
    autocast = plan_autocast(gm) if pricing else None
    itemsize = runtime_itemsize(gm, autocast) if autocast else {}
    fused: dict[fx.Node, float] = {}
    islands = inductor_fusion.island_groups(gm)
    runs_at = packed_fill(gm)  # each region node's fill as it runs (1.0 where padded)
    if pricing:
        sizes = itemsize or runtime_itemsize(gm, None)

        def runtime_bytes(n: fx.Node) -> float:
            val = n.meta.get("val")
            numel = val.numel() if isinstance(val, torch.Tensor) else 0
            return float(numel * sizes.get(n, 0) * runs_at.get(n, 1.0))

        fused = inductor_fusion.fused_ms(
            gm, pricing["gpu"], pricing["calibration"], runtime_bytes,
            {n: float(n.meta.get(ir.PREDICTED_MS, 0.0) or 0.0) for n in gm.graph.nodes})
    fused_writers = set(fused)
    convert: dict[fx.Node, float] = {}
    ratio: dict[str, float] = {}
    attention: set[str] = set()
    fill: dict[str, float] = {}
    score_fill: dict[str, float] = {}  # region -> its kept tokens' share of padded scores
    in_place: dict[str, float] = {}  # attention output -> its share of the padded scores
    for node in gm.graph.nodes:
        facts = node.meta.get(ir.KERNEL)
        # a ratio, not after_ms itself: the precision pass reprices the nodes after the
        # kernel passes priced their groups (at the captured dtype). A transposed linear's
        # own time is already the GEMM alone (its before adds the copy it saves).
        if facts and facts.get("before_ms") and facts.get("after_ms") is not None \
                and facts.get("id") in islands:  # Inductor runs the others' nodes
            ratio[facts["id"]] = float(facts["after_ms"]) / float(facts["before_ms"])
        if facts and facts.get("kind") in ("jagged_attention", "jagged_silu_attention"):
            attention.add(facts["id"])  # priced over the real tokens already
        region = node.meta.get(ir.PACKED_REGION)
        if region is not None:
            fill[region["id"]] = float(region["fill"])
            score_fill[region["id"]] = float(region.get("attention_fill", region["fill"]))
            # on the region's kept keys; a region with padding representatives' attentions
            # over its slots (``attention_fill``: their widths squared)
            for name in [*(region.get("in_place") or ()), *(region.get("rep_attentions") or ())]:
                in_place[name] = float(region.get("attention_fill", region["fill"]))
            if region.get("after_ms") is not None and region.get("before_ms") is not None:
                convert[node] = convert.get(node, 0.0) + max(
                    0.0, float(region["after_ms"])
                    - float(region["before_ms"]) * float(region["fill"]))
    if pricing:
        ratio.update(silu_kernel_ratios(gm, islands, autocast, itemsize, pricing))
    # a guarded region's attention run on its tokens: every member over the kept keys
    scores = {f["id"]: in_place[str(f["output"])] for n in gm.graph.nodes
              if isinstance(f := n.meta.get(ir.KERNEL), dict) and str(f.get("output")) in in_place}
    out: dict[fx.Node, float] = {}
    for node in gm.graph.nodes:
        ms = float(node.meta.get(ir.PREDICTED_MS, 0.0) or 0.0)
        gid = node.meta.get(ir.GROUP)
        packed = node.meta.get(ir.PACKED)
        node_fill = runs_at.get(node, 1.0)
        if node in fused:
            out[node] = fused[node] + convert.get(node, 0.0)
            continue
        casts = _autocast_casts_ms(node, itemsize, pricing, fused_writers) * node_fill \
            if autocast else 0.0
        # a region's unmasked causal attention run on its tokens (the jagged kernel):
        # the score work over each row's tokens, sum(len^2) of the padded B * L^2
        causal_share = score_fill.get(packed["id"]) if gid is None and packed is not None \
            and node_fill != 1.0 and packed_rules.causal_self_attention(node) else None
        repriced = attention_at_autocast(node, autocast, pricing) if autocast else None
        if repriced is not None:
            share = causal_share if causal_share is not None else scores.get(gid, 1.0)
            out[node] = repriced * share + casts + convert.get(node, 0.0)
            continue
        ms *= ratio.get(gid, 1.0)
        if gid in scores:
            ms *= scores[gid]
        elif causal_share is not None:
            ms *= causal_share
        elif packed is not None and gid not in attention:
            ms *= node_fill
        out[node] = ms + casts + convert.get(node, 0.0)
    return out


def silu_kernel_ratios(gm: fx.GraphModule, islands: set[str], autocast: str | None,
                        itemsize: dict[fx.Node, int], pricing: dict[str, Any]
                        ) -> dict[str, float]:
    """Group id -> (the jagged SiLU kernel's ms at the runtime dtype) / (its members' ms) of
    every matched SiLU attention: the kernel priced as it runs (autocast's dtype, the
    runtime element sizes of its bias and copies), shared over the members by their own
    times. Why: its ``after_ms`` is priced at the captured dtype (fp32 for HSTU), where
    the runner computes it in bf16, as the jagged softmax attention is repriced
    (``attention_at_autocast``)."""
    named = {n.name: n for n in gm.graph.nodes}
    members: dict[str, float] = defaultdict(float)
    for n in gm.graph.nodes:
        if (gid := n.meta.get(ir.GROUP)) is not None:
            members[gid] += float(n.meta.get(ir.PREDICTED_MS, 0.0) or 0.0)
    sizes = itemsize or runtime_itemsize(gm, None)
    out: dict[str, float] = {}
    for node in gm.graph.nodes:
        facts = node.meta.get(ir.KERNEL)
        if not facts or facts.get("kind") != "jagged_silu_attention" \
                or facts.get("id") not in islands or members[facts["id"]] <= 0:
            continue
        dtype = autocast or op_cost.dtype_name(ir.dtype_of(node))
        s = op_cost.jagged_silu_kernel_time(
            facts, node, named, dtype,
            lambda n: sizes.get(n) or (ir.dtype_of(n) or torch.float32).itemsize,
            pricing["gpu"], pricing["calibration"], in_region=ir.PACKED in node.meta)
        out[facts["id"]] = 1e3 * s / members[facts["id"]]
    return out


def gradient_accumulation_ms(gm: fx.GraphModule) -> dict[fx.Node, float]:
    """ms of the backward's gradient additions, keyed by the last reader of each tensor
    (or dense weight) that several ops read: a tensor read by k ops gets k gradients,
    added up by k-1 kernels of its size (read 2, write 1), at its runtime element size
    and, inside a packed region, its fill. Table weights are left to the lookup kernel.
    Why: GEM h200 has 26 such adds, priced 5.1 ms, where the run's profile shows 28 add
    kernels taking 4.4 ms; they were priced as free. Empty before predict-time ran.
    Under Inductor the additions fuse into the backward kernel of a fusible producer or
    reader (cost_model.inductor_fusion): only a tensor that extern kernels alone write
    and read (e.g. one input of two GEMMs) pays its own adds."""
    pricing = gm.meta.get(ir.PRICING)
    if not pricing:
        return {}
    itemsize = runtime_itemsize(gm, plan_autocast(gm))
    fill = packed_fill(gm)
    readers: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op != "call_function" or ir.kind_of(node) is OpKind.VIEW:
            continue
        for arg in node.all_input_nodes:
            base = view_base(arg)
            if node not in readers[base]:
                readers[base].append(node)
    islands = inductor_fusion.island_groups(gm)
    compiled = inductor_fusion.runs_compiled(gm)
    out: dict[fx.Node, float] = defaultdict(float)
    for base, users in readers.items():
        dt = ir.dtype_of(base)
        val = base.meta.get("val")
        if compiled and any(inductor_fusion.is_fusible(n, islands) for n in (base, *users)):
            continue
        if len(users) < 2 or dt is None or not dt.is_floating_point \
                or not isinstance(val, torch.Tensor) \
                or any(u.meta.get(ir.TABLE) or ir.kind_of(u) is OpKind.EMBEDDING
                       for u in users):
            continue
        nbytes = 3.0 * val.numel() * (itemsize.get(base) or dt.itemsize) * fill.get(base, 1.0)
        t, _ = op_cost.memory_time(nbytes, pricing["gpu"], pricing["calibration"], "pointwise")
        out[users[-1]] += 1e3 * (len(users) - 1) * t
    return dict(out)


def _autocast_casts_ms(node: fx.Node, itemsize: dict[fx.Node, int],
                       pricing: dict[str, Any], fused: set[fx.Node] = frozenset()) -> float:
    """Forward+backward ms of autocast's casts around a GEMM/attention node: each fp32
    floating operand read (4 B) and written bf16 (2 B), and its gradient back (2 + 4 B).
    Weights are counted too (autocast's cache casts each once a step). An operand an
    Inductor-fused kernel writes (``fused``) is cast inside that kernel: no copy."""
    if ir.kind_of(node) not in (OpKind.GEMM, OpKind.ATTENTION):
        return 0.0
    total = 0.0
    for arg in node.all_input_nodes:
        dt = ir.dtype_of(arg)
        if dt is None or not dt.is_floating_point or itemsize.get(arg, 0) <= 2 \
                or view_base(arg) in fused:
            continue
        val = arg.meta.get("val")
        numel = int(val.numel()) if isinstance(val, torch.Tensor) else 0
        if numel:
            t, _ = op_cost.memory_time(6.0 * numel, pricing["gpu"], pricing["calibration"],
                                       "copy")
            total += 2 * t
    return 1e3 * total


def attention_at_autocast(node: fx.Node, autocast: str,
                           pricing: dict[str, Any]) -> float | None:
    """Forward+backward ms of an fp32-captured attention node run under ``autocast``
    (the jagged kernel over its real tokens), or None for any other node."""
    if ir.kind_of(node) is not OpKind.ATTENTION or ir.dtype_of(node) != torch.float32:
        return None
    gpu, calib = pricing["gpu"], pricing["calibration"]
    facts = node.meta.get(ir.KERNEL) or {}
    if facts.get("kind") == "jagged_attention":
        a = node.meta.get(ir.ATTENTION) or {}
        return 1e3 * op_cost.jagged_attention_time(
            a.get("batch", 1), facts["heads"], facts["max_len"], facts["head_dim"],
            bool(facts.get("causal")), autocast, float(facts["fill"]), gpu, calib)
    return op_cost.node_cost(node, gpu, calib, dtype=autocast).total_ms


def region_facts(gm: fx.GraphModule, table_fqns: set[str]) -> list[RegionFacts]:
    """One :class:`RegionFacts` per dense region, sorted: its weights (the tables in
    ``table_fqns`` excluded), FLOPs, op mix, predicted time and strategy (``ddp`` where no
    placement is set yet)."""
    flops: dict[str, int] = defaultdict(int)
    nbytes: dict[str, int] = defaultdict(int)
    kinds: dict[str, Counter] = defaultdict(Counter)
    params: dict[str, int] = defaultdict(int)
    param_bytes: dict[str, int] = defaultdict(int)
    placed: dict[str, Mapping[str, Any]] = {}  # its first compute node's gemc.placement
    predicted: dict[str, float] = defaultdict(float)
    node_ms = kernel_adjusted_ms(gm)
    for node, ms in gradient_accumulation_ms(gm).items():
        predicted[node.meta.get(ir.REGION, "")] += ms
    for node in gm.graph.nodes:
        region = node.meta.get(ir.REGION, "")
        kind = ir.kind_of(node)
        fqn = node.meta.get(ir.PARAM)
        if fqn is not None:
            if fqn in table_fqns:
                continue
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                params[region] += int(val.numel())
                param_bytes[region] += ir.nbytes(val)
            kinds[region]["param"] += 1
            continue
        if (
            node.op != "call_function"
            or kind in (OpKind.VIEW, OpKind.EMBEDDING)
            or node.meta.get(ir.TABLE)
        ):
            continue
        flops[region] += int(node.meta.get(ir.FLOPS, 0))
        nbytes[region] += int(node.meta.get(ir.BYTES, 0))
        kinds[region][kind.value if kind else "other"] += 1
        predicted[region] += node_ms[node]
        placed.setdefault(region, node.meta.get(ir.PLACEMENT) or {})
    out = []
    for name in sorted(set(flops) | set(params)):
        placement = placed.get(name, {})  # none for a region of weights alone
        out.append(RegionFacts(
            name=name, params=params[name], param_bytes=param_bytes[name],
            fwd_flops=flops[name], fwd_bytes=nbytes[name],
            ops=dict(sorted(kinds[name].items())),
            strategy=placement.get("strategy", REPLICATED_DENSE),
            predicted_ms=round(predicted[name], 6) if predicted[name] else None,
            shard_group=placement.get("shard_group"), checkpoint=placement.get("checkpoint")))
    return out
