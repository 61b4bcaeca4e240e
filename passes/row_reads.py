"""Readers of one token per row of a padded sequence, as conditional readers of its padding.

Not a pass: the recogniser :func:`row_read` that ``match-jagged-attention`` and
``pack-jagged-tokens`` hand to :func:`.jagged_patterns.follow_padding`.

Why: most sequence recommenders score the history's last (or first) position, and they
write that readout in a few ways: RecBole's ``gather_indexes(output, item_seq_len - 1)``
(``output.gather(1, index.view(-1, 1, 1).expand(-1, -1, d))``), Hugging Face's
``hidden[torch.arange(B), lengths - 1]`` or ``hidden[torch.arange(B), mask.sum(1) - 1]``,
``hidden[:, 0]`` / ``hidden[:, -1]``, the same keeping the sequence dim (``hidden[:, -1:]``,
``hidden[:, c:c + 1]``, ``hidden.narrow(1, c, 1)``), or over the batch flattened
(``hidden.reshape(B * L, d).index_select(0, arange(B) * L + pos)``, ``hidden.view(-1,
d)[b * L + pos]``). Each reads one token of each row, ``x[b, pos[b]]``.
Whether that token is a real one is data: ``pos`` comes from lengths the mask may not
match (a loader that counts a dropped item, an empty session read at position 0). So such a
reader is token-wise *if* every ``pos[b]`` is a position the key mask keeps, which the
compiled program checks at run time together with the mask (``gemc.guard_sample.
missed_reads``); when it fails, everything the check guards runs padded, the model's own
computation (counted: ``packed_tokens.GUARD_STATS.missed_reads``, and the guarded
attention's fallback). Matched by what the ops compute, never by names: the index must be
``B`` values in row order broadcast over every other dim (a gather), or ``arange(B)``
beside a ``[B]`` index (advanced indexing), or a constant (``select``; a slice or narrow
that keeps exactly one position, resolved against the static ``L`` as Python's slicing
does), or, over the rows flattened to ``[B * L, ...]``, ``B`` flat indices that are a sum
with exactly one term ``arange(B) * L`` (or ``arange(0, B * L, L)``): one multiple of ``L``
per row plus a per-row offset. For that flat form the check does not trust the arithmetic
for the position: it computes ``pos[b] = index[b] - b * L`` from the index itself
(``gemc.guard_sample.read_positions``' ``stride``), so an offset that lands in another row
(or outside every row, where eager wraps or raises) is a miss, run padded as eager runs it.
Where the history is left-padded (or the model keeps its last real token at ``L - 1`` by its
own convention), ``x[:, -1]`` and ``x[:, -1:]`` read a kept token on every row; the region
is then one of kept positions that are no prefix (``compact``), and the check says so per
batch as for any other position.

The index must be computable before what it guards: it may not depend on any value the
padding reaches (:func:`follow_with_reads` refuses it, naming the reader).

Under a mask the graph proves (``arange(L) < lengths.clamp(min=c)`` over the offsets that
pad the history: the facts ``(offsets, c, L)`` of an offset-proven region) a reader needs
no check where the graph proves its position kept too (:func:`kept_by_offsets`: with
``c >= 1``, position 0, or ``lengths.clamp(min=c2) - 1`` of the same offsets, ``1 <= c2 <=
c``): such a reader is ``proven`` and the region stays unchecked (SASRec's last real token
under a clamped mask). Any other position there (``lengths - 1`` of a possibly empty row
reads ``-1``, position ``L - 1`` in eager: padding; ``x[:, -1]``) is no proven reader: the
history is then packed as a guarded region from its padded ``index_put``
(``pack-jagged-tokens``), whose check reads the positions as above.

After HSTU's pointwise attention over offsets (no mask at all: v's zeros pad the keys), a
position of an empty row is as good as a real one (the model's attention is 0 on all of
them, as the kernel's): ``kept_by_offsets``' ``empty_rows``, for ``match-silu-attention``
(any such reader) and ``pack-jagged-tokens`` (position 0 or ``lengths.clamp(min=1) - 1``,
read from slot 0 of an empty row in a layout over the lengths clamped to 1; or the
unclamped ``lengths - 1`` alone, ``kept_by_offsets``' ``empty_last``, read from an empty
row's one slot laid out at position ``L - 1``, where eager's ``-1`` lands).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx

from gemc import ir

from .jagged_patterns import (
    Dims,
    Facts,
    KeyMask,
    PaddingFlow,
    _arange_len,
    _lengths,
    _norm,
    _offsets_batch,
    follow_padding,
)

aten = torch.ops.aten

_ORDER_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
                aten.flatten.using_ints, aten.alias.default, aten.clone.default,
                aten.contiguous.default}
"""Views (and copies) that keep a tensor's elements in row-major order."""
_INTEGERS = (torch.int64, torch.int32)
_INT_CASTS = {aten._to_copy.default, aten.to.dtype, aten.to.device, aten.to.dtype_layout}
"""Casts (and moves) an index goes through before it is used (``.long()``, ``.to(dev)``)."""


