"""Graph patterns of jagged sequences: key-padding masks, jagged->padded conversions, and
where padding rows of an attention output are read.

Not a pass: the recognisers ``match-jagged-attention`` uses. The last one,
:func:`padding_rows_read_by`, is what makes the substitution safe: jagged attention leaves
the output rows of padding queries (positions at or past a row's length) zero, where the
model computed attention over the valid keys. That is only invisible if nothing reads
those rows unmasked, which the function checks by following them through the graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from gemc import ir
from gemc.fusion_spec import elementwise
from gemc.guard_sample import ADDITIVE_MASKED_GAP

from . import causal_masks
from .causal_masks import is_causal_drop, is_causal_keep

aten = torch.ops.aten
_VIEWS = {
    aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten.expand.default,
    aten._unsafe_view.default, aten.squeeze.dim, aten.permute.default, aten.transpose.int,
    aten.unbind.int, aten.select.int, aten.alias.default, aten.clone.default,
    aten.split.Tensor, aten.chunk.default,
}


def _is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "getitem"


def through_views(node: Any) -> Any:
    """The first non-view producer of ``node`` (getitem/unbind/permute/... skipped)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and (
        node.target in _VIEWS or _is_getitem(node)
    ):
        node = node.args[0]
    return node


def _arange_len(node: Any) -> int | None:
    node = through_views(node)
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is aten.arange.default:
        return int(node.args[0])
    if node.target is aten.arange.start and int(node.args[0]) == 0:
        return int(node.args[1])
    return None


def _offsets_of_diff(node: Any) -> fx.Node | None:
    """``offsets`` when ``node`` is ``offsets[1:] - offsets[:-1]``."""
    if not (isinstance(node, fx.Node) and node.target is aten.sub.Tensor):
        return None
    hi, lo = node.args[0], node.args[1]
    if not all(isinstance(x, fx.Node) and x.target is aten.slice.Tensor for x in (hi, lo)):
        return None
    if hi.args[0] is not lo.args[0]:
        return None
    hi_args = list(hi.args) + [0, None, None][len(hi.args) - 1:]
    lo_args = list(lo.args) + [0, None, None][len(lo.args) - 1:]
    if hi_args[1] != 0 or lo_args[1] != 0 or hi_args[2] != 1 or lo_args[2] not in (0, None):
        return None
    if lo_args[3] != -1:
        return None
    return hi.args[0]


def _lengths(node: Any) -> tuple[fx.Node, int] | None:
    """``(offsets, clamp_min)`` of a lengths node (possibly ``clamp(min=c)``)."""
    node = through_views(node)
    if not isinstance(node, fx.Node):
        return None
    clamp_min = 0
    if node.target in (aten.clamp.default, aten.clamp_min.default):
        lo = node.kwargs.get("min", node.args[1] if len(node.args) > 1 else None)
        hi = node.kwargs.get("max", node.args[2] if len(node.args) > 2 else None)
        if not isinstance(lo, int) or hi is not None:
            return None
        clamp_min = lo
        node = node.args[0]
    offsets = _offsets_of_diff(node)
    return (offsets, clamp_min) if offsets is not None else None


def key_padding_mask(mask: Any) -> tuple[fx.Node, int, int] | None:
    """``(offsets, clamp_min, L)`` of ``arange(L)[None, :] < lens[:, None]`` (via views)."""
    node = through_views(mask)
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is aten.lt.Tensor:
        positions, lens = node.args
    elif node.target is aten.gt.Tensor:
        lens, positions = node.args
    else:
        return None
    length = _arange_len(positions)
    found = _lengths(lens)
    if length is None or found is None:
        return None
    return found[0], found[1], length


def padded_sequences(gm: fx.GraphModule, offsets: fx.Node, length: int) -> list[fx.Node]:
    """``index_put`` nodes padding values over ``offsets`` into ``[B, length, ...]``."""
    out = []
    for node in gm.graph.nodes:
        if node.target is not aten.index_put.default:
            continue
        shape = ir.shape_of(node)
        indices = node.args[1]
        if shape is None or len(shape) < 2 or shape[1] != length or len(indices) != 2:
            continue
        row = indices[0]
        if not (isinstance(row, fx.Node) and row.target is aten.repeat_interleave.self_Tensor):
            continue
        if _offsets_of_diff(row.args[1]) is offsets:
            out.append(node)
    return out


def jagged_positions(row: Any, col: Any) -> fx.Node | None:
    """``offsets`` when ``(row, col)`` are the positions of a jagged tensor's tokens in its
    padded form: ``row = repeat_interleave(arange(B), offsets[1:] - offsets[:-1])`` and
    ``col = arange(N) - offsets[row]`` (``offsets[:-1][row]`` alike), so every ``col`` lies
    in ``[0, length of its row)``: an index by them reads real positions only."""
    row = through_views(row)
    if not (isinstance(row, fx.Node) and row.target is aten.repeat_interleave.self_Tensor):
        return None
    offsets = _offsets_of_diff(row.args[1])
    if offsets is None or _arange_len(row.args[0]) != (ir.shape_of(offsets) or (0,))[0] - 1:
        return None
    col = through_views(col)
    if not (isinstance(col, fx.Node) and col.target is aten.sub.Tensor):
        return None
    tokens, starts = col.args[:2]
    if _arange_len(tokens) != (ir.shape_of(row) or (-1,))[0]:
        return None
    if not (isinstance(starts, fx.Node) and starts.target is aten.index.Tensor
            and len(starts.args[1]) == 1 and through_views(starts.args[1][0]) is row):
        return None
    base = starts.args[0]
    if isinstance(base, fx.Node) and base.target is aten.slice.Tensor:
        args = list(base.args) + [0, None, None][len(base.args) - 1:]
        if args[1] != 0 or args[2] not in (0, None):
            return None
        base = base.args[0]
    return offsets if base is offsets else None


def jagged_flat_positions(index: Any, length: int) -> fx.Node | None:
    """``offsets`` when ``index`` is each jagged token's position in the padded rows
    flattened to ``[B * length]``: ``row * length + col`` (either order) with ``(row, col)``
    :func:`jagged_positions` of ``offsets`` (generative-recommenders' ``dense_to_jagged``
    written without FBGEMM: ``dense.reshape(B * n, ...).index_select(0, row * n + col)``).
    ``col`` lies in ``[0, length of its row)``, so an index by it reads real rows only."""
    index = through_views(index)
    if not (isinstance(index, fx.Node) and index.target is aten.add.Tensor):
        return None
    for scaled, col in (index.args[:2], index.args[1::-1]):
        if isinstance(scaled, fx.Node) and scaled.target is aten.mul.Tensor \
                and len(scaled.args) == 2 and _scalar(scaled.args[1]) == length:
            offsets = jagged_positions(scaled.args[0], col)
            if offsets is not None:
                return offsets
    return None


