"""fuse: group nodes into kernels that read their inputs once and write their outputs once.

Why: on an H200 a GEM step under torch.compile spends a third of its kernel time in
pointwise and norm kernels around cuBLAS GEMMs (GELU and its backward alone 5.4 ms),
because Inductor does not fuse into cuBLAS; a GEMM whose epilogue applies bias,
activation and residual before its one store, and whose backward GEMMs recompute the
activation's derivative from their input tiles, removes those passes over memory.

Groups, formed greedily in this order (earlier kinds take the nodes they can use):

1. ``gemm_epilogue``: an ``aten.linear`` and the pointwise ops that consume its result
   (bias is part of the linear; activation GELU/SiLU/ReLU/..., residual add, scale,
   cast); kept only with at least one epilogue op.
2. ``norm``: a LayerNorm over the last dim with the pointwise ops producing its input
   (e.g. the residual add, stored as a second output) and consuming its output; kept
   even alone (the residual add often went to the preceding GEMM's epilogue), since the
   generated kernel writes its output in the dtype its consumer reads (the runner narrows
   a LayerNorm feeding only GEMMs to the autocast dtype) where ATen's writes fp32.
3. ``reduction``: a sum/mean over dim -2 with the pointwise ops producing its input.
4. ``pointwise``: the remaining chains of two or more pointwise ops.

Rules: every member has the group's shape (operands may broadcast to it and may be
strided views: transposes and expands are read in place, so views at the boundary cost
nothing; a view between two ops ends the group); a member's value used outside the group
becomes an extra output (at most ``max_outputs``), so a node with several consumers can
still be fused where that saves traffic; a node joins only if the condensed graph stays
acyclic (no path leaves the group and re-enters it, through other groups included).

Each group's nodes get ``gemc.group = <id>``; its last node gets ``gemc.kernel`` with the
kind and the cost model's forward+backward milliseconds before (the nodes as separate
kernels, from predict-time) and after (one kernel per phase: reads of the group's inputs,
writes of its outputs, priced by roofline). The plan builder writes the kernel spec and
generated source from these annotations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import fusion_spec as fs
from gemc import ir
from gemc.context import PassContext

aten = torch.ops.aten
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
_AFFINE = {"identity", "cast", "add", "sub", "rsub", "neg"}
MAX_SLOTS = 12  # operand tiles one kernel reads; bounds its argument list and registers


def _float_tensor(node: fx.Node) -> bool:
    """A float tensor of a fixed size (a data-dependent one, gemc.data_dependent's bound,
    would be baked into the kernel)."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype in _FLOAT and val.dim() >= 1 \
        and val.numel() > 0 and ir.BOUNDED not in node.meta


def gemm_root(node: fx.Node) -> bool:
    if node.target is not aten.linear.default or not _float_tensor(node):
        return False
    w = node.args[1]
    b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return (isinstance(w, fx.Node) and len(ir.shape_of(w) or ()) == 2
            and (b is None or (isinstance(b, fx.Node) and len(ir.shape_of(b) or ()) == 1)))


def norm_root(node: fx.Node) -> bool:
    if node.target is not aten.layer_norm.default or not _float_tensor(node):
        return False
    shape = ir.shape_of(node)
    return list(node.args[1]) == [shape[-1]]


def reduction_root(node: fx.Node) -> bool:
    if node.target not in (aten.sum.dim_IntList, aten.mean.dim) or not _float_tensor(node):
        return False
    if node.kwargs.get("dtype") is not None or len(node.args) > 3:
        return False
    src = node.args[0]
    shape = ir.shape_of(src) if isinstance(src, fx.Node) and _float_tensor(src) else None
    dims = node.args[1] if len(node.args) > 1 else None
    if shape is None or len(shape) < 2 or not isinstance(dims, (list, tuple)) or len(dims) != 1:
        return False
    return dims[0] % len(shape) == len(shape) - 2 and shape[-2] > 0


@dataclass
class _Group:
    kind: str
    root: fx.Node
    members: set[fx.Node]
    shape: tuple[int, ...]


