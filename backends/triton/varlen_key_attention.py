"""Softmax attention of dense queries over keys of per-row length, on padded storage.

Why: cross-attention over a jagged history (learned summary queries over the history,
target attention of one candidate item over it) reads keys and values ``[B, H, L, D]`` that
are padded past each row's length ``len_b``; padded SDPA does ``M * L`` work per row,
this kernel ``M * len_b``: its key loop stops at the row's length, so nothing is converted
to a jagged layout (the queries are dense and short) and padding keys are never loaded.

``varlen_key_attention(q, k, v, key_lengths, scale)``: ``q: [B, H, M, D]``,
``k, v: [B, H, L, D]`` (any strides with unit stride on ``D``), ``key_lengths: [B]``
(int32, ``0 <= len_b <= L``). Query ``i`` of row ``b`` attends to keys ``0 .. len_b - 1``;
a row with no keys gets zeros (as eager SDPA gives under an all-False boolean mask) and no
gradient. Equal to ``scaled_dot_product_attention(q, k, v, attn_mask=arange(L) < len_b)``.

With ``query_lengths`` (int32 ``[B]``) the queries are padded too: only query rows
``0 .. qlen_b - 1`` are computed, the others come back zero (and get no gradient), and a
query block wholly past ``qlen_b`` skips its key loop: the kernel of padded history queries
over dense keys (``jagged_query_attention``), whose work is ``qlen_b * L`` per row.

Forward: flash attention (online softmax), saving the row logsumexp. Backward: one kernel
per query block for dq, one per key block for dk and dv (keys at or past ``len_b`` get
zero, as their attention weights are zero; the kernels write those zeros into buffers
made uninitialised, no separate zero fill), ``delta = rowsum(dO * O)`` computed in torch.
No atomics: deterministic. fp32 accumulation; outputs in the input dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import uncovered_rows
from .runtime import MIN_DOT, check_launchable, mma, next_pow2

__all__ = ["attention_backward", "attention_forward", "varlen_key_attention"]

_NEG = tl.constexpr(-1.0e30)


@triton.jit
def _tile(base, offs, limit, stride, offs_d, HEAD_DIM: tl.constexpr):
    """Rows ``offs`` (< ``limit``) of one head, ``[rows, BLOCK_D]``; others read zero."""
    mask = (offs[:, None] < limit) & (offs_d[None, :] < HEAD_DIM)
    return tl.load(base + offs[:, None].to(tl.int64) * stride + offs_d[None, :], mask=mask,
                   other=0.0)


@triton.jit
def _query_len(qlen_ptr, b, M, HAS_QLEN: tl.constexpr):
    """Row ``b``'s number of real queries (a prefix of its ``M``): all ``M`` without
    ``qlen_ptr``."""
    m_len = M
    if HAS_QLEN:
        m_len = tl.minimum(tl.maximum(tl.load(qlen_ptr + b), 0), M)
    return m_len


@triton.jit
def _fwd_kernel(Q, K, V, Out, LSE, klen_ptr, qlen_ptr, sqb, sqh, sqm, skb, skh, skn,
                svb, svh, svn,
                sob, soh, som, heads, M, scale,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, IEEE: tl.constexpr, HAS_QLEN: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // heads
    h = bh % heads
    n_len = tl.load(klen_ptr + b)
    m_len = _query_len(qlen_ptr, b, M, HAS_QLEN)
    start_m = tl.program_id(1) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    n_end = tl.where(start_m < m_len, n_len, 0)  # a block of padding queries: no key loop
    offs_d = tl.arange(0, BLOCK_D)
    q = _tile(Q + b.to(tl.int64) * sqb + h * sqh, offs_m, m_len, sqm, offs_d, HEAD_DIM)
    k_base = K + b.to(tl.int64) * skb + h * skh
    v_base = V + b.to(tl.int64) * svb + h * svh
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(0, n_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _tile(k_base, offs_n, n_len, skn, offs_d, HEAD_DIM)
        v = _tile(v_base, offs_n, n_len, svn, offs_d, HEAD_DIM)
        valid = offs_n[None, :] < n_len
        s = tl.where(valid, mma(q, tl.trans(k), IEEE) * scale, _NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(valid, tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, IEEE)
        m_i = m_new
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    acc = tl.where(offs_m[:, None] < m_len, acc / l_safe[:, None], 0.0)
    tl.store(LSE + bh.to(tl.int64) * M + offs_m, m_i + tl.log(l_safe), mask=offs_m < M)
    o_ptrs = Out + b.to(tl.int64) * sob + h * soh + offs_m[:, None].to(tl.int64) * som \
        + offs_d[None, :]
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, klen_ptr, qlen_ptr, sqb, sqh, sqm, skb, skh,
               skn, svb, svh, svn, heads, M, scale,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, IEEE: tl.constexpr, HAS_QLEN: tl.constexpr):
    """Q, DO and DQ share one contiguous [B, H, M, D] layout (strides sqb, sqh, sqm)."""
    bh = tl.program_id(0)
    b = bh // heads
    h = bh % heads
    n_len = tl.load(klen_ptr + b)
    m_len = _query_len(qlen_ptr, b, M, HAS_QLEN)
    start_m = tl.program_id(1) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    n_end = tl.where(start_m < m_len, n_len, 0)
    offs_d = tl.arange(0, BLOCK_D)
    q_off = b.to(tl.int64) * sqb + h * sqh
    q = _tile(Q + q_off, offs_m, m_len, sqm, offs_d, HEAD_DIM)
    do = _tile(DO + q_off, offs_m, m_len, sqm, offs_d, HEAD_DIM)
    lse = tl.load(LSE + bh.to(tl.int64) * M + offs_m, mask=offs_m < M, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * M + offs_m, mask=offs_m < M, other=0.0)
    k_base = K + b.to(tl.int64) * skb + h * skh
    v_base = V + b.to(tl.int64) * svb + h * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, n_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _tile(k_base, offs_n, n_len, skn, offs_d, HEAD_DIM)
        v = _tile(v_base, offs_n, n_len, svn, offs_d, HEAD_DIM)
        valid = (offs_m[:, None] < m_len) & (offs_n[None, :] < n_len)
        s = mma(q, tl.trans(k), IEEE) * scale
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        dp = mma(do, tl.trans(v), IEEE)
        ds = p * (dp - delta[:, None])
        dq += mma(ds.to(k.dtype), k, IEEE)
    dq = dq * scale
    tl.store(DQ + q_off + offs_m[:, None].to(tl.int64) * sqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, klen_ptr, qlen_ptr, sqb, sqh, sqm, skb,
                 skh, skn, svb, svh, svn, sgb, sgh, sgn, heads, M, N, scale,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, IEEE: tl.constexpr, HAS_QLEN: tl.constexpr):
    """DK and DV share one contiguous [B, H, L, D] layout (strides sgb, sgh, sgn), not
    initialised: every program writes all its ``N`` key rows, zeros at or past the row's
    length (a key block wholly past it skips its query loop and stores zeros)."""
    bh = tl.program_id(0)
    b = bh // heads
    h = bh % heads
    n_len = tl.load(klen_ptr + b)
    m_len = _query_len(qlen_ptr, b, M, HAS_QLEN)
    start_n = tl.program_id(1) * BLOCK_N
    m_end = tl.where(start_n < n_len, m_len, 0)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _tile(K + b.to(tl.int64) * skb + h * skh, offs_n, n_len, skn, offs_d, HEAD_DIM)
    v = _tile(V + b.to(tl.int64) * svb + h * svh, offs_n, n_len, svn, offs_d, HEAD_DIM)
    q_off = b.to(tl.int64) * sqb + h * sqh
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for start_m in range(0, m_end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _tile(Q + q_off, offs_m, m_len, sqm, offs_d, HEAD_DIM)
        do = _tile(DO + q_off, offs_m, m_len, sqm, offs_d, HEAD_DIM)
        lse = tl.load(LSE + bh.to(tl.int64) * M + offs_m, mask=offs_m < M, other=0.0)
        delta = tl.load(DELTA + bh.to(tl.int64) * M + offs_m, mask=offs_m < M, other=0.0)
        valid = (offs_m[:, None] < m_len) & (offs_n[None, :] < n_len)
        s = mma(q, tl.trans(k), IEEE) * scale
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        dv += mma(tl.trans(p.to(do.dtype)), do, IEEE)
        dp = mma(do, tl.trans(v), IEEE)
        ds = p * (dp - delta[:, None])
        dk += mma(tl.trans(ds.to(q.dtype)), q, IEEE)
    dk = dk * scale
    g_off = b.to(tl.int64) * sgb + h * sgh + offs_n[:, None].to(tl.int64) * sgn + offs_d[None, :]
    mask = (offs_n[:, None] < N) & (offs_d[None, :] < HEAD_DIM)  # zero past n_len
    tl.store(DK + g_off, dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + g_off, dv.to(DV.dtype.element_ty), mask=mask)


def _blocks(q: torch.Tensor) -> dict:
    head_dim = q.shape[-1]
    return {"HEAD_DIM": head_dim, "BLOCK_D": next_pow2(head_dim, MIN_DOT),
            "BLOCK_M": min(64, next_pow2(q.shape[2], MIN_DOT)), "BLOCK_N": 64,
            "IEEE": q.dtype == torch.float32}


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      key_lengths: torch.Tensor, query_lengths: torch.Tensor | None,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The output (contiguous ``[B, H, M, D]``; zero on query rows at or past
    ``query_lengths[b]``) and the row logsumexp ``[B * H, M]``. Lengths int32 ``[B]``."""
    batch, heads, m, _ = q.shape
    meta = _blocks(q)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((batch * heads, m), dtype=torch.float32, device=q.device)
    if out.numel():
        grid = (batch * heads, triton.cdiv(m, meta["BLOCK_M"]))
        _fwd_kernel[grid](q, k, v, out, lse, key_lengths,
                          key_lengths if query_lengths is None else query_lengths,
                          *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
                          heads, m, scale, HAS_QLEN=query_lengths is not None, **meta)
    return out, lse


