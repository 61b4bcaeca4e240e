"""match-softmax-attention: softmax attention written out as matmuls -> the guarded
key-padding attention.

Why: not every attention reaches the graph as SDPA. ``nn.MultiheadAttention`` called with
its default ``need_weights=True`` (what most user code does, the weights then discarded)
exports as ``baddbmm(mask, q * scale, k^T) -> softmax -> bmm(., v)`` over ``[B*H, L, d]``,
and many models write ``softmax(q @ k^T / sqrt(d) + mask) @ v`` by hand. Padded, both spend
their time on padding keys like padded SDPA does; recognised, they run as
``key_padding_attention`` (the same op and run-time guard as
``match-jagged-attention``'s, see ``backends/triton/key_padding_attention``).

The pattern, by what each op computes::

    s = matmul/bmm(q [* c], k^T)  or  baddbmm(mask, q [* c], k^T)   # [B, H, L, L] / [B*H, L, L]
    s = s * c | s / c                          # optional scale
    s = s + mask | masked_fill(s, ~keep, -inf) # the key-padding mask, if not in baddbmm
    out = matmul/bmm(softmax(s, -1), v)

with the mask a key-padding mask broadcast over heads and queries (bool or additive, from
any source, as :func:`.jagged_patterns.attention_key_mask` reads it). The keys may come
transposed by a ``permute`` rather than a ``transpose`` (RecBole's ``MultiHeadAttention``:
``key.view(B, L, H, d).permute(0, 2, 3, 1)``, with no ``[B, H, L, d]`` node of the keys):
the pass then writes them as ``x.permute(0, 2, 1, 3)`` and the scores read its transpose,
the same values (:func:`_key_node`).

Causal: only RecBole's SASRec mask, ``where(tril(keep[:, None, None, :].expand(-1, -1, L,
-1)), 0.0, -10000.0)`` (:func:`.jagged_patterns.causal_keep_drop`, whose docstring gives
the exactness argument): the causal kernel over the boolean keep-mask, its padding query
rows unread (else ``padding-rows-read-by:<node>``) and its fallback that very formula (the
entry's ``finite_drop``). A stack of such layers is matched from its last layer back: a
layer's padding rows reach the next layer's formula, clean only once that one is the kernel
(the pass sweeps again while it matches more).

A causal softmax written out over ``-inf`` (the causal mask recognised by its values,
:mod:`.causal_masks`, whatever its spelling): ``s.masked_fill(~causal, -inf)
.masked_fill(~keep, -inf)`` (either order), ``(s + generate_square_subsequent_mask(L))
.masked_fill(~keep, -inf)``, one operand holding both (``masked_fill(~(keep & tril),
-inf)``, ``s + (keys + causal)``), ``nn.MultiheadAttention``'s default
``need_weights=True`` with a causal ``attn_mask`` (its merged ``[B*H, L, L]`` mask: the
causal ``[1, L, L]`` plus the ``[B*H, 1, L]`` keys): the guarded causal attention, the
entry marked ``nan_if_unseen`` with ``causal_added`` (how the causal mask is applied:
added, or filled). Why a mark: eager's softmax is NaN on each query row that sees no kept
key. Over a prefix (right-padded) mask those are the rows that keep none (every query
sees key 0 otherwise), the op's ``nan_where_no_key`` on the jagged path; over any other
mask (a front-padded history) the queries ahead of each row's first kept key as well,
which only the padded formula gives: the op takes it there, counted, with the causal
mask applied as the model applies it (an add passes the NaN score gradient back to q and
k, a fill does not), and a packed region holding it packs only over a prefix with a key
on every row (``every_row``, never ``compact``). The NaN reaches the loss through a
masked multiply and, through the softmax backward, the gradients. A merged output's
padding query rows are followed here (the kernel leaves them zero), as a 4-D one's.
Refused, named ``causal-softmax-formula``: a finite causal drop or key fill next to a
``-inf`` term (a query with no kept key then attends over other keys), one fill of a
combined drop mask (``masked_fill(triu(ones, 1) | ~keep, -inf)``), two causal terms; a
causal one whose padding query rows something reads: ``padding-rows-read-by:<node>``.

``[B*H, L, d]`` operands (heads merged into the batch, as MultiheadAttention does) are
viewed as ``[B, H, L, d]``; unless causal their padding query rows are computed too (the
varlen-key kernel: the layout of a merged output is not followed), as are those of a 4-D attention whose padding
rows something reads; a reader of one token per row (``x[arange(B), lengths - 1]``) is
checked at run time instead (``read_rows``, as ``match-jagged-attention``'s). What reads the
scores or the weights must be dead code (the discarded
``need_weights`` average), which the pass removes.

A dropout of the weights that draws nothing (``p = 0``: ``nn.Dropout(0.0)`` stays in the
graph as ``dropout(w, 0.0, True)``) is the identity and part of the match.

Reasons it leaves one padded (in the dump as ``softmax_skipped=`` and in the warnings):
``dropout`` (one that draws), ``no-key-padding-mask``, ``weights-read-by:<node>``, the mask's own reasons.

Every match is priced against the model's own attention first (``attention_choice``: one
rule for the three attention match passes): where gemc's kernel is priced slower (its work
at the fill, plus the host time a guarded call's sync exposes) the model's stays, named
``kept-padded: ...`` with both prices; ``GEMC_ATTENTION_KERNEL`` forces either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import ir
from gemc.context import PassContext
from gemc.packed_rules import draws

from .attention_choice import choose
from .causal_masks import additive_causal, causal_form
from .jagged_patterns import PaddingFlow, attention_key_mask, causal_keep_drop
from .row_reads import follow_with_reads, read_specs

aten = torch.ops.aten
SKIPPED = ir.PREFIX + "softmax_skipped"
_MM = {aten.matmul.default, aten.bmm.default}
_SOFTMAX = {aten.softmax.int, aten._softmax.default}
_CAUSAL_FORMULA = "causal-softmax-formula"
_NOTS = {aten.bitwise_not.default, aten.logical_not.default}
_COMBINE = {aten.bitwise_or.Tensor, aten.logical_or.default, aten.__or__.Tensor,
            aten.bitwise_and.Tensor, aten.logical_and.default, aten.__and__.Tensor,
            aten.add.Tensor}
_READ_BY = "padding-rows-read-by:"  # a causal formula's refusal, tried again (see run)
_TRANSPOSED = {(-1, -2), (-2, -1), (1, 2), (2, 1), (2, 3), (3, 2), (-1, 1), (1, -1),
               (-1, 2), (2, -1), (-2, 1), (1, -2), (3, -2), (-2, 3)}


def _scalar(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _dead(node: fx.Node) -> bool:
    """Nothing the graph returns depends on ``node`` (its users, recursively, are unused)."""
    return node.op != "output" and all(_dead(u) for u in node.users)


def _over_keys(softmax: fx.Node) -> bool:
    """The softmax normalises over the scores' last dim, the keys (dim 2 is that of merged
    ``[B*H, L, L]`` scores, but the queries of ``[B, H, L, L]`` ones: a column softmax)."""
    dim, rank = softmax.args[1], len(ir.shape_of(softmax) or ())
    return isinstance(dim, int) and rank > 0 and dim % rank == rank - 1


def _term(node: Any, length: int) -> tuple[str, Any, Any, float] | None:
    """One mask term applied to the scores at ``node``: ``("fill", scores, dropped,
    value)`` for ``masked_fill(scores, dropped, value)`` with ``value <= -1e4``, ``("add",
    scores, mask, 0.0)`` for ``scores + mask`` (the scores: the operand of the add's own
    shape, else the one a matmul / scale made), or None."""
    if not isinstance(node, fx.Node):
        return None
    if node.target is aten.masked_fill.Scalar:
        value = _scalar(node.args[2])
        return None if value is None or value > -1e4 else ("fill", *node.args[:2], value)
    if node.target in (aten.where.self, aten.where.ScalarOther):
        return _where_term(node, length)
    if node.target is not aten.add.Tensor or not all(isinstance(a, fx.Node)
                                                      for a in node.args[:2]):
        return None
    a, b = node.args[:2]
    shape = tuple(ir.shape_of(node) or ())
    full = [x for x in (a, b) if tuple(ir.shape_of(x) or ()) == shape]
    if len(full) == 1:
        s = full[0]
    else:
        s = a if a.target in _MM | {aten.mul.Tensor, aten.div.Tensor} else b
    return "add", s, b if s is a else a, 0.0


def _where_value(x: Any) -> float | None:
    """The one value of ``where``'s other operand: a number, or a tensor made of one
    (``full_like(s, v)``, ``full(shape, v)``, ``scalar_tensor(v)``, ``ones_like(s) * v``:
    DIN's ``paddings``)."""
    if isinstance(x, (int, float)):
        return float(x)
    if not isinstance(x, fx.Node) or x.op != "call_function":
        return None
    if x.target in (aten.full_like.default, aten.full.default):
        return _scalar(x.args[1])
    if x.target is aten.scalar_tensor.default:
        return _scalar(x.args[0])
    if x.target is aten.mul.Tensor and isinstance(x.args[0], fx.Node) \
            and x.args[0].target is aten.ones_like.default:
        return _scalar(x.args[1])
    return None


def _filler_nodes(x: Any) -> list[fx.Node]:
    """The nodes that make ``where``'s one-value operand (:func:`_where_value`), which read
    the scores' shape and not their values (``full_like(s, v)``, ``ones_like(s) * v``)."""
    if not isinstance(x, fx.Node):
        return []
    if x.target is aten.mul.Tensor:
        return [x, x.args[0]]
    return [x]


def _where_term(node: fx.Node, length: int) -> tuple[str, Any, Any, float] | None:
    """``where(keep, scores, v)`` with ``v <= -1e4`` (TensorFlow's idiom, DIN's
    ``tf.where(key_masks, outputs, paddings)`` as ported): the term ``masked_fill(scores,
    ~keep, v)`` is, as ``("keep-fill", scores, keep, v)``. A causal condition is left to the
    forms this pass reads (None)."""
    cond, scores, other = node.args[:3]
    value = _where_value(other)
    if value is None or value > -1e4 or not isinstance(scores, fx.Node) \
            or tuple(ir.shape_of(scores) or ()) != tuple(ir.shape_of(node) or ()) \
            or _causal_term(cond, length):
        return None
    return "keep-fill", scores, cond, value


def _causal_inf(term: tuple[str, Any, Any, float], length: int) -> bool | None:
    """Whether a mask term is the causal mask applied with ``-inf`` (True: the future keys'
    scores become ``-inf``, by ``masked_fill(~tril, -inf)`` or ``+ triu(-inf, 1)``), a
    causal mask applied another way (False: a finite drop, or combined with the keys in
    one operand), or no causal mask (None)."""
    kind, _, mask, value = term
    if kind == "add":
        inf = additive_causal(mask, length)
        return inf if inf is not None else (False if _causal_term(mask, length) else None)
    inner = mask.args[0] if isinstance(mask, fx.Node) and mask.target in _NOTS else None
    if causal_form(mask, length) == "drop" or causal_form(inner, length) == "keep":
        return value == -math.inf
    return False if _causal_term(mask, length) else None


def _scores(node: Any) -> tuple[fx.Node, fx.Node, float, Any, list[fx.Node], float | None,
                                bool | None] | str | None:
    """``(q, k, scale, mask or None, nodes, fill, causal_added)`` of the scores before the
    softmax; ``fill``: the finite value of ``masked_fill(~keep, fill)`` (None for ``-inf``
    or an added mask), which a row that keeps no key has on every score;
    ``causal_added``: None without a causal term of its own, else how the model applies
    its ``-inf`` causal mask (True: added, False: ``masked_fill``), the other term then
    being the key mask (either order)."""
    nodes: list[fx.Node] = []
    scale, mask, fill, causal_added = 1.0, None, None, None
    if not isinstance(node, fx.Node):
        return None
    length = int((ir.shape_of(node) or (0,))[-1])
    terms: list[tuple[str, Any, Any, float]] = []
    while len(terms) < 2 and (term := _term(node, length)) is not None:
        terms.append(term)
        nodes.append(node)
        if term[0] == "keep-fill":  # where's filler reads the scores' shape only: a member
            nodes.extend(_filler_nodes(node.args[2]))
        node = term[1]
    if len(terms) == 2 and _term(node, length) is not None:
        return None  # a third mask term: no pattern of this pass
    causal = [_causal_inf(t, length) for t in terms]
    if len(terms) == 2:
        # the causal mask and the key mask applied one after the other: a causal formula,
        # by what the terms are, not how they are spelled
        if causal.count(True) != 1 or any(c is False for c in causal):
            if any(c is not None for c in causal):
                return _CAUSAL_FORMULA  # a finite causal drop, or two causal terms
            kind, _, outer, _ = terms[0]
            dropped_as_is = kind == "fill" and not (isinstance(outer, fx.Node)
                                                    and outer.target in _NOTS)
            return "mask-not-key-padding" if dropped_as_is else None
        at = causal.index(True)
        causal_added = terms[at][0] == "add"
        terms = [terms[1 - at]]
    elif terms and causal[0] is not None:
        # a causal mask alone (no key mask), or combined with the keys in one operand:
        # the latter is read below (attention_key_mask); the former has no key mask
        if terms[0][0] == "fill" and (terms[0][2].target not in _NOTS
                                      if isinstance(terms[0][2], fx.Node) else True):
            return _CAUSAL_FORMULA
    if terms:
        kind, _, term_mask, value = terms[0]
        if kind == "keep-fill":  # where(keep, scores, value): the kept keys themselves
            fill = value if math.isfinite(value) else None
            mask = term_mask
        elif kind == "fill":
            fill = value if math.isfinite(value) else None
            inner = term_mask.args[0] if isinstance(term_mask, fx.Node) \
                and term_mask.target in _NOTS else None
            if inner is None:
                return "mask-not-key-padding"
            mask = inner
        else:
            mask = term_mask
        if causal_added is not None and fill is not None:
            return _CAUSAL_FORMULA  # a finite key fill under a -inf causal mask
    if isinstance(node, fx.Node) and node.target in (aten.mul.Tensor, aten.div.Tensor) \
            and _scalar(node.args[1]):
        c = float(node.args[1])
        scale = c if node.target is aten.mul.Tensor else 1.0 / c
        nodes.append(node)
        node = node.args[0]
    if not isinstance(node, fx.Node):
        return None
    if node.target is aten.baddbmm.default:
        if mask is not None or node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 \
                or len(node.args) > 3:
            return None
        mask, q, kt = node.args[:3]
    elif node.target in _MM:
        q, kt = node.args[:2]
    else:
        return None
    nodes.append(node)
    if isinstance(q, fx.Node) and q.target is aten.mul.Tensor and _scalar(q.args[1]):
        scale *= float(q.args[1])
        nodes.append(q)
        q = q.args[0]
    if isinstance(kt, fx.Node) and kt.target is aten.permute.default:
        # RecBole's key: view(B, L, H, d).permute(0, 2, 3, 1), the transposed keys with no
        # [B, H, L, d] node of their own: the keys are that permute with its last two dims
        # swapped back (made a node by the pass, :func:`_key_node`)
        perm = [int(d) % len(kt.args[1]) for d in kt.args[1]]
        if len(perm) < 3:
            return None
        return (q, (kt, kt.args[0], [*perm[:-2], perm[-1], perm[-2]]), scale, mask, nodes,
                fill, causal_added)
    if not (isinstance(kt, fx.Node) and kt.target is aten.transpose.int
            and tuple(kt.args[1:3]) in _TRANSPOSED):
        return None
    return q, kt.args[0], scale, mask, nodes, fill, causal_added


def _causal_term(node: Any, length: int) -> bool:
    """``node``, a mask a written-out softmax applies, holds the causal mask: by its values
    (:mod:`.causal_masks`), itself or one operand of an ``|`` / ``&`` / ``+`` combining it
    with a key mask (``triu(ones, 1) | ~keep``, ``keep & tril``, ``causal + keys``)."""
    if not isinstance(node, fx.Node):
        return False
    if causal_form(node, length) is not None:
        return True
    combined = node.op == "call_function" and node.target in _COMBINE
    return combined and any(isinstance(a, fx.Node) and causal_form(a, length) is not None
                            for a in node.args[:2])


def _key_shape(k: Any) -> tuple[int, ...]:
    """The shape of the keys: a node's, or that of ``(kt, x, perm)``: ``x`` permuted."""
    if isinstance(k, fx.Node):
        return tuple(ir.shape_of(k) or ())
    shape = tuple(ir.shape_of(k[1]) or ())
    return tuple(shape[d] for d in k[2]) if len(shape) == len(k[2]) else ()


def _key_node(gm: fx.GraphModule, scores: fx.Node, k: tuple[fx.Node, fx.Node, list[int]]
              ) -> fx.Node:
    """The keys as a node: ``k = x.permute(perm)`` and the score matmul reading
    ``k.transpose(-2, -1)``, the same values as the model's ``x.permute(perm')`` (``perm``
    with its last two dims swapped), which is erased where nothing else reads it. Both new
    nodes are views, annotated as the permute they replace (provenance: this pass)."""
    kt, x, perm = k
    with gm.graph.inserting_before(kt):
        key = gm.graph.call_function(aten.permute.default, (x, perm))
        transposed = gm.graph.call_function(aten.transpose.int, (key, -2, -1))
    where = f"{MatchSoftmaxAttention.name}: {kt.meta.get(ir.REGION, '')}"
    for node, val in ((key, x.meta["val"].permute(perm)), (transposed, kt.meta["val"])):
        node.meta.update({k: v for k, v in kt.meta.items() if k != "val"})
        node.meta.update({"val": val, ir.PROVENANCE: where})
    scores.replace_input_with(kt, transposed)
    if not kt.users:
        gm.graph.erase_node(kt)
    return key


def match(node: fx.Node) -> dict[str, Any] | str | None:
    """Facts of an attention output ``mm(softmax(scores), v)``, a named reason, or None."""
    if node.target not in _MM:
        return None
    p, v = node.args[:2]
    identity: list[fx.Node] = []
    if isinstance(p, fx.Node) and p.target is aten.dropout.default and not draws(p):
        # a dropout that draws nothing (p = 0, as HF configs set it for fine-tuning, or not
        # training) is its input: the weights pass through unchanged
        identity, p = [p], p.args[0]
    if isinstance(p, fx.Node) and p.target in (aten.dropout.default, aten.native_dropout.default):
        # attention dropout (of softmax weights); any other matmul after a dropout is no
        # attention at all and gets no reason (nor a warning)
        weights = p.args[0]
        return "dropout" if isinstance(weights, fx.Node) and weights.target in _SOFTMAX \
            else None
    if not (isinstance(p, fx.Node) and p.target in _SOFTMAX and _over_keys(p)):
        return None
    if len(p.args) > 2 and p.args[2] not in (False, None) and p.target is aten._softmax.default:
        return None
    found = _scores(p.args[0])
    if found is None or isinstance(found, str):
        return found
    q, k, scale, mask, nodes, fill, causal_added = found
    shapes = [tuple(ir.shape_of(q) or ()), _key_shape(k), tuple(ir.shape_of(v) or ())]
    if shapes[1] != shapes[2] or len(shapes[0]) != len(shapes[1]) \
            or shapes[0][:-2] != shapes[1][:-2] or shapes[0][-1] != shapes[1][-1]:
        return "qkv-shapes"
    if mask is None:
        return "no-key-padding-mask"
    if len(shapes[1]) == 4:
        batch, heads, length = shapes[1][:3]
        merged = False
    elif len(shapes[1]) == 3:
        # [B*H, 1, L] (MultiheadAttention's merged mask): B from the mask's source
        heads, merged = 0, True
        length = shapes[1][1]
        merge = _merged_causal(mask, length)
        if isinstance(merge, str):
            return merge
        if merge is not None:  # MultiheadAttention's causal attn_mask + key mask
            mask, causal_added = merge, True
        mshape = tuple(ir.shape_of(mask) or ())
        if len(mshape) != 3 or mshape[1] != 1 or mshape[2] != length:
            return "mask-shape"
        batch = _batch_of(mask, length)
        if batch is None or shapes[1][0] % batch:
            return "mask-not-key-padding"
        heads = shapes[1][0] // batch
    else:
        return "not-3d-or-4d"
    key = attention_key_mask(mask if not merged else _as4d(mask, batch, heads, length),
                             batch, length, finite_drop=not merged)
    if isinstance(key, str):
        return key
    key_mask, causal = key
    dropped = causal_keep_drop(mask, batch, length) if not merged else None
    if causal and dropped is None:
        if causal_added is not None or fill is not None:
            return _CAUSAL_FORMULA  # two causal terms, or a finite key fill: see the doc
        # the key mask and the causal one in one operand: the causal mask applied as the
        # keys are (added to an additive mask, and-ed into a boolean one)
        causal_added = key_mask.additive
    elif dropped is not None and causal_added is not None:
        return _CAUSAL_FORMULA  # a finite causal drop and a causal term besides
    causal = causal or causal_added is not None
    group = [*nodes, p, *identity, node]
    inside = set(group)
    for n in group[:-1]:
        for u in n.users:
            if u not in inside and not _dead(u):
                return f"weights-read-by:{u.name}"
    queries = shapes[0][-2]
    # a merged [B*H, L, d] output's padding rows are followed only for a causal
    # attention (which needs them zero: no kernel computes a causal padding query row)
    zero_rows = queries == length and (not merged or causal)
    flow = follow_with_reads(node, (0, 1) if merged else (0, 2), key_mask) \
        if zero_rows else None
    reader = flow if isinstance(flow, fx.Node) else None
    reads = read_specs(flow) if isinstance(flow, PaddingFlow) else []
    if causal and not (zero_rows and reader is None):
        # the causal kernel leaves padding query rows zero; eager's rows with no kept key
        # attend over every key (causal_keep_drop): only unread rows may differ
        return f"{_READ_BY}{reader.name if reader is not None else 'cross-attention'}"
    return {
        "_group": group,
        "_mask": key_mask,
        "_key": k if not isinstance(k, fx.Node) else None,
        "q": q.name, "k": k.name if isinstance(k, fx.Node) else None, "v": v.name,
        "output": node.name,
        "mask": key_mask.node.name,
        "additive": key_mask.additive,
        "causal": causal,
        "zero_padding_queries": zero_rows and reader is None,
        # softmax over all -inf, written out: NaN (SDPA: 0); a finite drop is never NaN
        "nan_if_empty": dropped is None and fill is None,
        # a causal softmax written out over -inf: NaN on each query row that sees no kept
        # key, not only on a row that keeps none (a front-padded history's leading
        # queries): exact on the kernels only over a prefix mask (the op's padded path,
        # the formula with the causal mask applied as the model does, otherwise)
        **({"nan_if_unseen": True, "causal_added": causal_added}
           if causal and dropped is None else {}),
        # masked_fill(~keep, fill) with a finite fill: a row keeping no key has that one
        # value on every score, so eager attends uniformly over all L keys (the op's
        # uniform_where_no_key; its padded path fills with it)
        **({"fill_value": fill} if fill is not None else {}),
        # the drop of where(keep & causal, 0, v): the op's fallback rebuilds that mask
        **({"finite_drop": dropped[1]} if dropped is not None else {}),
        "merged_heads": merged,
        "queries": int(queries),
        "max_len": int(length), "heads": int(heads), "head_dim": int(shapes[1][-1]),
        "scale": scale,
        "fill": 1.0,
        **({"padding_rows_read_by": reader.name} if reader is not None else {}),
        # readers of one token per row: checked by the op with the mask (see there)
        **({"read_rows": reads} if reads else {}),
    }


def _merged_causal(mask: Any, length: int) -> fx.Node | str | None:
    """The key term of ``nn.MultiheadAttention``'s merged ``[B*H, L, L]`` mask, its causal
    ``attn_mask`` plus the ``[B*H, 1, L]`` keys (both ``-inf`` / 0 after
    ``F._canonical_mask``); None where the mask holds no causal mask; the named reason
    where it holds one this pass does not cover (a finite causal drop, another
    combination)."""
    shape = tuple(ir.shape_of(mask) or ())
    if len(shape) != 3 or shape[1:] != (length, length):
        return None
    if isinstance(mask, fx.Node) and mask.target is aten.add.Tensor:
        for c, other in (mask.args[:2], mask.args[1::-1]):
            inf = additive_causal(c, length)
            if inf is not None:
                return other if inf and isinstance(other, fx.Node) else _CAUSAL_FORMULA
    return _CAUSAL_FORMULA if _causal_term(mask, length) else None


def _batch_of(mask: fx.Node, length: int) -> int | None:
    """B of a merged ``[B*H, 1, L]`` mask: the first ``[B, L]`` tensor up its views."""
    node: Any = mask
    while isinstance(node, fx.Node):
        shape = tuple(ir.shape_of(node) or ())
        if len(shape) == 2 and shape[1] == length:
            return int(shape[0])
        if node.op != "call_function" or not node.args:
            return None
        node = node.args[0]
    return None


def _as4d(mask: fx.Node, batch: int, heads: int, length: int) -> Any:
    """The merged ``[B*H, 1, L]`` mask as an fx node whose recorded shape is 4-D: the
    ``[B, H, 1, L]`` view it was reshaped from, when it was (MultiheadAttention's)."""
    node: Any = mask
    while isinstance(node, fx.Node) and node.op == "call_function" and node.args:
        if tuple(ir.shape_of(node) or ()) in ((batch, heads, 1, length), (batch, 1, 1, length)):
            return node
        node = node.args[0]
    return mask


@dataclass(frozen=True)
class MatchSoftmaxAttention:
    """Groups each matched formula with ``gemc.kernel`` (kind ``key_padding_attention``,
    q/k/v/output named) on its output matmul; removes the dead reads of its weights."""

    name: ClassVar[str] = "match-softmax-attention"
    requires: ClassVar[tuple[str, ...]] = ("classify-ops",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        count = 0
        pending = [n for n in gm.graph.nodes if n.op == "call_function"]
        final: list[tuple[fx.Node, str]] = []  # refusals no later sweep retries
        while pending:
            # a causal layer whose padding rows reach the next layer's formula, not yet
            # matched, is tried again once a sweep matched more (the next layer's kernel
            # then keeps them unread): the stack matches from its last layer back
            refused: list[tuple[fx.Node, str]] = []
            before = count
            for node in pending:
                if ir.GROUP in node.meta:
                    continue
                found = match(node)
                if found is None:
                    continue
                if isinstance(found, str):
                    refused.append((node, found))
                    continue
                count += self._apply(gm, node, found, count, ctx)
            retry = [n for n, why in refused if why.startswith(_READ_BY)]
            if count == before or not retry:
                final += refused
                break
            final += [(n, why) for n, why in refused if not why.startswith(_READ_BY)]
            pending = retry
        for node, why in final:
            node.meta[SKIPPED] = why
            ctx.warn(f"match-softmax-attention: {node.name} stays padded ({why})")
        return PassResult(gm, count > 0)

    def _apply(self, gm: fx.GraphModule, node: fx.Node, found: dict[str, Any], count: int,
               ctx: PassContext) -> int:
        """Group one matched formula as kernel number ``count``; 1 if it did, else 0
        (also where the priced choice keeps the formula: ``attention_choice``)."""
        group: list[fx.Node] = found.pop("_group")
        found.pop("_mask")
        key = found.pop("_key")
        if any(ir.GROUP in n.meta for n in group):
            return 0
        kept = choose(gm, node, group, found, "key_padding_attention", ctx, skip_key=SKIPPED,
                      warning="match-softmax-attention: {node} stays padded ({why})")
        if kept is not None:
            node.meta[SKIPPED] = kept
            ctx.warn(f"match-softmax-attention: {node.name} stays padded ({kept})")
            return 0
        if key is not None:  # RecBole's permuted keys: a [B, H, L, d] node for them
            found["k"] = _key_node(gm, next(n for n in group if n.target in _MM
                                            and key[0] in n.args), key).name
        self._drop_dead_reads(gm, group)
        gid = f"softmax_attention_{count}"
        for n in group:
            n.meta[ir.GROUP] = gid
        # the fill of a data mask is unknown at compile time: no saving claimed
        before = sum(float(n.meta.get(ir.PREDICTED_MS) or 0.0) for n in group)
        node.meta[ir.KERNEL] = {"id": gid, "kind": "key_padding_attention", **found,
                                "before_ms": round(before, 6),
                                "after_ms": round(before, 6)}
        return 1

    @staticmethod
    def _drop_dead_reads(gm: fx.GraphModule, group: list[fx.Node]) -> None:
        """Erase the dead code hanging off the group's intermediates (users first)."""
        inside = set(group)
        stack = [u for n in group[:-1] for u in n.users if u not in inside]
        dead: set[fx.Node] = set()
        while stack:
            n = stack.pop()
            if n not in dead:
                dead.add(n)
                stack.extend(n.users)
        while dead:  # users before producers
            leaf = next(n for n in dead if not n.users)
            gm.graph.erase_node(leaf)
            dead.discard(leaf)