class _Grouper:
    """Group membership plus the legality checks (shape, operands, acyclicity)."""

    def __init__(self, gm: fx.GraphModule, max_outputs: int) -> None:
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.max_outputs = max_outputs
        self.unit: dict[fx.Node, frozenset[fx.Node]] = {}
        by_id: dict[Any, set[fx.Node]] = {}
        for n in gm.graph.nodes:  # groups of earlier passes are units too
            if ir.GROUP in n.meta:
                by_id.setdefault(n.meta[ir.GROUP], set()).add(n)
        for members in by_id.values():
            frozen = frozenset(members)
            for n in members:
                self.unit[n] = frozen

    def taken(self, node: fx.Node) -> bool:
        return node in self.unit or ir.GROUP in node.meta

    def pointwise(self, node: fx.Node, shape: tuple[int, ...]) -> bool:
        if self.taken(node) or not _float_tensor(node) or ir.shape_of(node) != shape:
            return False
        tr = fs.translate(node)
        if tr is None:
            return False
        for a in tr[1]:
            if isinstance(a, fx.Node) and fs.broadcast_flags(ir.shape_of(a) or (), shape) is None:
                return False
        return True

    def outputs(self, members: set[fx.Node]) -> list[fx.Node]:
        return sorted((n for n in members if any(u not in members for u in n.users)),
                      key=self.order.__getitem__)

    def slots(self, members: set[fx.Node]) -> int:
        keys = set()
        for n in members:
            for a in n.all_input_nodes:
                if a not in members:
                    keys.add((a, ir.shape_of(n)))
        return len(keys)

    def acyclic(self, members: set[fx.Node]) -> bool:
        """No path from the group through outside nodes (or other groups) back into it."""
        stack = [u for n in members for u in n.users if u not in members]
        seen: set[fx.Node] = set()
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            for y in self.unit.get(x, (x,)):
                if y in members:
                    return False
                seen.add(y)
                stack.extend(u for u in y.users if u not in seen)
        return True

    def legal(self, members: set[fx.Node]) -> bool:
        return (len(self.outputs(members)) <= self.max_outputs
                and self.slots(members) <= MAX_SLOTS and self.acyclic(members))

    def grow(self, group: _Group, *, forward: bool, backward: bool) -> None:
        """Add consumers (forward) and producers (backward) while legal."""
        rejected: set[fx.Node] = set()
        changed = True
        while changed:
            changed = False
            cands: set[fx.Node] = set()
            for n in group.members:
                if forward and not (group.kind == "reduction" and n is group.root):
                    cands.update(u for u in n.users if u.op == "call_function")
                if backward:
                    cands.update(self._data_args(n, group))
            for c in sorted(cands - group.members - rejected, key=self.order.__getitem__):
                if not self.pointwise(c, group.shape) or not self.legal(group.members | {c}):
                    rejected.add(c)
                    continue
                group.members.add(c)
                changed = True

    def _data_args(self, node: fx.Node, group: _Group) -> list[fx.Node]:
        if node is group.root and group.kind == "norm":
            x = node.args[0]
            return [x] if isinstance(x, fx.Node) else []
        if node is group.root and group.kind == "gemm_epilogue":
            return []
        return list(node.all_input_nodes)

    def commit(self, group: _Group) -> None:
        frozen = frozenset(group.members)
        for n in group.members:
            self.unit[n] = frozen


def _epilogue_ops(members: list[fx.Node]) -> int:
    return sum(fs.translate(n) is not None for n in members)


def form_groups(gm: fx.GraphModule, kinds: tuple[str, ...], max_outputs: int) -> list[_Group]:
    g = _Grouper(gm, max_outputs)
    groups: list[_Group] = []
    nodes = list(gm.graph.nodes)
    phases = (
        ("gemm_epilogue", gemm_root, dict(forward=True, backward=False)),
        ("norm", norm_root, dict(forward=True, backward=True)),
        ("reduction", reduction_root, dict(forward=False, backward=True)),
    )
    for kind, is_root, how in phases:
        if kind not in kinds:
            continue
        for node in nodes:
            if g.taken(node) or not is_root(node):
                continue
            shape = ir.shape_of(node.args[0]) if kind == "reduction" else ir.shape_of(node)
            group = _Group(kind, node, {node}, tuple(shape))
            g.grow(group, **how)
            if kind == "norm" or _epilogue_ops(list(group.members)) >= 1:
                g.commit(group)
                groups.append(group)
    if "pointwise" in kinds:
        for node in nodes:
            if node.op != "call_function" or not g.pointwise(node, tuple(ir.shape_of(node) or ())):
                continue
            group = _Group("pointwise", node, {node}, tuple(ir.shape_of(node)))
            if not g.legal(group.members):
                continue
            g.grow(group, forward=True, backward=True)
            if len(group.members) >= 2:
                g.commit(group)
                groups.append(group)
    order = {n: i for i, n in enumerate(nodes)}
    for group in groups:
        group.members = set(sorted(group.members, key=order.__getitem__))
    return groups


# ---- pricing ---------------------------------------------------------------------------------


