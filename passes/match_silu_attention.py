"""match-silu-attention: HSTU pointwise attention written as its formula -> the jagged SiLU
kernel, guarded at run time.

Why: HSTU ("Actions Speak Louder than Words", Zhai et al. 2024) replaces softmax by a
pointwise SiLU; models write it out on padded tensors, so the ``[B, H, L, L]`` scores, their
SiLU, the division and the mask run over padding (at 50% fill, three quarters of the score
work) and through memory. ``gemc.backends.triton.jagged_attention`` (``kind="silu"``)
computes it over values + offsets with nothing of ``[L, L]`` ever stored
(``benchmarks/kernels.py``'s ``silu`` case measures it against the padded formula).

The pattern, recognised by what each op computes (never by names or one spelling)::

    s = q . k over the head dim                # [B, H, L, L]: matmul(q, k.transpose(-1, -2))
                                               # or a two-operand einsum ("bnhd,bmhd->bhnm");
                                               # optionally * scale
    s = s + bias                               # optionally: any [B|1, H|1, L, L] addend
    a = silu(s) / n                            # or * (1 / n); n a constant >= L
    a = a * visible  (or where(visible, a, 0)) # visible: an and of a [B, L] key mask on the
                                               # key axis, optionally the same mask on the
                                               # query axis, optionally the causal mask
                                               # (bool, or a float 0 / 1: a tril of ones)
    out = a . v over the keys                  # matmul(a, v) or an einsum, any output layout

where q, k, v are ``[B, H, L, D]`` up to a permutation of their axes (the entry carries it:
``q_perm``, ``k_perm``, ``v_perm``, ``out_perm``) and the intermediates are read by nothing
else. The key mask may be any bool ``[B, L]`` tensor (an input, ``arange < lengths``): the
op checks at run time that it is a prefix and otherwise runs the padded formula (counted in
``key_padding_attention.STATS``). Or the keys carry no mask at all and the padding is
implicit, as HSTU's authors write it: v is jagged values written into zeros with
``index_put`` at the positions of ``offsets`` (``row = repeat_interleave(arange(B),
lengths)``, ``col = arange(N) - offsets[row]``), so a key at or past a row's length adds
``a_ij * 0``; the kernel then runs over those offsets' lengths (entry ``offsets``: a prefix by
construction). Without the query-axis mask, padding query rows are nonzero in the model and
zero in the kernel: matched only when nothing reads them unmasked (a gather at the same
jagged positions reads real rows only). Except on an empty row: every value the model sums
there is 0, so its every position is 0, as the kernel's. So over offsets a reader of one
token per row (``passes/row_reads``) whose position is a real token or one of an empty row
reads what the kernel gives (``row_reads.kept_by_offsets`` with ``empty_rows``): position 0,
``lengths.clamp(min=1) - 1`` and the unclamped ``lengths - 1`` (HSTU retrieval's user
embedding ``out[arange(B), lengths - 1]``) of the same offsets; the entry lists them
(``reads``). Over the rows flattened, ``(lengths - 1) + arange(B) * L`` reads the previous
row's last position on an empty row: not matched (``padding-rows-read-by``).

The causal mask may also be read from the model's weights (generative-recommenders registers
it, ``register_buffer("_attn_mask", tril(ones(M, M)))``, and multiplies by
``_attn_mask[:n, :n]``, or by ``1.0 - triu_mask.to(dtype)``): an ``[L, L]`` factor computed
from parameters, buffers or lifted tensor constants alone, at least ``[L, L]`` each, through
ops that draw nothing
(``jagged_patterns.stored_mask_sources``). The graph is captured on meta, so its values are
not in it: the entry is causal and names the factor (``causal_mask``), the weights
(``causal_mask_of``) and the whole mask as the scores read it (``visible``,
``visible_where``); the runner checks the factor against the ``tril`` once per change of
the weights and otherwise runs the padded formula (``backends/triton/causal_mask``). The
same ``[L, L]`` mask given with the batch stays the padded formula (``mask-factor``).

The bias (relative position, time buckets: any tensor of that shape) is an operand of the
kernel, indexed by positions within each sequence; its gradient flows back to whatever
computed it. Not matched (named in the dump and the warnings): a mask of another kind, or
none with values that are not zero-padded over offsets (``no-key-padding-mask``,
``mask-factor``), a per-row normaliser (``normaliser``), a normaliser below ``L``
(``normaliser-below-length``), an addend that is not a ``[B|1, H|1, L, L]`` tensor
(``bias-shape``), a scale applied to the scores plus their bias (``scaled-bias``: the
kernel computes ``silu(scale * q k^T + bias)``), scores that are not a contraction of q and
k over the head dim (``scores-not-q-kt``).

Every match is priced against the model's own attention first (``attention_choice``: one
rule for the three attention match passes): where gemc's kernel is priced slower (its work
at the fill, plus the host time a guarded call's sync exposes) the model's stays, named
``kept-padded: ...`` with both prices; ``GEMC_ATTENTION_KERNEL`` forces either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import ir
from gemc.context import PassContext

from .attention_choice import choose
from .jagged_patterns import (
    _ANDS,
    _CASTS,
    KeyMask,
    _broadcast_root,
    _is_tril,
    _through_views_and_casts,
    dims_through_views,
    follow_padding,
    keep_of,
    padded_values,
    stored_mask_sources,
    zero_padded_source,
)
from .row_reads import follow_with_reads, read_specs

aten = torch.ops.aten
SKIPPED = ir.PREFIX + "silu_skipped"  # why a pointwise attention was not made jagged
_MATMUL = aten.matmul.default
_TRANSPOSED = {(-1, -2), (-2, -1), (2, 3), (3, 2), (-1, 2), (2, -1), (3, -2), (-2, 3)}


def _scalar(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _kept_where_not(test: Any) -> fx.Node | None:
    """``m`` of a "dropped" test ``m == 0`` (``m`` bool or float) or ``~m`` (``m`` bool):
    zeroing ``a`` where the test holds keeps ``a`` where ``m`` is non-zero, so ``m`` is
    the visibility mask (read as ``m != 0``: ``_visible`` takes only a bool or a proven
    0 / 1 float, and the run-time check of a stored one compares it with the ``tril``)."""
    if not isinstance(test, fx.Node) or test.op != "call_function":
        return None
    if test.target is aten.eq.Scalar and _scalar(test.args[1]) == 0.0 \
            and isinstance(test.args[0], fx.Node):
        return test.args[0]
    if test.target in (aten.logical_not.default, aten.bitwise_not.default) \
            and isinstance(test.args[0], fx.Node) and ir.dtype_of(test.args[0]) == torch.bool:
        return test.args[0]
    return None


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
    else:  # the factor as broadcast (its views kept), without the casts to the scores' dtype
        while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _CASTS:
            node = node.args[0]
        out.append(node)


def _visible(mask: Any, batch: int, length: int
             ) -> tuple[KeyMask | None, bool, bool, fx.Node | None] | str:
    """``(key mask, causal, query_mask, stored)`` of a ``[B|1, 1|H, L, L]`` visibility mask
    (bool, or a float of 0 / 1: a cast bool, a ``tril`` of ones), or why not. The key mask
    is None when the mask names none (the caller then looks for zero-padded values).
    ``stored``: the ``[L, L]`` factor read from the model's weights (a registered buffer),
    causal only if its values are the ``tril`` (``causal`` is then True, to be checked at
    run time: :func:`~.jagged_patterns.stored_mask_sources`); else None."""
    root = _through_views_and_casts(mask)
    if not (isinstance(root, fx.Node) and root.op == "call_function" and root.target in _ANDS):
        # one mask, no and: its shape as the scores read it ([B, 1, 1, L] for a bare key
        # mask), not as it was built ([B, L], which would read as [L, L])
        root = mask
    rshape = tuple(ir.shape_of(root) or ()) if isinstance(root, fx.Node) else ()

    def batch_query_key(shape: tuple[int, ...]) -> tuple[int, ...]:
        """A factor's shape aligned to the root's, as ``(batch, query, key)``: the root is
        ``[B|1, 1, L|1, L]``, ``[B|1, L|1, L]`` (the head axis stripped with the views) or
        ``[L|1, L]``."""
        aligned = (1,) * (len(rshape) - len(shape)) + shape
        if len(rshape) == 4:
            return aligned[:1] + aligned[2:] if aligned[1] == 1 else ()
        return (1,) * (3 - len(aligned)) + aligned if len(aligned) in (2, 3) else ()

    whole = batch_query_key(rshape)
    if len(whole) != 3 or whole[0] not in (1, batch) or whole[1] not in (1, length) \
            or whole[2] != length:
        return "mask-shape"
    factors: list[fx.Node] = []
    _mask_factors(mask, factors)
    keys: list[fx.Node] = []
    queries: list[fx.Node] = []
    causal = False
    stored: fx.Node | None = None
    for f in factors:
        aligned = batch_query_key(tuple(ir.shape_of(f) or ()))
        if len(aligned) != 3 or aligned[0] not in (1, batch):
            return "mask-factor"
        if aligned == (1, length, length) and _is_tril(f, length):
            causal = True
            continue
        if aligned == (1, length, length) and stored is None \
                and stored_mask_sources(f, length) is not None:
            causal, stored = True, f
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
    if len(keys) > 1 or len(queries) > 1 or (queries and not keys):
        return "no-key-padding-mask"
    if not keys:
        return None, causal, False, stored
    keep = keep_of(keys[0]) or keys[0]
    if queries and (keep_of(queries[0]) or queries[0]) is not keep:
        return "query-mask-differs"
    return KeyMask(keys[0], False, keep, batch, length), causal, bool(queries), stored


_CANONICAL = [0, 1, 2, 3]


def _equation(node: fx.Node) -> tuple[str, str, str] | None:
    """The two operand layouts and the result's of a two-operand einsum over 4-d tensors
    with distinct letters (no ellipsis, no diagonal), or None."""
    eq, ops = node.args[0], node.args[1]
    if not isinstance(eq, str) or "->" not in eq or "." in eq or len(ops) != 2 \
            or not all(isinstance(o, fx.Node) for o in ops):
        return None
    lhs, out = eq.replace(" ", "").split("->")
    parts = lhs.split(",")
    if len(parts) != 2 or any(len(p) != 4 or len(set(p)) != 4 for p in (*parts, out)):
        return None
    return parts[0], parts[1], out


def _scores(t: Any) -> tuple[fx.Node, fx.Node, list[int], list[int]] | str:
    """``(q, k, q_perm, k_perm)`` of scores ``S[b, h, i, j] = sum_d q . k`` laid out
    ``[B, H, L, L]``: ``matmul(q, k^T)``, or an einsum contracting the last letter of
    neither-batch (``"bnhd,bmhd->bhnm"``); ``x.permute(perm)`` is an operand ``[B, H, L, D]``."""
    if isinstance(t, fx.Node) and t.target is _MATMUL:
        q, kt = t.args[:2]
        if not (isinstance(kt, fx.Node) and kt.target is aten.transpose.int
                and tuple(kt.args[1:3]) in _TRANSPOSED):
            return "scores-not-q-kt"
        return q, kt.args[0], _CANONICAL, _CANONICAL
    if not (isinstance(t, fx.Node) and t.target is aten.einsum.default):
        return "scores-not-a-matmul"
    found = _equation(t)
    if found is None:
        return "scores-not-q-kt"
    x, y, (b, h, i, j) = found
    shared = (set(x) & set(y)) - {b, h, i, j}
    if len(shared) != 1 or set(x) != {b, h, i, *shared} or set(y) != {b, h, j, *shared}:
        return "scores-not-q-kt"
    (d,) = shared
    q, k = t.args[1]
    return q, k, [x.index(c) for c in (b, h, i, d)], [y.index(c) for c in (b, h, j, d)]


def _weighted_sum(node: fx.Node) -> tuple[Any, fx.Node, list[int], list[int]] | None:
    """``(a, v, v_perm, out_perm)`` of ``O[b, h, i, e] = sum_j a[b, h, i, j] v[b, h, j, e]``
    with ``a`` laid out ``[B, H, L, L]``: ``matmul(a, v)`` or an einsum in any output
    layout (``"bhnm,bmhd->bnhd"``); the kernel's ``[B, H, L, D]`` result ``.permute(out_perm)``
    is the node's."""
    if node.target is _MATMUL:
        a, v = node.args[:2]
        return (a, v, _CANONICAL, _CANONICAL) if isinstance(v, fx.Node) else None
    if node.target is not aten.einsum.default:
        return None
    found = _equation(node)
    if found is None:
        return None
    x, y, z = found
    b, h, i, j = x
    rest = set(y) - {b, h, j}
    if len(rest) != 1 or {b, h, j} - set(y) or set(z) != {b, h, i, *rest}:
        return None
    (e,) = rest
    a, v = node.args[1]
    return a, v, [y.index(c) for c in (b, h, j, e)], [(b, h, i, e).index(c) for c in z]


