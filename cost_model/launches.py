"""How many kernels one training step of a plan launches, and what issuing them costs the host.

The runner trains a plan through ``torch.compile``: Inductor's fused Triton kernels,
cuBLAS for the GEMMs, gemc's own kernels, and the eager ops around the compiled graph
(the batched lookup's per-table id preparation, eager table routes, the optimizer). Each
launch costs the host Python and driver time; when the GPU's work per launch is short
the host falls behind and the step is bounded below by the time to issue it. Why: on the
session-7 H200 profiles Wukong ran 31.9 ms of GPU work in a 41.2 ms step and DCNv2 9.8 ms
in 14.2 ms, the rest host-late idle, where the plans predicted a flat 3.9 ms of host time.

Per-item counts below are read off those two profiles (``data/s8/p/*.gaps.txt`` and the
Kineto traces, the timed window of a step; host-to-device batch copies fall outside it),
the per-launch host cost fitted on their measured steps (see ``GRAPH_LAUNCH_HOST_S``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import fx

from gemc import ir
from gemc.ir import OpKind
from gemc.table_lookup import BATCHED, DENSE_GRAD

from .inductor_fusion import fusion_groups, island_groups
from .op_cost import BWD_KERNELS
from .types import TableCost

# Inductor: a fused group's forward kernel and its backward kernel.
INDUCTOR_KERNELS_PER_GROUP = 2
# Inductor: per parameter, the autocast cast of the weight (forward) and its gradient's
# cast back (backward) fuse into about one kernel a parameter (Wukong: 344 Triton kernels
# for 102 groups and 171 parameters; DCNv2: 84 for 11 and 51).
INDUCTOR_KERNELS_PER_PARAM = 1
# A GEMM node: forward, dgrad and wgrad cuBLAS calls, each with its workspace memset or
# split-K reduction (Wukong: 214 GEMM kernels + 136 memsets for 54 GEMMs; DCNv2: 51 + 21
# for 14).
GEMM_LAUNCHES = 6
# The batched lookup: per table, the runner's fill and cat that build the kernel's ids
# and offsets (Wukong: 65 + 66 for 64 tables; DCNv2: 27 + 28 for 26), and per batched
# kernel its forward, sort, scans and fused backward+update (DCNv2: ~25 around its two).
BATCHED_TABLE_LAUNCHES = 2
BATCHED_LOOKUP_LAUNCHES = 25
# A table looked up eagerly on the sparse route: lookup, backward, finding the touched rows
# and the sparse optimizer's step, ~40 kernels (DIN: 731 eager kernels for 18 tables, syncs
# included, when its dense-gradient route still scanned for the used rows like this one).
EAGER_TABLE_LAUNCHES = 40
# A data-parallel replica on several ranks since its step went into the step's one bucket
# (backends/torch/sparse_optim.ReplicaBucket): its lookup, ATen's sparse bag backward, its
# rows and flags added into the bucket, its masked pass. Measured on the H200 (fifteenth
# session, benchmarks/replica_step.py --device cuda: DLRMv2's 18 smallest tables as
# replicas, batch 4,096 at world 16): 3.68 ms of lookups + 2.73 ms of optimizer step, wall,
# 0.356 ms a replica, i.e. 8.5 launches at GRAPH_LAUNCH_HOST_S; 9 here (13, read from the
# code path before, priced a replica 1.5x over the measurement)
REPLICA_TABLE_LAUNCHES = 9
# Replicas that share one storage (backends/torch/replica_groups.py: fp32, no padding row,
# one width; the rule is :func:`replica_group_key`) launch their lookup, its sparse
# backward, the bucket's add and flag fill and the masked pass once a GROUP, in module mode
# and in graph mode alike: graph mode looks the group up ahead of its compiled graph and
# hands each member's rows to it as an input (backends/torch/replica_ahead.py), so no op
# runs a member. Counted on the CPU (twenty-fifth session: benchmarks/replica_step.py
# --compare --cpu-proxy, with and without --graph: the ATen ops each step dispatches, views
# left out, the ops inside gemc's custom ops counted, the loss's own four a table and its
# fixed four taken off), 6, 9 and 18 replicas: module mode 142/211/418 ops per table
# against 52/64/100 grouped; graph mode 184/274/544 per table (26 a replica: its lookup in
# the graph, the deferred copies and its replay) against 52/64/100 grouped (the same ops as
# module mode), and 94/127/226 with each member still looked up inside the graph (the
# path before: 7 a member). So a group is 24 ops and a member 0; at 8.5 launches for the
# 19 ops of a replica alone (measured above), a group is 11 launches. A member's views and
# Python bookkeeping are not ATen ops and are not counted (see REPLICA_GROUPED_TABLE_LAUNCHES).
REPLICA_GROUP_LAUNCHES = 11
# A member of a group: no op of its own (above). What is left is host Python (its ids'
# and bags' entries in the group's lookup, its views, its input of the compiled graph):
# on the CPU proxy with the arithmetic cut to nothing (batch 1, width 1; twenty-fifth
# session, BENCHMARKS.md) a member adds 0.021 ms to a graph-mode step and 0.038 ms to a
# module-mode one, its loss's own four ops included, against 0.36 / 0.17 ms a replica
# alone (8.5 launches): under one launch. A member whose ids the model computes stays
# inside the compiled graph: REPLICA_IN_GRAPH_MEMBER_LAUNCHES.
REPLICA_GROUPED_TABLE_LAUNCHES = 0
# A member the runner cannot look up ahead (its ids, offsets or weights computed in the
# model, or looked up twice: ``TableCost.batch_fed`` False) is looked up inside the
# compiled graph and replayed by its group at the optimizer's step: 7 ops a member on the
# count above (graph mode with members in the graph: 94/127/226 ops for 6/9/18 replicas,
# 11 a replica, the loss's four off), 3 launches at 8.5 launches per 19 ops.
REPLICA_IN_GRAPH_MEMBER_LAUNCHES = 3
# A table on the dense-gradient route since its update became one masked pass
# (backends/triton/masked_row_update.py, no scan, no sync): DIN's e05fd50 H200 profile
# launches 549 kernels a step for its 18 such tables (ATen's bag backwards with their cub
# sorts and memsets, the gradients' zero-fills, the masked updates), 30 a table.
DENSE_GRAD_TABLE_LAUNCHES = 30
# A gemc kernel run as its own (attention, packed tokens): forward and two backward.
ISLAND_LAUNCHES = 3
# An attention over padding representatives adds its key bias (gemc::rep_key_bias, one
# kernel, forward only) to its island's launches.
REP_KEY_BIAS_LAUNCHES = 1
# The fused optimizer: one multi-tensor kernel per ~20 parameters, plus its step count.
OPTIMIZER_PARAMS_PER_LAUNCH = 20

GRAPH_LAUNCH_HOST_S = 42e-6
"""Host seconds per kernel a compiled step launches, everything the host does in a step
divided by its launches: Inductor's Python launchers, AOTAutograd's and autograd's
wrappers, the custom ops' dispatch, the eager ops and the optimizer. Fitted on the two
launch-bound H200 profiles with the sync term left as it is (step - 3.9 ms of syncs over
the launches counted here): Wukong 37.1 ms / 862 = 43 us, DCNv2 9.9 ms / 238 = 42 us.
A calibration's ``launch.graph_launch_s`` replaces it."""