@dataclass(frozen=True)
class RowRead:
    """``node`` reads ``source[b, pos[b]]`` along ``source``'s (batch, sequence) ``dims``:
    ``pos`` is ``index`` (its ``B`` elements in row order) or the constant ``at``; ``wrap``:
    a negative position counts from the row's end (indexing and ``select`` do; a gather
    raises); ``keepdim``: the output keeps the sequence dim at size 1 (a gather, a slice);
    ``stride``: ``source`` has its batch and sequence dims merged (``dims`` ``(d, d)``,
    batch outer) and ``index`` is a flat position there, row ``b``'s being ``index[b] - b *
    stride``; ``proven``: the graph proves every position kept (:func:`kept_by_offsets`), so
    nothing checks it."""

    node: fx.Node
    source: fx.Node
    dims: Dims
    index: fx.Node | None
    at: int | None
    wrap: bool
    keepdim: bool
    stride: int | None = None
    proven: bool = False

    def spec(self) -> dict[str, Any]:
        """The facts a plan entry carries (what the runners check and read with)."""
        return {"reader": self.node.name, "source": self.source.name,
                "dims": list(self.dims),
                "index": self.index.name if self.index is not None else None,
                "at": self.at, "wrap": self.wrap, "keepdim": self.keepdim,
                **({"stride": self.stride} if self.stride is not None else {}),
                **({"proven": True} if self.proven else {})}


def row_read(user: fx.Node, src: fx.Node, dims: Dims, facts: Facts,
             empty_rows: bool = False, empty_last: bool = False) -> RowRead | None:
    """The :class:`RowRead` ``user`` is, reading ``src`` (a padded value at ``dims`` under
    the key mask ``facts``), or None. Under a run-time key mask (a :class:`KeyMask`) any
    such reader: its check is where the positions are checked too. Under a mask over
    offsets (``(offsets, clamp_min, L)``: nothing is checked at run time) only a reader
    whose positions the graph proves kept (:func:`kept_by_offsets`, ``empty_rows`` and
    ``empty_last`` as there), ``proven``."""
    if user.op != "call_function" or not user.args or user.args[0] is not src:
        return None
    if isinstance(facts, KeyMask):
        return _read(user, src, dims, facts.batch, facts.length)
    batch = _offsets_batch(facts)
    read = _read(user, src, dims, batch, int(facts[2])) if batch is not None else None
    return replace(read, proven=True) if read is not None \
        and kept_by_offsets(read, facts, empty_rows, empty_last) else None