def _permuted(shape: Any, perm: list[int]) -> tuple[int, ...]:
    shape = tuple(int(x) for x in (shape or ()))
    return tuple(shape[p] for p in perm) if len(shape) == len(perm) else ()


def _zero_padded_keys(v: fx.Node, v_perm: list[int], batch: int, length: int
                      ) -> fx.Node | None:
    """The offsets ``v`` was zero-padded over (jagged values written into zeros with
    ``index_put``, or ``index_copy`` at flat positions) when its batch and key axes are that padding's: then a key at or past a
    row's length contributes ``a_ij * 0`` in the model, and leaving it out is exact."""
    found = zero_padded_source(v)
    if found is None:
        return None
    source, offsets = found
    if tuple(ir.shape_of(source) or ())[:2] != (batch, length) \
            or (ir.shape_of(offsets) or (0,))[0] != batch + 1:
        return None
    dims = dims_through_views(source, v, (0, 1), length)
    return offsets if dims == (v_perm[0], v_perm[2]) else None


def _fill(v: fx.Node, batch: int, length: int) -> float:
    """Real tokens over padded slots of zero-padded ``v``: its jagged values' row count (a
    shape, known at compile time) over ``B * L``."""
    found = zero_padded_source(v)
    rows = (ir.shape_of(padded_values(found[0])) or (batch * length,))[0] if found \
        else batch * length
    return round(min(1.0, int(rows) / max(1, batch * length)), 6)


