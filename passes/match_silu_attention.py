"""match-silu-attention: HSTU pointwise attention written as its formula -> the jagged SiLU
kernel, guarded at run time.

Why: HSTU ("Actions Speak Louder than Words", Zhai et al. 2024) replaces softmax by a
pointwise SiLU; models write it out on padded tensors, so the ``[B, H, L, L]`` scores, their
SiLU, the division and the mask run over padding (at 50% fill, three quarters of the score
work) and through memory. ``gemc.backends.triton.jagged_attention`` (``kind="silu"``)
computes it over values + offsets with nothing of ``[L, L]`` ever stored
(``benchmarks/kernels.py``'s ``silu`` case measures it against the padded formula).

The pattern, recognised by what each op computes (never by names)::

    s = matmul(q, k.transpose(-1, -2))         # [B, H, L, L]; optionally * scale,
    s = s + bias                               # optionally: any [B|1, H|1, L, L] addend
    a = silu(s) / n                            # or * (1 / n); n a constant >= L
    a = a * visible  (or where(visible, a, 0)) # visible: an and of a [B, L] key mask on the
                                               # key axis, optionally the same mask on the
                                               # query axis, optionally the causal mask
    out = matmul(a, v)

where q, k, v are ``[B, H, L, D]`` and the intermediates are read by nothing else. The key
mask may be any bool ``[B, L]`` tensor (an input, ``arange < lengths``): the op checks at run
time that it is a prefix and otherwise runs the padded formula (counted in
``key_padding_attention.STATS``). Without the query-axis mask, padding query rows are
nonzero in the model and zero in the kernel: matched only when nothing reads them unmasked.

The bias (relative position, time buckets: any tensor of that shape) is an operand of the
kernel, indexed by positions within each sequence; its gradient flows back to whatever
computed it. Not matched (named in the dump and the warnings): the formula spelled with
``einsum`` (``einsum-spelling``), scores times a float mask (``mask-not-boolean``: e.g. only
a causal ``tril`` of ones, the key padding left implicit in zero-padded values), a per-row normaliser
(``normaliser``), a normaliser below ``L`` (``normaliser-below-length``), an addend that is
not a ``[B|1, H|1, L, L]`` tensor (``bias-shape``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import ir
from gemc.context import PassContext

from .jagged_patterns import (
    _ANDS,
    KeyMask,
    _broadcast_root,
    _is_tril,
    _through_views_and_casts,
    keep_of,
    padding_rows_read_by,
)

aten = torch.ops.aten
SKIPPED = ir.PREFIX + "silu_skipped"  # why a pointwise attention was not made jagged
_MATMUL = aten.matmul.default
_TRANSPOSED = {(-1, -2), (-2, -1), (2, 3), (3, 2), (-1, 2), (2, -1), (3, -2), (-2, 3)}


def _scalar(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _normalised_silu(node: Any) -> bool:
    """``node`` is ``silu(.) / n`` or ``silu(.) * c``."""
    return isinstance(node, fx.Node) and node.target in (aten.div.Tensor, aten.mul.Tensor) \
        and isinstance(node.args[0], fx.Node) and node.args[0].target is aten.silu.default


def _mask_factors(node: Any, out: list[fx.Node]) -> None:
    """The operands of an and-tree of boolean masks (through casts), in ``out``."""
    inner = _through_views_and_casts(node)
    if isinstance(inner, fx.Node) and inner.op == "call_function" and inner.target in _ANDS \
            and ir.dtype_of(inner) == torch.bool:
        for a in inner.args[:2]:
            _mask_factors(a, out)
    else:
        out.append(node)


def _visible(mask: Any, batch: int, length: int
             ) -> tuple[KeyMask, bool, bool] | str:
    """``(key mask, causal, query_mask)`` of a ``[B, 1|H, L, L]`` visibility mask, or why not."""
    root = _through_views_and_casts(mask)
    rshape = tuple(ir.shape_of(root) or ()) if isinstance(root, fx.Node) else ()
    if rshape not in ((batch, length, length), (batch, 1, length, length)):
        return "mask-shape"
    factors: list[fx.Node] = []
    _mask_factors(root, factors)
    keys: list[fx.Node] = []
    queries: list[fx.Node] = []
    causal = False
    for f in factors:
        shape = tuple(ir.shape_of(f) or ())
        aligned = (1,) * (len(rshape) - len(shape)) + shape
        if len(aligned) != len(rshape) or aligned[0] not in (1, batch):
            return "mask-factor"
        if aligned[-2:] == (length, length) and aligned[0] == 1 and _is_tril(f, length):
            causal = True
            continue
        root_f = _broadcast_root(f, batch, length) if aligned[0] == batch else None
        if root_f is None or ir.dtype_of(root_f) != torch.bool:
            return "mask-factor"
        if aligned[-2:] == (1, length):
            keys.append(root_f)
        elif aligned[-2:] == (length, 1):
            queries.append(root_f)
        else:
            return "mask-factor"
    if len(keys) != 1 or len(queries) > 1:
        return "no-key-padding-mask"
    keep = keep_of(keys[0]) or keys[0]
    if queries and (keep_of(queries[0]) or queries[0]) is not keep:
        return "query-mask-differs"
    return KeyMask(keys[0], False, keep, batch, length), causal, bool(queries)


def match(node: fx.Node) -> dict[str, Any] | str | None:
    """The facts of a pointwise-attention output ``matmul(a, v)``, the reason it is not one
    (once it looks like one: ``silu`` scores), or None for any other node."""
    if node.target is aten.einsum.default:  # the formula spelled with einsum: not yet
        ops = [o for o in node.args[1] if isinstance(o, fx.Node)]
        looks = any(_normalised_silu(o) or (o.target is aten.mul.Tensor and any(
            _normalised_silu(a) for a in o.args)) for o in ops)
        return "einsum-spelling" if looks else None
    if node.target is not _MATMUL:
        return None
    a_node, v = node.args[:2]
    vshape = tuple(ir.shape_of(v) or ())
    if len(vshape) != 4 or not isinstance(a_node, fx.Node):
        return None
    batch, heads, length, head_dim = (int(x) for x in vshape)
    group = [node]
    a = a_node
    mask = None
    if a.target is aten.mul.Tensor:
        x, y = a.args[:2]
        silu_side = [t for t in (x, y) if isinstance(t, fx.Node)
                     and ir.dtype_of(_through_views_and_casts(t)) != torch.bool]
        bool_side = [t for t in (x, y) if isinstance(t, fx.Node)
                     and ir.dtype_of(_through_views_and_casts(t)) == torch.bool]
        if len(silu_side) != 1 or len(bool_side) != 1:
            # silu scores times a float mask (a causal tril of ones, no key mask): say so
            return "mask-not-boolean" if any(_normalised_silu(t) for t in (x, y)) else None
        group.append(a)
        mask, a = bool_side[0], silu_side[0]
    elif a.target is aten.where.ScalarOther and _scalar(a.args[2]) == 0.0:
        group.append(a)
        mask, a = a.args[0], a.args[1]
    if not isinstance(a, fx.Node):
        return None
    norm = None
    if a.target is aten.div.Tensor and _scalar(a.args[1]) is not None:
        norm = _scalar(a.args[1])
    elif a.target is aten.mul.Tensor and _scalar(a.args[1]):
        norm = 1.0 / float(a.args[1])
    elif a.target in (aten.div.Tensor, aten.mul.Tensor):
        inner = a.args[0]
        if isinstance(inner, fx.Node) and inner.target is aten.silu.default:
            return "normaliser"
        return None
    if norm is None:
        return None
    group.append(a)
    s = a.args[0]
    if not (isinstance(s, fx.Node) and s.target is aten.silu.default):
        return None
    group.append(s)
    t = s.args[0]
    if mask is None:
        return "no-key-padding-mask"
    scale = 1.0
    if isinstance(t, fx.Node) and t.target is aten.mul.Tensor and _scalar(t.args[1]):
        group.append(t)
        scale, t = float(t.args[1]), t.args[0]
    bias = None
    if isinstance(t, fx.Node) and t.target is aten.add.Tensor:
        x, y = t.args[:2]
        scores = [a for a in (x, y) if isinstance(a, fx.Node) and a.target in (_MATMUL,
                                                                               aten.mul.Tensor)]
        if len(scores) != 1 or not isinstance(x, fx.Node) or not isinstance(y, fx.Node):
            return "score-addend"
        bias = y if scores[0] is x else x
        group.append(t)
        t = scores[0]
        if t.target is aten.mul.Tensor and _scalar(t.args[1]):
            group.append(t)
            scale, t = float(t.args[1]), t.args[0]
    if not (isinstance(t, fx.Node) and t.target is _MATMUL):
        return "scores-not-a-matmul"
    group.append(t)
    q, kt = t.args[:2]
    if not (isinstance(kt, fx.Node) and kt.target is aten.transpose.int
            and tuple(kt.args[1:3]) in _TRANSPOSED):
        return "scores-not-q-kt"
    k = kt.args[0]
    if tuple(ir.shape_of(q) or ()) != vshape or tuple(ir.shape_of(k) or ()) != vshape:
        return "qkv-shapes"
    rounded = round(norm)
    if abs(norm - rounded) > 1e-6 * max(1.0, abs(norm)):
        return "normaliser"
    if rounded < length:
        return "normaliser-below-length"
    if bias is not None:
        bshape = tuple(ir.shape_of(bias) or ())
        aligned = (1,) * (4 - len(bshape)) + bshape
        if len(aligned) != 4 or aligned[2:] != (length, length) \
                or aligned[0] not in (1, batch) or aligned[1] not in (1, heads):
            return "bias-shape"
    found = _visible(mask, batch, length)
    if isinstance(found, str):
        return found
    key_mask, causal, query_mask = found
    inside = set(group)
    for n in group[1:]:
        if any(u not in inside for u in n.users):
            return f"scores-read-by:{next(u for u in n.users if u not in inside).name}"
    if not query_mask:
        reader = padding_rows_read_by(node, key_mask)
        if reader is not None:
            return f"padding-rows-read-by:{reader.name}"
    return {
        "_group": group,
        "_mask": key_mask,
        "q": q.name, "k": k.name, "v": v.name,
        "output": node.name,
        "mask": key_mask.node.name,
        "bias": bias.name if bias is not None else None,
        "norm": int(rounded),
        "scale": scale,
        "causal": causal,
        "query_mask": query_mask,
        "max_len": length, "heads": heads, "head_dim": head_dim,
        "fill": 1.0,  # unknown at compile time: data, checked per call
    }


def _price(group: list[fx.Node], mask: fx.Node, ctx: PassContext) -> dict[str, float] | None:
    """The group's forward+backward ms padded, and as compiled at fill 1 (the fill of a data
    mask is unknown at compile time) plus the guard's traffic and the jagged copies."""
    topology = getattr(ctx, "topology", None)
    if topology is None:
        return None
    from gemc.cost_model import op_cost

    gpu, calib = topology.gpu, getattr(ctx, "calibration", None)
    before = sum(float(n.meta.get(ir.PREDICTED_MS) or
                       op_cost.node_cost(n, gpu, calib).total_ms) for n in group)
    scores = sum(ir.nbytes(n) for n in group[1:])  # what the kernel never stores
    mem, _ = op_cost.memory_time(ir.nbytes(mask) + 16 * ir.nbytes(group[0]), gpu, calib, "copy")
    saved, _ = op_cost.memory_time(scores, gpu, calib, "copy")
    after = max(before - 1e3 * saved, 0.0) + 1e3 * mem
    return {"before_ms": round(before, 6), "after_ms": round(after, 6)}


@dataclass(frozen=True)
class MatchSiluAttention:
    """Groups each matched formula (``gemc.group``) with ``gemc.kernel`` on its output
    matmul: kind ``jagged_silu_attention`` and the facts the runner needs."""

    name: ClassVar[str] = "match-silu-attention"
    requires: ClassVar[tuple[str, ...]] = ("classify-ops",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        count = 0
        for node in list(gm.graph.nodes):
            if ir.GROUP in node.meta:
                continue
            found = match(node)
            if found is None:
                continue
            if isinstance(found, str):
                node.meta[SKIPPED] = found
                ctx.warn(f"match-silu-attention: {node.name} stays the padded formula "
                         f"({found})")
                continue
            group: list[fx.Node] = found.pop("_group")
            if any(ir.GROUP in n.meta for n in group):
                continue
            mask: KeyMask = found.pop("_mask")
            gid = f"jagged_silu_attention_{count}"
            count += 1
            for n in group:
                n.meta[ir.GROUP] = gid
            node.meta[ir.KERNEL] = {"id": gid, "kind": "jagged_silu_attention", **found,
                                    **(_price(group, mask.node, ctx) or {})}
        return PassResult(gm, count > 0)