def kept_by_offsets(read: RowRead, facts: Facts, empty_rows: bool = False,
                    empty_last: bool = False) -> bool:
    """Whether the graph proves that ``read`` reads a position the mask ``arange(L) <
    lengths.clamp(min=c)`` (``facts``: ``(offsets, c, L)``) keeps on every row: with ``c >=
    1`` (every row keeps position 0), position 0 (``x[:, 0]``, ``x[:, :1]``, ``x[:, -L]``),
    or ``lengths.clamp(min=c2) - 1`` with ``lengths`` of the same offsets and ``1 <= c2 <=
    c`` (``max(len, c2) - 1`` is below ``max(len, c)``, and at least 0). A row's length is
    at most ``L``, else the model's own ``index_put`` over those offsets raises. Unclamped
    lengths prove nothing: ``lengths - 1`` of an empty row is ``-1``, which eager reads at
    position ``L - 1`` (wrapped) or rejects (a gather).

    ``empty_rows``: any position of a row with no real token counts as kept too. Why: HSTU's
    pointwise attention over values zero-padded by these offsets (``match-silu-attention``)
    is 0 on every position of such a row in the model, as in its kernel (every value it
    sums is 0; so are its gradients to q, k and the bias), so a reader there reads what the
    kernel gives. Then position 0 and ``lengths.clamp(min=c2) - 1`` with ``0 <= c2 <=
    max(c, 1)`` (the unclamped ``lengths - 1`` included: ``-1`` only on an empty row) read
    a real token or one of an empty row, whatever ``c``.

    ``empty_last``: under the unclamped mask (``c`` 0), each empty row is laid out as one
    slot standing for its position ``L - 1`` (``pack-jagged-tokens``, after HSTU's
    attention over these offsets, which gives that slot 0 as the model gives the position).
    Then exactly ``lengths - 1`` of the same offsets, unclamped, reads a kept position on
    every row: a real token, or ``-1`` of an empty row, which indexing wraps to ``L - 1``,
    the slot (a gather rejects ``-1``, and so does the packed read: ``packed_tokens.
    read_rows``). Position 0 of an empty row is then no slot: refused."""
    offsets, clamp, length = facts
    if read.stride is not None:
        return False
    if empty_last:
        found = _last_of(read.index) if read.index is not None else None
        return clamp == 0 and found is not None and found[0] is offsets and found[1] == 0
    if clamp < 1 and not empty_rows:
        return False
    if read.index is None:
        return read.at == 0 or (read.wrap and read.at == -length)
    found = _last_of(read.index)
    low, high = (0, max(clamp, 1)) if empty_rows else (1, clamp)
    return found is not None and found[0] is offsets and low <= found[1] <= high


def _last_of(index: fx.Node) -> tuple[fx.Node, int] | None:
    """``(offsets, c)`` where ``index`` is ``lengths - 1`` (through order-keeping views and
    casts) with ``lengths`` those offsets' lengths clamped to at least ``c`` (0: unclamped;
    ``jagged_patterns._lengths``), else None."""
    node = _through_order_views(index)
    if not (isinstance(node, fx.Node) and node.target is aten.sub.Tensor
            and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1
            and isinstance(node.args[1], int) and not isinstance(node.args[1], bool)
            and node.args[1] == 1):
        return None
    return _lengths(node.args[0])


def _read(user: fx.Node, src: fx.Node, dims: Dims, batch: int, length: int
          ) -> RowRead | None:
    """:func:`row_read`'s recognition of ``user`` reading one token per row of ``src``
    (``[.., batch, .., length, ..]`` at ``dims``), whatever checks its positions."""
    bd, ld = dims
    shape = tuple(ir.shape_of(src) or ())
    rank = len(shape)
    if bd == ld:
        return _flat_read(user, src, dims, batch, length)
    if bd < 0 or rank <= max(bd, ld) or shape[bd] != batch or shape[ld] != length:
        return None
    t = user.target
    if t is aten.gather.default:
        index = user.args[2] if len(user.args) > 2 else user.kwargs.get("index")
        sparse = user.args[3] if len(user.args) > 3 else user.kwargs.get("sparse_grad", False)
        want = tuple(1 if d == ld else s for d, s in enumerate(shape))
        if _norm(user.args[1], rank) != ld or sparse or not isinstance(index, fx.Node) \
                or tuple(ir.shape_of(index) or ()) != want:
            return None  # (a narrower index reads part of each token: not this reader)
        root = per_row(index, bd, batch)
        return RowRead(user, src, dims, root, None, False, True) if root is not None else None
    if t is aten.index.Tensor:
        indices = list(user.args[1])
        if dims != (0, 1) or len(indices) != 2:
            return None
        rows, pos = indices
        if not isinstance(rows, fx.Node) or not isinstance(pos, fx.Node) \
                or _arange_len(rows) != batch \
                or tuple(ir.shape_of(rows) or ()) != (batch,) \
                or tuple(ir.shape_of(pos) or ()) != (batch,) \
                or ir.dtype_of(pos) not in _INTEGERS:
            return None
        return RowRead(user, src, dims, pos, None, True, False)
    if t is aten.select.int and _norm(user.args[1], rank) == ld:
        return RowRead(user, src, dims, None, int(user.args[2]), True, False)
    if t in (aten.slice.Tensor, aten.narrow.default) and len(user.args) > 1 \
            and _norm(user.args[1], rank) == ld:
        at = _one_position(user, length)
        return RowRead(user, src, dims, None, at, False, True) if at is not None else None
    return None