def match(node: fx.Node) -> dict[str, Any] | str | None:
    """The facts of a pointwise-attention output (``matmul(a, v)`` or its einsum), the
    reason it is not one (once it looks like one: ``silu`` scores), or None for any other
    node."""
    found = _weighted_sum(node) if node.op == "call_function" else None
    if found is None:
        return None
    a_node, v, v_perm, out_perm = found
    vshape = _permuted(ir.shape_of(v), v_perm)
    if len(vshape) != 4 or not isinstance(a_node, fx.Node):
        return None
    batch, heads, length, head_dim = vshape
    group = [node]
    a = a_node
    mask = None
    if a.target is aten.mul.Tensor and all(isinstance(t, fx.Node) for t in a.args[:2]):
        x, y = a.args[:2]
        if _normalised_silu(x) == _normalised_silu(y):
            return None
        group.append(a)
        mask, a = (y, x) if _normalised_silu(x) else (x, y)
    elif a.target is aten.where.ScalarOther and _scalar(a.args[2]) == 0.0:
        group.append(a)
        mask, a = a.args[0], a.args[1]
    elif a.target is aten.where.ScalarSelf and _scalar(a.args[1]) == 0.0 \
            and _kept_where_not(a.args[0]) is not None:  # where(m == 0, 0, a)
        group.append(a)
        mask, a = _kept_where_not(a.args[0]), a.args[2]
    elif a.target is aten.masked_fill.Scalar and _scalar(a.args[2]) == 0.0 \
            and _kept_where_not(a.args[1]) is not None:  # a.masked_fill(m == 0, 0)
        group.append(a)
        mask, a = _kept_where_not(a.args[1]), a.args[0]
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
    scale = 1.0
    if isinstance(t, fx.Node) and t.target is aten.mul.Tensor and _scalar(t.args[1]):
        group.append(t)
        scale, t = float(t.args[1]), t.args[0]
    bias = None
    if isinstance(t, fx.Node) and t.target is aten.add.Tensor:
        if scale != 1.0:  # silu(c * (q k^T + bias)): the kernel adds its bias unscaled
            return "scaled-bias"
        x, y = t.args[:2]
        scores = [a for a in (x, y) if isinstance(a, fx.Node) and a.target in (
            _MATMUL, aten.einsum.default, aten.mul.Tensor)]
        if len(scores) != 1 or not isinstance(x, fx.Node) or not isinstance(y, fx.Node):
            return "score-addend"
        bias = y if scores[0] is x else x
        group.append(t)
        t = scores[0]
        if t.target is aten.mul.Tensor and _scalar(t.args[1]):
            group.append(t)
            scale, t = float(t.args[1]), t.args[0]
    qk = _scores(t)
    if isinstance(qk, str):
        return qk
    group.append(t)
    q, k, q_perm, k_perm = qk
    if _permuted(ir.shape_of(q), q_perm) != vshape or _permuted(ir.shape_of(k), k_perm) != vshape:
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
    visible = _visible(mask, batch, length) if mask is not None \
        else (None, False, False, None)
    if isinstance(visible, str):
        return visible
    key_mask, causal, query_mask, stored = visible
    keys: KeyMask | tuple[fx.Node, int, int]
    if key_mask is not None:
        keys = key_mask
    else:  # no mask on the keys: their values may be zero-padded over offsets
        offsets = _zero_padded_keys(v, v_perm, batch, length)
        if offsets is None:
            return "no-key-padding-mask"
        keys = (offsets, 0, length)
    inside = set(group)
    for n in group[1:]:
        if any(u not in inside for u in n.users):
            return f"scores-read-by:{next(u for u in n.users if u not in inside).name}"
    reads: list[dict[str, Any]] = []
    if not query_mask:
        rows = (out_perm.index(0), out_perm.index(2))
        # over offsets, readers of one token per row at a real position or one of an
        # empty row (where the model's attention is 0, as the kernel's) read what the
        # kernel gives; under a data mask nothing would check a reader's positions
        flow = follow_padding(node, rows, keys) if isinstance(keys, KeyMask) \
            else follow_with_reads(node, rows, keys, empty_rows=True)
        if isinstance(flow, fx.Node):
            return f"padding-rows-read-by:{flow.name}"
        reads = read_specs(flow)
    perms = {name: (None if perm == _CANONICAL else perm) for name, perm in (
        ("q_perm", q_perm), ("k_perm", k_perm), ("v_perm", v_perm), ("out_perm", out_perm))}
    return {
        "_group": group,
        "q": q.name, "k": k.name, "v": v.name,
        "output": node.name,
        "mask": key_mask.node.name if key_mask is not None else None,
        "offsets": None if key_mask is not None else keys[0].name,
        **perms,
        "bias": bias.name if bias is not None else None,
        "norm": int(rounded),
        "scale": scale,
        "causal": causal,
        **(_stored_facts(stored, mask, group[1], length) if stored is not None else {}),
        "query_mask": query_mask,
        # readers of one token per row of the output (``out[arange(B), lengths - 1]``):
        # each reads a real token or one of an empty row (``row_reads.kept_by_offsets``)
        **({"reads": reads} if reads else {}),
        "max_len": length, "heads": heads, "head_dim": head_dim,
        # a data mask's fill is unknown at compile time (checked per call); zero-padded
        # values have a fixed number of rows
        "fill": 1.0 if key_mask is not None else _fill(v, batch, length),
    }


