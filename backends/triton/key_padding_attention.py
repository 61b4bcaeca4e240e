"""Attention under a key-padding mask the compiler cannot prove is a prefix, guarded at run time.

Why: most recommendation models receive a padded history ``[B, L, d]`` and a mask ``[B, L]``
as inputs (a boolean "keep" mask, an additive float mask of 0 / -inf or 0 / a large
negative, or one built from lengths). When every row's mask keeps a prefix of its
positions, the attention is the jagged attention over ``lengths = mask.sum(-1)``, whose work
scales with ``sum(len_b ** 2)`` instead of ``B * L ** 2``. Nothing in the graph proves what a
mask from the data looks like, so :func:`key_padding_attention` checks it on every call with
one small kernel (per row: the kept count, positions that break the prefix, additive values
that are no mask) and picks a path, each counted in :data:`STATS`:

* ``jagged``: every row a prefix: straight to the jagged kernels;
* ``compacted``: a boolean-valid mask that is not a prefix on some row (e.g. a history with
  the target item appended after its padding, as BST does): each row's kept positions are
  moved to the front in their order (a stable sort of the mask, one gather of q, k, v and a
  scatter of the output), which makes it a prefix. Exact: softmax attention is invariant to
  the order of its keys, and the causal mask keeps its meaning because the order of the kept
  positions is preserved;
* ``fallback``: anything else (an additive row with a value less than 1e4 below its kept
  keys' but not equal to it, or whose kept keys' value is beyond 1e4 of 0; the SiLU
  kernel's masks that are not prefixes,
  whose relative bias is indexed by position; a causal softmax written out over ``-inf``
  whose mask is not a prefix, NaN on each query ahead of a row's first kept key, which
  compaction would give keys): the exact padded computation.

Never silently wrong. The op is a plain function of tensors and static scalars (``scale``,
``causal``, ``additive``, ``zero_padding_queries``), so it can be registered as a custom
op; the check and the fallback live inside it, so it is guarded however it is invoked.

Semantics: ``key_padding_attention(q, k, v, key_mask)`` with ``q, k, v: [B, H, L, D]`` and
``key_mask: [B, L]`` (bool: True keeps the key; float, ``additive=True``: added to the
scores) equals ``scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])``
(combined with a lower-triangular mask when ``causal``) on every query row at a kept
position; rows at masked positions are padding and come back zero on the jagged paths (the
caller, i.e. the pass, proves nothing reads them unmasked). With
``zero_padding_queries=False``, or queries ``[B, H, M, D]`` of another length
(cross-attention: summary queries or a target item over the history), every query row is
computed, over the row's kept keys only (:mod:`.varlen_key_attention`). On the fallback
path every row is exactly the padded attention.

What counts as a mask, checked per row: bool: any; additive: one value on the kept keys,
the row's largest, and every other entry ``1e4`` or more below it (so ``exp`` of a masked
score underflows to exactly 0 next to any kept one, as in eager); a row that is all
``-inf`` keeps nothing (eager's output for such a row is then 0, as the jagged kernel's).
The kept keys' value is ``0`` as usual, or any constant within ``1e4`` of 0: softmax is
invariant to a row's constant, so a BERT-style ``(1 - mask) * -1e4`` row of an empty
history (``-1e4`` everywhere) keeps every key and attends over all of them, as eager does
(eager's own rounding of ``score - 1e4`` in fp32 moves a logit by at most ``2**-11``). A
larger constant is no mask: at ``-1e9`` every fp32 score rounds to the constant and eager
averages the values, which only the exact padded path reproduces.

Host synchronisation: one per call, a read of four integers (prefix violations, invalid
values, the total number of kept tokens, rows whose one-token readers miss a kept key). Why it cannot be avoided here: the paths launch
different kernels with different shapes (the jagged values have ``total`` rows), a choice
the host makes; doing all of them and selecting on the device would cost more than the
padded attention alone. The layers of a model usually share one mask, so this is one small
read per layer; sharing one check across the layers is left to the caller.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gemc.guard_sample import ADDITIVE_MASKED_GAP, kept_keys, mask_rows, missed_reads

from .jagged import jagged_to_padded, padded_to_jagged
from .jagged_attention import jagged_attention
from .runtime import next_pow2
from .varlen_key_attention import varlen_key_attention

__all__ = ["STATS", "KeyPaddingStats", "kept_first", "kept_keys", "key_padding_attention",
           "key_padding_silu_attention", "nan_where_no_key", "padded_attention",
           "permute_keys", "prefix_lengths", "uniform_where_no_key"]



@dataclass
class KeyPaddingStats:
    """How often the guarded attention took each path (module-level: :data:`STATS`)."""

    calls: int = 0
    jagged: int = 0
    compacted: int = 0
    fallback: int = 0

    def reset(self) -> None:
        self.calls = self.jagged = self.compacted = self.fallback = 0

    def as_dict(self) -> dict[str, int]:
        return {"calls": self.calls, "jagged": self.jagged, "compacted": self.compacted,
                "fallback": self.fallback}


STATS = KeyPaddingStats()


@triton.jit
def _prefix_kernel(mask_ptr, stride_b, stride_l, length, lengths_ptr, bad_ptr,
                   ADDITIVE: tl.constexpr, GAP: tl.constexpr, BLOCK_L: tl.constexpr):
    """One program per row: its kept-key count, and how many positions break the prefix."""
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_L)
    inside = offs < length
    ptrs = mask_ptr + b.to(tl.int64) * stride_b + offs * stride_l
    if ADDITIVE:
        m = tl.load(ptrs, mask=inside, other=float("-inf")).to(tl.float32)
        top = tl.max(m, 0)  # the row's kept keys sit at its largest value
        keep = (m == top) & (m > float("-inf"))
    else:
        m = tl.load(ptrs, mask=inside, other=0).to(tl.float32)
        keep = m != 0.0
    n = tl.sum((keep & inside).to(tl.int32), 0)
    not_prefix = tl.sum((inside & (keep != (offs < n))).to(tl.int32), 0)
    invalid = not_prefix * 0
    if ADDITIVE:
        # masked entries must lie 1e4 or more below the kept ones (nothing kept: all -inf),
        # and the kept ones' value be at most 1e4 from 0 (see the module doc)
        weak = inside & (~keep) & (m > top - GAP)
        invalid += tl.sum(weak.to(tl.int32), 0)
        invalid += tl.where(top > float("-inf"), tl.where(tl.abs(top) > GAP, 1, 0), 0)
    tl.store(lengths_ptr + b, n)
    tl.store(bad_ptr + 2 * b, not_prefix)
    tl.store(bad_ptr + 2 * b + 1, invalid)


def prefix_lengths(key_mask: torch.Tensor, additive: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(offsets [B+1] int64, bad [B, 2] int32)`` of a ``[B, L]`` key mask, on its device with
    no sync: ``offsets`` from the kept-key counts; ``bad[b, 0] > 0`` where row ``b`` keeps
    something other than a prefix, ``bad[b, 1] > 0`` where an additive row is no key mask
    (see the module doc for the additive rule)."""
    key_mask = mask_rows(key_mask)
    if key_mask.dim() != 2:
        raise ValueError(f"key_mask must be [B, L], got {tuple(key_mask.shape)}")
    batch, length = key_mask.shape
    mask = key_mask.view(torch.uint8) if key_mask.dtype == torch.bool else key_mask
    lengths = torch.empty(batch, dtype=torch.int32, device=key_mask.device)
    bad = torch.empty((batch, 2), dtype=torch.int32, device=key_mask.device)
    if batch and length:
        _prefix_kernel[(batch,)](mask, mask.stride(0), mask.stride(1), length, lengths, bad,
                                 ADDITIVE=bool(additive), GAP=ADDITIVE_MASKED_GAP,
                                 BLOCK_L=next_pow2(length, 16))
    else:
        lengths.zero_()
        bad.zero_()
    offsets = torch.cat([lengths.new_zeros(1, dtype=torch.int64),
                         torch.cumsum(lengths, 0, dtype=torch.int64)])
    return offsets, bad