def _one_position(user: fx.Node, length: int) -> int | None:
    """The one position of ``length`` that a ``slice`` (``x[:, -1:]``, ``x[:, c:c + 1]``,
    any step) or a ``narrow(x, d, c, 1)`` along the sequence keeps, resolved as eager
    resolves it (Python's slicing: negative bounds count from the end and clamp; narrow's
    start may be negative), or None when it keeps another number of positions or a bound
    is not a constant."""
    args = list(user.args[2:])
    if user.target is aten.narrow.default:
        start, size = (args + [None, None][len(args):])[:2]
        if not isinstance(start, int) or size != 1 or not -length <= start < length:
            return None
        return range(length)[start]
    start, end, step = (args + [None, None, 1][len(args):])[:3]
    start, end, step = (user.kwargs.get(k, v) for k, v in
                        (("start", start), ("end", end), ("step", step)))
    if any(v is not None and not isinstance(v, int) for v in (start, end)) \
            or not isinstance(step, int) or step < 1:
        return None
    kept = range(length)[slice(start, end, step)]
    return kept[0] if len(kept) == 1 else None


def _flat_read(user: fx.Node, src: fx.Node, dims: Dims, batch: int, length: int
               ) -> RowRead | None:
    """The :class:`RowRead` of ``src``, a value whose batch and sequence dims are merged
    into one dim ``d`` of ``B * L`` (batch outer: ``x.reshape(B * L, D)``), read by
    ``index_select(src, d, index)`` or ``src[index]`` (``d`` 0) with ``B`` flat indices
    ``arange(B) * L + pos`` (:func:`flat_rows`); else None."""
    if dims[0] < 0:
        return None  # sequence outer ([L * B, E]): a row's stride is 1, not recognised
    d = dims[0]
    shape = tuple(ir.shape_of(src) or ())
    if len(shape) <= d or shape[d] != batch * length:
        return None
    if user.target is aten.index_select.default and _norm(user.args[1], len(shape)) == d:
        index = user.args[2]
    elif user.target is aten.index.Tensor and d == 0 and len(user.args[1]) == 1:
        index = user.args[1][0]
    else:
        return None
    if not isinstance(index, fx.Node) or tuple(ir.shape_of(index) or ()) != (batch,) \
            or ir.dtype_of(index) not in _INTEGERS \
            or not flat_rows(index, batch, length):
        return None
    return RowRead(user, src, dims, index, None, False, False, length)


def flat_rows(index: fx.Node, batch: int, length: int) -> bool:
    """Whether ``index`` (``[B]`` integers) is a sum (``+``/``-`` terms, through views and
    casts) with exactly one term ``arange(B) * length`` (either factor order) or
    ``arange(0, B * length, length)``, added: each row's start in the rows flattened to
    ``[B * length]``, the other terms its offset in that row. Why the structure and not just
    the run-time check: it is what says the reader reads one token of each row in row
    order (the check then says which token, from the index itself)."""
    terms: list[tuple[int, Any]] = []
    stack: list[tuple[int, Any]] = [(1, index)]
    while stack:
        sign, node = stack.pop()
        node = _through_order_views(node)
        if isinstance(node, fx.Node) and node.op == "call_function" \
                and node.target in (aten.add.Tensor, aten.sub.Tensor) \
                and node.kwargs.get("alpha", 1) == 1 and len(node.args) == 2:
            other = sign if node.target is aten.add.Tensor else -sign
            stack += [(sign, node.args[0]), (other, node.args[1])]
        else:
            terms.append((sign, node))
    starts = [sign for sign, node in terms if _row_starts(node, batch, length)]
    return starts == [1]


def _row_starts(node: Any, batch: int, length: int) -> bool:
    """``node`` is ``arange(batch) * length`` or ``arange(0, batch * length, length)``."""
    node = _through_order_views(node)
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target is aten.arange.start_step:
        start, end, step = (list(node.args) + [1])[:3]
        return start == 0 and step == length and isinstance(end, int) \
            and len(range(0, end, length)) == batch
    if node.target is aten.mul.Tensor and len(node.args) == 2:
        for a, b in (node.args, node.args[::-1]):
            if isinstance(b, int) and not isinstance(b, bool) and b == length \
                    and _arange_len(_through_order_views(a)) == batch \
                    and _plain_arange(_through_order_views(a)):
                return True
    return False


def _plain_arange(node: Any) -> bool:
    """``node`` is ``arange(n)`` or ``arange(0, n)`` itself (step 1), not a view of one."""
    return isinstance(node, fx.Node) and (
        node.target is aten.arange.default
        or (node.target is aten.arange.start and node.args[0] == 0))


