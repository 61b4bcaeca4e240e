"""Padding as one weighted token per row: when a history's padding is read only by
reductions over the token axis, and only where every padded token of a row is one value.

Not a pass: the rules ``pack-jagged-tokens`` uses for a history no attention reads whose
padded tokens some reduction reads (DIN's Dice: the mean and the biased variance of every
``B * L`` row of the activation unit). Refusing to pack such a history leaves its dominant
work on the padding; packing it over the real tokens only would change those statistics.

Why it is exact: within a row every padded token is the same value whenever (a) every
value entering the region varies along the token axis only through its real entries,
i.e. each region source's padded entries are equal within the row (the padded ids, all 0
in DIN; this is data, so the region's run-time check compares them), and (b) every other
operand of a region op is constant over the token axis (a per-row value such as DIN's
candidate ``expand``-ed over ``L``, a weight, a global statistic): structural, proven here.
Then the padded computation is the packed one over the real tokens plus ONE
representative per row with padding (its first padded position), weighted by the row's
padding count ``L - len``, as long as every reduction over the token axis weighs its
tokens: ``sum(w x)``, ``mean = sum(w x) / N``, ``var = sum(w (x - mean)^2) / (N - c)`` for
any correction ``c``, ``std`` its root (``N = sum(w)`` times the other reduced sizes).
Backward is exact too: the weighted reductions give the representative the sum of its
copies' gradients, and every token-wise op's backward is linear in its output gradient, so
the weights' and the tables' gradients are the padded ones up to summation order. A mask
multiply zeroes the representative (its mask entry is a padded one), so a masked pooling
is unchanged.

Supported readers: ``sum``, ``mean``, ``var`` and ``std`` (any correction) whose reduced
dims hold both token dims (or their merged ``B * L`` dim), with no ``dtype`` argument.
A reduction over the positions of each row alone (a per-row statistic), an ``amax``, a
scan, a softmax or the graph's output keep the history padded, as before. So does a
region that draws random numbers (a dropout: its padded copies differ) or holds an
attention kernel (its keys would count the representative as a real key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from gemc import ir
from gemc.fusion_spec import elementwise
from gemc.guard_sample import why_not_ahead
from gemc.packed_rules import draws

from .jagged_patterns import _CASTS, KeyMask, PaddingFlow
from .row_reads import follow_with_reads

aten = torch.ops.aten
Dims = tuple[int, int]

_SUM = {aten.sum.dim_IntList, aten.sum.default}
_MEAN = {aten.mean.dim, aten.mean.default}
_VAR = {aten.var.correction, aten.var.dim}
_STD = {aten.std.correction, aten.std.dim}


@dataclass(frozen=True)
class TokenReduction:
    """A reduction over the token axis the runner weighs: ``op`` (sum, mean, var, std), the
    dims it reduces (of the padded value), ``keepdim`` and the variance's ``correction``."""

    op: str
    dims: tuple[int, ...]
    keepdim: bool
    correction: float
    index: None = None  # no position to check (what ``row_reads`` readers carry)

    def spec(self, node: fx.Node) -> dict[str, Any]:
        """The plan's fact for the reduction ``node``."""
        return {"node": node.name, "op": self.op, "dims": list(self.dims),
                "keepdim": self.keepdim, "correction": self.correction}


def token_reduction(user: fx.Node, src: fx.Node, dims: Dims, facts: Any
                    ) -> TokenReduction | None:
    """The weighted reduction ``user`` is, reading ``src`` (at ``dims``) over every token
    of the batch, or None (not a kind this module weighs exactly)."""
    if user.op != "call_function" or not user.args or user.args[0] is not src:
        return None
    t = user.target
    if t not in _SUM | _MEAN | _VAR | _STD or user.kwargs.get("dtype") is not None:
        return None
    rank = len(ir.shape_of(src) or ())
    args, kwargs = list(user.args), user.kwargs
    if t in (aten.sum.default, aten.mean.default):
        reduced, keepdim, correction = None, False, 0.0
    elif t in (aten.var.dim, aten.std.dim):
        reduced = args[1] if len(args) > 1 else kwargs.get("dim")
        unbiased = args[2] if len(args) > 2 else kwargs.get("unbiased", True)
        keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
        correction = 1.0 if unbiased else 0.0
    elif t in (aten.var.correction, aten.std.correction):
        reduced = args[1] if len(args) > 1 else kwargs.get("dim")
        c = kwargs.get("correction")
        correction = 1.0 if c is None else float(c)
        keepdim = bool(kwargs.get("keepdim", False))
    else:  # sum.dim_IntList, mean.dim
        reduced = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        correction = 0.0
    if reduced is None or (isinstance(reduced, (list, tuple)) and not reduced):
        axes = set(range(rank))
    else:
        axes = {int(d) % rank for d in ([reduced] if isinstance(reduced, int) else reduced)}
    bd, ld = dims
    token = {bd if bd >= 0 else ~bd} if bd == ld or bd < 0 else {bd, ld}
    if not token <= axes:
        return None  # a per-row statistic (over the positions only): not weighed here
    op = "sum" if t in _SUM else "mean" if t in _MEAN else "var" if t in _VAR else "std"
    return TokenReduction(op, tuple(sorted(axes)), bool(keepdim), correction)