def _stored_facts(stored: fx.Node, visible: fx.Node, masking: fx.Node, length: int
                  ) -> dict[str, Any]:
    """What the runner needs to check a causal mask read from the model's weights and,
    when it is not the ``tril``, to compute the model's padded formula exactly:
    ``causal_mask`` (the factor the check compares with the lower-triangular ones),
    ``causal_mask_of`` (the weights it is computed from: the check's result is cached
    per their storage and version), ``visible`` (the whole mask as the scores read it)
    and ``visible_where`` (read by ``where(visible, a, 0)``, else ``a * visible``)."""
    sources = stored_mask_sources(stored, length) or []
    return {"causal_mask": stored.name, "causal_mask_of": [n.name for n in sources],
            "visible": visible.name,
            "visible_where": masking.target in _WHERE_FORMS}


_WHERE_FORMS = (aten.where.ScalarOther, aten.where.ScalarSelf, aten.masked_fill.Scalar)
"""The ways ``a`` is zeroed outside the visible mask by selection (``where(visible, a, 0)``,
``where(visible == 0, 0, a)``, ``a.masked_fill(visible == 0, 0)``), not by a multiply."""


def _price(group: list[fx.Node], facts: dict[str, Any], named: dict[str, fx.Node],
           ctx: PassContext) -> dict[str, float] | None:
    """The group's forward+backward ms padded (op by op), and as the jagged kernel in the
    captured dtype (``op_cost.jagged_silu_kernel_time``: the attention over the real
    tokens, the bias's traffic, the guard and the jagged copies). The plan's step reprices
    the kernel at the runtime dtype (graph_summary.kernel_adjusted_ms)."""
    topology = ctx.topology
    if topology is None:
        return None
    from gemc.cost_model import op_cost

    gpu, calib = topology.gpu, ctx.calibration
    before = sum(float(n.meta.get(ir.PREDICTED_MS) or
                       op_cost.node_cost(n, gpu, calib).total_ms) for n in group)
    after = 1e3 * op_cost.jagged_silu_kernel_time(
        facts, group[0], named, op_cost.dtype_name(ir.dtype_of(group[0])),
        lambda n: (ir.dtype_of(n) or torch.float32).itemsize, gpu, calib)
    return {"before_ms": round(before, 6), "after_ms": round(after, 6)}


@dataclass(frozen=True)
class MatchSiluAttention:
    """Groups each matched formula (``gemc.group``) with ``gemc.kernel`` on its output
    matmul: kind ``jagged_silu_attention`` and the facts the runner needs."""

    name: ClassVar[str] = "match-silu-attention"
    requires: ClassVar[tuple[str, ...]] = ("classify-ops",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        count = 0
        named = {n.name: n for n in gm.graph.nodes}
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
            kept = choose(gm, node, group, found, "jagged_silu_attention", ctx,
                          skip_key=SKIPPED, warning="match-silu-attention: {node} stays "
                          "the padded formula ({why})")
            if kept is not None:  # priced slower than the formula: see attention_choice
                node.meta[SKIPPED] = kept
                ctx.warn(f"match-silu-attention: {node.name} stays the padded formula "
                         f"({kept})")
                continue
            gid = f"jagged_silu_attention_{count}"
            count += 1
            for n in group:
                n.meta[ir.GROUP] = gid
            node.meta[ir.KERNEL] = {"id": gid, "kind": "jagged_silu_attention", **found,
                                    **(_price(group, found, named, ctx) or {})}
        return PassResult(gm, count > 0)
