"""The silu attention's backward as one program per (sequence, key block): dk and dv of each
head, dq's share added with relaxed atomics, and the score bias's gradient summed over the
heads without atomics (``jagged_attention.SILU_KEY_BLOCK_BACKWARD`` selects it).

Why a kernel of its own (issue 17, HSTU at its h200 preset: B=128, L=512, 4 heads of 128,
causal, ~50% fill, a ``[B, 1, L, L]`` relative bias shared by the heads): the two-kernel
backward took ~0.86 ms against a 0.15 ms forward, the one-kernel one ~0.6 ms, and the bias
doubled it. What this kernel changes, each counted at that shape in the module's report
(``benchmarks/kernels.py --cases silu_variants`` times both side by side):

* **The bias's gradient without atomics, zeroing or a cast pass.** The old kernels add
  every head's ``ds`` tile into one fp32 ``[B, 1, L, L]`` buffer with ``acq_rel`` atomics
  (~30M of them), after a ``torch.zeros`` of that buffer (134 MB) and before a cast to the
  bias's dtype (134 MB read, 67 MB written). Here a program owns the column strip
  ``[:, key block]`` of its sequence's ``[L, L]`` block for *every* head, so it loops over
  the heads (``heads_per_program``) and sums them in that strip itself: the first head
  stores its tile, the next ones load, add and store (fp32, the program's own lines,
  L2-resident: at most ``Lb x BLOCK_N x 4`` bytes, 128 KB at L=512), the last stores the sum in the output's dtype (the
  bias's, where no batch sum follows). A barrier between heads orders one head's stores
  before the next head's loads (the only cross-thread dependency; no other program
  touches the strip). Tiles no head visits (above the causal diagonal, past the sequence,
  a key block past it) are written as zeros, so the output is ``torch.empty``.
* **Relaxed atomics.** dq's share (``ds @ k``) is added with ``sem="relaxed"``; Triton's
  default (``acq_rel``) orders every atomic against the program's other memory accesses,
  which nothing here needs (nothing reads dq before the kernel ends).
* **Hopper's tile shapes.** Scores are computed transposed (``k @ q^T``, as the Triton
  tutorial's backward does), so ``p^T`` and ``ds^T`` feed ``dv += p^T @ dO`` and
  ``dk += ds^T @ q`` straight from the accumulator's registers; 64 x 64 tiles with 8
  warps keep dk, dv (2 x 64 x 128 fp32: 64 registers a thread) and the score tiles in
  registers at head dim 128 (the old heuristic's 32 x 64 tiles on 4 warps held 128
  registers a thread of dk/dv alone, and their 32-row products cannot use wgmma).
* **Sequence-major launch order.** The programs of one sequence run together (its key
  blocks heaviest first), so the dq rows they add into stay in L2 (all of dq in fp32 is
  63 MB, more than the H200's L2).

Without a bias gradient (or with a bias per head) each program takes one head: the grid is
then the old dk/dv kernel's, with the changes above but the first.
"""

from __future__ import annotations

import importlib

import torch
import triton
import triton.language as tl

from . import config_choice
from .config_choice import Preferred, Tiles
from .jagged_attention import (
    _any_uncovered,
    _inv_norm,
    _load_rows,
    _query_blocks,
    _sequence,
    _sigmoid,
    _store_rows,
    _zero_uncovered,
    grid_rows,
    operand_sizes,
)
from .runtime import MIN_DOT, autotune_configs, mma

__all__ = ["silu_key_block_backward"]

# the module (the package's ``jagged_attention`` is its function), read at each call
_attention = importlib.import_module(f"{__package__}.jagged_attention")


def _cfg(block_m: int, block_n: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps,
                         num_stages=stages)