def graph_launches(gm: fx.GraphModule, tables: Sequence[TableCost],
                   world: int = 1) -> dict[str, int]:
    """Kernels one compiled training step launches, by source (see the module constants):
    ``inductor``, ``gemm``, ``island``, ``extern`` (other ATen kernels in the graph),
    ``tables`` (by each table's lookup path; the replicas on ``world`` > 1 ranks by their
    bucketed step, by group where they share a storage: :func:`replica_launches`) and
    ``optimizer``; ``total`` sums them."""
    groups = fusion_groups(gm)
    islands = island_groups(gm)
    out = dict.fromkeys(("inductor", "gemm", "island", "extern", "tables", "optimizer"), 0)
    params = 0
    seen_islands: set[Any] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            params += bool(node.meta.get(ir.PARAM)) or ir.kind_of(node) is OpKind.PARAM
            continue
        kind = ir.kind_of(node)
        if node.op != "call_function" or kind in (None, OpKind.VIEW, OpKind.PARAM) \
                or node in groups or node.meta.get(ir.TABLE):
            continue
        gid = node.meta.get(ir.GROUP)
        if gid in islands:
            if gid not in seen_islands and kind is not OpKind.EMBEDDING:
                seen_islands.add(gid)
                out["island"] += ISLAND_LAUNCHES
            continue
        if kind is OpKind.EMBEDDING:
            continue
        if kind is OpKind.GEMM:
            out["gemm"] += GEMM_LAUNCHES
        else:
            out["extern"] += 1 + BWD_KERNELS.get(kind, 1)
    out["island"] += REP_KEY_BIAS_LAUNCHES * sum(
        len(f.get("rep_attentions") or ()) for f in ir.packed_regions(gm).values())
    out["inductor"] = (INDUCTOR_KERNELS_PER_GROUP * len(set(groups.values()))
                       + INDUCTOR_KERNELS_PER_PARAM * params)
    batched = [t for t in tables if t.lookup == BATCHED]
    replicas = [t for t in tables if t.lookup not in (BATCHED, DENSE_GRAD) and t.replicated
                and world > 1]
    replica_ids = {id(t) for t in replicas}
    out["tables"] = (BATCHED_TABLE_LAUNCHES * len(batched)
                     + (BATCHED_LOOKUP_LAUNCHES if batched else 0)
                     + replica_launches(replicas)
                     + sum(DENSE_GRAD_TABLE_LAUNCHES if t.lookup == DENSE_GRAD
                           else EAGER_TABLE_LAUNCHES
                           for t in tables if t.lookup != BATCHED and id(t) not in replica_ids))
    out["optimizer"] = 1 + math.ceil(params / OPTIMIZER_PARAMS_PER_LAUNCH) if params else 0
    out["total"] = sum(out.values())
    return out


