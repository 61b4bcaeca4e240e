"""Gathers from a small parameter table by a huge index, with a backward free of contention.

Why: models of this family index small learned tables with one index per score or per
token pair — HSTU's relative attention bias (``w_pos[j - i]``, ``w_ts[bucket(t_i - t_j)]``:
a few hundred rows, ``B * L * L`` indices). The gather is cheap; its backward is a
scatter-add of ``B * L * L`` values into those few rows, which Inductor and ATen write as
one atomic add per value. When the indices pile onto a few rows (padding pairs all land in
bucket 0, time gaps cluster), the atomics on one address serialise: on the H200 the HSTU
zoo model spent 25 ms per layer (202 of 228 ms a step) in that one scatter.

This op keeps the forward an ordinary gather, ``weight[index]`` (so an out-of-range id
fails as it would have) and computes the weight's gradient per block of indices: each
program sums its block's values per row in registers (a ``[block, rows]`` compare and a
sum over the block), then adds one partial sum per row to the result. A row then receives
one atomic add per program instead of one per index: ``N / 8192`` instead of up to ``N``.

Exactness: the sums are fp32, as the atomics were; only the order of the additions
differs (which the atomics do not fix either).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .runtime import check_launchable, next_pow2

__all__ = ["CHUNK", "WIDE_ROWS", "RowSumsLaunch", "gather_rows", "row_sums"]

# Indices per program at the default launch: the fastest of scatter_add_contention.py --sweep
# on HSTU's two gathers on the H200 (0.90 / 0.86 ms, against 0.99 / 0.95 at 8192).
CHUNK = 2048
_BLOCK = 128  # indices per compare tile
_BINS = 32  # rows per compare tile
WIDE_ROWS = 256  # a chunk whose ids span more rows than this adds them one atomic each


@dataclass(frozen=True)
class RowSumsLaunch:
    """How :func:`row_sums` launches its kernel: ids per program, ids per tile, warps.
    ``benchmarks/scatter_add_contention.py --sweep`` times the choices on a GPU."""

    chunk: int = CHUNK
    block: int = _BLOCK
    warps: int = 4


@triton.jit
def _load_ids(idx_ptr, offs, inside, other, n_rows):
    """A block of ids as int32, a negative one counted from the table's end (as
    ``weight[index]`` reads it); lanes outside the index keep ``other``. int32 because the
    ids index a small table (the forward's gather already refused one out of range) and
    the tile path compares every id with every row of a tile: in int64 each compare is two
    instructions."""
    ix = tl.load(idx_ptr + offs, mask=inside, other=other).to(tl.int32)
    return tl.where(inside & (ix < 0), ix + n_rows, ix)


@triton.jit
def _live_values(val_ptr, offs, n_idx, width, col):
    """A block's values of column ``col`` and which of them add something: inside the index
    and not exactly zero (NaN is not zero: it is summed, as ``index_add`` sums it)."""
    inside = offs < n_idx
    v = tl.load(val_ptr + offs * width + col, mask=inside, other=0.0)
    return v, inside & (v != 0.0)


@triton.jit
def _row_sums_kernel(idx_ptr, val_ptr, out_ptr, n_idx, n_rows, width,
                     CHUNK: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr,
                     WIDE: tl.constexpr):
    """Program (chunk, column): per row, the sum of the chunk's values of that column whose
    index is the row, added once into ``out[row, column]``.

    Only the rows between the chunk's smallest and largest id are visited (ids that pile
    onto a few rows, or ids of neighbouring token pairs such as HSTU's ``j - i``, span a
    small part of the table). Within a tile of rows the matches accumulate elementwise in
    a ``[BLOCK, BINS]`` register tile and are summed over the ids once per tile of rows,
    not once per block of ids: a reduction across threads per block was what bounded the
    kernel (1.7 ms a call on HSTU's 33.5M ids on the H200, half its step). A chunk whose
    ids span more than ``WIDE`` rows is spread by construction, where one atomic per id
    does not contend and a compare per row would cost rows / BINS passes: its ids are
    added one by one (on the H200, 33.5M ids over 1,023 rows took 7.0 ms through tiles
    against 0.9 ms for ATen's atomics). A negative id counts from the table's end, as
    ``weight[index]`` reads it: wrapped here, per loaded id, rather than by three ATen
    passes over the whole index first (``where(index < 0, index + n, index)``: on HSTU's
    ``[B, L, L]`` int64 ids those passes cost ~9 ms of a 45-ms H100 step, forward and
    backward together; twenty-eighth session's profile): :func:`_load_ids`.

    A value of exactly zero adds nothing, so its id is neither read nor compared, nor does
    it widen the chunk's rows; a block whose every value is zero skips the compares. Why:
    the gradient of a bias over padded ``[B, L, L]`` scores is zero on every pair that
    touches padding (about two thirds of HSTU's pairs at ~50% fill, by arithmetic: uniform
    lengths keep E[len^2] / L^2 = 1/3), in whole runs of a
    query row's keys; and HSTU's padding pairs carry the largest time gaps, so the largest
    buckets, which widened every chunk's rows by a tile (HSTU's row sums: 6.3 ms of a
    33-ms H100 step, thirtieth session). Exact: a skipped ``-0.0`` leaves a sum that
    starts at ``+0.0`` unchanged, and a NaN is not zero, so it is summed."""
    base = tl.program_id(0).to(tl.int64) * CHUNK
    col = tl.program_id(1)
    lo = tl.full([BLOCK], 2147483647, tl.int32)
    hi = tl.full([BLOCK], -1, tl.int32)
    for s in range(0, CHUNK, BLOCK):
        offs = base + s + tl.arange(0, BLOCK)
        _, live = _live_values(val_ptr, offs, n_idx, width, col)
        ix = _load_ids(idx_ptr, offs, live, -1, n_rows)
        lo = tl.minimum(lo, tl.where(live, ix, 2147483647))
        hi = tl.maximum(hi, ix)
    first = (tl.min(lo, axis=0) // BINS) * BINS
    last = tl.minimum(tl.max(hi, axis=0) + 1, n_rows)
    if last - first > WIDE:
        for s in range(0, CHUNK, BLOCK):
            offs = base + s + tl.arange(0, BLOCK)
            v, live = _live_values(val_ptr, offs, n_idx, width, col)
            ix = _load_ids(idx_ptr, offs, live, 0, n_rows)
            tl.atomic_add(out_ptr + ix * width + col, v.to(tl.float32), mask=live)
    else:
        for b0 in range(first, last, BINS):
            rows = b0 + tl.arange(0, BINS)
            acc = tl.zeros([BLOCK, BINS], dtype=tl.float32)
            for s in range(0, CHUNK, BLOCK):
                offs = base + s + tl.arange(0, BLOCK)
                v, live = _live_values(val_ptr, offs, n_idx, width, col)
                if tl.max(live.to(tl.int32), axis=0) > 0:  # a block of zeros adds nothing
                    ix = _load_ids(idx_ptr, offs, live, -1, n_rows)
                    acc += tl.where(ix[:, None] == rows[None, :], v.to(tl.float32)[:, None],
                                    0.0)
            tl.atomic_add(out_ptr + rows * width + col, tl.sum(acc, axis=0),
                          mask=rows < n_rows)


def row_sums(index: Tensor, values: Tensor, n_rows: int,
             launch: RowSumsLaunch | None = None) -> Tensor:
    """``zeros(n_rows, *values.shape[index.dim():]).index_add_(0, index.flatten(), values)``
    in fp32, without one atomic per index where ids pile up (see the module doc).
    ``index``: ids in ``[-n_rows, n_rows)``, a negative one counting from the end as
    ``weight[index]`` reads it; ``values``: ``[*index.shape, *row_shape]``."""
    launch = launch or RowSumsLaunch()
    row_shape = tuple(values.shape[index.dim():])
    width = 1
    for n in row_shape:
        width *= n
    flat_idx = index.reshape(-1).contiguous()
    flat_val = values.reshape(flat_idx.numel(), width).contiguous()
    out = torch.zeros((n_rows, width), dtype=torch.float32, device=values.device)
    if flat_idx.numel() == 0 or n_rows == 0 or width == 0:
        return out.view(n_rows, *row_shape)
    check_launchable(flat_idx, flat_val, out)
    grid = (triton.cdiv(flat_idx.numel(), launch.chunk), width)
    _row_sums_kernel[grid](flat_idx, flat_val, out, flat_idx.numel(), n_rows, width,
                           CHUNK=launch.chunk, BLOCK=launch.block,
                           BINS=min(_BINS, next_pow2(n_rows, 16)), WIDE=WIDE_ROWS,
                           num_warps=launch.warps)
    return out.view(n_rows, *row_shape)


@torch.library.custom_op("gemc::gather_rows", mutates_args=())
def gather_rows(weight: Tensor, index: Tensor) -> Tensor:
    """``weight[index]`` (rows of ``weight``; negative ids count from the end) as one node
    whose backward is :func:`row_sums`. Indexed as the model wrote it (ATen's gather wraps
    a negative id itself, one pass over the ids; an id out of range fails as it would
    have), not ``index_select`` of the ids wrapped first (three more passes)."""
    return weight[index]


@gather_rows.register_fake
def _gather_rows_fake(weight: Tensor, index: Tensor) -> Tensor:
    return weight.new_empty((*index.shape, *weight.shape[1:]))


@torch.library.custom_op("gemc::gather_rows_backward", mutates_args=())
def gather_rows_backward(grad: Tensor, index: Tensor, n_rows: int, dtype: torch.dtype
                         ) -> Tensor:
    """The gradient of :func:`gather_rows`'s weight, in the weight's dtype."""
    return row_sums(index, grad, n_rows).to(dtype)


@gather_rows_backward.register_fake
def _gather_rows_backward_fake(grad: Tensor, index: Tensor, n_rows: int, dtype: torch.dtype
                               ) -> Tensor:
    return grad.new_empty((n_rows, *grad.shape[index.dim():]), dtype=dtype)


def _setup(ctx, inputs, output) -> None:  # noqa: ANN001
    weight, index = inputs
    ctx.n_rows, ctx.dtype = weight.shape[0], weight.dtype
    ctx.save_for_backward(index)


def _backward(ctx, grad):  # noqa: ANN001, ANN202
    (index,) = ctx.saved_tensors
    return torch.ops.gemc.gather_rows_backward(grad, index, ctx.n_rows, ctx.dtype), None


gather_rows.register_autograd(_backward, setup_context=_setup)
