"""A local lookup with a padding row whose sparse gradient keeps the padding ids: no host sync.

torch's sparse embedding gradient leaves the padding ids out by a boolean mask
(``indices != padding_idx``), a ``nonzero`` that waits for the GPU to count them before the
host can queue anything else (HSTU h200: 6 such syncs a step in its item table's three
lookups, 16 ms of the GPU idle behind them). Here the padding ids stay in the gradient with
zero rows — as a dense tensor the same gradient as torch's — and the sparse optimizer leaves
the padding row out (:func:`gemc.backends.torch.sparse_optim.summed_rows`, ``skip_row``), as
it did when the row never appeared. The forward is torch's own op with the padding row, and
the gradient's other rows torch's own backward (``_embedding_bag_sparse_backward`` for a
bag), so the arithmetic is unchanged.
"""

from __future__ import annotations

import torch

# nn.EmbeddingBag's pooling modes as ATen numbers them
_MODES = {"sum": 0, "mean": 1}


class _PaddedSparseLookup(torch.autograd.Function):
    """``weight`` looked up at ``ids`` (``offsets`` None: one row per id, as nn.Embedding;
    else bags with ``include_last_offset``). Backward: a sparse gradient of one row per id,
    the padding ids' rows zero."""

    @staticmethod
    def forward(ctx, weight, ids, offsets, per_sample_weights, mode, padding_idx):  # type: ignore[override]
        ctx.padding_idx, ctx.mode = padding_idx, mode
        ctx.shape = tuple(weight.shape)
        if offsets is None:
            ctx.save_for_backward(ids)
            return torch.embedding(weight, ids, padding_idx)
        out, offset2bag, bag_size, _ = torch.ops.aten._embedding_bag(
            weight, ids, offsets, False, mode, False, per_sample_weights, True, padding_idx)
        ctx.save_for_backward(ids, offsets, offset2bag, bag_size, per_sample_weights)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if len(ctx.saved_tensors) == 1:
            (ids,) = ctx.saved_tensors
            index, values = ids.reshape(-1), grad.reshape(-1, ctx.shape[1])
        else:
            ids, offsets, offset2bag, bag_size, weights = ctx.saved_tensors
            g = torch.ops.aten._embedding_bag_sparse_backward(
                grad, ids, offsets, offset2bag, bag_size, ctx.shape[0], False, ctx.mode,
                weights, -1)
            index, values = g._indices()[0], g._values()
        values = torch.where((index == ctx.padding_idx).unsqueeze(1), 0.0, values)
        # no invariant check: it would read the ids back on the host
        sparse = torch.sparse_coo_tensor(index.unsqueeze(0), values, ctx.shape,
                                         check_invariants=False, is_coalesced=False)
        return sparse, None, None, None, None, None


def padded_sparse_lookup(weight: torch.Tensor, ids: torch.Tensor, padding_idx: int, *,
                         offsets: torch.Tensor | None = None,
                         per_sample_weights: torch.Tensor | None = None,
                         mode: str = "sum") -> torch.Tensor:
    """``F.embedding(ids, weight, padding_idx, sparse=True)`` (``offsets`` None) or
    ``F.embedding_bag(ids, weight, offsets, mode=mode, sparse=True, per_sample_weights=...,
    include_last_offset=True, padding_idx=padding_idx)`` (1-D ``ids``), with the same
    output and the gradient described in the module doc. ``per_sample_weights`` are
    constants (no gradient)."""
    mode_number = _MODES[mode] if offsets is not None else 0
    return _PaddedSparseLookup.apply(weight, ids, offsets, per_sample_weights, mode_number,
                                     int(padding_idx))
