"""Which forward tensors autograd keeps for the backward, read off an annotated graph.

A rule per op kind of what its backward formula needs (PyTorch's derivatives.yaml): GEMMs
keep their inputs, attention keeps Q, K, V, the output and the log-sum-exp, norms keep the
input (and per-row statistics), ReLU/exp/sigmoid/tanh keep their output, other nonlinear
pointwise ops and products keep their inputs, losses keep input and target, indexing keeps
its indices; additions, views, concatenations and reductions by sum keep nothing. Views
are resolved to the tensor they alias, so a tensor is counted once; parameters are never
activations.

As the runner executes it (``runtime=True``): under the plan's bf16 autocast a GEMM or
attention writes bf16 and saves the bf16 *casts* of its fp32 inputs (weights included:
autocast's cast cache keeps one per weight for the backward), autocast's fp32 ops (norms,
softmax, losses, sum, exp/log/pow/rsqrt) write fp32, and other ops follow type promotion
(bf16 with fp32 gives fp32); inside a packed token region (pack-jagged-tokens) a tensor
holds only the real tokens, ``fill`` of its padded rows. ``activation_profile`` also walks
the forward in order, freeing each tensor after its last use unless the backward saved
it, so the peak includes what is live at the worst moment, not only what is saved.
Why: the GEM plan's activations were priced at 36.8 GB (fp32, padded, every saved tensor)
where the whole step measured 24.2 GB.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import fx

from gemc import ir
from gemc.ir import OpKind
from gemc.packed_rules import on_tokens, source_names

_KEEP_OUTPUT = ("relu", "exp", "sigmoid", "tanh", "softmax", "threshold", "hardtanh")
_KEEP_NOTHING = ("add", "sub", "neg", "cat", "stack", "sum", "mean", "clone", "copy",
                 "to_copy", "_to_copy", "contiguous", "fill", "zeros", "ones", "full",
                 "arange", "empty", "detach", "alias", "lift_fresh")


def _op(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    return name.split(".")[0].lower()


def view_base(node: fx.Node) -> fx.Node:
    """The tensor a view aliases (follows view chains)."""
    seen = 0
    while ir.kind_of(node) is OpKind.VIEW and node.all_input_nodes and seen < 64:
        node = node.all_input_nodes[0]
        seen += 1
    return node


def _saved_inputs(node: fx.Node, kind: OpKind) -> list[fx.Node]:
    op = _op(node)
    inputs = list(node.all_input_nodes)
    if kind in (OpKind.GEMM, OpKind.NORM, OpKind.LOSS, OpKind.EMBEDDING, OpKind.INDEX):
        return inputs
    if kind is OpKind.ATTENTION:
        return inputs[:3] + [node]
    if kind is OpKind.POINTWISE or kind is OpKind.OTHER:
        if any(op.startswith(k) for k in _KEEP_NOTHING):
            return []
        if any(k in op for k in _KEEP_OUTPUT):
            return [node]
        return inputs
    if kind is OpKind.REDUCTION:
        return [] if any(op.startswith(k) for k in ("sum", "mean")) else inputs
    return []


def saved_activation_bytes(gm: fx.GraphModule, *, runtime: bool = True) -> dict[str, int]:
    """Bytes saved for backward per region (gemc.region, '' when unannotated), plus
    'inputs': the batch tensors themselves. The same walk as ``activation_profile`` (one
    accounting for the solver, the plan's prediction and eager's): ``runtime=False`` for
    eager PyTorch (captured dtypes, padded shapes, every saved tensor kept)."""
    profile = activation_profile(gm, runtime=runtime)
    return {**profile.saved, "inputs": profile.inputs}


PACKED = ir.PREFIX + "packed"  # pack-jagged-tokens' per-node facts (its region id)
PACKED_REGION = ir.PREFIX + "packed_region"  # the region's facts (fill) on its source node
_AUTOCAST_FP32 = ("softmax", "_softmax", "log_softmax", "_log_softmax", "sum", "cumsum",
                  "prod", "exp", "log", "pow", "rsqrt", "reciprocal", "logsumexp",
                  "native_layer_norm", "layer_norm", "group_norm", "norm")


def plan_autocast(gm: fx.GraphModule) -> str | None:
    """The plan's autocast dtype ("bf16"/"fp16"), from choose-precision's baseline on the
    output node; None when the graph runs in its captured dtypes."""
    out = next((n for n in gm.graph.nodes if n.op == "output"), None)
    facts = out.meta.get(ir.PRECISION) if out is not None else None
    base = facts.get("baseline") if isinstance(facts, dict) else None
    return base if base in ("bf16", "fp16") else None


def packed_fill(gm: fx.GraphModule) -> dict[fx.Node, float]:
    """Fill (real tokens / padded rows) of every node inside a packed token region, as the
    runners run it: 1.0 for a node without a packed rule, which runs on the padded tensor
    (:func:`gemc.packed_rules.on_tokens`)."""
    regions = [f for n in gm.graph.nodes if isinstance(f := n.meta.get(PACKED_REGION), dict)]
    fills = {f["id"]: float(f["fill"]) for f in regions if "fill" in f}
    sources = set().union(*(source_names(f) for f in regions))
    members = {n for n in gm.graph.nodes if isinstance(n.meta.get(PACKED), dict)}
    out: dict[fx.Node, float] = {}
    for n in members:
        runs_on_tokens = isinstance(n.meta.get(PACKED_REGION), dict) \
            or on_tokens(n, members, sources)
        out[n] = fills.get(n.meta[PACKED]["id"], 1.0) if runs_on_tokens else 1.0
    return out


def _numel(node: fx.Node) -> int:
    val = node.meta.get("val")
    return int(val.numel()) if isinstance(val, torch.Tensor) else 0


def runtime_itemsize(gm: fx.GraphModule, autocast: str | None) -> dict[fx.Node, int]:
    """Bytes per element of every tensor as the runner computes it (see module doc)."""
    out: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        dt = ir.dtype_of(node)
        captured = dt.itemsize if dt is not None else 0
        if autocast is None or dt is None or not dt.is_floating_point \
                or node.op != "call_function":
            out[node] = captured
            continue
        kind = ir.kind_of(node)
        if kind in (OpKind.GEMM, OpKind.ATTENTION):
            out[node] = 2
        elif kind in (OpKind.NORM, OpKind.LOSS, OpKind.EMBEDDING) or _op(node) in _AUTOCAST_FP32:
            out[node] = captured
        elif kind is OpKind.VIEW and node.all_input_nodes:
            out[node] = out.get(node.all_input_nodes[0], captured)
        else:
            floats = [out[a] for a in node.all_input_nodes
                      if (d := ir.dtype_of(a)) is not None and d.is_floating_point and a in out]
            out[node] = min(captured, max(floats)) if floats else captured
    return out


@dataclass
class ActivationProfile:
    """Saved-for-backward bytes per region, the batch inputs, and the forward's peak."""

    saved: dict[str, int] = field(default_factory=dict)  # region -> bytes kept for backward
    inputs: int = 0           # the batch tensors
    saved_total: int = 0
    peak: int = 0             # max over the step of saved + live temporaries (and grads)
    transient: int = 0        # peak above what is saved: the extra the walk finds
    # table lookup node name -> saved bytes still live when its backward runs
    alive_at_lookup: dict[str, int] = field(default_factory=dict)