_CONFIGS = autotune_configs(
    [_cfg(64, 64, 8, 2), _cfg(64, 64, 8, 3), _cfg(64, 128, 8, 2), _cfg(128, 64, 8, 2),
     _cfg(64, 64, 4, 3), _cfg(32, 64, 4, 3)],
    _cfg(MIN_DOT, MIN_DOT, 1, 1),
)
_TUNE_KEY = ["HEAD_DIM", "CAUSAL", "FAST_SIGMOID", "FUSED_DQ", "HAS_BIAS", "BIAS_GRAD",
             "HEADS_LOOP"]


def _tiles(cfg: triton.Config, args: dict) -> Tiles:
    """q and dO streamed (with the bias tile and the bias gradient's partial sums), k and v
    resident, p^T and ds^T converted (ds^T twice with dq fused)."""
    bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
    d, e, eb = operand_sizes(args)
    partial = bm * bn * 4 if args.get("BIAS_GRAD") and args.get("HEADS_LOOP") else 0
    converted = 3 if args.get("FUSED_DQ") else 2
    return Tiles(streamed=2 * bm * d * e + bm * bn * eb + partial, resident=2 * bn * d * e,
                 scratch=converted * bm * bn * 4)


def _prefer(args: dict) -> list[Preferred]:
    """Head dim <= 64: 64 x 64 on 4 warps; 128 (HSTU): 64 x 64 on 8 warps (see the module
    doc: registers), 2 stages."""
    if int(args.get("BLOCK_D", 64)) <= 64:
        return [({"BLOCK_M": 64, "BLOCK_N": 64}, 4, 3)]
    return [({"BLOCK_M": 64, "BLOCK_N": 64}, 8, 2), ({"BLOCK_M": 64, "BLOCK_N": 64}, 8, 3)]


@triton.jit
def _strip_offsets(offs_n, offs_m, sdi, sdj):
    """Offsets of a transposed [BLOCK_N, BLOCK_M] tile of an ``[Lb, Lb]`` block (row = query
    position ``m``, column = key position ``n``)."""
    return offs_n[:, None].to(tl.int64) * sdj + offs_m[None, :].to(tl.int64) * sdi


@triton.jit
def _bias_grad_part(db_sum, db_out, dst, offs_n, offs_m, db_rows, sdi, sdj, i, n):
    """Head ``i`` of the program's ``n``: its ``ds^T`` tile into the strip, the heads'
    running fp32 sum in ``db_sum`` (the first head stores, the next add), the last head's
    total into ``db_out`` (its own dtype). ``db_sum`` may be ``db_out`` (fp32 output): the
    two stores never overlap."""
    offs = _strip_offsets(offs_n, offs_m, sdi, sdj)
    inside = (offs_n[:, None] < db_rows) & (offs_m[None, :] < db_rows)
    head = tl.zeros_like(offs_m)[None, :] + i  # a tensor under the interpreter too
    total = dst + tl.load(db_sum + offs, mask=inside & (head > 0), other=0.0)
    tl.store(db_sum + offs, total, mask=inside & (head < n - 1))
    tl.store(db_out + offs, total.to(db_out.dtype.element_ty), mask=inside & (head == n - 1))