def follow_weighted(start: fx.Node, dims: Dims, facts: KeyMask) -> PaddingFlow | fx.Node:
    """:func:`.jagged_patterns.follow_padding` with readers of one token per row
    (``row_reads``) and weighted reductions (:func:`token_reduction`) both allowed: the
    flow, the reductions among its ``reads`` (:func:`reductions` takes them out), or the
    first node that may read the padding otherwise."""
    return follow_with_reads(start, dims, facts, also=token_reduction)


def reductions(flow: PaddingFlow) -> dict[fx.Node, TokenReduction]:
    """The weighted reductions among ``flow.reads``, removed from it (what stays are the
    readers of one token per row, which the region's check checks)."""
    out = {n: r for n, r in flow.reads.items() if isinstance(r, TokenReduction)}
    for n in out:
        del flow.reads[n]
    return out


def _constant_over(node: Any, axis: int) -> bool:
    """``node``'s value does not vary along ``axis`` (of its own shape): size 1 there, an
    ``expand`` of a size-1 dim (DIN's candidate, ``query[:, None].expand(-1, L, -1)``), a
    cast of such, or elementwise over such."""
    if not isinstance(node, fx.Node):
        return True
    shape = tuple(ir.shape_of(node) or ())
    if axis < 0 or axis >= len(shape) or shape[axis] == 1:
        return True
    if node.op != "call_function":
        return False
    if node.target is aten.expand.default or node.target in _CASTS:
        inner = node.args[0]
        rank = len(tuple(ir.shape_of(inner) or ()))
        return _constant_over(inner, axis - (len(shape) - rank))
    if elementwise(node):
        return all(_constant_over(a, axis - (len(shape) - len(ir.shape_of(a) or ())))
                   for a in node.args if isinstance(a, fx.Node))
    return False


def rep_facts(gm: fx.GraphModule, flow: PaddingFlow, key_mask: KeyMask,
              weighted: dict[fx.Node, TokenReduction]) -> dict[str, Any] | str:
    """The region entry's facts for padding representatives over ``flow`` (``pad_rep``,
    the ``rep_sources`` its check compares, the ``weighted`` reductions), or why the
    padded tokens of a row may differ (condition (b) of the module doc fails)."""
    members = set(flow.carriers) | set(flow.zeroed)
    sources: list[str] = []

    def source(x: fx.Node, at: Dims, where: fx.Node) -> str | None:
        """``x`` (a ``[B, L, ...]`` value outside the region whose tokens vary) as a source
        the check compares; or why not."""
        shape = tuple(ir.shape_of(x) or ())
        if at != (0, 1) or shape[:2] != (key_mask.batch, key_mask.length):
            return (f"{x.name} varies along the token axis of {where.name} and is not "
                    "laid out [B, L, ...]")
        blocked = why_not_ahead(gm, x.name, {})
        if blocked is not None:
            return (f"{x.name} varies along the token axis of {where.name} and cannot be "
                    f"checked from the batch ({blocked.replace('its mask ', '')})")
        if x.name not in sources:
            sources.append(x.name)
        return None

    for node, dims in flow.carriers.items():
        kind = str((node.meta.get(ir.KERNEL) or {}).get("kind") or "")
        if "attention" in kind:
            return f"{node.name} is a {kind} kernel (it would count the representative " \
                "as a real key)"
        if node.op != "call_function":
            continue
        if draws(node):
            return f"{node.name} draws random numbers (its padded copies differ)"
        rank = len(ir.shape_of(node) or ())
        bd, ld = dims
        for x in (a for a in node.all_input_nodes if a not in members):
            shape = tuple(ir.shape_of(x) or ())
            if x.op == "placeholder" and ir.PARAM not in x.meta \
                    and (ir.dtype_of(x) or torch.int64).is_floating_point \
                    and shape[:2] == (key_mask.batch, key_mask.length) and len(shape) >= 3:
                why = source(x, (0, 1), node)  # a float history input: a region start
            elif node.target is aten.embedding.default:
                # its ids (a table is a weight, the same for every token)
                why = source(x, dims, node) if x is node.args[1] else None
            elif node.target in (aten.linear.default, aten.layer_norm.default) \
                    and x is not node.args[0]:
                why = None  # weights, biases: the same for every token
            elif elementwise(node) or node.target is aten.cat.default:
                off = rank - len(shape)
                if bd == ld or bd < 0:
                    why = None if _constant_over(x, (bd if bd >= 0 else ~bd) - off) else (
                        f"{x.name} varies along the merged token dim of {node.name} (no "
                        "check compares a merged source)")
                elif _constant_over(x, ld - off):
                    why = None
                else:
                    why = source(x, (bd - off, ld - off), node)
            else:
                why = (f"{node.name} ({getattr(node.target, '__name__', node.target)}) reads "
                       f"{x.name} beside the history, with no rule for its tokens")
            if why is not None:
                return why
    if not sources:
        return "no source of the history is known to the check"
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_name = {n.name: n for n in gm.graph.nodes}
    return {"pad_rep": True,
            "rep_sources": sorted(sources, key=lambda name: order[by_name[name]]),
            "weighted": [weighted[n].spec(n) for n in sorted(weighted, key=order.__getitem__)]}