def activation_profile(gm: fx.GraphModule, *, runtime: bool = True) -> ActivationProfile:
    """Saved bytes per region and the liveness peak of the forward (see module doc).
    ``runtime=False`` prices the captured dtypes and padded shapes (eager).

    At runtime the step is compiled (Inductor): AOTAutograd's min-cut partitioner keeps
    of a tensor that a fused memory-bound kernel writes either the tensor or, when that
    is fewer new bytes, what it is recomputed from in the backward (extern kernels'
    outputs, weights, the batch: ``inductor_fusion.recompute_sources``); and a fused
    kernel's intermediates are never written, so the forward's walk allocates only what
    a fused group hands to another kernel. Why: the zoo's plans priced every eager saved
    tensor and were 26-118% above the measured peaks (BENCHMARKS.md, issue 18's table)."""
    from .inductor_fusion import fusion_groups, recompute_sources

    autocast = plan_autocast(gm) if runtime else None
    size = runtime_itemsize(gm, autocast)
    fill = packed_fill(gm) if runtime else {}
    sources = recompute_sources(gm) if runtime else {}
    internal = _fused_internal(gm, fusion_groups(gm)) if runtime else set()
    in_kernel = _fused_internal(gm, _attention_kernels(gm)) if runtime else set()
    internal |= in_kernel
    operands = _attention_kernel_operands(gm) if runtime else {}

    def nbytes(n: fx.Node, itemsize: int | None = None) -> int:
        isz = size.get(n, 0) if itemsize is None else itemsize
        return int(_numel(n) * isz * fill.get(n, 1.0))

    saved: dict[fx.Node, tuple[str, int]] = {}
    casts: dict[fx.Node, tuple[str, int]] = {}  # autocast's bf16 copies of fp32 inputs
    inputs = 0
    for node in gm.graph.nodes:
        kind = ir.kind_of(node)
        if node.op == "placeholder":
            if kind is not OpKind.PARAM and not node.meta.get(ir.PARAM):
                inputs += ir.nbytes(node)
            continue
        if node.op != "call_function" or kind is None:
            continue
        dt = ir.dtype_of(node)
        if dt is not None and not dt.is_floating_point:
            continue
        region = str(node.meta.get(ir.REGION, ""))
        gemm = autocast is not None and kind in (OpKind.GEMM, OpKind.ATTENTION)
        # a region node without a packed rule runs on padded copies of its packed inputs
        # (gemc.packed_rules): what it saves is those copies, at the padded size
        padded_op = fill.get(node) == 1.0
        for t in [*_saved_inputs(node, kind), *operands.get(node, ())]:
            b = view_base(t)
            if padded_op and t is not node and fill.get(b, 1.0) < 1.0 and t not in saved:
                itemsize = 2 if gemm and size.get(b, 0) > 2 else size.get(b, 0)
                saved[t] = (region, _numel(t) * itemsize)
                continue
            is_param = ir.kind_of(b) is OpKind.PARAM or bool(b.meta.get(ir.PARAM))
            cast = gemm and t is not node and size.get(b, 0) > 2
            if b in sources:  # the partitioner's choice: b, or what recomputes b
                own = nbytes(b, 2) if cast else nbytes(b)
                new = [a for a in sources[b] if a not in saved and _is_activation(a)]
                if sum(nbytes(a) for a in new) < own:
                    for a in new:
                        saved.setdefault(a, (region, nbytes(a)))
                    continue
            if b in in_kernel:  # an attention kernel keeps its inputs, output, statistics
                continue
            if cast:
                casts.setdefault(b, (region, nbytes(b, 2)))  # the cast is what is saved
                continue
            if b.op == "placeholder" or is_param:
                continue
            saved.setdefault(b, (region, nbytes(b)))
    per_region: dict[str, int] = defaultdict(int)
    for region, b in [*saved.values(), *casts.values()]:
        per_region[region] += b
    saved_total = sum(per_region.values())
    peak = _forward_peak(gm, saved, casts, nbytes, internal)
    if runtime:
        peak = max(peak, _backward_peak(gm, {**saved, **casts}, nbytes, internal))
    return ActivationProfile(saved=dict(per_region), inputs=inputs, saved_total=saved_total,
                             peak=max(peak, saved_total),
                             transient=max(0, peak - saved_total),
                             alive_at_lookup=_alive_at_lookups(gm, {**saved, **casts}))