@triton.jit
def _bias_grad_zeros(db_out, offs_n, lo, hi, db_rows, sdi, sdj,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Zeros into the strip's rows ``[lo, hi)``: scores no head of the program visits."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs = _strip_offsets(offs_n, offs_m, sdi, sdj)
        inside = (offs_n[:, None] < db_rows) & (offs_m[None, :] < db_rows)
        tl.store(db_out + offs, tl.zeros([BLOCK_N, BLOCK_M], db_out.dtype.element_ty),
                 mask=inside)


@triton.jit
def _step(dk, dv, k, v, q_base, do_base, dq_base, start, start_m, offs_n, offs_d, row_len,
          stride_qt, stride_dot, stride_dqt, scale, inv_norm, bias_base, sbi, sbj,
          db_sum, db_out, sdi, sdj, db_rows, i, n,
          HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
          CAUSAL: tl.constexpr, IEEE: tl.constexpr, MASK: tl.constexpr,
          HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, FAST_SIGMOID: tl.constexpr,
          FUSED_DQ: tl.constexpr):
    """One query block against the program's key block, scores transposed
    ([BLOCK_N, BLOCK_M]): dk, dv updated; dq's share added (``FUSED_DQ``); this head's part
    of the bias's gradient (``BIAS_GRAD``)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load_rows(q_base, start, offs_m, row_len, stride_qt, offs_d, HEAD_DIM, EVEN_D, MASK)
    do = _load_rows(do_base, start, offs_m, row_len, stride_dot, offs_d, HEAD_DIM, EVEN_D, MASK)
    st = mma(k, tl.trans(q), IEEE) * scale
    if HAS_BIAS:
        ptrs = bias_base + _strip_offsets(offs_n, offs_m, sbi, sbj)
        inside = (offs_n[:, None] < row_len) & (offs_m[None, :] < row_len)
        st += tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
    sig = _sigmoid(st, FAST_SIGMOID)
    pt = st * sig * inv_norm
    dpds = sig * (1.0 + st * (1.0 - sig)) * inv_norm
    if MASK:
        visible = (offs_n[:, None] < row_len) & (offs_m[None, :] < row_len)
        if CAUSAL:
            visible = visible & (offs_m[None, :] >= offs_n[:, None])
        pt = tl.where(visible, pt, 0.0)
        dpds = tl.where(visible, dpds, 0.0)
    dst = mma(v, tl.trans(do), IEEE) * dpds
    dv += mma(pt.to(do.dtype), do, IEEE)
    dk += mma(dst.to(q.dtype), q, IEEE)
    if FUSED_DQ:
        dq = mma(tl.trans(dst.to(k.dtype)), k, IEEE) * scale
        tl.atomic_add(dq_base + (start + offs_m[:, None]) * stride_dqt + offs_d[None, :], dq,
                      mask=(offs_m[:, None] < row_len) & (offs_d[None, :] < HEAD_DIM),
                      sem="relaxed")
    if BIAS_GRAD:
        _bias_grad_part(db_sum, db_out, dst, offs_n, offs_m, db_rows, sdi, sdj, i, n)
    return dk, dv


@config_choice.autotune(_CONFIGS, _TUNE_KEY, name="jagged_attention._bwd_silu_kv_kernel",
                        tiles=_tiles, prefer=_prefer,
                        accumulates=lambda a: ("DQ",) if a.get("FUSED_DQ") else ())
@triton.jit
def _bwd_silu_kv_kernel(
    Q, K, V, DO, DK, DV, DQ, offsets_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    stride_dqt, stride_dqh,
    n_heads, heads_per_program, n_rows, scale, inv_max_len, pad_len, db_rows, total_rows,
    BIAS, DB_SUM, DB_OUT, stride_bb, stride_bh, stride_bi, stride_bj,
    stride_dbb, stride_dbh, stride_dbi, stride_dbj,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    CAUSAL: tl.constexpr, NORM_BY_OWN_LEN: tl.constexpr, IEEE: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, FAST_SIGMOID: tl.constexpr,
    FUSED_DQ: tl.constexpr, HEADS_LOOP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # one grid axis (no 65,535 limit on B x H): the key blocks of one (sequence, group of
    # heads_per_program heads) are consecutive, block 0 (the heaviest under a causal mask)
    # first, so one sequence's programs run together and its dq rows stay in L2
    groups = n_heads // heads_per_program
    key_blocks = tl.cdiv(n_rows, BLOCK_N)
    pid = tl.program_id(0)
    seq_group = pid // key_blocks
    b = seq_group // groups
    h0 = (seq_group % groups) * heads_per_program
    start, row_len = _sequence(offsets_ptr, b, pad_len)
    start_n = (pid % key_blocks) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    inv_norm = _inv_norm(row_len, inv_max_len, NORM_BY_OWN_LEN)
    lo, diag, full = _query_blocks(start_n, row_len, BLOCK_M, BLOCK_N, CAUSAL)
    db_strip = b.to(tl.int64) * stride_dbb + h0 * stride_dbh
    # this program's chunk of dk's and dv's uncovered rows, for its heads (the buffers are
    # never zero-filled: jagged_attention.written_rows); n_rows spans every row
    chunk = b * key_blocks + pid % key_blocks
    n_seqs = tl.num_programs(0) // (key_blocks * groups)
    if _any_uncovered(chunk, 1, offsets_ptr, n_seqs, total_rows, pad_len, BLOCK_N):
        for i in range(0, heads_per_program):
            _zero_uncovered(DK + (h0 + i) * stride_dkh, chunk, offsets_ptr, n_seqs,
                            total_rows, pad_len, stride_dkt, offs_d, HEAD_DIM, BLOCK_N)
            _zero_uncovered(DV + (h0 + i) * stride_dvh, chunk, offsets_ptr, n_seqs,
                            total_rows, pad_len, stride_dvt, offs_d, HEAD_DIM, BLOCK_N)
    if start_n < row_len:
        for i in range(0, heads_per_program):
            h = h0 + i
            k = _load_rows(K + h * stride_kh, start, offs_n, row_len, stride_kt, offs_d,
                           HEAD_DIM, EVEN_D, True)
            v = _load_rows(V + h * stride_vh, start, offs_n, row_len, stride_vt, offs_d,
                           HEAD_DIM, EVEN_D, True)
            q_base = Q + h * stride_qh
            do_base = DO + h * stride_doh
            dq_base = DQ + h * stride_dqh
            bias_base = BIAS + b.to(tl.int64) * stride_bb + h * stride_bh
            db_sum = DB_SUM + db_strip
            db_out = DB_OUT + db_strip
            dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            for start_m in range(lo, tl.minimum(diag, row_len), BLOCK_M):
                dk, dv = _step(dk, dv, k, v, q_base, do_base, dq_base, start, start_m, offs_n,
                               offs_d, row_len, stride_qt, stride_dot, stride_dqt, scale,
                               inv_norm, bias_base, stride_bi, stride_bj, db_sum, db_out,
                               stride_dbi, stride_dbj, db_rows, i, heads_per_program,
                               HEAD_DIM, EVEN_D, BLOCK_M, CAUSAL, IEEE, True, HAS_BIAS,
                               BIAS_GRAD, FAST_SIGMOID, FUSED_DQ)
            for start_m in range(diag, full, BLOCK_M):
                dk, dv = _step(dk, dv, k, v, q_base, do_base, dq_base, start, start_m, offs_n,
                               offs_d, row_len, stride_qt, stride_dot, stride_dqt, scale,
                               inv_norm, bias_base, stride_bi, stride_bj, db_sum, db_out,
                               stride_dbi, stride_dbj, db_rows, i, heads_per_program,
                               HEAD_DIM, EVEN_D, BLOCK_M, CAUSAL, IEEE, False, HAS_BIAS,
                               BIAS_GRAD, FAST_SIGMOID, FUSED_DQ)
            for start_m in range(tl.maximum(diag, full), row_len, BLOCK_M):
                dk, dv = _step(dk, dv, k, v, q_base, do_base, dq_base, start, start_m, offs_n,
                               offs_d, row_len, stride_qt, stride_dot, stride_dqt, scale,
                               inv_norm, bias_base, stride_bi, stride_bj, db_sum, db_out,
                               stride_dbi, stride_dbj, db_rows, i, heads_per_program,
                               HEAD_DIM, EVEN_D, BLOCK_M, CAUSAL, IEEE, True, HAS_BIAS,
                               BIAS_GRAD, FAST_SIGMOID, FUSED_DQ)
            _store_rows(DK + h * stride_dkh, start, offs_n, row_len, stride_dkt, offs_d,
                        dk * scale, HEAD_DIM)
            _store_rows(DV + h * stride_dvh, start, offs_n, row_len, stride_dvt, offs_d, dv,
                        HEAD_DIM)
            if HEADS_LOOP:
                # this head's partial sums, stored by any of the program's threads, are
                # what the next head's threads load
                tl.debug_barrier()
    if BIAS_GRAD:
        # rows no head visited: [0, lo) above the diagonal, [cdiv(row_len), db_rows) past
        # the sequence; a key block at or past the sequence's end visits none
        visits = (start_n < row_len).to(tl.int32)
        zero_lo = lo * visits
        zero_hi = tl.cdiv(row_len, BLOCK_M) * BLOCK_M * visits
        _bias_grad_zeros(DB_OUT + db_strip, offs_n, 0, zero_lo, db_rows, stride_dbi,
                         stride_dbj, BLOCK_M, BLOCK_N)
        _bias_grad_zeros(DB_OUT + db_strip, offs_n, zero_hi, db_rows, db_rows, stride_dbi,
                         stride_dbj, BLOCK_M, BLOCK_N)


def silu_key_block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            do: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                            dv: torch.Tensor, offsets: torch.Tensor, max_len: int,
                            scale: float, meta: dict, bias: torch.Tensor | None,
                            dbias: torch.Tensor | None, pad_len: int = 0) -> None:
    """Writes dk and dv (``[N, H, D]`` contiguous, q's dtype) of the silu attention into
    every row a sequence covers and zeros into every other row (they come uninitialised:
    :func:`~.jagged_attention.written_rows`); adds dq's share into ``dq`` (fp32, zeroed)
    when ``meta["FUSED_DQ"]``; writes every element of ``dbias``
    (the ``[B, H, Lb, Lb]`` view of :func:`~.jagged_attention.bias_grad_buffer`'s output,
    head stride 0 where the heads share it) when ``meta["BIAS_GRAD"]``. ``bias``: the
    ``[B, H, Lb, Lb]`` view of the score bias, or None."""
    total, heads, _ = q.shape
    batch = offsets.numel() - 1
    bias_grad = bool(meta["BIAS_GRAD"]) and dbias is not None
    db_rows = dbias.shape[-1] if bias_grad else 0
    heads_loop = bias_grad and dbias.stride(1) == 0 and heads > 1
    per_program = heads if heads_loop else 1
    if batch == 0 or (max_len == 0 and db_rows == 0):
        return
    # the heads' running sums of the bias's gradient: fp32, the output itself where it is
    # fp32, else a scratch buffer of its layout (only the visited tiles are touched)
    db_sum = dbias
    if heads_loop and dbias.dtype != torch.float32:
        db_sum = _attention.uninitialised(tuple(dbias.shape), dbias.stride(), torch.float32,
                                          dbias.device)
    kernel_meta = {key: meta[key] for key in ("HEAD_DIM", "BLOCK_D", "EVEN_D", "CAUSAL",
                                              "NORM_BY_OWN_LEN", "IEEE", "HAS_BIAS",
                                              "FAST_SIGMOID", "FUSED_DQ")}
    b = bias if bias is not None else q
    bs = bias.stride() if bias is not None else (0, 0, 0, 0)
    d = dbias if bias_grad else q
    ds = dbias.stride() if bias_grad else (0, 0, 0, 0)
    # key blocks enough for the bias's gradient and for every row of dk and dv
    rows = max(grid_rows(total, batch, max_len), db_rows)
    programs = batch * (heads // per_program)
    _bwd_silu_kv_kernel[lambda cfg: (triton.cdiv(rows, cfg["BLOCK_N"]) * programs,)](
        q, k, v, do, dk, dv, dq, offsets,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        dq.stride(0), dq.stride(1),
        heads, per_program, rows, scale, 1.0 / max(max_len, 1), pad_len, db_rows, total,
        b, db_sum if bias_grad else q, d, *bs, *ds,
        **kernel_meta, BIAS_GRAD=bias_grad, HEADS_LOOP=heads_loop,
    )
