"""Padded history queries over dense keys: attention computed on the real query rows only.

Why: a history ``[B, L, d]`` padded past each row's length ``len_b`` often attends, item by
item, to a small dense set of keys ``[B, M, d]`` (candidate or feature tokens, a learned
memory). Padded SDPA computes all ``L`` query rows; the rows past ``len_b`` are padding the
model never reads unmasked (the pass proves that). This op computes ``len_b * M`` instead
of ``L * M`` per row: the varlen kernel of :mod:`.varlen_key_attention` with per-row query
lengths (a query block past ``len_b`` skips its key loop; padding rows come back zero).

Why that kernel and not a gather of the real query rows into ``[T, H, D]`` + dense
attention + scatter: each row's queries read their own row's keys, so a packed ``[T, H, D]``
needs a varlen attention anyway, plus two copies and a data-dependent ``T`` (a host read,
or room for ``B * L`` rows, which saves nothing). The kernel reads the padded layout in
place, has static shapes and no host synchronisation: exact and the simplest.

The query lengths come from the graph when it proves them (``offsets``, optionally
clamped below: :func:`offsets_query_lengths`) or from a boolean ``[B, L]`` keep mask
checked at run time (:func:`mask_query_lengths`): a row whose mask keeps a prefix gets
its kept count; a row whose mask is anything else gets ``L`` (every query row computed:
that row's exact padded attention). The fallback is per row and decided on the device, so
the op needs no host read and stays one node of the compiled graph; :data:`STATS` counts
calls, calls with a fallback row and fallback rows in device counters, read only when
asked (:meth:`QueryPaddingStats.as_dict`, the run report).
"""

from __future__ import annotations

import math

import torch

from .key_padding_attention import prefix_lengths
from .varlen_key_attention import varlen_key_attention

__all__ = ["STATS", "QueryPaddingStats", "jagged_query_attention", "mask_query_lengths",
           "offsets_query_lengths"]


class QueryPaddingStats:
    """Run-time guard counts of the query-padded attention, per device, kept on the device
    (``calls``, ``fallback_calls``: calls with a row whose mask is no prefix,
    ``fallback_rows``); :meth:`as_dict` reads them (one sync, at report time)."""

    def __init__(self) -> None:
        self._counts: dict[torch.device, torch.Tensor] = {}

    def prepare(self, device: torch.device | str) -> None:
        """Make ``device``'s counts now, ahead of any compiled graph. Why: counts made at a
        graph's first run under CUDA graphs (``torch.compile(mode="reduce-overhead")``)
        would be a tensor of the graph's memory pool that outlives the run without being
        its output, which the CUDA-graph trees refuse (as they refused the embedding
        module's layout, twenty-ninth session); made before, the replayed graph adds into
        them as the eager call does."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._counts:
            self._counts[device] = torch.zeros(3, dtype=torch.int64, device=device)

    def add(self, bad_rows: torch.Tensor) -> None:
        """Count one guarded call whose rows ``bad_rows`` (bool ``[B]``) fell back."""
        self.prepare(bad_rows.device)
        counts = self._counts[bad_rows.device]
        n = bad_rows.sum().to(torch.int64)
        counts.add_(torch.stack([torch.ones_like(n), (n > 0).to(torch.int64), n]))

    def reset(self) -> None:
        """Zero the counts in place: a compiled graph (a CUDA graph's replay) keeps adding
        into the tensors it was built with."""
        for counts in self._counts.values():
            counts.zero_()

    def as_dict(self) -> dict[str, int]:
        total = [0, 0, 0]
        for counts in self._counts.values():
            total = [a + int(b) for a, b in zip(total, counts.tolist())]
        return {"calls": total[0], "fallback_calls": total[1], "fallback_rows": total[2]}


STATS = QueryPaddingStats()


def mask_query_lengths(keep: torch.Tensor) -> torch.Tensor:
    """Per row of a bool ``[B, L]`` keep mask, the number of query rows to compute (int32):
    its kept count where it keeps a prefix, else ``L`` (that row falls back to the padded
    attention; counted in :data:`STATS`). No host read."""
    if keep.dim() != 2 or keep.dtype != torch.bool:
        raise ValueError(f"the query mask must be bool [B, L], got {keep.dtype} "
                         f"{tuple(keep.shape)}")
    offsets, bad = prefix_lengths(keep)
    not_prefix = bad[:, 0] > 0
    STATS.add(not_prefix)
    kept = (offsets[1:] - offsets[:-1]).to(torch.int32)
    return torch.where(not_prefix, torch.full_like(kept, keep.shape[1]), kept)


def offsets_query_lengths(offsets: torch.Tensor, clamp_min: int, length: int) -> torch.Tensor:
    """``clamp(offsets[1:] - offsets[:-1], clamp_min, length)`` as int32: the query rows
    the graph's ``arange(L) < lengths.clamp(min=clamp_min)`` mask keeps (a prefix)."""
    lengths = offsets[1:] - offsets[:-1]
    return lengths.clamp(min=clamp_min, max=length).to(torch.int32)


def jagged_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           query_lengths: torch.Tensor, scale: float | None = None
                           ) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, scale=scale)`` of ``q: [B, H, L, D]`` over
    dense ``k, v: [B, H, M, D]`` on query rows ``i < query_lengths[b]``; the others zero."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] \
            or q.shape[3] != k.shape[3]:
        raise ValueError("q must be [B, H, L, D] and k, v [B, H, M, D], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    keys = torch.full((q.shape[0],), k.shape[2], dtype=torch.int32, device=q.device)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return varlen_key_attention(q, k, v, keys, scale, query_lengths=query_lengths)
