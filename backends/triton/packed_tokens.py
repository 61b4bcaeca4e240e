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

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

aten = torch.ops.aten
Dims = tuple[int, int]

SIZED = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.expand.default}
"""Ops whose size argument names the batch and sequence sizes: rewritten to (1, T)."""
FIRST_ONLY = {
    aten.linear.default, aten.layer_norm.default, aten.transpose.int, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.flatten.using_ints, aten.unflatten.int,
    aten.unbind.int, aten.split.Tensor, aten.chunk.default, aten.clone.default,
    aten._to_copy.default, aten.to.dtype, aten.alias.default, aten.detach.default,
    aten.sum.dim_IntList, aten.mean.dim, operator.getitem,
}
"""Ops that act per token when their first argument is packed (the rest are weights,
dims or dtypes)."""


@dataclass
class TokenLayout:
    """Where the real tokens of one padded ``[B, L]`` batch sit: ``offsets`` (the attention's
    lengths, clamped as its mask clamps them) and ``total`` tokens; the gather indices are
    built on first use."""

    offsets: torch.Tensor
    total: int
    batch: int
    max_len: int
    _index: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, offsets: torch.Tensor, clamp_min: int, max_len: int) -> TokenLayout:
        lengths = (offsets[1:] - offsets[:-1]).clamp(min=clamp_min, max=max_len)
        attn_offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
        # the one host sync of a step's layout: every shape below depends on it
        return cls(attn_offsets, int(attn_offsets[-1]), int(lengths.numel()), max_len)

    def index(self, kind: str) -> torch.Tensor:
        """``row``, ``pos`` or ``flat`` (``row * L + pos``) of every token."""
        if not self._index:
            dev = self.offsets.device
            lengths = self.offsets[1:] - self.offsets[:-1]
            row = torch.repeat_interleave(torch.arange(self.batch, device=dev), lengths,
                                          output_size=self.total)
            pos = torch.arange(self.total, device=dev) - self.offsets[row]
            self._index.update(row=row, pos=pos, flat=row * self.max_len + pos)
        return self._index[kind]


def gather(x: Any, dims: Dims, rank: int, layout: TokenLayout) -> Any:
    """``x`` (broadcastable, right-aligned, to a rank-``rank`` value whose batch and
    sequence dims are ``dims``) in the packed layout; a tensor constant over both, or not a
    tensor, comes back as it is."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    given = x
    if x.dim() < rank:
        x = x.reshape((1,) * (rank - x.dim()) + tuple(x.shape))
    bd, ld = dims
    sb, sl = x.shape[bd], x.shape[ld]
    if sb == 1 and sl == 1:
        return given
    kind = "flat" if sb > 1 and sl > 1 else "row" if sb > 1 else "pos"
    moved = x.movedim((bd, ld), (0, 1))
    rest = tuple(moved.shape[2:])
    picked = moved.reshape(sb * sl, *rest).index_select(0, layout.index(kind))
    return picked.view(1, layout.total, *rest).movedim((0, 1), (bd, ld))


def scatter(x: torch.Tensor, dims: Dims, layout: TokenLayout) -> torch.Tensor:
    """A packed value back at its padded shape, zeros on the padding rows."""
    bd, ld = dims
    moved = x.movedim((bd, ld), (0, 1))
    rest = tuple(moved.shape[2:])
    tokens = moved.reshape(layout.total, *rest)
    full = tokens.new_zeros((layout.batch * layout.max_len, *rest))
    full = full.index_copy(0, layout.index("flat"), tokens)
    return full.view(layout.batch, layout.max_len, *rest).movedim((0, 1), (bd, ld))


def segment_sum(x: torch.Tensor, dims: Dims, layout: TokenLayout) -> torch.Tensor:
    """``scatter(x).sum(sequence dim)`` without the padded tensor: each row's tokens added
    up (in fp32, as a reduction over a bf16 dim accumulates). Only for a value whose padding
    rows are zero (a masked one): the pass never lets another reach a sum over positions."""
    bd, ld = dims
    moved = x.movedim((bd, ld), (0, 1))
    rest = tuple(moved.shape[2:])
    tokens = moved.reshape(layout.total, *rest)
    acc = torch.zeros((layout.batch, *rest), dtype=torch.float32, device=x.device)
    acc = acc.index_add(0, layout.index("row"), tokens.float()).to(x.dtype)
    return acc.movedim(0, bd - (bd > ld))


def packed_shape(shape: list[int] | tuple[int, ...], dims: Dims, rank: int,
                 total: int) -> list[int]:
    """A (right-aligned) value shape of a region value in the packed layout: the batch dim
    1, the sequence dim ``total`` when the value varies over either (it is gathered to every
    token), else 1."""
    s = [int(v) for v in shape]
    off = rank - len(s)
    bd, ld = dims[0] - off, dims[1] - off
    sb = s[bd] if bd >= 0 else 1
    sl = s[ld] if ld >= 0 else 1
    if bd >= 0:
        s[bd] = 1
    if ld >= 0:
        s[ld] = total if (sb != 1 or sl != 1) else 1
    return s


def resize(sizes: list[Any], dims: Dims, total: int) -> list[Any]:
    """A view's or expand's size list with the batch and sequence sizes packed."""
    out = list(sizes)
    out[dims[0]] = 1
    out[dims[1]] = total
    return out


def source(values: torch.Tensor, row: torch.Tensor, pos: torch.Tensor,
           layout: TokenLayout, accumulate: bool = False) -> torch.Tensor:
    """The packed form of ``zeros(B, L, ...).index_put((row, pos), values)``, built without
    the padded tensor: value ``i`` lands on token ``offsets[row[i]] + pos[i]``."""
    token = layout.offsets[row] + pos
    out = values.new_zeros((layout.total, *values.shape[1:]))
    out = out.index_put((token,), values, accumulate=accumulate)
    return out.view(1, layout.total, *values.shape[1:])


def is_pointwise(node: fx.Node) -> bool:
    from gemc.passes.fusion_spec import translate

    return translate(node) is not None or node.target in (aten.cat.default,
                                                           aten.where.self)