def kept_first(key_mask: torch.Tensor, additive: bool) -> torch.Tensor:
    """Per row, the positions with the kept keys first, in their order (a stable sort of
    "dropped"): the permutation that makes a boolean-valid mask a prefix."""
    return torch.sort((~kept_keys(key_mask, additive)).to(torch.uint8), dim=1,
                      stable=True).indices


def nan_where_no_key(out: torch.Tensor, key_mask: torch.Tensor, additive: bool,
                     operands: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """``out [B, H, M, D]`` NaN on the rows that keep no key, as a written-out softmax over
    all ``-inf`` gives them where the kernels give 0; and, through ``operands``, NaN
    gradients for those batch rows' operands, as that softmax's backward gives them: its
    NaN probabilities multiply every upstream gradient, zero included, so a model that
    cleans the output with ``torch.nan_to_num`` still gets NaN weights in eager PyTorch
    after one step, and so it does here (a masked fill alone passed none back). Which
    operands: :func:`nan_gradient_operands`."""
    empty = ~kept_keys(key_mask, additive).any(1)
    out = out.masked_fill(empty[:, None, None, None], math.nan)
    if not operands:
        return out
    # zero where a row keeps a key, NaN where none: NaN x (sum of the row's operands) adds
    # nothing elsewhere, and differentiates to NaN for each of that row's elements
    poison = torch.zeros(empty.shape, dtype=out.dtype, device=out.device).masked_fill(
        empty, math.nan)
    total = sum(x.sum(dim=tuple(range(1, x.dim()))) for x in operands)
    return out + (poison * total)[:, None, None, None]


def uniform_where_no_key(out: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor,
                         additive: bool) -> torch.Tensor:
    """``out [B, H, M, D]`` with each row that keeps no key replaced by the mean of its
    values over all ``L`` keys, on every query row: what a written-out softmax gives a row
    whose every score the model set to one finite value (``masked_fill(~keep, -1e9)``):
    equal scores, weights ``1 / L``. Its gradient is ``1 / L`` of the output's to each of
    the row's values and none to q or k, as that softmax's (a constant row's) is."""
    empty = ~kept_keys(key_mask, additive).any(1)
    mean = v.float().mean(dim=2, keepdim=True).to(out.dtype).expand(out.shape)
    return torch.where(empty[:, None, None, None], mean, out)


def nan_gradient_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          additive: bool) -> tuple[torch.Tensor, ...]:
    """The operands whose gradient a written-out softmax over an all-``-inf`` row makes
    NaN in eager PyTorch: ``v`` always (``probs^T @ dout``); ``q`` and ``k`` too where the
    mask is added to the scores (its backward passes the NaN score gradient on), not where
    the scores are ``masked_fill``-ed (whose backward zeroes every masked position, here
    the whole row). The same under a ``-inf`` causal mask, however it is applied (a row
    that keeps no key: the key term drops every position, the causal one some)."""
    return (q, k, v) if additive else (v,)


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     key_mask: torch.Tensor, scale: float | None, causal: bool,
                     additive: bool, written_out: bool = False,
                     drop: float | None = None, fill_value: float | None = None,
                     causal_added: bool | None = None) -> torch.Tensor:
    """The exact padded attention (the fallback), as eager computes it: SDPA, or with
    ``written_out`` the model's own ``softmax(q @ k^T * scale + mask) @ v``. ``drop``: the
    model's mask is ``where(keep & causal, 0, drop)`` over the boolean ``key_mask`` (a
    finite drop for future and padding keys alike: RecBole's SASRec,
    ``passes/jagged_patterns.causal_keep_drop``), written out: a query row with no kept
    key then attends over every key, as in eager, where a ``-inf`` causal term would not.
    ``fill_value`` (written out): the model's ``masked_fill(~key_mask, fill_value)``, a
    finite value, where ``-inf`` is the default. ``causal_added`` (written out, causal): how
    the model applies its ``-inf`` causal mask, added (``+ triu(-inf, 1)``) or
    ``masked_fill(~tril, -inf)``, each term then applied on its own; None: as the keys
    are (one mask). Why it matters: on a query row that sees no kept key the softmax is
    NaN and so is its score gradient; a ``masked_fill`` passes none of it back through the
    positions it fills, an add passes all, so which of q and k get NaN gradients depends on
    how each term is applied (a row's kept future keys pass it under an added causal mask
    and a filled key mask), not on their order.

    Why the formula for a written-out softmax: SDPA's fused backward recomputes the
    probabilities from a saved log-sum-exp, which rounds where the mask is huge: a row
    whose every key carries ``torch.finfo(float32).min`` (Hugging Face's extended mask over
    an empty history) has uniform weights ``1 / L`` forward, both ways, but SDPA's backward
    recomputes them as ``exp(0) = 1`` and its q, k, v gradients come out up to ``L`` times
    eager's (tests/test_probes_sequence_c.py)."""
    mask = key_mask[:, None, None, :]
    length = q.shape[2]
    if drop is not None:
        visible = mask.to(torch.bool)
        if causal:
            visible = visible & torch.ones(length, k.shape[2], dtype=torch.bool,
                                           device=q.device).tril()
        scores = q @ k.transpose(-2, -1) * (scale if scale is not None
                                            else q.shape[-1] ** -0.5)
        return torch.softmax(scores + torch.where(visible, 0.0, drop).to(scores.dtype),
                             dim=-1) @ v
    if causal and written_out and causal_added is not None:
        tril = torch.ones(length, k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = q @ k.transpose(-2, -1) * (scale if scale is not None
                                            else q.shape[-1] ** -0.5)
        scores = scores + mask if additive else scores.masked_fill(~mask, -math.inf)
        scores = scores + torch.zeros_like(tril, dtype=scores.dtype).masked_fill(
            ~tril, -math.inf) if causal_added else scores.masked_fill(~tril, -math.inf)
        return torch.softmax(scores, dim=-1) @ v
    if causal:
        tril = torch.ones(length, k.shape[2], dtype=torch.bool, device=q.device).tril()
        if additive:
            mask = mask + torch.zeros_like(tril, dtype=mask.dtype).masked_fill(~tril, -math.inf)
        else:
            mask = mask & tril
    if not written_out:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = scores + mask if additive else scores.masked_fill(
        ~mask, -math.inf if fill_value is None else fill_value)
    return torch.softmax(scores, dim=-1) @ v


def key_padding_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          key_mask: torch.Tensor, scale: float | None = None,
                          causal: bool = False, additive: bool = False,
                          zero_padding_queries: bool = True,
                          nan_if_empty: bool = False,
                          read_rows: Sequence[torch.Tensor] = (),
                          drop: float | None = None,
                          fill_value: float | None = None,
                          causal_added: bool | None = None) -> torch.Tensor:
    """Attention of ``[B, H, M, D]`` queries over ``[B, H, L, D]`` keys and values under a
    ``[B, L]`` key mask, checked here: over the kept keys only (a prefix as it is, another
    mask compacted), the exact padded attention when it is no key mask. Self-attention (``M == L`` and
    ``zero_padding_queries``) runs jagged and leaves padding query rows zero; otherwise
    (cross-attention, or padding query rows someone reads) every query row is computed, its
    key loop stopping at the row's length. ``nan_if_empty`` (the attention is a written-out
    softmax): a row with no kept key gives NaN and NaN gradients (a ``softmax`` over all
    ``-inf``, where SDPA gives 0: :func:`nan_where_no_key`), and the padded path is the
    formula (:func:`padded_attention`). ``read_rows``: the positions (``[B]``,
    ``gemc.guard_sample.read_positions``) at which readers of one token per row read the
    output (``out[arange(B), lengths - 1]``, the only readers of its padding query rows):
    where one is not a kept key, those rows are needed, and a self-attention computes
    every query row (a causal one: the exact padded attention, counted as a fallback).
    ``drop``: the model masks with ``where(key_mask & causal, 0, drop)``, a finite drop
    (:func:`padded_attention`): the kept-key paths are exact on every row with a kept key,
    the padding query rows with none being unread (the caller's proof, or ``read_rows``
    checked: a miss takes the padded path, this formula). ``fill_value``: the model writes
    the softmax out over ``scores.masked_fill(~key_mask, fill_value)`` with a finite value
    (``-1e9``, ``-1e4``): a row that keeps no key has that one value on every score, so
    eager attends uniformly over all ``L`` keys (:func:`uniform_where_no_key`), where
    ``-inf`` gives NaN (``nan_if_empty``) and the kernels 0. ``causal`` with
    ``nan_if_empty`` (a causal softmax written out over ``-inf``): eager's softmax is NaN on
    each query row that sees no kept key; over a prefix mask those are the rows that keep
    none (every query sees key 0 otherwise), the jagged path's NaN rows; over any other
    mask, the queries ahead of a row's first kept key too: the exact padded formula,
    counted as a fallback (compaction would give them keys), with the causal mask applied
    as the model applies it (``causal_added``: :func:`padded_attention`). See the module
    doc (semantics, the one sync)."""
    if drop is not None and additive:
        raise ValueError("drop: the key mask must be the boolean keep-mask (additive=False)")
    if fill_value is not None and (additive or nan_if_empty or not math.isfinite(fill_value)):
        raise ValueError("fill_value: a finite masked_fill value over the boolean keep-mask "
                         f"(additive=False, nan_if_empty=False), got {fill_value}")
    if causal_added is not None and not (causal and nan_if_empty):
        raise ValueError("causal_added: how a written-out causal softmax over -inf applies "
                         "its causal mask; it needs causal=True and nan_if_empty=True")
    out = _key_padding_attention(q, k, v, key_mask, scale, causal, additive,
                                 zero_padding_queries,
                                 written_out=nan_if_empty or drop is not None
                                 or fill_value is not None,
                                 read_rows=read_rows, drop=drop, fill_value=fill_value,
                                 prefix_only=causal and nan_if_empty,
                                 causal_added=causal_added)
    if fill_value is not None:
        return uniform_where_no_key(out, v, key_mask, additive)
    if not nan_if_empty:
        return out
    return nan_where_no_key(out, key_mask, additive, nan_gradient_operands(q, k, v, additive))


