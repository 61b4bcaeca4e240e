"""What Inductor fuses of a plan's graph, and what its fused kernels cost.

The runner trains the plan through ``torch.compile``: gemc's attention, embedding and
packed-token kernels are custom ops (islands), every other node is Inductor's. Inductor
keeps GEMMs, attention and custom ops as extern kernels and fuses the memory-bound ops
between them (pointwise, norms, reductions, losses; views are free) into as few
Triton kernels as their dependencies allow. Priced op by op, a chain of k such ops costs k
round trips through HBM; fused, it costs the bytes entering and leaving the chain once.
Why: priced op by op, the zoo's plans predicted 15-35% above their runs (BENCHMARKS.md,
"Plan prediction vs the runs above").

Grouping (a first-principles stand-in for Inductor's scheduler): two fusible nodes joined
by an edge fuse when they sit at the same *extern depth* (the number of extern kernels on
the longest path from the graph's inputs). Fusing across different depths would put an
extern kernel both after and before the group (a cycle), which Inductor never does.

Cost of a group: the forward reads its external inputs and writes the tensors read outside
it; the backward reads the outputs' gradients and the inputs again and writes the floating
inputs' gradients (the fused-group rule of ``passes/fuse.py``); the gradient additions of a
tensor read by several ops fuse into the backward kernel that produces them. Activation
casts under autocast fuse into the kernel that writes the activation. Min-cut
rematerialisation (AOTAutograd's partitioner) recomputes a group's intermediates in the
backward instead of saving them: ``recompute_sources`` says what it saves instead.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping

import torch
from torch import fx

from gemc import ir
from gemc.ir import OpKind
from gemc.kernel_kinds import inductor_compiled_kinds

from . import op_cost
from .activations import view_base
from .hardware import GPUSpec

FUSIBLE_KINDS = frozenset({OpKind.POINTWISE, OpKind.NORM, OpKind.REDUCTION, OpKind.LOSS})
"""Gathers (``OpKind.INDEX``) are left out: their backward is a scatter-add whose atomics
into few rows serialise, a kernel of its own that fusion does not make cheaper."""


PRICING = ir.PRICING
"""gm.meta: what predict-time priced the graph for ({"gpu", "calibration", "world_size"})."""


def runs_compiled(gm: fx.GraphModule) -> bool:
    """Whether the runner trains this graph through torch.compile: graph mode (a plan with
    gemc kernels) always does; module mode (none) only on one rank, where several ranks
    stay eager (backends/torch/runner._compile_module_mode). Unknown world size: one."""
    if any(ir.KERNEL in n.meta for n in gm.graph.nodes):
        return True
    return int((gm.meta.get(PRICING) or {}).get("world_size", 1)) == 1


def island_groups(gm: fx.GraphModule) -> set[str]:
    """Group ids of gemc kernels that run as their own kernels (not Inductor's code): every
    kind but those whose declaration says Inductor compiles their nodes
    (``KernelKind.compiled_by_inductor`` in gemc.kernel_kinds: the generated groups, their
    code unless a measurement picked gemc's, and ATen formulations, the transposed linear)."""
    compiled = set(inductor_compiled_kinds())
    return {f["id"] for n in gm.graph.nodes
            if isinstance(f := n.meta.get(ir.KERNEL), dict) and "id" in f
            and f.get("kind") not in compiled}


def is_fusible(node: fx.Node, islands: set[str]) -> bool:
    """A memory-bound compute node Inductor compiles (not a member of a gemc island)."""
    if node.op != "call_function" or ir.kind_of(node) not in FUSIBLE_KINDS:
        return False
    if node.meta.get(ir.TABLE) or node.meta.get(ir.PARAM) is not None:
        return False
    return node.meta.get(ir.GROUP) not in islands


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and ir.kind_of(node) is OpKind.VIEW


def fusion_groups(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Fusible node -> its Inductor group (see the module doc: same extern depth, joined
    by an edge, views looked through); empty when the step runs eager."""
    if not runs_compiled(gm):
        return {}
    islands = island_groups(gm)
    depth: dict[fx.Node, int] = {}
    fusible: set[fx.Node] = set()
    for n in gm.graph.nodes:
        d = 0
        for a in n.all_input_nodes:
            extern = a.op == "call_function" and not _is_view(a) and a not in fusible
            d = max(d, depth.get(a, 0) + (1 if extern else 0))
        depth[n] = d
        if is_fusible(n, islands):
            fusible.add(n)
    parent: dict[fx.Node, fx.Node] = {n: n for n in fusible}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in fusible:
        for a in n.all_input_nodes:
            b = view_base(a)
            if b in fusible and depth[b] == depth[n]:
                parent[find(b)] = find(n)
    ids: dict[fx.Node, int] = {}
    return {n: ids.setdefault(find(n), len(ids)) for n in gm.graph.nodes if n in fusible}


def _readers(gm: fx.GraphModule) -> dict[fx.Node, set[fx.Node]]:
    """Base tensor -> the non-view nodes reading it (directly or through views)."""
    out: dict[fx.Node, set[fx.Node]] = defaultdict(set)
    for n in gm.graph.nodes:
        if _is_view(n):
            continue
        for a in n.all_input_nodes:
            out[view_base(a)].add(n)
    return out


def fused_ms(gm: fx.GraphModule, gpu: GPUSpec, calibration: object | None,
             nbytes: Callable[[fx.Node], float],
             weight: Mapping[fx.Node, float] | None = None) -> dict[fx.Node, float]:
    """Forward+backward ms of every fusible node as its share of its Inductor group's
    kernels (shares by ``weight``, e.g. the node's op-by-op price; equal without one).
    ``nbytes(node)``: the bytes of the tensor a node writes as the runner holds it (its
    runtime element size, packed token count)."""
    groups = fusion_groups(gm)
    members: dict[int, list[fx.Node]] = defaultdict(list)
    for n, g in groups.items():
        members[g].append(n)
    readers = _readers(gm)
    out: dict[fx.Node, float] = {}
    for nodes in members.values():
        inside = set(nodes)
        inputs = {view_base(a) for n in nodes for a in n.all_input_nodes} - inside
        in_bytes = sum(nbytes(a) for a in inputs)
        float_in = sum(nbytes(a) for a in inputs
                       if (ir.dtype_of(a) or torch.int64).is_floating_point)
        outs = [n for n in nodes if readers.get(n, set()) - inside or not readers.get(n)]
        out_bytes = sum(nbytes(o) for o in outs)
        backward = any((ir.dtype_of(n) or torch.int64).is_floating_point for n in outs)
        fwd, _ = op_cost.memory_time(in_bytes + out_bytes, gpu, calibration, "pointwise")
        bwd = 0.0
        if backward:
            bwd, _ = op_cost.memory_time(out_bytes + in_bytes + float_in, gpu, calibration,
                                         "pointwise")
        total = 1e3 * (fwd + bwd)
        w = [max(0.0, float((weight or {}).get(n, 0.0))) for n in nodes]
        s = sum(w)
        for n, wn in zip(nodes, w, strict=True):
            out[n] = total * (wn / s if s > 0 else 1.0 / len(nodes))
    return out


def recompute_sources(gm: fx.GraphModule) -> dict[fx.Node, set[fx.Node]]:
    """Fusible node -> the tensors its value is recomputed from in the backward: walking
    back through fusible nodes and views to the first extern outputs, batch inputs and
    weights (which the partitioner saves instead of the node)."""
    islands = island_groups(gm)
    out: dict[fx.Node, set[fx.Node]] = {}
    if not runs_compiled(gm):
        return out
    for n in gm.graph.nodes:
        if not is_fusible(n, islands):
            continue
        src: set[fx.Node] = set()
        for a in n.all_input_nodes:
            b = view_base(a)
            src |= out.get(b, {b})
        out[n] = src
    return out
