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
scan, a softmax or the graph's output keep a history no attention reads padded, as
before. So does a region that draws random numbers (a dropout: its padded copies differ).

Around an attention (TransAct: ``nn.TransformerEncoder`` under an additive key mask that
is no prefix, its output max-pooled over every position and sliced to its first tokens):
:func:`follow_around_attention` lets *any* reader end the flow outside the region
(:class:`PaddedRead`), and the layout comes from the sources themselves (``rep_layout:
"sources"``): each row keeps its tokens up to the last position where some source differs
from the row's last position, then one representative for the trailing run of equal
tokens (``gemc.guard_sample.trailing_lengths``; no padding mask is assumed, so there is no
miss to fall back on: a row whose padded entries differ keeps them as real tokens). Exact
because within that run every region value is one value per row: token-wise ops commute
with it, and every attention in the region (``rep_attentions``) runs on the tokens, each
real key biased by its own mask entry and each representative key by the ``logsumexp`` of
the entries of the positions it stands for (``c`` identical keys with entries ``m_p`` weigh
``exp(s + logsumexp(m))`` in the softmax: ``backends/triton/packed_tokens.rep_key_bias``,
the jagged kernel's score bias), which is the attention on the padded values at every
position: the padded queries of a row are one query, their outputs one value, as the mask
varies by key only (:func:`_per_key_attention`); its key mask is read in the graph, not
ahead (TransAct's reads the action-type buffer), and a row keeping no key is 0 there (no
gradient), as eager's SDPA gives it. A reader outside
the region reads the value scattered the same way, i.e. eager's padded value, whatever it
does with it (an un-masked ``max`` over the positions, a slice of the first tokens).
Backward: the scatter is a gather, so each representative receives the sum of its copies'
gradients, which every token-wise op and the attention (linear in their output gradient,
identical inputs on the copies) pass on as eager's padded computation does. A causal
attention, a mask varying by query, or one zeroing the queries the mask drops (its
outputs differ by position) keeps the history padded, the warning saying why.
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

from .jagged_patterns import _CASTS, KeyMask, PaddingFlow, follow_padding
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


@dataclass(frozen=True)
class PaddedRead:
    """A reader outside a region with padding representatives around an attention: it
    reads the region value scattered back to ``[B, L, ...]``, each row's representative on
    every position it stands for, which is eager's padded value (module doc). No run-time
    check of its own (``index`` None), no packed rule: the runners scatter as for any
    reader outside a region."""

    index: None = None


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


def follow_around_attention(start: fx.Node, dims: Dims, facts: KeyMask
                            ) -> PaddingFlow | fx.Node:
    """The padding flow of a history an attention reads, for a region with padding
    representatives laid out from its sources (module doc): weighted reductions over the
    token axis stay in the region (:func:`token_reduction`), any other reader that may
    read the padding ends the flow outside it (:class:`PaddedRead`). Returns the flow, or
    a node reached as a carrier and a reader both (a layout conflict)."""
    def read(user: fx.Node, src: fx.Node, at: Dims, f: Any) -> Any:
        target = getattr(user, "target", None)
        if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            return None  # it would write into the scattered copy, not the region's value
        return token_reduction(user, src, at, f) or PaddedRead()

    flow = follow_padding(start, dims, facts, reads=read)
    if isinstance(flow, fx.Node):
        return flow
    both = [n for n in flow.reads if n in flow.carriers or n in flow.zeroed]
    return both[0] if both else flow


def outside_readers(flow: PaddingFlow) -> list[fx.Node]:
    """The :class:`PaddedRead` readers among ``flow.reads``, removed from it (they read the
    value scattered, as any reader outside a region: nothing for the check)."""
    out = [n for n, r in flow.reads.items() if isinstance(r, PaddedRead)]
    for n in out:
        del flow.reads[n]
    return out


def _per_key_attention(node: fx.Node, kind: str) -> str | None:
    """Why the attention ``node`` (a region carrier, run on the tokens over representative
    keys) cannot be, or None: it must be a key-padding attention over SDPA whose key mask
    is a ``[B, L]`` tensor (or its rows viewed: the key bias is read from it), not causal,
    not zeroing the queries its mask drops, its mask of size 1 over the queries (``[B,
    1|H, 1, L]``): otherwise a row's identical padded queries could get different
    outputs, which one representative query cannot stand for."""
    facts = node.meta.get(ir.KERNEL) or {}
    if kind != "key_padding_attention" or node.target is not \
            aten.scaled_dot_product_attention.default:
        return f"{node.name} is a {kind} kernel (no rule for its padded queries)"
    key_mask = next((n for n in node.graph.nodes if n.name == facts.get("mask")), None)
    rows = tuple(ir.shape_of(key_mask) or ()) if key_mask is not None else ()
    if len(rows) < 2 or any(int(d) != 1 for d in rows[1:-1]) or facts.get("merged_heads"):
        return (f"{node.name}'s key mask is no [B, L] (or [B, 1, ..., 1, L]) tensor the "
                "representatives' key bias can be read from")
    args = list(node.args) + [None] * (7 - len(node.args))
    mask = args[3] if args[3] is not None else node.kwargs.get("attn_mask")
    causal = args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    if facts.get("causal") or causal:
        return f"{node.name} is causal (each padded query sees other keys)"
    if facts.get("zero_padding_queries"):
        return f"{node.name} zeroes the queries its mask drops (padded queries differ)"
    if isinstance(mask, fx.Node):
        shape = tuple(ir.shape_of(mask) or ())
        if len(shape) < 2 or shape[-2] != 1:
            return (f"{node.name}'s mask {mask.name} is {list(shape)}: it varies by query "
                    "(a key mask [B, 1|H, 1, L] is needed)")
    return None


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


def _token_wise_origin(gm: fx.GraphModule, x: fx.Node) -> fx.Node | None:
    """A ``[B, L, ...]`` value the check can compute from the batch of which ``x`` is a
    token-wise function (a row lookup ``table[ids]`` in a parameter or buffer, an
    elementwise op whose other operands are constant over both token dims), or None.
    Why exact: ``x``'s tokens at two positions of a row are equal where that value's are."""
    seen = 0
    while x is not None and seen < 16:
        seen += 1
        if why_not_ahead(gm, x.name, {}) is None:
            return x
        shape = tuple(ir.shape_of(x) or ())
        if x.op != "call_function" or len(shape) < 2:
            return None
        inner: fx.Node | None = None
        if x.target is aten.index.Tensor and isinstance(x.args[0], fx.Node) \
                and ir.PARAM in x.args[0].meta and len(x.args[1]) == 1 \
                and isinstance(x.args[1][0], fx.Node) \
                and tuple(ir.shape_of(x.args[1][0]) or ())[:2] == shape[:2]:
            inner = x.args[1][0]
        elif elementwise(x):
            varying = [a for a in x.all_input_nodes
                       if not (_constant_over(a, 0 - (len(shape) - len(ir.shape_of(a) or ())))
                               and _constant_over(a, 1 - (len(shape)
                                                          - len(ir.shape_of(a) or ()))))]
            if len(varying) == 1 and tuple(ir.shape_of(varying[0]) or ())[:2] == shape[:2]:
                inner = varying[0]
        if inner is None:
            return None
        x = inner
    return None


def rep_facts(gm: fx.GraphModule, flow: PaddingFlow, key_mask: KeyMask,
              weighted: dict[fx.Node, TokenReduction], around: bool = False
              ) -> dict[str, Any] | str:
    """The region entry's facts for padding representatives over ``flow`` (``pad_rep``,
    the ``rep_sources`` its check compares, the ``weighted`` reductions), or why the
    padded tokens of a row may differ (condition (b) of the module doc fails). ``around``:
    the flow of a history an attention reads (:func:`follow_around_attention`): its
    key-padding attentions run on the tokens over representative keys (``rep_attentions``:
    ``packed_tokens.rep_attention``) and the layout
    comes from the sources (``rep_layout: "sources"``)."""
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
        if blocked is not None and around:
            # a token-wise function of a checkable value (TransAct's ids looked up in a
            # buffer, ``lookup[types + 1]``): equal inputs give equal tokens, so the
            # check compares that value instead
            inner = _token_wise_origin(gm, x)
            if inner is not None:
                x, blocked = inner, None
        if blocked is not None:
            return (f"{x.name} varies along the token axis of {where.name} and cannot be "
                    f"checked from the batch ({blocked.replace('its mask ', '')})")
        if x.name not in sources:
            sources.append(x.name)
        return None

    attentions: list[str] = []
    for node, dims in flow.carriers.items():
        kind = str((node.meta.get(ir.KERNEL) or {}).get("kind") or "")
        if "attention" in kind:
            if not around:
                return f"{node.name} is a {kind} kernel (it would count the " \
                    "representative as a real key)"
            why = _per_key_attention(node, kind)
            if why is not None:
                return why
            attentions.append(node.name)
            continue  # its other operands (the mask) enter it as they are: padded
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
    facts = {"pad_rep": True,
             "rep_sources": sorted(sources, key=lambda name: order[by_name[name]]),
             "weighted": [weighted[n].spec(n) for n in sorted(weighted, key=order.__getitem__)]}
    if around:
        # the layout from the sources' trailing runs; the attentions on the tokens with
        # the representatives' key bias, not in place by the region's mask (there is no
        # region mask: no prefix or empty-row rule to check)
        # the check reads the sources only: its "mask" is the first of them (what the
        # runners compute ahead of the graph); the attention's own mask stays its own
        facts.update({"rep_layout": "sources", "rep_attentions": attentions,
                      "mask": facts["rep_sources"][0], "additive": False,
                      "key_mask": key_mask.node.name,
                      "in_place": [], "compact": False, "every_row": False})
    return facts