def replica_group_key(t: TableCost) -> int | None:
    """The group a data-parallel replica shares storage with on several ranks (its width),
    None when it runs on its own: the runner's rule (backends/torch/replica_groups.
    why_not_grouped: fp32 stored fp32, no padding row, not max-pooled; a table the model
    reads outside its lookups (``replicated_only``, max pooling among them) is priced on
    its own). Sum and mean bags group apart in the runner; TableCost does not say which,
    so a width with both is priced one group short."""
    if not t.replicated or t.precision != "fp32" or t.dtype_bytes != 4 or t.padding_row \
            or t.replicated_only:
        return None
    return int(t.dim)


def replica_launches(replicas: Sequence[TableCost]) -> int:
    """Launches of the data-parallel replicas' part of a step on several ranks: a group of
    two or more (:func:`replica_group_key`) ``REPLICA_GROUP_LAUNCHES`` plus
    ``REPLICA_GROUPED_TABLE_LAUNCHES`` a member looked up ahead of the graph
    (``batch_fed``) and ``REPLICA_IN_GRAPH_MEMBER_LAUNCHES`` one looked up inside it; a
    replica on its own ``REPLICA_TABLE_LAUNCHES``."""
    groups: dict[int, list[TableCost]] = {}
    alone = 0
    for t in replicas:
        key = replica_group_key(t)
        if key is None:
            alone += 1
        else:
            groups.setdefault(key, []).append(t)
    out = REPLICA_TABLE_LAUNCHES * alone
    for members in groups.values():
        if len(members) < 2:
            out += REPLICA_TABLE_LAUNCHES
            continue
        out += REPLICA_GROUP_LAUNCHES + sum(
            REPLICA_GROUPED_TABLE_LAUNCHES if t.batch_fed else REPLICA_IN_GRAPH_MEMBER_LAUNCHES
            for t in members)
    return out


def launch_bound_s(launches: int, per_launch_s: float, device_s: float) -> float:
    """Seconds the host adds to a step beyond the GPU's: issuing ``launches`` at
    ``per_launch_s`` overlaps the device's ``device_s`` of work, so the step is the longer
    of the two (the host runs ahead while kernels are long; when they are short the GPU
    waits for every launch)."""
    return max(0.0, launches * per_launch_s - device_s)