def zero_padded_source(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(source, offsets)`` when ``node`` (through views) is jagged values written over
    ``offsets`` into zeros, ``[B, L, ...]``: its rows at or past each length are zero.
    ``source`` is the ``index_put`` at (row, col), or the view that unflattens an
    ``index_copy`` into ``[B * L, ...]`` zeros at ``row * L + col`` (FBGEMM's
    ``jagged_to_padded_dense`` written out, generative-recommenders' layout)."""
    src = through_views(node)
    if isinstance(src, fx.Node) and src.target is aten.index_copy.default:
        return _unflattened_index_copy(node, src)
    if isinstance(src, fx.Node) and fbgemm_op(src) == "jagged_to_padded_dense":
        return _fbgemm_padded(src)
    if not (isinstance(src, fx.Node) and src.target is aten.index_put.default):
        return None
    accumulate = src.kwargs.get("accumulate", src.args[3] if len(src.args) > 3 else False)
    indices = src.args[1]
    if accumulate or len(indices) != 2 or not _is_zeros(src.args[0]):
        return None
    offsets = jagged_positions(*indices)
    return (src, offsets) if offsets is not None else None


def fbgemm_op(node: fx.Node) -> str | None:
    """The name of an FBGEMM op (``torch.ops.fbgemm.NAME``), or None: generative-recommenders
    and TorchRec pad and unpad jagged values with these rather than ATen indexing. Matched by
    the op's namespace and name, so FBGEMM need not be importable here."""
    target = node.target if node.op == "call_function" else None
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "fbgemm":
        return target.overloadpacket.__name__
    return None


def _fbgemm_padded(pad: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """:func:`zero_padded_source` of ``fbgemm.jagged_to_padded_dense(values, [offsets],
    [L], padding_value)``: one jagged dim padded with zeros to ``[B, L, ...]``."""
    values, offsets_list, max_lengths = pad.args[:3]
    padding = pad.args[3] if len(pad.args) > 3 else pad.kwargs.get("padding_value", 0.0)
    shape = tuple(ir.shape_of(pad) or ())
    if not (isinstance(offsets_list, (list, tuple)) and len(offsets_list) == 1
            and isinstance(max_lengths, (list, tuple)) and len(max_lengths) == 1
            and isinstance(padding, (int, float)) and padding == 0 and len(shape) >= 2
            and shape[1] == max_lengths[0] and isinstance(values, fx.Node)):
        return None
    offsets = offsets_list[0]
    if not isinstance(offsets, fx.Node) or (ir.shape_of(offsets) or (0,))[0] != shape[0] + 1:
        return None
    return pad, offsets


def _unflattened_index_copy(node: fx.Node, copy: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """:func:`zero_padded_source` of an ``index_copy(zeros[B * L, ...], 0, row * L + col,
    values)``: the first view between it and ``node`` that splits its rows into
    ``[B, L, ...]``, and the offsets of the positions."""
    base, dim, index = copy.args[:3]
    flat = tuple(ir.shape_of(copy) or ())
    if not flat or _norm(int(dim), len(flat)) != 0 or not _is_zeros(base):
        return None
    chain = []
    at = node
    while at is not copy:
        chain.append(at)
        at = at.args[0]
    for view in reversed(chain):  # the nearest to the copy first
        shape = tuple(ir.shape_of(view) or ())
        if len(shape) >= 2 and shape[0] * shape[1] == flat[0] and shape[2:] == flat[1:]:
            offsets = jagged_flat_positions(index, shape[1])
            if offsets is None or (ir.shape_of(offsets) or (0,))[0] != shape[0] + 1:
                return None
            return view, offsets
    return None


def padded_values(source: fx.Node) -> Any:
    """The jagged values a :func:`zero_padded_source` wrote: ``index_put``'s or the
    unflattened ``index_copy``'s."""
    if source.target is aten.index_put.default:
        return source.args[2]
    if fbgemm_op(source) == "jagged_to_padded_dense":
        return source.args[0]
    return through_views(source).args[3]


def dims_through_views(start: fx.Node, end: fx.Node, dims: Dims, length: int
                       ) -> Dims | None:
    """Where ``start``'s (batch, sequence) ``dims`` sit in ``end``, a view chain below it
    (reshape, view, transpose, permute, unsqueeze, getitem of a split), or None."""
    chain = []
    node = end
    while node is not start:
        if not (isinstance(node, fx.Node) and node.op == "call_function"
                and (node.target in _VIEWS or _is_getitem(node))):
            return None
        chain.append(node)
        node = node.args[0]
    facts = (start, 0, length)  # only read by masks and attentions, never on a view chain
    for user in reversed(chain):
        if _is_getitem(user):
            continue
        step = _step(user, user.args[0], dims, facts)
        if not isinstance(step, list) or not step:
            return None
        dims = step[0][1] if user.target not in _TUPLES else dims
    return dims


def descends(node: fx.Node, ancestor: fx.Node) -> bool:
    stack, seen = [node], set()
    while stack:
        x = stack.pop()
        if x is ancestor:
            return True
        if x in seen:
            continue
        seen.add(x)
        stack.extend(x.all_input_nodes)
    return False


def projection_source(q: fx.Node, k: fx.Node, v: fx.Node) -> fx.Node | None:
    """The tensor q, k, v are projections of: one fused projection (``qkv``), or separate
    linears of one input. None when they come from different places (cross-attention)."""
    roots = [through_views(x) for x in (q, k, v)]
    if all(r is roots[0] for r in roots):
        return roots[0]
    if all(isinstance(r, fx.Node) and r.target is aten.linear.default for r in roots):
        inputs = [through_views(r.args[0]) for r in roots]
        if all(i is inputs[0] for i in inputs):
            return inputs[0]
    return None


# ---- where do the padding rows of an attention output go? ---------------------------------

_CASTS = {aten.to.dtype, aten._to_copy.default, aten.alias.default, aten.clone.default,
          aten.detach.default, aten.contiguous.default}
_SAME = _CASTS | {aten.expand.default, aten.dropout.default}
"""Ops whose output keeps the operand's layout element for element: casts, copies, an
expand, and dropout (each element kept or zeroed on its own draw: a token's padding stays
its own, and eager's padding rows are as unread after it as before)."""
Dims = tuple[int, int]  # (batch dim, sequence dim) of a tensor whose padding rows are unknown
# Merged: a reshape that flattens the two (adjacent) dims into one dim ``d`` (a token-wise
# GEMM over ``[B * L, E]``, or ``nn.MultiheadAttention``'s ``[L * B, E]``) gives ``(d, d)``
# when the batch is the outer of the two, ``(~d, ~d)`` when the sequence is.
Facts = Any  # (offsets, clamp_min, L) of an ``arange < lengths`` mask, or a KeyMask


def _through_views_and_casts(node: Any) -> Any:
    while isinstance(node, fx.Node) and node.op == "call_function" and (
        node.target in _VIEWS or node.target in _CASTS or _is_getitem(node)
    ):
        node = node.args[0]
    return node


def _norm(d: int, rank: int) -> int:
    return d % rank if rank else 0


def _reshape_dims(before: tuple[int, ...], after: tuple[int, ...], dims: Dims) -> Dims | None:
    """Where dims of ``before`` sit in ``after`` when a reshape keeps them whole."""
    out = []
    for d in dims:
        prefix = 1
        for s in before[:d]:
            prefix *= s
        p, found = 1, None
        for j, s in enumerate(after):
            if p == prefix and s == before[d]:
                found = j
                break
            p *= s
        if found is None:
            return None
        out.append(found)
    return out[0], out[1]


def _cleaning_mask(arg: Any, out_shape: tuple[int, ...], dims: Dims, facts: Facts) -> bool:
    """``arg`` is the key-padding mask (same offsets and length, lengths no longer than the
    attention's) laid along ``dims``: multiplying by it zeroes every padding row."""
    shape = ir.shape_of(arg) if isinstance(arg, fx.Node) else None
    if shape is None:
        return False
    if isinstance(facts, KeyMask):
        # a 0/1 multiplier: a boolean mask, cast (an additive mask, which keep_of also
        # reads as its keep-mask, scales the padding rows instead of zeroing them)
        if ir.dtype_of(_through_views_and_casts(arg)) != torch.bool:
            return False
        if keep_of(arg) is not facts.keep and not _drops_the_same(arg, facts.keep):
            return False
    else:
        found = key_padding_mask(_through_views_and_casts(arg))
        offsets, clamp_min, length = facts
        if found is None or found[0] is not offsets or found[2] != length \
                or found[1] > clamp_min:
            return False
    padded = (1,) * (len(out_shape) - len(shape)) + tuple(shape)
    return all(s == (out_shape[i] if i in dims else 1) for i, s in enumerate(padded))


def _dropped_of(node: Any) -> fx.Node | None:
    """The boolean tensor whose True entries a mask drops: ``X`` of ``~X``, or of the
    additive ``masked_fill(zeros, X, v)`` with ``v <= -1e4`` (``nn.MultiheadAttention``'s
    conversion of a ``key_padding_mask``); else None."""
    node = _through_views_and_casts(node)
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target in _NOTS and ir.dtype_of(node) == torch.bool:
        return _through_views_and_casts(node.args[0])
    if node.target in (aten.masked_fill.Scalar, aten.masked_fill_.Scalar):
        value = _scalar(node.args[2])
        if value is not None and value <= ADDITIVE_MASKED_MAX and _is_zeros(node.args[0]):
            return _through_views_and_casts(node.args[1])
    return None


def _drops_the_same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` drop the same entries: ``~pad`` and the attention's additive mask
    filled from ``pad`` (BST's and SASRec's ``out * ~pad`` after ``src_key_padding_mask=pad``)."""
    dropped = _dropped_of(a)
    return dropped is not None and dropped is _dropped_of(b)


def _masked_product(arg: Any, out_shape: tuple[int, ...], dims: Dims, facts: Facts) -> bool:
    """``arg`` is a product by the key-padding mask (``scores * mask``), possibly cast or
    with trailing dims unsqueezed (``[..., None]``), laid along ``dims``: its padding rows
    are zero, so multiplying by it zeroes them too (DIN's sum pooling
    ``sum(weights[..., None] * keys, 1)`` with ``weights`` masked). The same rule as a
    multiply by the mask itself: a padding row of the other factor is never read."""
    node = arg
    while isinstance(node, fx.Node) and node.op == "call_function" and (
            node.target in _CASTS or (node.target is aten.unsqueeze.default
                                      and _norm(node.args[1], len(ir.shape_of(node) or ()))
                                      == len(ir.shape_of(node) or ()) - 1)):
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.target is aten.mul.Tensor):
        return False
    shape = tuple(ir.shape_of(arg) or ())
    inner = tuple(ir.shape_of(node) or ())
    padded = (1,) * (len(out_shape) - len(shape)) + shape
    lead = len(out_shape) - len(shape)  # where ``arg``'s dims start in the output
    if len(padded) != len(out_shape) or any(padded[d] != out_shape[d] for d in dims) \
            or any(d - lead >= len(inner) or d < lead for d in dims) \
            or shape[:len(inner)] != inner or any(s != 1 for s in shape[len(inner):]):
        return False
    at = (dims[0] - lead, dims[1] - lead)
    return any(_cleaning_mask(a, inner, at, facts) for a in node.args[:2])


_SHAPE_ONLY = {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
               aten.full_like.default, aten.new_zeros.default, aten.new_ones.default,
               aten.new_empty.default, aten.new_full.default, aten.sym_size.int}
"""Ops whose result depends on their input's shape and dtype only, never its values."""


def _step(user: fx.Node, src: fx.Node, dims: Dims, facts: Facts
          ) -> list[tuple[fx.Node, Dims]] | str | tuple[str, Dims] | None:
    """Where the padding rows go through ``user``: new (node, dims), ``"clean"`` (not read),
    ``("zero", dims)`` (a multiply by the mask: ``user``'s own padding rows are zero), or
    None when ``user`` may read them (unverifiable)."""
    if user.op != "call_function":
        return None
    t = user.target
    if t in _SHAPE_ONLY:
        return "clean"  # reads the shape, not the values (``torch.ones_like(logits)``)
    in_shape = ir.shape_of(src) or ()
    out_shape = ir.shape_of(user) or ()
    rank = len(in_shape)
    bd, ld = dims
    if bd == ld or bd < 0:
        return _merged_step(user, src, dims, facts)
    unit = _attention_unit(user, src, dims, facts)
    if unit is not None:
        return unit
    silu = _silu_unit(user, src, dims, facts)
    if silu is not None:
        return None if silu == "read" else silu
    if t in _SAME:
        return [(user, dims)]
    if fbgemm_op(user) == "dense_to_jagged" and user.args[0] is src and dims == (0, 1) \
            and not isinstance(facts, KeyMask) and facts[1] == 0:
        # FBGEMM's unpadding over the same offsets reads each row's first length tokens
        offsets = user.args[1]
        ok = isinstance(offsets, (list, tuple)) and len(offsets) == 1 \
            and offsets[0] is facts[0]
        return "clean" if ok else None
    if t is aten.transpose.int:
        a, b = (_norm(x, rank) for x in user.args[1:3])
        swap = {a: b, b: a}
        return [(user, (swap.get(bd, bd), swap.get(ld, ld)))]
    if t is aten.permute.default:
        perm = [_norm(x, rank) for x in user.args[1]]
        return [(user, (perm.index(bd), perm.index(ld)))]
    if t is aten.unsqueeze.default:
        d = _norm(user.args[1], rank + 1)
        return [(user, (bd + (bd >= d), ld + (ld >= d)))]
    if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
             aten.flatten.using_ints, aten.unflatten.int, aten.squeeze.dim):
        mapped = _reshape_dims(in_shape, out_shape, dims)
        if mapped is None and isinstance(facts, KeyMask):
            whole = in_shape[bd] == facts.batch  # else the batch dim holds an inner factor
            mapped = (_merge_dims(in_shape, out_shape, dims) if whole else None) or \
                _factor_dims(in_shape, out_shape, dims, facts.batch, facts.length)
        elif mapped is None and bd < ld and in_shape[bd] == _offsets_batch(facts):
            mapped = _merge_dims(in_shape, out_shape, dims)  # rows flattened, batch outer
        return [(user, mapped)] if mapped is not None else None
    if t is aten.select.int and user.args[0] is src:
        d = _norm(user.args[1], rank)
        if d in dims:
            return None
        return [(user, (bd - (bd > d), ld - (ld > d)))]
    if t in (aten.unbind.int, aten.split.Tensor, aten.chunk.default):
        at = 1 if t is aten.unbind.int else 2  # split(x, size, dim), chunk(x, n, dim)
        d = _norm(user.args[at] if len(user.args) > at else user.kwargs.get("dim", 0), rank)
        if d in dims:
            return None
        nd = dims if t is not aten.unbind.int else (bd - (bd > d), ld - (ld > d))
        return [(g, nd) for g in user.users]
    if t is aten.linear.default:
        return [(user, dims)] if user.args[0] is src and rank - 1 not in dims else None
    if t is aten.layer_norm.default:
        return [(user, dims)] if len(user.args[1]) == 1 and rank - 1 not in dims else None
    if t is aten.cat.default:
        d = _norm(user.args[1] if len(user.args) > 1 else 0, rank)
        return [(user, dims)] if d not in dims else None
    if t in (aten.sum.dim_IntList, aten.mean.dim):
        reduced = {_norm(d, rank) for d in user.args[1]}
        if reduced & set(dims):
            return None
        keep = len(user.args) > 2 and user.args[2]
        shift = (lambda x: x) if keep else (lambda x: x - sum(r < x for r in reduced))
        return [(user, (shift(bd), shift(ld)))]
    if t is aten.scaled_dot_product_attention.default:
        q, k, v = user.args[:3]
        mask = user.kwargs.get("attn_mask", user.args[3] if len(user.args) > 3 else None)
        if src is q and dims == (0, 2):
            return [(user, (0, 2))]
        causal = user.kwargs.get("is_causal", user.args[5] if len(user.args) > 5 else False)
        if src in (k, v) and src is not q and dims == (0, 2) and mask is None and causal \
                and (not isinstance(facts, KeyMask) or facts.prefix) \
                and (ir.shape_of(q) or ())[2:3] == (ir.shape_of(src) or ())[2:3]:
            # causal over right-padded rows: a real query i < len reads keys j <= i, all
            # real, when the padding is a suffix of each row (a prefix mask)
            return "clean"
        if src in (k, v) and src is not q and dims == (0, 2):
            if isinstance(facts, KeyMask):
                got = attention_key_mask(mask, facts.batch, facts.length)
                ok = not isinstance(got, str) and got[0].keep is facts.keep
            else:
                found = key_padding_mask(mask) if mask is not None else None
                ok = found is not None and found[0] is facts[0] and found[2] == facts[2] \
                    and found[1] <= facts[1]
            return "clean" if ok else None
        return None
    if t is aten._assert_tensor_metadata.default:  # reads metadata, not values
        return "clean"
    if t is aten.index.Tensor and user.args[0] is src:
        # a gather at the jagged positions of the same offsets reads real rows only
        indices = list(user.args[1])
        if isinstance(facts, KeyMask) or len(indices) < max(dims) + 1 \
                or any(i is not None for k, i in enumerate(indices) if k not in dims):
            return None
        offsets = jagged_positions(indices[bd], indices[ld])
        return "clean" if offsets is not None and offsets is facts[0] else None
    if elementwise(user):  # pointwise
        shift = len(out_shape) - rank
        nd = (bd + shift, ld + shift)
        if t in (aten.mul.Tensor,) and any(
            _cleaning_mask(a, out_shape, nd, facts) or _masked_product(a, out_shape, nd, facts)
            for a in user.args if a is not src
        ):
            return ("zero", nd)
        return [(user, nd)]
    return None


def _factor_dims(before: tuple[int, ...], after: tuple[int, ...], dims: Dims, batch: int,
                 length: int) -> Dims | None:
    """``dims`` after a reshape that keeps the batch as the *outer* factor of a dim (the
    batch dim may hold ``batch * k``: heads merged into it, as ``nn.MultiheadAttention``
    writes ``[L, B * heads, d]``) and the sequence whole, or that merges the two (adjacent,
    the batch's inner factor moving to the dims after): ``(j, j)`` / ``(~j, ~j)`` as
    :func:`_merge_dims`. Where a factor lands is read from the element order alone: the
    elements before it (the product of the dims before it) are the same on both sides."""
    bd, ld = dims
    if batch < 2 or before[ld] != length or before[bd] % batch:
        return None  # (a batch of 1 is a factor of every dim: nowhere to place it)
    lead_b, lead_l = _prod(before[:bd]), _prod(before[:ld])
    jb = jl = None
    for j in range(len(after)):
        lead = _prod(after[:j])
        if lead == lead_b and after[j] % batch == 0 and jb is None:
            jb = j
        if lead == lead_l and after[j] == length and jl is None:
            jl = j
    if jb is not None and jl is not None and jb != jl:
        return jb, jl
    outer, inner = (bd, ld) if bd < ld else (ld, bd)
    if inner - outer != 1 or (ld < bd and before[ld + 1] % batch):
        return None  # not adjacent, or the batch is not the outer part of its dim
    for j in range(len(after)):
        if _prod(after[:j]) == _prod(before[:outer]) and after[j] == batch * length:
            return (j, j) if bd < ld else (~j, ~j)
    return None


def _kernel_facts(user: fx.Node) -> tuple[fx.Node, dict[str, Any]] | None:
    """The node holding the kernel facts of the fused group ``user`` is a member of (they
    sit on the group's last node: walked forward to it) and the facts, or None."""
    group = user.meta.get(ir.GROUP)
    if group is None:
        return None
    kernel: fx.Node | None = user
    while kernel is not None and kernel.op != "output" and \
            (kernel.meta.get(ir.KERNEL) or {}).get("id") != group:
        kernel = kernel.next
    if kernel is None or kernel.op == "output":
        return None
    return kernel, kernel.meta[ir.KERNEL]


def _silu_unit(user: fx.Node, src: fx.Node, dims: Dims, facts: Facts
               ) -> list[tuple[fx.Node, Dims]] | str | None:
    """Through HSTU's pointwise attention kernel ``user`` is part of
    (``jagged_silu_attention`` facts on its output), as a whole, when its keys are the ones
    followed here (the same keep mask; or the same offsets, unclamped, which its values
    were zero-padded over): its queries' padding rows become its output's, at the dims the
    output layout puts batch and sequence; its keys' and values' padding rows are never
    read (the kernel walks each row's real keys). ``"read"`` when ``src`` reaches the
    kernel another way (its bias, or as an operand at other dims): the kernel's own nodes
    are never a region's carriers. None when ``user`` is no such kernel's member."""
    found = _kernel_facts(user)
    if found is None or found[1].get("kind") != "jagged_silu_attention":
        return None
    kernel, f = found
    by_name = {n.name: n for n in user.graph.nodes}
    if isinstance(facts, KeyMask):
        mask = by_name.get(f.get("mask") or "")
        same = mask is not None and (keep_of(mask) or mask) is facts.keep
    else:
        # over the offsets its values were zero-padded by; a layout that keeps slot 0 of
        # an empty row (``clamp_min`` 1: a reader of that position, ``pack-jagged-tokens``)
        # too: q, k and v are 0 there, so the kernel gives that slot 0, as the model does
        # at every position of such a row (and 0 gradients to q, k and the bias)
        offsets, clamp_min, length = facts
        same = f.get("offsets") == offsets.name and clamp_min in (0, 1) \
            and int(f["max_len"]) == length
    if not same:
        return "read"

    def at(perm: list[int] | None) -> Dims:
        p = perm or [0, 1, 2, 3]
        return p[0], p[2]

    out: list[tuple[fx.Node, Dims]] = []
    read_as = False
    if src.name == f["q"] and dims == at(f.get("q_perm")):
        perm = f.get("out_perm") or [0, 1, 2, 3]
        out.append((by_name[f.get("output", kernel.name)], (perm.index(0), perm.index(2))))
        read_as = True
    keys_dims = dims
    if src.target is aten.transpose.int and isinstance(src.args[0], fx.Node) \
            and src.args[0].name == f["k"]:  # matmul(q, k.transpose(-1, -2))
        rank = len(ir.shape_of(src) or ())
        a, b = (_norm(x, rank) for x in src.args[1:3])
        swap = {a: b, b: a}
        src, keys_dims = src.args[0], (swap.get(dims[0], dims[0]), swap.get(dims[1], dims[1]))
    for name, perm in (("k", "k_perm"), ("v", "v_perm")):
        if src.name == f[name]:
            if keys_dims != at(f.get(perm)):
                return "read"
            read_as = True
    if not read_as:
        return "read"
    return out or "clean"


def _attention_unit(user: fx.Node, src: fx.Node, dims: Dims, facts: Facts
                    ) -> list[tuple[fx.Node, Dims]] | str | None:
    """Through a guarded attention kernel ``user`` is part of (a fused softmax attention:
    scale, score matmul, softmax, value matmul; ``key_padding_attention`` facts on its last
    node), as a whole: its queries' padding rows become its output's (at the same dims), its
    keys and values (or views of them) are not read when the kernel masks them with the key
    mask followed here. None when ``user`` is no such kernel's member."""
    held = _kernel_facts(user) if isinstance(facts, KeyMask) else None
    if held is None:
        return None
    kernel, found = held
    if found.get("kind") != "key_padding_attention" or not found.get("mask") or \
            not all(found.get(x) for x in ("q", "k", "v")):
        return None  # (an SDPA call: its own rule in :func:`_step`)
    by_name = {n.name: n for n in user.graph.nodes}
    mask = by_name.get(found["mask"])
    out = by_name.get(found.get("output", kernel.name))
    if mask is None or out is None or keep_of(mask) is not facts.keep:
        return None
    if src.name == found["q"]:
        same = len(ir.shape_of(out) or ()) == len(ir.shape_of(src) or ()) and \
            (ir.shape_of(out) or ())[dims[1]] == (ir.shape_of(src) or ())[dims[1]]
        return [(out, dims)] if same else None
    chain = src
    while isinstance(chain, fx.Node) and chain.name not in (found["k"], found["v"]) and \
            chain.op == "call_function" and (chain.target in _VIEWS or chain.target in _CASTS):
        chain = chain.args[0]
    return "clean" if isinstance(chain, fx.Node) and chain.name in (found["k"], found["v"]) \
        else None


def padding_rows_read_by(sdpa: fx.Node, facts: Facts) -> fx.Node | None:
    """The first node that may read the SDPA output's padding query rows unmasked, or None
    when every path ends masked (multiplied by the key-padding mask, or used only as masked
    keys/values of an attention over the same lengths)."""
    found = follow_padding(sdpa, (0, 2), facts)
    return found if isinstance(found, fx.Node) else None


_TUPLES = (aten.unbind.int, aten.split.Tensor, aten.chunk.default)


@dataclass
class PaddingFlow:
    """Where a padded tensor's padding rows go, when nothing reads them: every node they
    reach, with its (batch, sequence) dims (``carriers``), and the mask multiplies that end
    them, whose padding rows are exactly zero (``zeroed``)."""

    carriers: dict[fx.Node, Dims] = field(default_factory=dict)
    zeroed: dict[fx.Node, Dims] = field(default_factory=dict)
    # readers of one token per row that read no padding row exactly when a run-time check
    # of their positions passes (``passes/row_reads``): the reader -> its facts
    reads: dict[fx.Node, Any] = field(default_factory=dict)


def follow_padding(start: fx.Node, dims: Dims, facts: Facts,
                   reads: Callable[[fx.Node, fx.Node, Dims, Facts], Any] | None = None
                   ) -> PaddingFlow | fx.Node:
    """Follow ``start``'s padding rows (at ``dims``) through its users: the flow, or the
    first node that may read them unmasked. A node reached with two different layouts
    counts as a reader (its padding rows are not one set). ``reads``: a recogniser of
    readers that read padding rows only where a run-time check fails (``row_reads.row_read``:
    ``x[arange(B), lengths - 1]``); what it recognises goes to the flow's ``reads``
    instead of stopping it (the caller then owes the check)."""
    flow = PaddingFlow()
    stack: list[tuple[fx.Node, Dims]] = [(start, dims)]
    while stack:
        node, dims = stack.pop()
        if flow.carriers.get(node) == dims:
            continue
        if node in flow.carriers:
            return node
        flow.carriers[node] = dims
        for user in node.users:
            step = _step(user, node, dims, facts)
            if step is None:
                read = reads(user, node, dims, facts) if reads is not None else None
                if read is None or flow.reads.setdefault(user, read) != read:
                    return user
                continue
            if step == "clean":
                continue
            if isinstance(step, tuple):  # ("zero", dims): a mask multiply
                if flow.zeroed.setdefault(user, step[1]) != step[1]:
                    return user
                continue
            if user.target in _TUPLES:  # the tuple node carries them to its getitems
                if flow.carriers.setdefault(user, dims) != dims:
                    return user
            stack.extend(step)
    if set(flow.zeroed) & set(flow.carriers):
        return next(iter(set(flow.zeroed) & set(flow.carriers)))
    return flow


# ---- key-padding masks from any source ----------------------------------------------------
#
# A mask that reaches an attention as ``[B, 1|H, 1|Lq, L]`` and varies only over batch and
# key position is a key-padding mask, whatever produced it: a boolean graph input, an
# additive float input, ``arange(L) < lengths``, or ``nn.MultiheadAttention``'s conversion
# of its ``key_padding_mask`` (``masked_fill(zeros, ~mask, -inf)``, viewed and expanded over
# heads). Nothing here proves it is a prefix: the kernel op checks that at run time.

_BROADCASTS = {aten.unsqueeze.default, aten.view.default, aten.reshape.default,
               aten.expand.default, aten._unsafe_view.default, aten.alias.default,
               aten.clone.default, aten.contiguous.default}
_NOTS = {aten.bitwise_not.default, aten.logical_not.default}
_ANDS = {aten.bitwise_and.Tensor, aten.logical_and.default, aten.mul.Tensor,
         aten.__and__.Tensor}
ADDITIVE_MASKED_MAX = -ADDITIVE_MASKED_GAP  # the check's rule, with the kept keys at 0


@dataclass(frozen=True)
class KeyMask:
    """A key-padding mask as the attention receives it: ``node`` (``[B, L]``, the tensor the
    kernel op checks at run time), whether it is ``additive`` (float) or a keep-mask
    (bool), and ``keep``: the boolean ``[B, L]`` node whose True entries are the kept keys
    (the mask itself, or what an additive mask was filled from), which is what a later
    multiply by the same mask is recognised by."""

    node: fx.Node
    additive: bool
    keep: fx.Node
    batch: int
    length: int
    prefix: bool = False  # the caller runs its rewrite only where the mask is a prefix


def _broadcast_root(mask: Any, batch: int, length: int) -> fx.Node | None:
    """The ``[B, L]`` tensor ``mask`` (``[B, 1|H, 1|Lq, L]``) broadcasts, through views that
    keep row-major order (unsqueeze, expand, view, reshape: never a transpose)."""
    node = mask
    while isinstance(node, fx.Node) and node.op == "call_function" \
            and node.target in _BROADCASTS:
        if tuple(ir.shape_of(node) or ()) == (batch, length):
            return node
        node = node.args[0]
    if isinstance(node, fx.Node) and tuple(ir.shape_of(node) or ()) == (batch, length):
        return node
    return None


def _scalar(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _is_zeros(node: Any) -> bool:
    node = through_views(node)
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target in (aten.zeros_like.default, aten.zeros.default, aten.new_zeros.default):
        return True
    if node.target in (aten.full.default, aten.full_like.default, aten.new_full.default):
        return _scalar(node.args[-1]) == 0.0
    return False


def _diagonal(node: fx.Node) -> Any:
    """The ``diagonal`` argument of a ``tril`` / ``triu`` (0 when not given)."""
    return node.args[1] if len(node.args) > 1 else 0


def _square_mask(shape: tuple[int, ...], length: int) -> bool:
    """``shape`` is ``[..., L, L]`` with every leading dim 1 (one mask for all rows)."""
    return shape[-2:] == (length, length) and all(s == 1 for s in shape[:-2])


def keep_of(node: Any) -> fx.Node | None:
    """The boolean keep-mask ``X`` a mask tensor is equivalent to: ``X`` itself (a bool
    tensor, through views and casts), or an additive mask built from it
    (``masked_fill(zeros, ~X, v)`` or ``where(X, 0, v)`` with ``v <= -1e4``)."""
    node = _through_views_and_casts(node)
    if not isinstance(node, fx.Node):
        return None
    if ir.dtype_of(node) == torch.bool and not (node.op == "call_function"
                                                and node.target is aten.eq.Scalar):
        return None if node.op == "call_function" and node.target in _NOTS else node
    if node.op != "call_function":
        return None
    if node.target in (aten.masked_fill.Scalar, aten.masked_fill_.Scalar):
        dropped = _dropped_of(node)
        if isinstance(dropped, fx.Node) and dropped.target in _NOTS:
            return keep_of(dropped.args[0])
        return None
    if node.target is aten.eq.Scalar and _scalar(node.args[1]) == 0.0:
        # ``additive == 0``: the keep-mask of an additive mask (itself its identity)
        inner = _through_views_and_casts(node.args[0])
        if isinstance(inner, fx.Node) and (ir.dtype_of(inner) or torch.bool).is_floating_point:
            return keep_of(inner) or inner
        return None
    if node.target is aten.where.ScalarOther or node.target is aten.where.Scalar:
        cond = node.args[0]
        first = _scalar(node.args[1])
        other = _scalar(node.args[2])
        if first == 0.0 and other is not None and other <= ADDITIVE_MASKED_MAX:
            return keep_of(cond)
    if node.target is aten.mul.Tensor:
        return _extended_keep(node)
    return None


def drops_to_minus_inf(node: Any) -> bool:
    """Whether an additive mask that :func:`keep_of` reads drops with ``-inf`` (a row it
    drops whole is NaN in eager, as the boolean's empty row is refused), not with a finite
    value (BERT's ``-1e4``, ``finfo.min``: a row dropped whole attends uniformly over every
    key in eager, which only the additive mask's own rule keeps). False where unsure."""
    node = _through_views_and_casts(node)
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target in (aten.masked_fill.Scalar, aten.masked_fill_.Scalar):
        return _scalar(node.args[2]) == -math.inf
    if node.target is aten.where.ScalarOther or node.target is aten.where.Scalar:
        return _scalar(node.args[2]) == -math.inf
    return False


def _extended_keep(node: fx.Node) -> fx.Node | None:
    """``X`` of Hugging Face's extended mask ``(1.0 - X[:, None, None, :].to(dtype)) * v``
    (``v``: ``-10000.0`` or ``torch.finfo(dtype).min``, any ``v <= -1e4``) with ``X`` a
    boolean ``[B, L]`` keep-mask (through unsqueezes, views that keep its order and casts):
    0 where ``X`` keeps, ``v`` where it drops, as ``masked_fill(zeros, ~X, v)``."""
    for one_minus, value in (node.args[:2], node.args[1::-1]):
        v = _scalar(value)
        if v is None or v > ADDITIVE_MASKED_MAX or not isinstance(one_minus, fx.Node) \
                or one_minus.target is not aten.rsub.Scalar or _scalar(one_minus.args[1]) != 1.0:
            continue
        inner = one_minus.args[0]
        while isinstance(inner, fx.Node) and inner.op == "call_function" \
                and (inner.target in _BROADCASTS or inner.target in _CASTS):
            inner = inner.args[0]
        if isinstance(inner, fx.Node) and ir.dtype_of(inner) == torch.bool:
            return keep_of(inner)
    return None


def _is_tril(node: Any, length: int) -> bool:
    """``node`` is the causal ``[L, L]`` keep-mask (query >= key), by its values, however
    it is spelled (``tril`` of ones, ``~triu(ones, 1)``, ``arange[:, None] >= arange[None,
    :]``, ...): :func:`.causal_masks.is_causal_keep`."""
    return is_causal_keep(node, length)


def _is_strict_upper(node: Any, length: int) -> bool:
    """``node`` is the boolean strictly-upper-triangular ``[L, L]`` mask (the keys a causal
    query may not see), by its values: :func:`.causal_masks.is_causal_drop`."""
    return is_causal_drop(node, length)


def additive_causal(node: Any, length: int) -> bool | None:
    """Whether ``node`` is an additive causal ``[L, L]`` mask (leading dims 1): 0 where the
    query sees the key, a large negative above the diagonal. True when that value is
    ``-inf`` (``nn.Transformer.generate_square_subsequent_mask``'s ``triu(full(-inf), 1)``,
    ``F._canonical_mask`` of a boolean causal mask, ``where(tril, 0, -inf)``, ``log(tril)``);
    False when it is finite (at most ``-1e4``); None when ``node`` is no causal mask. By its
    values: :func:`.causal_masks.additive_causal`."""
    return causal_masks.additive_causal(node, length)


def stored_mask_sources(node: Any, length: int) -> list[fx.Node] | None:
    """The weights ``node`` is computed from when it is a candidate causal mask: an
    ``[L, L]`` value (leading dims 1) that reads nothing of the batch, only parameters,
    buffers or lifted tensor constants of the model (``gemc.param`` / ``gemc.constant``
    placeholders, each at least ``[L, L]`` in its last two dims: a mask table sliced
    ``[:L, :L]`` or not), through ops that draw no random number; else None. Why a candidate and not a proof: the graph is captured on ``meta``,
    so a buffer's values (``register_buffer("mask", tril(ones(M, M)))``) are not in it; the
    runner checks the value against the lower-triangular ones once per change of these
    weights (``backends/triton/causal_mask``) and otherwise runs the padded formula."""
    from gemc.packed_rules import draws

    if not isinstance(node, fx.Node):
        return None
    if not _square_mask(tuple(ir.shape_of(node) or ()), length):
        return None
    sources = []
    for n in ir.ancestors([node]):
        if n.op == "placeholder":
            weight = tuple(ir.shape_of(n) or ())
            if (ir.PARAM not in n.meta and ir.CONSTANT not in n.meta) or len(weight) < 2 \
                    or any(int(s) < length for s in weight[-2:]):
                return None
            sources.append(n)
        elif n.op != "call_function" or draws(n):
            return None
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(sources, key=order.__getitem__) or None


def _key_rows(node: Any, batch: int, length: int) -> fx.Node | None:
    """The boolean ``[B, L]`` keep-mask a ``[B, 1|H, 1, L]`` key mask broadcasts (its
    query dim size 1: one value per key, never a query mask broadcast over the keys)."""
    shape = tuple(ir.shape_of(node) or ()) if isinstance(node, fx.Node) else ()
    if len(shape) != 4 or shape[2] != 1 or shape[3] != length:
        return None
    root = _broadcast_root(node, batch, length)
    return root if root is not None and ir.dtype_of(root) == torch.bool else None


def _tril_of_keys(node: Any, batch: int, length: int) -> fx.Node | None:
    """The boolean ``[B, L]`` keep-mask ``X`` when ``node`` is ``tril`` of ``X``'s keys
    broadcast over the queries, ``tril(X[:, None, None, :].expand(-1, -1, L, -1))``
    (RecBole's ``get_attention_mask``): entry ``(i, j)`` is ``X[b, j] and j <= i``, the key
    mask and-ed with the causal one."""
    node = _through_views_and_casts(node)
    if not isinstance(node, fx.Node) or node.target is not aten.tril.default \
            or _diagonal(node) != 0 or ir.dtype_of(node) != torch.bool:
        return None
    shape = tuple(ir.shape_of(node) or ())
    inner = node.args[0]
    if len(shape) != 4 or shape[2:] != (length, length) or not isinstance(inner, fx.Node) \
            or inner.target is not aten.expand.default:
        return None
    return _key_rows(inner.args[0], batch, length)


def _causal_keys(node: Any, batch: int, length: int) -> fx.Node | None:
    """The boolean ``[B, L]`` keep-mask ``X`` of a boolean ``[B, 1|H, L, L]`` mask that is
    ``X``'s keys and-ed with the causal mask: :func:`_tril_of_keys`, or ``X[:, None, None,
    :] & tril`` (either order)."""
    found = _tril_of_keys(node, batch, length)
    if found is not None:
        return found
    node = _through_views_and_casts(node)
    if not isinstance(node, fx.Node) or node.op != "call_function" \
            or node.target not in _ANDS or ir.dtype_of(node) != torch.bool:
        return None
    a, b = node.args[:2]
    for keys, tri in ((a, b), (b, a)):
        if _is_tril(tri, length):
            return _key_rows(keys, batch, length)
    return None


def causal_keep_drop(mask: Any, batch: int, length: int) -> tuple[fx.Node, float] | None:
    """``(X, v)`` when ``mask`` is ``where(C, 0.0, v)`` with ``C`` a boolean keep-mask
    ``X``'s keys and-ed with the causal mask (:func:`_causal_keys`) and ``v`` a finite drop
    at most ``-1e4`` (RecBole's SASRec: ``torch.where(tril(m.expand(-1, -1, L, -1)), 0.0,
    -10000.0)``), added to the scores of a written-out softmax; else None.

    Why the drop's finiteness matters, and when the kept-key attention is exact:
    ``where`` drops a future key and a padding key alike, with the same ``v``. A query row
    with at least one kept key ``j <= i`` is exact as causal attention over ``X``'s keys:
    every dropped score sits ``1e4`` below the kept ones, so its ``exp`` underflows to 0
    in fp32 (the additive rule of ``gemc.guard_sample.ADDITIVE_MASKED_GAP``, where the
    scores' own spread is far below ``1e4``). A query row with no kept key has ``v`` on
    every one of its ``L`` entries: eager attends over *all* ``L`` keys, future ones
    included (a constant shift of the softmax), which no causal kernel over kept keys
    computes. Such a row is always a padding query: a kept query ``i`` keeps key ``i``
    itself. So the kernel is exact where nothing reads the padding query rows (the pass
    proves it, or the readers of one token per row are checked at run time), and its
    fallback, taken where a reader reads a padding row, must be this very formula (not
    ``-inf`` for the future keys): the entry carries ``v`` (``finite_drop``) and the op's
    padded path rebuilds ``where(X & causal, 0, v)`` (``key_padding_attention.
    padded_attention``). ``-inf`` as ``v`` is another mask (NaN rows): not this one."""
    node = _through_views_and_casts(mask)
    if not isinstance(node, fx.Node) or node.op != "call_function" \
            or node.target not in (aten.where.ScalarOther, aten.where.Scalar) \
            or _scalar(node.args[1]) != 0.0:
        return None
    value = _scalar(node.args[2])
    if value is None or math.isinf(value) or value > ADDITIVE_MASKED_MAX:
        return None
    keep = _causal_keys(node.args[0], batch, length)
    return (keep, value) if keep is not None else None


def attention_key_mask(mask: Any, batch: int, length: int, finite_drop: bool = False
                       ) -> tuple[KeyMask, bool] | str:
    """``(key mask, causal)`` of an attention's ``attn_mask`` (``[B, 1|H, 1|Lq, L]``), or
    the reason it is not a key-padding mask: a boolean or additive ``[B, L]`` mask broadcast
    over heads and queries, optionally and-ed with the causal ``[L, L]`` mask (added to it,
    for additive masks: ``nn.MultiheadAttention``'s merge; or ``tril`` of the key mask
    broadcast over the queries). ``finite_drop``: the caller carries the drop value of
    :func:`causal_keep_drop`'s ``where(keep & causal, 0, v)`` to its fallback, so that mask
    is its boolean keep-mask, causal (without it: ``"causal-mask-finite"``)."""
    if not isinstance(mask, fx.Node):
        return "no-mask"
    shape = tuple(ir.shape_of(mask) or ())
    if len(shape) != 4 or shape[0] != batch or shape[3] != length:
        return "mask-shape"
    dropped = causal_keep_drop(mask, batch, length)
    if dropped is not None:
        if not finite_drop:
            return "causal-mask-finite"  # a fallback with -inf for the future keys differs
        return KeyMask(dropped[0], False, keep_of(dropped[0]) or dropped[0], batch,
                       length), True
    causal = merged = False  # merged: the mask is a key term combined with another
    node = _through_views_and_casts(mask)
    tril_keys = _tril_of_keys(node, batch, length)
    if tril_keys is not None:
        mask, causal = tril_keys, True
    elif isinstance(node, fx.Node) and node.op == "call_function" and node.target in _ANDS \
            and ir.dtype_of(node) == torch.bool:
        a, b = node.args[:2]
        if _is_tril(b, length):
            mask, causal = a, True
        elif _is_tril(a, length):
            mask, causal = b, True
        elif shape[2] != 1:
            return "mask-varies-over-queries"
        merged = True
    elif isinstance(node, fx.Node) and node.op == "call_function" \
            and node.target is aten.add.Tensor and shape[2] != 1:
        # nn.MultiheadAttention's merge of a causal attn_mask and a key_padding_mask
        # (both made -inf / 0 by F._canonical_mask): causal [L, L] + keys [B*H, 1, L]
        terms = [(inf, o) for inf, o in ((additive_causal(c, length), o) for c, o in
                                         (node.args[:2], node.args[1::-1])) if inf is not None]
        if not terms:
            return "mask-varies-over-queries"
        if not terms[0][0]:
            return "causal-mask-finite"  # the fallback's causal mask is -inf (exact only so)
        mask, causal, merged = terms[0][1], True, True
    elif shape[2] != 1:
        return "mask-varies-over-queries"
    if merged:
        part = tuple(ir.shape_of(mask) or ()) if isinstance(mask, fx.Node) else ()
        if len(part) < 2 or part[-2] != 1 or part[-1] != length:
            return "mask-varies-over-queries"  # e.g. a query mask combined with the causal one
    root = _broadcast_root(mask, batch, length)
    if root is None and not causal and shape[1:3] == (1, 1):
        # a [B, 1, 1, L] mask made at that shape (Hugging Face's extended mask: the
        # arithmetic after the unsqueezes): its rows are a view, taken by the runners
        # (gemc.guard_sample.mask_rows)
        root = mask
    if root is None:
        return "mask-not-key-padding"
    dtype = ir.dtype_of(root)
    additive = dtype is not None and dtype.is_floating_point
    if dtype != torch.bool and not additive:
        return "mask-dtype"
    keep = keep_of(root)
    return KeyMask(root, additive, keep if keep is not None else root, batch, length), causal


def padding_masks(gm: fx.GraphModule, batch: int, length: int) -> list[Facts]:
    """Every key-padding mask over ``[batch, length]`` the graph builds or receives, as the
    facts :func:`follow_padding` takes: ``arange(length) < lens`` over offsets (a prefix by
    construction: ``(offsets, clamp_min, length)``) first, then every boolean ``[B, L]``
    keep-mask root (a mask input, ``arange < lengths``, a mask computed from inputs: a
    :class:`KeyMask`, whose prefix property only a run-time check can establish). Why: a
    value that attention did not mask (queries of a padded history over dense keys) carries
    the padding of whichever mask later zeroes it; the caller tries each."""
    proven: list[Facts] = []
    keeps: list[Facts] = []
    for node in gm.graph.nodes:
        if ir.dtype_of(node) != torch.bool:
            continue
        found = key_padding_mask(node)
        if found is not None and found[2] == length \
                and (ir.shape_of(found[0]) or (0,))[0] == batch + 1 and found not in proven:
            proven.append(found)
        if tuple(ir.shape_of(node) or ()) == (batch, length) and keep_of(node) is node:
            keeps.append(KeyMask(node, False, node, batch, length))
    return proven + keeps


def _prod(xs: Any) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def _merge_dims(before: tuple[int, ...], after: tuple[int, ...], dims: Dims) -> Dims | None:
    """``dims`` after a reshape that flattens the batch and sequence dims (adjacent, either
    order) into one output dim; the dims before them may regroup among themselves and so may
    those after (per-token features), never across. Else None."""
    bd, ld = dims
    lo = min(bd, ld)
    if abs(bd - ld) != 1:
        return None
    lead = _prod(before[:lo])
    for j in range(len(after)):
        if _prod(after[:j]) == lead and after[j] == before[bd] * before[ld]:
            return (j, j) if bd < ld else (~j, ~j)
        if _prod(after[:j]) > lead:
            break
    return None


def _offsets_batch(facts: Facts) -> int | None:
    """The batch of offsets facts (``(offsets, clamp_min, L)``: ``B + 1`` offsets)."""
    if isinstance(facts, KeyMask) or not isinstance(facts[0], fx.Node):
        return None
    shape = ir.shape_of(facts[0])
    return int(shape[0]) - 1 if shape else None


def _merged_step(user: fx.Node, src: fx.Node, dims: Dims, facts: Facts
                 ) -> list[tuple[fx.Node, Dims]] | str | tuple[str, Dims] | None:
    """:func:`_step` for a value whose batch and sequence dims are merged: token-wise ops
    keep it, a reshape that splits the dim back restores the pair; anything else reads."""
    if user.op != "call_function":
        return None
    t = user.target
    in_shape = tuple(ir.shape_of(src) or ())
    out_shape = tuple(ir.shape_of(user) or ())
    rank = len(in_shape)
    batch_outer = dims[0] >= 0
    d = dims[0] if batch_outer else ~dims[0]
    if t is aten.index_select.default and not isinstance(facts, KeyMask):
        # a gather at the flat jagged positions of the same offsets reads real rows only
        ok = user.args[0] is src and batch_outer and _norm(user.args[1], rank) == d \
            and facts[1] == 0 and jagged_flat_positions(user.args[2], facts[2]) is facts[0]
        return "clean" if ok else None
    if t in _SAME:
        return [(user, dims)]
    if t is aten.linear.default:
        return [(user, dims)] if user.args[0] is src and d != rank - 1 else None
    if t is aten.layer_norm.default:
        return [(user, dims)] if len(user.args[1]) == 1 and d != rank - 1 else None
    if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        if not isinstance(facts, KeyMask):  # splitting back to rows needs B and L: a mask's
            return None
        outer, inner = (facts.batch, facts.length) if batch_outer else \
            (facts.length, facts.batch)
        lead = _prod(in_shape[:d])
        for j in range(len(out_shape)):
            if _prod(out_shape[:j]) != lead:
                if _prod(out_shape[:j]) > lead:
                    break
                continue
            if out_shape[j] == in_shape[d]:  # still merged
                return [(user, (j, j) if batch_outer else (~j, ~j))]
            if tuple(out_shape[j:j + 2]) == (outer, inner) and facts.batch != facts.length:
                return [(user, (j, j + 1) if batch_outer else (j + 1, j))]
        return None
    if elementwise(user) and len(out_shape) == rank:  # pointwise, same rank
        others = [a for a in user.args if isinstance(a, fx.Node) and a is not src]
        for a in others:  # another operand must not vary along the merged dim
            shape = tuple(ir.shape_of(a) or ())
            pos = d - (rank - len(shape))
            if pos >= 0 and shape[pos] != 1:
                return None
        return [(user, dims)]
    return None
