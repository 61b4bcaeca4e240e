"""Graph patterns of jagged sequences: key-padding masks, jagged->padded conversions, and
where padding rows of an attention output are read.

Not a pass: the recognisers ``match-jagged-attention`` uses. The last one,
:func:`padding_rows_read_by`, is what makes the substitution safe: jagged attention leaves
the output rows of padding queries (positions at or past a row's length) zero, where the
model computed attention over the valid keys. That is only invisible if nothing reads
those rows unmasked, which the function checks by following them through the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from gemc import ir

from .fusion_spec import translate

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
          aten.detach.default}
_SAME = _CASTS | {aten.expand.default}
Dims = tuple[int, int]  # (batch dim, sequence dim) of a tensor whose padding rows are unknown


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


def _cleaning_mask(arg: Any, out_shape: tuple[int, ...], dims: Dims,
                   facts: tuple[fx.Node, int, int]) -> bool:
    """``arg`` is the key-padding mask (same offsets and length, lengths no longer than the
    attention's) laid along ``dims``: multiplying by it zeroes every padding row."""
    found = key_padding_mask(_through_views_and_casts(arg))
    shape = ir.shape_of(arg) if isinstance(arg, fx.Node) else None
    if found is None or shape is None:
        return False
    offsets, clamp_min, length = facts
    if found[0] is not offsets or found[2] != length or found[1] > clamp_min:
        return False
    padded = (1,) * (len(out_shape) - len(shape)) + tuple(shape)
    return all(s == (out_shape[i] if i in dims else 1) for i, s in enumerate(padded))


def _step(user: fx.Node, src: fx.Node, dims: Dims, facts: tuple[fx.Node, int, int]
          ) -> list[tuple[fx.Node, Dims]] | str | tuple[str, Dims] | None:
    """Where the padding rows go through ``user``: new (node, dims), ``"clean"`` (not read),
    ``("zero", dims)`` (a multiply by the mask: ``user``'s own padding rows are zero), or
    None when ``user`` may read them (unverifiable)."""
    if user.op != "call_function":
        return None
    t = user.target
    in_shape = ir.shape_of(src) or ()
    out_shape = ir.shape_of(user) or ()
    rank = len(in_shape)
    bd, ld = dims
    if t in _SAME:
        return [(user, dims)]
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
        return [(user, mapped)] if mapped is not None else None
    if t in (aten.unbind.int, aten.split.Tensor, aten.chunk.default):
        d = _norm(user.args[1] if len(user.args) > 1 else 0, rank)
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
        if src in (k, v) and src is not q and dims == (0, 2):
            found = key_padding_mask(mask) if mask is not None else None
            ok = found is not None and found[0] is facts[0] and found[2] == facts[2] \
                and found[1] <= facts[1]
            return "clean" if ok else None
        return None
    if t is aten._assert_tensor_metadata.default:  # reads metadata, not values
        return "clean"
    if translate(user) is not None:  # pointwise
        shift = len(out_shape) - rank
        nd = (bd + shift, ld + shift)
        if t in (aten.mul.Tensor,) and any(
            _cleaning_mask(a, out_shape, nd, facts) for a in user.args if a is not src
        ):
            return ("zero", nd)
        return [(user, nd)]
    return None


def padding_rows_read_by(sdpa: fx.Node, facts: tuple[fx.Node, int, int]) -> fx.Node | None:
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


def follow_padding(start: fx.Node, dims: Dims, facts: tuple[fx.Node, int, int]
                   ) -> PaddingFlow | fx.Node:
    """Follow ``start``'s padding rows (at ``dims``) through its users: the flow, or the
    first node that may read them unmasked. A node reached with two different layouts
    counts as a reader (its padding rows are not one set)."""
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
                return user
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