def _backward_order(gm: fx.GraphModule) -> tuple[list[fx.Node], dict[fx.Node, int],
                                                  dict[fx.Node, int]]:
    """(the forward's compute nodes in order, their index, each tensor's first reader's
    index): a saved tensor is freed after its first reader's backward."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"
             and ir.kind_of(n) is not OpKind.VIEW]
    order = {n: i for i, n in enumerate(nodes)}
    first_reader: dict[fx.Node, int] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            first_reader.setdefault(view_base(a), order[n])
    return nodes, order, first_reader


def _alive_at_lookups(gm: fx.GraphModule, saved: dict[fx.Node, tuple[str, int]]) -> dict[str, int]:
    """Saved bytes still live when each table lookup's backward runs: those first read at
    or before the lookup (the backward frees a saved tensor after its first reader's).
    A lookup used at the loss (HSTU's targets and negatives) sees nearly all of them, one
    at the model's start none: where its table-sized gradient (``dense_grad``) lands."""
    nodes, order, first_reader = _backward_order(gm)
    lookups = [n for n in nodes if n.meta.get(ir.TABLE)]
    if not lookups:
        return {}
    read = sorted((first_reader.get(b, order.get(b, 0)), size) for b, (_, size) in saved.items())
    out = {}
    for n in lookups:
        out[n.name] = sum(size for i, size in read if i <= order[n])
    return out


def _backward_peak(gm: fx.GraphModule, saved: dict[fx.Node, tuple[str, int]],
                   nbytes, internal: set[fx.Node]) -> int:  # noqa: ANN001
    """Walk the backward (the forward in reverse): everything saved is live when it
    starts; a tensor's gradient is allocated at the backward of its last reader and freed
    once its producer's backward has consumed it; a saved tensor is freed after the
    backward of its first reader. Weights' gradients are the memory model's ``grads``,
    the batch and integer tensors get none, a fused kernel's internal values none.
    Why: at the start of the backward the saved tensors and the first gradients are live
    together, which is where a compiled step peaks."""
    nodes, order, first_reader = _backward_order(gm)
    frees: dict[int, list[int]] = defaultdict(list)
    for b, (_, size) in saved.items():
        frees[first_reader.get(b, order.get(b, 0))].append(size)

    def has_grad(n: fx.Node) -> bool:
        dt = ir.dtype_of(n)
        return n in order and n not in internal and _is_activation(n) \
            and dt is not None and dt.is_floating_point

    live = peak = sum(size for _, size in saved.values())
    grads: set[fx.Node] = set()
    for n in reversed(nodes):
        for a in n.all_input_nodes:
            b = view_base(a)
            if has_grad(b) and b not in grads:
                grads.add(b)
                live += nbytes(b)
        peak = max(peak, live)
        if n in grads:  # its producer's backward consumed it
            grads.discard(n)
            live -= nbytes(n)
        live -= sum(frees.pop(order[n], []))
    return peak


def _is_activation(node: fx.Node) -> bool:
    """A tensor the step allocates (not a weight, not the batch)."""
    return node.op == "call_function" and ir.kind_of(node) is not OpKind.PARAM \
        and not node.meta.get(ir.PARAM)


def _attention_kernels(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Member -> group of gemc's attention kernels (islands whose kind is an attention):
    one kernel that saves Q, K, V, its output and row statistics, recomputing the scores
    in its backward, so the members' intermediates are neither allocated nor saved."""
    from .inductor_fusion import island_groups

    kinds = {f["id"]: str(f.get("kind", "")) for n in gm.graph.nodes
             if isinstance(f := n.meta.get(ir.KERNEL), dict) and "id" in f}
    islands = {g for g in island_groups(gm) if kinds.get(g, "").endswith("attention")}
    return {n: g for n in gm.graph.nodes if (g := n.meta.get(ir.GROUP)) in islands}


def _attention_kernel_operands(gm: fx.GraphModule) -> dict[fx.Node, list[fx.Node]]:
    """Output node -> what a gemc attention kernel matched from a written-out formula saves
    for its backward (``JaggedAttentionFunction.save_for_backward``: q, k, v, the score
    bias, its output): the facts name them. Why: priced by its members' own rules, the
    formula's second matmul kept its (never stored) weights and v, and neither the output
    nor the bias (HSTU: 134 MB a layer) was counted."""
    from .inductor_fusion import island_groups

    islands = island_groups(gm)
    named = {n.name: n for n in gm.graph.nodes}
    out: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        facts = node.meta.get(ir.KERNEL)
        if not isinstance(facts, dict) or facts.get("id") not in islands \
                or not str(facts.get("kind", "")).endswith("attention") \
                or not all(isinstance(facts.get(k), str) for k in ("q", "k", "v", "output")):
            continue
        names = [facts[k] for k in ("q", "k", "v", "output")] + \
            ([facts["bias"]] if isinstance(facts.get("bias"), str) else [])
        out[node] = [named[n] for n in names if n in named]
    return out


def _fused_internal(gm: fx.GraphModule, groups: dict[fx.Node, object]) -> set[fx.Node]:
    """Nodes of a fused group that only the group itself reads (never written to HBM)."""
    readers: dict[fx.Node, set[fx.Node]] = defaultdict(set)
    for n in gm.graph.nodes:
        if ir.kind_of(n) is OpKind.VIEW and n.op == "call_function":
            continue
        for a in n.all_input_nodes:
            readers[view_base(a)].add(n)
    return {n for n, g in groups.items()
            if readers.get(n) and all(groups.get(r) == g for r in readers[n])}


def _forward_peak(gm: fx.GraphModule, saved: dict[fx.Node, tuple[str, int]],
                  casts: dict[fx.Node, tuple[str, int]], nbytes,  # noqa: ANN001
                  internal: set[fx.Node] = frozenset()) -> int:
    """Walk the forward: a tensor is allocated when computed (views alias their base),
    freed after its last use unless saved; saved tensors and casts stay to the end; a
    fused kernel's ``internal`` values are never allocated."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        for a in n.all_input_nodes:
            b = view_base(a)
            last[b] = max(last.get(b, 0), order[n])
    frees: dict[int, list[fx.Node]] = defaultdict(list)
    live = peak = 0
    for n in gm.graph.nodes:
        i = order[n]
        if n in internal and n not in saved:
            pass
        elif n.op == "call_function" and ir.kind_of(n) is not OpKind.VIEW \
                and not n.meta.get(ir.PARAM) and n.op != "output":
            live += nbytes(n)
            if n in casts:
                live += casts[n][1]
            if n not in saved:
                frees[last.get(n, i)].append(n)
        elif n in casts:  # a weight or input cast to bf16 when first used
            live += casts[n][1]
        peak = max(peak, live)
        for dead in frees.pop(i, []):
            live -= nbytes(dead)
    return peak