def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       key_lengths: torch.Tensor, query_lengths: torch.Tensor | None,
                       out: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`attention_forward` (padding query rows get zero and add
    nothing to dk, dv: their output is the constant zero)."""
    batch, heads, m, _ = q.shape
    meta = _blocks(q)
    q = q.contiguous()
    do = grad.to(q.dtype).contiguous()
    delta = (do.float() * out.float()).sum(-1).reshape(batch * heads, m)
    dq = uncovered_rows.uninitialised(tuple(q.shape), q.stride(), q.dtype, q.device)
    grad_strides = uncovered_rows.contiguous_strides(k.shape)
    dk, dv = (uncovered_rows.uninitialised(tuple(k.shape), grad_strides, t.dtype, t.device)
              for t in (k, v))
    qlen = key_lengths if query_lengths is None else query_lengths
    has_qlen = query_lengths is not None
    if not (q.numel() and k.numel()):  # no launch writes them
        return dq.zero_(), dk.zero_(), dv.zero_()
    _dq_kernel[(batch * heads, triton.cdiv(m, meta["BLOCK_M"]))](
        q, k, v, do, dq, lse, delta, key_lengths, qlen, *q.stride()[:3], *k.stride()[:3],
        *v.stride()[:3], heads, m, scale, HAS_QLEN=has_qlen, **meta)
    _dkdv_kernel[(batch * heads, triton.cdiv(k.shape[2], meta["BLOCK_N"]))](
        q, k, v, do, dk, dv, lse, delta, key_lengths, qlen, *q.stride()[:3],
        *k.stride()[:3], *v.stride()[:3], *dk.stride()[:3], heads, m, k.shape[2], scale,
        HAS_QLEN=has_qlen, **meta)
    return dq, dk, dv


class _VarlenKeyAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_lengths, query_lengths, scale):  # type: ignore[override]
        out, lse = attention_forward(q, k, v, key_lengths, query_lengths, scale)
        ctx.save_for_backward(q, k, v, key_lengths, query_lengths, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v, key_lengths, query_lengths, out, lse = ctx.saved_tensors
        return (*attention_backward(q, k, v, key_lengths, query_lengths, out, lse, grad,
                                    ctx.scale), None, None, None)


def varlen_key_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_lengths: torch.Tensor, scale: float | None = None,
                         query_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Dense queries ``[B, H, M, D]`` over the first ``key_lengths[b]`` keys of padded
    ``[B, H, L, D]`` keys and values (see the module doc); with ``query_lengths`` only the
    first ``query_lengths[b]`` query rows are computed, the others are zero."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[:2] != k.shape[:2] \
            or q.shape[3] != k.shape[3]:
        raise ValueError(f"q [B, H, M, D] and k, v [B, H, L, D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    for name, lengths in (("key_lengths", key_lengths), ("query_lengths", query_lengths)):
        if lengths is not None and lengths.shape != (q.shape[0],):
            raise ValueError(f"{name} must be [B={q.shape[0]}], got {tuple(lengths.shape)}")
    check_launchable(q, k, v, key_lengths)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if query_lengths is not None:
        query_lengths = query_lengths.to(torch.int32)
    return _VarlenKeyAttention.apply(q, k, v, key_lengths.to(torch.int32), query_lengths,
                                     float(scale))