def _price(kind: str, members: list[fx.Node], outputs: list[fx.Node], ctx: PassContext
           ) -> dict[str, float] | None:
    """Cost model's fwd+bwd ms: the nodes as they run now, and the group as one kernel."""
    topology = ctx.topology
    if topology is None:
        return None
    from gemc.cost_model import op_cost

    gpu, calib = topology.gpu, ctx.calibration
    before = 0.0
    for n in members:
        ms = n.meta.get(ir.PREDICTED_MS)
        before += float(ms) if ms is not None else op_cost.node_cost(n, gpu, calib).total_ms
    member_set = set(members)
    inputs = {a for n in members for a in n.all_input_nodes if a not in member_set}
    in_bytes = sum(ir.nbytes(a) for a in inputs)
    float_in = sum(ir.nbytes(a) for a in inputs
                   if (ir.dtype_of(a) or torch.int64).is_floating_point)
    out_bytes = sum(ir.nbytes(o) for o in outputs)
    launch = calib.kernel_s if calib is not None else op_cost.DEFAULT_KERNEL_LAUNCH_S
    dtype = op_cost.dtype_name(ir.dtype_of(members[0]))
    if kind == "gemm_epilogue":
        root = members[0]
        p = root.meta.get(ir.GEMM) or {"batch": 1, "m": 0, "n": 0, "k": 0}
        flops = 2.0 * p["batch"] * p["m"] * p["n"] * p["k"]
        z = ir.nbytes(root) if any((fs.translate(n) or ("",))[0] not in _AFFINE
                                   for n in members[1:]) else 0
        eff = calib.gemm_efficiency(p["m"], p["n"], p["k"], dtype) if calib is not None else None
        eff = eff if eff is not None else op_cost.ROOFLINE_EFFICIENCY["gemm"]
        mem = op_cost.ROOFLINE_EFFICIENCY["memory"]

        def gemm(nbytes: float) -> float:
            return op_cost.roofline_time(flops, nbytes, gpu.peak_flops(dtype), gpu.hbm_bandwidth,
                                         compute_efficiency=eff, memory_efficiency=mem) + launch

        fwd = gemm(in_bytes + out_bytes + z)
        bwd = gemm(out_bytes + z + in_bytes) + gemm(out_bytes + z + float_in)
    elif kind == "norm":
        # the backward moves the inputs again, the outputs' gradients and the inputs'
        # gradients; the norm_bwd curve is measured on op_cost's axis for a LayerNorm (2x
        # the forward's bytes), where the ATen op is priced. Fewer bytes than that axis
        # never cost more (the measured curve is not monotone everywhere): so a lone
        # LayerNorm is priced at most as the ATen op less its second launch
        fwd, _ = op_cost.memory_time(in_bytes + out_bytes, gpu, calib, "norm_fwd", dtype=dtype)
        bwd = min(op_cost.memory_time(nbytes, gpu, calib, "norm_bwd", dtype=dtype)[0]
                  for nbytes in (in_bytes + out_bytes + float_in, 2.0 * (in_bytes + out_bytes)))
    else:
        fwd, _ = op_cost.memory_time(in_bytes + out_bytes, gpu, calib, "pointwise")
        bwd, _ = op_cost.memory_time(in_bytes + out_bytes + float_in, gpu, calib, "pointwise")
    return {"before_ms": round(before, 6), "after_ms": round(1e3 * (fwd + bwd), 6)}


@dataclass(frozen=True)
class Fuse:
    """Annotates ``gemc.group`` on fused nodes and ``gemc.kernel`` on each group's last node."""

    name: ClassVar[str] = "fuse"
    requires: ClassVar[tuple[str, ...]] = ("classify-ops", "count-flops-bytes")
    kinds: tuple[str, ...] = ("gemm_epilogue", "norm", "reduction", "pointwise")
    max_outputs: int = 4

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        groups = sorted(form_groups(gm, self.kinds, self.max_outputs),
                        key=lambda g: min(order[n] for n in g.members))  # ids in graph order
        for i, group in enumerate(groups):
            members = sorted(group.members, key=order.__getitem__)
            gid = f"{group.kind}_{i}"
            outputs = [n for n in members if any(u not in group.members for u in n.users)]
            for n in members:
                n.meta[ir.GROUP] = gid
            facts: dict[str, Any] = {"id": gid, "kind": group.kind, "nodes": len(members),
                                     "outputs": [o.name for o in outputs]}
            price = _price(group.kind, members, outputs, ctx)
            if price:
                facts.update(price)
            members[-1].meta[ir.KERNEL] = facts
        return PassResult(gm, bool(groups))