def _key_padding_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           key_mask: torch.Tensor, scale: float | None, causal: bool,
                           additive: bool, zero_padding_queries: bool,
                           written_out: bool = False,
                           read_rows: Sequence[torch.Tensor] = (),
                           drop: float | None = None,
                           fill_value: float | None = None,
                           prefix_only: bool = False,
                           causal_added: bool | None = None) -> torch.Tensor:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] \
            or q.shape[3] != k.shape[3]:
        raise ValueError("q must be [B, H, M, D] and k, v [B, H, L, D], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch, _, queries, head_dim = q.shape
    length = k.shape[2]
    if tuple(key_mask.shape) != (batch, length):
        raise ValueError(f"key_mask must be [B={batch}, L={length}], got "
                         f"{tuple(key_mask.shape)}")
    if additive != key_mask.dtype.is_floating_point:
        raise TypeError(f"additive={additive} does not fit a {key_mask.dtype} mask")
    jagged_queries = zero_padding_queries and queries == length
    if causal and not jagged_queries:
        raise ValueError("causal key-padding attention needs M == L and "
                         "zero_padding_queries=True")
    STATS.calls += 1
    offsets, bad = prefix_lengths(key_mask, additive)
    missed = missed_reads(kept_keys(key_mask, additive), read_rows) if jagged_queries \
        and read_rows else offsets.new_zeros(1)
    not_prefix, invalid, total, missed_rows = torch.cat([
        bad.sum(0).to(torch.int64), offsets[-1:], missed]).tolist()  # the one sync
    if invalid or (missed_rows and causal) or (not_prefix and prefix_only):
        STATS.fallback += 1
        return padded_attention(q, k, v, key_mask, scale, causal, additive, written_out,
                                drop, fill_value, causal_added)
    if missed_rows:  # a reader reads a padding query row: compute every row
        jagged_queries = False
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    order = None
    if not_prefix:
        STATS.compacted += 1
        order = kept_first(key_mask, additive)
        k, v = (permute_keys(x, order) for x in (k, v))
        if jagged_queries:
            q = permute_keys(q, order)
    else:
        STATS.jagged += 1
    if not jagged_queries:
        return varlen_key_attention(q, k, v, offsets[1:] - offsets[:-1], scale)
    qj, kj, vj = (padded_to_jagged(x.transpose(1, 2), offsets, total) for x in (q, k, v))
    out = jagged_attention(qj, kj, vj, offsets, length, causal=causal, scale=scale)
    out = jagged_to_padded(out, offsets, length).transpose(1, 2)
    if order is not None:  # each row back to its positions (masked ones: zero)
        index = order[:, None, :, None].expand(out.shape)
        out = torch.zeros_like(out).scatter(2, index, out)
    return out


def permute_keys(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``x[b, :, order[b]]`` of a ``[B, H, L, D]`` tensor (differentiable)."""
    return x.gather(2, order[:, None, :, None].expand(x.shape))


def _silu_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor,
                 norm: float, scale: float, causal: bool, query_mask: bool,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The HSTU formula on padded tensors (the fallback), as a model writes it."""
    length = q.shape[2]
    visible = key_mask[:, None, None, :]
    if query_mask:
        visible = visible & key_mask[:, None, :, None]
    if causal:
        visible = visible & torch.ones(length, length, dtype=torch.bool,
                                       device=q.device).tril()
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias
    return torch.matmul(F.silu(s) / norm * visible.to(q.dtype), v)


def key_padding_silu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               key_mask: torch.Tensor, norm: float, scale: float = 1.0,
                               causal: bool = True, query_mask: bool = True,
                               bias: torch.Tensor | None = None) -> torch.Tensor:
    """HSTU pointwise attention ``(silu(scale * q k^T [+ bias]) / norm * visible) @ v`` of
    ``[B, H, L, D]`` q, k, v, where ``visible`` is the bool ``[B, L]`` key mask on the key
    axis (and on the query axis when ``query_mask``), and-ed with the causal mask when
    ``causal``: the jagged SiLU kernel over ``lengths = key_mask.sum(-1)`` when the mask is a
    prefix on every row (checked here, one sync as :func:`key_padding_attention`), else the
    padded formula. ``norm`` must be >= L (the kernel's ``max_len`` normaliser; it also
    sizes the grid). Padding query rows come back zero on the jagged path: exact with
    ``query_mask``, else the caller proves nothing reads them. ``bias``: an additive score
    bias broadcastable to ``[B, H, L, L]`` (relative position, time buckets)."""
    if q.dim() != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError("q, k, v must be one [B, H, L, D] shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    length = q.shape[2]
    if key_mask.dtype != torch.bool or tuple(key_mask.shape) != (q.shape[0], length):
        raise ValueError(f"key_mask must be bool [B, L], got {key_mask.dtype} "
                         f"{tuple(key_mask.shape)}")
    if norm < length or int(norm) != norm:
        raise ValueError(f"norm must be an integer >= L={length}, got {norm}")
    STATS.calls += 1
    offsets, bad = prefix_lengths(key_mask)
    flags = torch.cat([bad.sum(0).to(torch.int64), offsets[-1:]]).tolist()  # the one sync
    if flags[0] != 0:  # positions matter here (the bias): no compaction
        STATS.fallback += 1
        return _silu_padded(q, k, v, key_mask, norm, scale, causal, query_mask, bias)
    STATS.jagged += 1
    qj, kj, vj = (padded_to_jagged(x.transpose(1, 2), offsets, int(flags[2]))
                  for x in (q, k, v))
    out = jagged_attention(qj, kj, vj, offsets, int(norm), scale=scale, causal=causal,
                           kind="silu", silu_normalizer="max_len", bias=bias)
    return jagged_to_padded(out, offsets, length).transpose(1, 2)