def _through_order_views(node: Any) -> Any:
    """``node`` through views that keep its elements in order and casts."""
    while isinstance(node, fx.Node) and node.op == "call_function" \
            and (node.target in _ORDER_VIEWS or node.target in _INT_CASTS):
        node = node.args[0]
    return node


def per_row(index: fx.Node, bd: int, batch: int) -> fx.Node | None:
    """The node whose ``batch`` elements, in order, are ``index``'s along dim ``bd``, when
    ``index`` varies along no other dim: ``index`` is an expand of a tensor with ``batch``
    at ``bd`` and 1 elsewhere, itself a row-major view of a ``batch``-element integer
    tensor (``lengths - 1``, ``(...).view(-1, 1, 1)``); else None."""
    node: Any = index
    while isinstance(node, fx.Node) and node.target is aten.expand.default:
        node = node.args[0]
    shape = tuple(ir.shape_of(node) or ()) if isinstance(node, fx.Node) else ()
    if len(shape) != len(ir.shape_of(index) or ()) or shape[bd] != batch \
            or any(s != 1 for d, s in enumerate(shape) if d != bd):
        return None
    while node.op == "call_function" and node.target in _ORDER_VIEWS \
            and isinstance(node.args[0], fx.Node) \
            and _numel(ir.shape_of(node.args[0])) == batch:
        node = node.args[0]
    return node if ir.dtype_of(node) in _INTEGERS else None


def _numel(shape: Any) -> int:
    out = 1
    for s in shape or (-1,):
        out *= int(s)
    return out


def follow_with_reads(start: fx.Node, dims: Dims, facts: Facts, empty_rows: bool = False,
                      also: Callable[..., Any] | None = None, empty_last: bool = False
                      ) -> PaddingFlow | fx.Node:
    """:func:`.jagged_patterns.follow_padding` with :func:`row_read`s allowed: the flow
    (its ``reads``, which the caller must check at run time unless ``proven``), or the
    first node that may read the padding unmasked, a reader whose index depends on a value
    the padding reaches included (it could not be checked before them). ``empty_rows``,
    ``empty_last``: as :func:`kept_by_offsets`. ``also``: another kind of reader allowed
    where :func:`row_read` finds none (``pad_reps.token_reduction``: its readers carry no
    index)."""
    def read(u: fx.Node, s: fx.Node, d: Dims, f: Any) -> Any:
        return row_read(u, s, d, f, empty_rows, empty_last) or (
            also(u, s, d, f) if also else None)

    flow = follow_padding(start, dims, facts, reads=read)
    if isinstance(flow, fx.Node):
        return flow
    reached = set(flow.carriers) | set(flow.zeroed) | set(flow.reads)
    for node, read in flow.reads.items():
        if read.index is not None and ir.ancestors([read.index]) & reached:
            return node
    return flow


def unproven_reader(start: fx.Node, dims: Dims, facts: Facts, node: fx.Node) -> bool:
    """Whether ``node``, where following ``start``'s padding over offsets (``facts``)
    stopped, is a reader of one token per row whose positions the graph does not prove
    real (for the user's message: which reader, and how to make it provable)."""
    return reader_at(start, dims, facts, node) is not None


def reader_at(start: fx.Node, dims: Dims, facts: Facts, node: fx.Node) -> RowRead | None:
    """The :class:`RowRead` ``node`` is in ``start``'s padding flow over offsets
    (``facts``), whatever its positions, or None where it is no such reader."""
    batch = _offsets_batch(facts)
    if batch is None or isinstance(facts, KeyMask):
        return None
    seen: dict[fx.Node, RowRead] = {}

    def any_read(user: fx.Node, src: fx.Node, at: Dims, _: Facts) -> RowRead | None:
        read = _read(user, src, at, batch, int(facts[2])) \
            if user.op == "call_function" and user.args and user.args[0] is src else None
        if read is not None:
            seen[user] = read
        return read

    follow_padding(start, dims, facts, reads=any_read)
    return seen.get(node)


def read_specs(flow: PaddingFlow) -> list[dict[str, Any]]:
    """The flow's readers as plan facts, in graph order."""
    order = {n: i for i, n in enumerate(next(iter(flow.reads)).graph.nodes)} \
        if flow.reads else {}
    return [flow.reads[n].spec() for n in sorted(flow.reads, key=order.__getitem__)]
