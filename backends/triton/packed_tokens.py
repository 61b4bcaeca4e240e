"""The packed token layout of a ``packed_tokens`` region (see ``passes/pack_jagged_tokens``).

A region value is the padded tensor with its batch dim at size 1 and its sequence dim at
size ``T``: the real tokens in offsets order (batch-major, positions below each row's
length, the jagged attention's layout). Keeping the rank and the other dims lets every op
of the region run unchanged, with only the sizes a view or an expand names rewritten; the
token-wise work then scales with ``T`` instead of ``B * L``.

Crossing the region's boundary is a gather (a tensor entering it: by token for a full
``[B, L, ...]`` operand, by row for a per-sequence ``[B, 1, ...]`` one, by position for a
``[1, L, ...]`` one) or a scatter into zeros (a region value read outside it); both are ATen
index ops, so autograd carries the gradients back (zero on the padding rows, as the model's
masks make them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# the check's rules, shared with the cost model (which prices a region at a sample's fill)
from gemc.guard_sample import BUCKETS as BUCKETS  # noqa: F401 - re-exported
from gemc.guard_sample import bucket as bucket  # noqa: F401
from gemc.guard_sample import kept_keys, mask_rows, missed_reads
from gemc.guard_sample import packs as packs  # noqa: F401

# the packed rules, shared with the cost model (which prices each region node at the size
# it runs at)
from gemc.packed_rules import FIRST_ONLY as FIRST_ONLY  # noqa: F401 - re-exported
from gemc.packed_rules import SIZED as SIZED  # noqa: F401
from gemc.packed_rules import attention_operands as attention_operands  # noqa: F401
from gemc.packed_rules import causal_self_attention as causal_self_attention  # noqa: F401
from gemc.packed_rules import draws as draws  # noqa: F401
from gemc.packed_rules import is_pointwise as is_pointwise  # noqa: F401
from gemc.packed_rules import per_token as per_token  # noqa: F401

from .segment_sum import segment_sum_rows

aten = torch.ops.aten
Dims = tuple[int, int]


@dataclass
class GuardStats:
    """How often a region guarded by a run-time mask check ran packed (every row a prefix)
    or padded (the model's own computation), and how many of the padded calls had a
    one-token reader (``x[arange(B), lengths - 1]``) reading a padding token
    (``missed_reads``): module-level, :data:`GUARD_STATS`."""

    calls: int = 0
    packed: int = 0
    padded: int = 0
    missed_reads: int = 0
    # padded calls of a region with padding representatives whose padded entries differed
    # within a row (``gemc.guard_sample.padding_reps``)
    unequal_padding: int = 0
    # padded calls of a region with padding representatives laid out from its sources
    # (``rep_layout: "sources"``) whose source input itself requires a gradient: the
    # packed run gives each representative's position the sum of its copies' gradients,
    # eager gives each copy its own (parameters' gradients are the same either way)
    input_grad: int = 0

    def count(self, packed: bool, flags: list[int] | None = None,
              input_grad: bool = False) -> None:
        """One call's outcome; ``flags``: its check's (:func:`region_check`, with
        :func:`gemc.guard_sample.padding_reps`' two after them in a ``pad_rep`` region)."""
        self.calls += 1
        if packed:
            self.packed += 1
        else:
            self.padded += 1
            self.missed_reads += int(bool(flags is not None and len(flags) > 4 and flags[4]))
            self.unequal_padding += int(bool(flags is not None and len(flags) > 5
                                             and flags[5]))
            self.input_grad += int(input_grad)

    def reset(self) -> None:
        self.calls = self.packed = self.padded = self.missed_reads = 0
        self.unequal_padding = self.input_grad = 0

    def as_dict(self) -> dict[str, int]:
        """The counts; ``unequal_padding`` only once a call ran padded for it (the report
        of a model without padding representatives keeps its four keys)."""
        out = {"calls": self.calls, "packed": self.packed, "padded": self.padded,
               "missed_reads": self.missed_reads}
        if self.unequal_padding:
            out["unequal_padding"] = self.unequal_padding
        if self.input_grad:
            out["input_grad"] = self.input_grad
        return out


GUARD_STATS = GuardStats()


def region_check(mask: torch.Tensor, additive: bool, reads: Sequence[torch.Tensor] = ()
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A guarded region's run-time check of its ``[B, L]`` key mask (or its rows viewed
    ``[B, 1, ..., 1, L]``), on the device with no sync: ``(offsets [B + 1], flags [5])``,
    the flags being the rows that break the prefix, the additive values that are no key
    mask (see ``key_padding_attention``), the kept tokens in all, the rows that keep none,
    and the rows whose one-token readers (their positions ``reads``:
    ``gemc.guard_sample.read_positions``) read a token the mask drops. Both runners read
    the flags on the host once per call (:func:`packs`)."""
    from .key_padding_attention import prefix_lengths

    mask = mask_rows(mask)
    offsets, bad = prefix_lengths(mask, additive)
    empty = (offsets[1:] == offsets[:-1]).sum().reshape(1)
    missed = missed_reads(kept_keys(mask, additive), reads) if reads else \
        torch.zeros(1, dtype=torch.int64, device=mask.device)
    return offsets, torch.cat([bad.sum(0).to(torch.int64), offsets[-1:], empty, missed])


def kept_positions(mask: torch.Tensor, additive: bool, room: int) -> torch.Tensor:
    """For each of ``room`` token slots (the kept positions of a ``[B, L]`` key mask in row
    order, then spare slots) the position it has in its row, on the device with no sync:
    the layout of a guarded region whose mask keeps positions that are not a prefix
    (``TokenLayout.positions``). Kept: True, or an additive 0 (the check's rule). A spare
    slot answers 0, as :meth:`TokenLayout.index` reads it."""
    mask = mask_rows(mask)
    flat = kept_keys(mask, additive).flatten()
    slot = torch.cumsum(flat.to(torch.int64), 0) - 1
    cols = torch.arange(mask.shape[1], device=mask.device).repeat(mask.shape[0])
    out = torch.zeros(room + 1, dtype=torch.int64, device=mask.device)
    return out.index_copy(0, torch.where(flat, slot.clamp(max=room), room), cols)[:room]


@dataclass
class TokenLayout:
    """Where the real tokens of one padded ``[B, L]`` batch sit: ``offsets`` (the attention's
    lengths, clamped as its mask clamps them) and room for ``total`` tokens.

    ``total`` is either the exact count (a host sync) or an upper bound the host knows
    from shapes alone (:meth:`bounded`); the tokens past the real ones are *spare*: zero
    where a value enters the region, ignored by the attention (it walks the offsets),
    dropped where a value leaves it, and, as every op of the region is token-wise, they never
    reach a real token. Their gradients are therefore zero. Why a bound: the exact count
    is data, reading it drains the GPU's queue mid-forward, and a count that changes every
    batch would give every fused kernel a new shape to tune; the bound depends only on the
    batch's shapes."""

    offsets: torch.Tensor
    total: int
    batch: int
    max_len: int
    positions: torch.Tensor | None = None
    """Per token slot its position in the row, where the kept positions are not a prefix
    (:func:`kept_positions`: a guarded region over a mask that is not one, compacted; or
    :func:`with_empty_last`); None: the slot's rank in its row (``t - offsets[row]``), a
    prefix."""
    empty_last: bool = False
    """The ``positions`` are the ranks but on each empty row's one slot, which stands for
    position ``L - 1`` (:func:`with_empty_last`). An attention over the region's offsets
    whose values are zero there (HSTU's, its v a source) gives that slot 0 whatever its
    position, so such an attention still runs on the tokens by ranks."""
    weights: torch.Tensor | None = None
    """Per token slot how many padded tokens it stands for, in a layout with padding
    representatives (:func:`rep_layout`): 1 for a real token, ``L - len`` for a row's
    representative (its first padded position, the last slot of the row); None: every
    slot is one token, the padding is not there."""
    _index: dict[str, torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def _offsets(offsets: torch.Tensor, clamp_min: int, max_len: int) -> torch.Tensor:
        lengths = (offsets[1:] - offsets[:-1]).clamp(min=clamp_min, max=max_len)
        return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])

    @classmethod
    def of(cls, offsets: torch.Tensor, clamp_min: int, max_len: int) -> TokenLayout:
        """The exact layout (one host sync: ``total`` is read from the device)."""
        attn = cls._offsets(offsets, clamp_min, max_len)
        return cls(attn, int(attn[-1]), int(offsets.numel() - 1), max_len)

    @classmethod
    def bounded(cls, offsets: torch.Tensor, clamp_min: int, max_len: int,
                values: int) -> TokenLayout:
        """Room for every token without a sync: ``values`` (the jagged values' count, a
        shape) plus the ``clamp_min`` slots each row may add."""
        batch = int(offsets.numel() - 1)
        return cls(cls._offsets(offsets, clamp_min, max_len),
                   int(values) + batch * max(0, int(clamp_min)), batch, max_len)

    def index(self, kind: str) -> torch.Tensor:
        """Per token slot: ``row``, ``pos``, ``flat`` (``row * L + pos``) to gather with (a
        spare slot reads element 0), or ``row_out`` / ``flat_out`` to scatter with (a spare
        slot writes one past the end: ``B`` / ``B * L``, a row the caller drops)."""
        if not self._index:
            dev = self.offsets.device
            t = torch.arange(self.total, device=dev)
            row = _row_of_slot(self.offsets, self.total)  # B for spare slots
            live = row < self.batch
            row_in = torch.where(live, row, 0)
            rank = t - self.offsets[row_in] if self.positions is None else self.positions
            pos = torch.where(live, rank, 0)
            flat = row_in * self.max_len + pos
            self._index.update(row=row_in, pos=pos, flat=flat, row_out=row,
                               flat_out=torch.where(live, flat, self.batch * self.max_len))
        return self._index[kind]


REPS = "padding-representatives"
"""The ``positions`` argument the compiled graph's layout helpers get for a region with
padding representatives (``inductor_graph._layout``): its slots are a prefix layout whose
last slot per row may stand for the row's padding (:func:`with_rep_weights`)."""


def rep_offsets(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """The offsets of a layout with padding representatives: each row's real tokens (a
    prefix of ``lengths[b]``) and, where it has padding, its first padded position as one
    more token: the prefix layout over ``min(len + 1, L)``, so gathers and the one-token
    readers need nothing new."""
    widened = (lengths.to(torch.int64) + 1).clamp(max=max_len)
    return torch.cat([widened.new_zeros(1), torch.cumsum(widened, 0)])


def with_rep_weights(layout: TokenLayout) -> TokenLayout:
    """``layout`` (over :func:`rep_offsets`) with its ``weights``: 1 for every slot but each
    row's last, which weighs ``L - width + 1``. Why the offsets suffice: a row of width
    ``w < L`` has ``w - 1`` real tokens and a representative of ``L - (w - 1)`` padded ones;
    a row of width ``L`` is full (weight 1) or has one padded position (its representative
    weighs ``L - (L - 1) = 1``): the same formula. Spare slots (a bucketed count) weigh 0."""
    row = layout.index("row")
    width = (layout.offsets[1:] - layout.offsets[:-1])[row]
    last = layout.index("pos") == width - 1
    live = layout.index("row_out") < layout.batch
    weights = torch.where(last, layout.max_len - width + 1, 1) * live
    layout.weights = weights.to(torch.float32)
    return layout


EMPTY_LAST = "empty-rows-at-last-position"
"""The ``positions`` argument the compiled graph's layout helpers get for an offset-proven
region with ``empty_last`` (``inductor_graph._layout``): the positions follow from the
region's offsets (:func:`with_empty_last`)."""


def with_empty_last(layout: TokenLayout, offsets: torch.Tensor) -> TokenLayout:
    """``layout`` (over the lengths clamped to 1: one slot per empty row) with each empty
    row's slot standing for position ``L - 1`` instead of 0: its ``positions``, the ranks
    elsewhere (a spare slot 0, as :meth:`TokenLayout.index` reads it). ``offsets``: the
    region's own, unclamped (which rows are empty). Why ``L - 1``: the region's reader is
    the unclamped ``lengths - 1`` (``pack-jagged-tokens``' ``empty_last``), which eager
    reads at ``-1``, wrapped to ``L - 1``; every gather into the region then reads what
    eager computes there (a position embedding's row ``L - 1``), and the reader the slot
    (:func:`read_rows`). On the device, no sync."""
    dev = layout.offsets.device
    row = _row_of_slot(layout.offsets, layout.total)
    live = row < layout.batch
    row_in = torch.where(live, row, 0)
    rank = torch.arange(layout.total, device=dev) - layout.offsets[row_in]
    empty = (offsets[1:] - offsets[:-1] <= 0)[row_in]
    layout.positions = torch.where(live & empty, layout.max_len - 1,
                                   torch.where(live, rank, 0))
    layout.empty_last = True
    layout._index.clear()
    return layout


def _row_of_slot(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """Per token slot ``t < total`` its row: how many row ends ``offsets[1:]`` are ``<= t``
    (``searchsorted(offsets[1:], t, right=True)``; ``B`` for a spare slot).

    Why counted, not searched: this runs inside the graph Inductor compiles, and Inductor's
    CUDA lowering of ``searchsorted`` over a sliced boundary tensor (``offsets[1:]``) drops
    the slice's offset and answers one row too far for every slot (pytorch/pytorch#182343,
    seen here as GEM's packed history tower training on shifted rows and positions on the
    H200 while the CPU, eager and the interpreter were right). A scatter of ones at each
    row end and a running sum give the same count with ops every backend lowers alike."""
    ends = offsets[1:].clamp(max=total)  # a row ending at or past the room: no slot after it
    marks = torch.zeros(total + 1, dtype=offsets.dtype, device=offsets.device)
    marks = marks.index_add(0, ends, torch.ones_like(ends))
    return torch.cumsum(marks, 0)[:total]


def gather(x: Any, dims: Dims, rank: int, layout: TokenLayout,
           take: Callable[..., torch.Tensor] | None = None) -> Any:
    """``x`` (broadcastable, right-aligned, to a rank-``rank`` value whose batch and
    sequence dims are ``dims``) in the packed layout; a tensor constant over both, or not a
    tensor, comes back as it is. ``take(src, index, offsets)`` picks the rows (default
    :class:`_Gather`; the Inductor graph passes its custom op ``gemc::gather_tokens``)."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    given = x
    if x.dim() < rank:
        x = x.reshape((1,) * (rank - x.dim()) + tuple(x.shape))
    split = _split_padded(x, dims, layout)
    if split is not None:
        x, plain, at = split
        return gather(x, plain, rank + 1, layout, take).flatten(at, at + 1)
    if dims[0] == dims[1] or dims[0] < 0:  # merged, constant over the tokens: broadcast
        return given
    bd, ld = dims
    sb, sl = x.shape[bd], x.shape[ld]
    if sb == 1 and sl == 1:
        return given
    kind = "flat" if sb > 1 and sl > 1 else "row" if sb > 1 else "pos"
    moved = x.movedim((bd, ld), (0, 1))
    rest = tuple(moved.shape[2:])
    picked = (take or _Gather.apply)(moved.reshape(sb * sl, *rest), layout.index(kind),
                                     layout.offsets if kind == "row" else None)
    return picked.view(1, layout.total, *rest).movedim((0, 1), (bd, ld))


class _Gather(torch.autograd.Function):
    """``src[index]`` whose backward adds the gradients up in fp32. Why not ``index_select``:
    its backward adds with atomics in the gradient's dtype (bf16 for a bf16 operand), where
    the broadcast it replaces (eager's) reduces in fp32. For a per-sequence operand
    gathered to every token of its row (``offsets`` given) the tokens of one row are
    contiguous, and the backward is :func:`.segment_sum.segment_sum_rows` (one pass, no
    atomics); other gathers (by position, by token) add in an fp32 ``index_add``."""

    @staticmethod
    def forward(ctx, src, index, offsets):  # type: ignore[override]
        ctx.save_for_backward(index, offsets)
        ctx.rows, ctx.dtype = src.shape[0], src.dtype
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        index, offsets = ctx.saved_tensors
        if offsets is not None:  # by row; spare slots past offsets[-1] (zero) are not read
            return segment_sum_rows(grad, offsets, ctx.dtype), None, None
        acc = torch.zeros((ctx.rows, *grad.shape[1:]), dtype=torch.float32, device=grad.device)
        return acc.index_add_(0, index, grad.float()).to(ctx.dtype), None, None


class _SegmentSum(torch.autograd.Function):
    """Each row's tokens added up (fp32 accumulation, the input's dtype out); the gradient
    of a row's sum goes back to each of its tokens, zero to the spare slots."""

    @staticmethod
    def forward(ctx, tokens, offsets, row_out):  # type: ignore[override]
        ctx.save_for_backward(row_out)
        return segment_sum_rows(tokens, offsets)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (row_out,) = ctx.saved_tensors  # B (one past the rows) for a spare slot
        padded = torch.cat([grad, grad.new_zeros((1, *grad.shape[1:]))])
        return padded.index_select(0, row_out), None, None


def _tokens(x: torch.Tensor, dims: Dims, layout: TokenLayout
            ) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A packed value as ``[T, rest...]`` (its batch and sequence dims moved to the front
    and merged), and ``rest``."""
    moved = x.movedim(dims, (0, 1))
    rest = tuple(moved.shape[2:])
    return moved.reshape(layout.total, *rest), rest


def _merged_at(dims: Dims) -> int | None:
    """The one dim a merged pair of token dims occupies (``(d, d)``: batch outer, ``(~d, ~d)``:
    sequence outer, as ``passes/jagged_patterns`` writes them), or None."""
    if dims[0] != dims[1]:
        return None
    return dims[0] if dims[0] >= 0 else ~dims[0]


def _split_padded(x: torch.Tensor, dims: Dims, layout: TokenLayout
                  ) -> tuple[torch.Tensor, Dims, int] | None:
    """A padded value whose token dims are not two plain dims, with them made so: a merged
    ``B * L`` (or ``L * B``) dim unflattened, a batch dim that holds ``B * k`` (the batch
    outer of an inner factor: ``nn.MultiheadAttention``'s ``[L, B * heads, d]``) split into
    ``(B, k)``. Returns the split value, its plain dims and the dim to flatten back at; None
    when there is nothing to split (plain dims, or a value constant over the tokens)."""
    d = _merged_at(dims)
    b, n = layout.batch, layout.max_len
    if d is not None:
        if x.shape[d] == 1:
            return None
        outer_batch = dims[0] >= 0
        x = x.unflatten(d, (b, n) if outer_batch else (n, b))
        return x, ((d, d + 1) if outer_batch else (d + 1, d)), d
    bd, ld = dims
    size = x.shape[bd]
    if bd < 0 or size <= b or size % b:
        return None
    return x.unflatten(bd, (b, size // b)), (bd, ld + (ld > bd)), bd


def scatter(x: torch.Tensor, dims: Dims, layout: TokenLayout) -> torch.Tensor:
    """A packed value back at its padded shape, zeros on the padding rows; in a layout with
    padding representatives (``layout.weights``) each row's representative on every one of
    its padded positions (:func:`_broadcast_reps`)."""
    d = _merged_at(dims)
    if d is not None:  # [.., T, ..] -> [.., 1, T, ..] (or [.., T, 1, ..]) -> B * L
        outer_batch = dims[0] >= 0
        plain = (d, d + 1) if outer_batch else (d + 1, d)
        return scatter(x.unsqueeze(d if outer_batch else d + 1), plain, layout
                       ).flatten(d, d + 1)
    if x.shape[dims[0]] > 1:  # the batch dim holds an inner factor k: [.., k, ..] -> B * k
        bd, ld = dims
        return scatter(x.unsqueeze(bd), (bd, ld + (ld > bd)), layout).flatten(bd, bd + 1)
    bd, ld = dims
    tokens, rest = _tokens(x, dims, layout)
    if layout.weights is not None:
        return _broadcast_reps(tokens, rest, layout).movedim((0, 1), (bd, ld))
    full = tokens.new_zeros((layout.batch * layout.max_len + 1, *rest))  # + a spare row
    full = full.index_copy(0, layout.index("flat_out"), tokens)[:-1]
    return full.view(layout.batch, layout.max_len, *rest).movedim((0, 1), (bd, ld))


def _broadcast_reps(tokens: torch.Tensor, rest: tuple[int, ...], layout: TokenLayout
                    ) -> torch.Tensor:
    """``[B, L, rest...]`` from a layout with padding representatives: position ``p`` of
    row ``b`` reads slot ``offsets[b] + min(p, width_b - 1)``, the row's representative
    (its last slot) on every padded position. Exact where the region's check passed: every
    padded copy is that value in eager (a masked value's representative is 0, as eager's
    padded rows are). A gather, so autograd gives the representative the sum of its
    copies' gradients."""
    offsets = layout.offsets
    width = offsets[1:] - offsets[:-1]  # [B]
    cols = torch.arange(layout.max_len, device=offsets.device)
    slot = offsets[:-1, None] + torch.minimum(cols[None, :], (width - 1).clamp(min=0)[:, None])
    picked = tokens.index_select(0, slot.flatten())
    return picked.view(layout.batch, layout.max_len, *rest)


def weighted_reduce(x: torch.Tensor, dims: Dims, layout: TokenLayout, op: str,
                    reduced: Sequence[int], keepdim: bool, correction: float = 0.0
                    ) -> torch.Tensor:
    """A reduction over the token axis (``reduced``: dims of the padded value, both token
    dims or their merged one among them) of a packed value in a layout with padding
    representatives, each slot counted ``layout.weights`` times: ``sum`` is ``sum(w x)``,
    ``mean`` ``sum(w x) / N``, ``var`` ``sum(w (x - mean)^2) / (N - correction)``, ``std``
    its root (``N``: the padded count, ``sum(w)`` times the other reduced dims' sizes).
    Equal to the op on the padded value when every padded copy is its row's
    representative; accumulated in fp32 at least (as ATen reduces a bf16 tensor), returned
    in ``x``'s dtype."""
    assert layout.weights is not None
    merged = _merged_at(dims)
    axis = merged if merged is not None else dims[1]
    shape = [1] * x.dim()
    shape[axis] = layout.total
    acc = torch.promote_types(x.dtype, torch.float32)
    w = layout.weights.to(acc).view(shape)
    xs = x.to(acc)
    dims_ = sorted({int(d) % max(x.dim(), 1) for d in reduced})
    count = w.sum()
    for d in dims_:
        if d != axis:
            count = count * x.shape[d]
    total = (xs * w).sum(dims_, keepdim=True)
    if op == "sum":
        out = total
    else:
        mean = total / count
        if op == "mean":
            out = mean
        else:
            out = ((xs - mean) ** 2 * w).sum(dims_, keepdim=True) / (count - correction)
            if op == "std":
                out = out.sqrt()
    if not keepdim:
        out = out.squeeze(dims_) if dims_ else out
    return out.to(x.dtype)


def in_eager_order(x: torch.Tensor, stride: tuple[int, ...] | None) -> torch.Tensor:
    """``x`` laid out in the memory order of the strides eager gave the value (its
    capture's ``stride``): dense, its dims ordered by those strides (ties by dim).

    Why: an op that draws random numbers (``packed_rules.draws``: a dropout) runs on the
    padded tensor so that it draws eager's numbers, but ATen draws them in memory order
    (``bernoulli_`` of an ``empty_like`` of the input, which keeps the input's dim order),
    so the scattered input, contiguous, gets eager's numbers on other elements where
    eager's was not (torch's encoder layer: its attention block's output is a transposed
    view, strides ``(E, B * E, 1)``). The order, not the strides themselves, so a batch
    of another size (an input the plan lets vary) is laid out alike."""
    if stride is None or x.dim() != len(stride):
        return x
    order = sorted(range(x.dim()), key=lambda d: (-stride[d], d))
    if order == list(range(x.dim())) and x.is_contiguous():
        return x
    out = x.new_empty([x.shape[d] for d in order]).permute(
        sorted(range(x.dim()), key=order.__getitem__))
    return out.copy_(x)


def segment_sum(x: torch.Tensor, dims: Dims, layout: TokenLayout) -> torch.Tensor:
    """``scatter(x).sum(sequence dim)`` without the padded tensor: each row's tokens added
    up (in fp32, as a reduction over a bf16 dim accumulates). Only for a value whose padding
    rows are zero (a masked one): the pass never lets another reach a sum over positions."""
    bd, ld = dims
    tokens, rest = _tokens(x, dims, layout)
    acc = _SegmentSum.apply(tokens, layout.offsets, layout.index("row_out"))
    return acc.movedim(0, bd - (bd > ld))


def packed_shape(shape: list[int] | tuple[int, ...], dims: Dims, rank: int,
                 total: int, batch: int = 1) -> list[int]:
    """A (right-aligned) value shape of a region value in the packed layout: the batch dim
    1 (``k`` where it holds ``batch * k``), the sequence dim ``total`` when the value varies
    over either (it is gathered to every token), else 1; a merged pair's dim ``total``."""
    s = [int(v) for v in shape]
    off = rank - len(s)
    d = _merged_at(dims)
    if d is not None:
        if d - off >= 0 and s[d - off] != 1:
            s[d - off] = total
        return s
    bd, ld = dims[0] - off, dims[1] - off
    sb = s[bd] if bd >= 0 else 1
    sl = s[ld] if ld >= 0 else 1
    if bd >= 0:
        s[bd] = _packed_batch(sb, batch)
    if ld >= 0:
        s[ld] = total if (sb != 1 or sl != 1) else 1
    return s


def _packed_batch(size: Any, batch: int) -> Any:
    """A batch dim's packed size: 1, or ``k`` where the dim holds ``batch * k`` (the batch
    outer of an inner factor: heads merged into the batch dim)."""
    if isinstance(size, int) and size > batch and size % batch == 0:
        return size // batch
    return 1


def resize(sizes: list[Any], dims: Dims, total: int, batch: int = 1) -> list[Any]:
    """A view's or expand's size list with the batch and sequence sizes packed (a merged
    pair's one dim: ``total``)."""
    out = list(sizes)
    d = _merged_at(dims)
    if d is not None:
        out[d] = total
        return out
    out[dims[0]] = _packed_batch(out[dims[0]], batch)
    out[dims[1]] = total
    return out


def source(values: torch.Tensor, row: torch.Tensor, pos: torch.Tensor,
           layout: TokenLayout, accumulate: bool = False, in_order: bool = False
           ) -> torch.Tensor:
    """The packed form of ``zeros(B, L, ...).index_put((row, pos), values)``, built without
    the padded tensor: value ``i`` lands on token ``offsets[row[i]] + pos[i]``. With
    ``in_order`` (the pass proved ``(row, pos)`` the jagged positions of the region's own,
    unclamped offsets: ``offsets[row[i]] + pos[i] = i``) value ``i`` is token ``i`` and the
    values are the packed value as they are, viewed: no copy."""
    if in_order and values.shape[0] == layout.total:
        return values.view(1, layout.total, *values.shape[1:])
    token = layout.offsets[row] + pos
    out = values.new_zeros((layout.total, *values.shape[1:]))
    out = out.index_put((token,), values, accumulate=accumulate)
    return out.view(1, layout.total, *values.shape[1:])


def read_rows(x: torch.Tensor, dims: Dims, layout: TokenLayout, positions: torch.Tensor,
              keepdim: bool) -> torch.Tensor:
    """``scatter(x)`` read at one position per row without the padded tensor: row ``b``'s
    token at ``positions[b]`` (``gemc.guard_sample.read_positions``; the region's check
    found each a kept position), as the one-token reader (``passes/row_reads``) returns
    it: ``[..B.., 1, ...]`` at ``dims`` with ``keepdim`` (a gather), else without the
    sequence dim (indexing, ``select``). Where the row's kept positions are a prefix, the
    token is ``offsets[b] + positions[b]``; in a compact layout (kept positions in any
    order, ``layout.positions``) it is the slot holding that position of that row. A value
    whose batch and sequence dims are merged (``(d, d)``: ``x.reshape(B * L, D)`` read at
    ``arange(B) * L + pos``) holds the tokens at ``d``; the ``B`` picked rows go there.
    A position -1 (outside the row: a gather's ``-1`` on an empty row, which eager rejects,
    ``read_positions``) reads past the tokens, so the read raises as eager's does."""
    merged = _merged_at(dims)
    tokens = x.movedim(merged, 0) if merged is not None else _tokens(x, dims, layout)[0]
    batch, length = layout.batch, layout.max_len
    if layout.positions is None:
        slot = layout.offsets[:-1] + positions
    else:  # slot of each (row, position): the inverse of the slots' flat positions
        flat = layout.index("flat_out")  # B * L for a spare slot: dropped below
        slots = torch.arange(layout.total, device=flat.device)
        inverse = torch.zeros(batch * length + 1, dtype=torch.int64, device=flat.device)
        inverse = inverse.index_copy(0, flat, slots)
        rows = torch.arange(batch, device=flat.device)
        slot = inverse[rows * length + positions.clamp(min=0)]
    slot = torch.where(positions >= 0, slot, tokens.shape[0])
    picked = tokens.index_select(0, slot)  # [B, rest...]
    if merged is not None:
        return picked.movedim(0, merged)
    bd, ld = dims
    if keepdim:
        return picked.unsqueeze(1).movedim((0, 1), (bd, ld))
    return picked.movedim(0, bd - (bd > ld))


def exit_tokens(x: torch.Tensor, dims: Dims, layout: TokenLayout, row: torch.Tensor,
                col: torch.Tensor) -> torch.Tensor:
    """``scatter(x)[row, col]`` without the padded tensor: a region value gathered at
    jagged positions ``(row, col)`` of the region's own offsets (``pack-jagged-tokens``'
    ``exits``: every ``col`` below its row's length), read from the packed tokens. Token
    ``(r, c)`` sits at ``offsets[r] + c``; in the model's own jagged order that is every
    token in order, one gather over the real tokens (no spare slot is read)."""
    tokens, _ = _tokens(x, dims, layout)
    return tokens.index_select(0, layout.offsets[row] + col)




def rep_key_bias(mask: torch.Tensor, additive: bool, layout: TokenLayout
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-key score bias of an attention over a layout with padding representatives
    (``[B, L]`` fp32 by position within the row, what
    ``gemc::jagged_attention_values`` reads as its ``key_bias``) from its ``[B, L]`` key mask (a
    bool keep-mask or an additive one), and which rows keep some key (``[B]`` bool).

    A real slot's key is biased by its own mask entry; a row's last slot stands for its
    positions ``p >= width - 1`` (its representative and, in a full row, itself alone):
    biased by ``logsumexp`` of their mask entries, since ``c`` identical keys with entries
    ``m_p`` weigh ``sum_p exp(s + m_p) = exp(s + logsumexp(m))`` in the softmax, forward and
    backward (``-inf`` where none is kept: the empty row's position 0, kept by
    TransAct's ``mask[:, 0] = 0``, gives its representative ``log 1 = 0``). One kernel,
    ``gemc::rep_key_bias`` (:mod:`.rep_key_bias`, whose doc says why)."""
    from . import ops  # noqa: F401  (registers the gemc:: ops)
    from .rep_key_bias import rep_key_bias as _rep_key_bias

    if mask.requires_grad and torch.is_grad_enabled():
        _warn_mask_grad()
    return _rep_key_bias(mask.detach(), layout.offsets, bool(additive))


def _warn_mask_grad() -> None:
    import warnings

    warnings.warn(
        "gemc: the key mask of an attention over padding representatives "
        "(packed_tokens.rep_attention) requires grad, but the packed attention takes its "
        "bias as a mask and passes it no gradient (gemc::jagged_attention_values' key_bias, "
        "as before the bias became one kernel): the mask's gradient is zero here where "
        "eager's is not. Detach the mask in the model, or compile with "
        "--disable-pass pack-jagged-tokens",
        stacklevel=3)


def rep_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  dims: tuple[Dims, ...], layout: TokenLayout, mask: torch.Tensor,
                  additive: bool, scale: float | None) -> torch.Tensor:
    """A key-padding attention (not causal, a per-key ``mask``) on the tokens of a region
    with padding representatives, in place: each row's slots as queries and keys, each
    key biased by :func:`rep_key_bias`. Equal to the attention on the padded values the
    representatives scatter to (:func:`scatter`) at every slot; a row keeping no key gives
    0 and no gradient, as the SDPA it replaces does (:mod:`.rep_key_bias`: its bias is
    ``-inf`` on every key; no pass over the output). Two gemc ops forward (the bias, the
    attention), one backward."""
    from . import ops  # noqa: F401  (registers the gemc:: ops)

    qj, kj, vj = one_dtype(*(token_major(x, d) for x, d in zip((q, k, v), dims)))
    if scale is None:
        scale = qj.shape[-1] ** -0.5
    bias, _ = rep_key_bias(mask, additive, layout)
    out, _ = torch.ops.gemc.jagged_attention_values(
        qj, kj, vj, layout.offsets, layout.max_len, float(scale), False, bias)
    if q.dim() == 3:  # heads in the batch dim: [T, H, D] -> [H, T, D] at its dims
        bd, ld = dims[3]
        return out.movedim((0, 1), (ld, bd))
    return out.unsqueeze(0).movedim((0, 1), dims[3])


def one_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v in one dtype, as gemc's attention kernels read them (a ``tl.dot`` of a
    bf16 and an fp32 tile does not compile). A mix arises under autocast, where the SDPA
    eager runs casts all three to the autocast dtype (MMoE h200: its candidate query in
    fp32, the history's keys and values from bf16 projections); elsewhere the wider one."""
    if q.dtype == k.dtype == v.dtype:
        return q, k, v
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def token_major(x: torch.Tensor, dims: Dims) -> torch.Tensor:
    """A packed attention operand as ``[T, H, D]``: ``[1, H, T, D]`` at its dims (heads a
    dim of their own), or rank 3 with the heads in the batch dim (``nn.MultiheadAttention``'s
    ``[B * H, L, D]``, packed ``[H, T, D]``)."""
    bd, ld = dims
    if x.dim() == 3:
        return x.movedim((ld, bd), (0, 1))
    return x.movedim(dims, (0, 1)).flatten(0, 1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: tuple[Dims, ...],
              layout: TokenLayout, scale: float | None, causal: bool = False) -> torch.Tensor:
    """Jagged attention on region values (``dims``: q's, k's, v's and the output's), within
    each row's tokens of ``layout``, in the values' own layout (no conversion); over a
    compact region's kept tokens too where the caller knows the rule holds (their order in
    each row is kept). Both runners call it (``gemc::jagged_attention_values``)."""
    qj, kj, vj = one_dtype(*(token_major(x, d) for x, d in zip((q, k, v), dims)))
    if scale is None:
        scale = qj.shape[-1] ** -0.5
    out, _ = torch.ops.gemc.jagged_attention_values(qj, kj, vj, layout.offsets,
                                                    layout.max_len, scale, causal)
    if q.dim() == 3:  # heads in the batch dim: [T, H, D] -> [H, T, D] at its dims
        bd, ld = dims[3]
        return out.movedim((0, 1), (ld, bd))
    return out.unsqueeze(0).movedim((0, 1), dims[3])
