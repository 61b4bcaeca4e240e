"""The softmax attention's backward of short rows as one program per (sequence, head): dq, dk
and dv from one pass over the row's tile pairs, with no atomics
(``jagged_attention.FUSED_SOFTMAX_SHORT_ROWS`` selects it).

Why (issue 17, TransAct at its h200 preset: B=4,096 rows of ~51 tokens, at most 101, 2 heads
of 48): a row is one or two tiles, so the two-kernel backward's dq kernel (0.168 ms on an
H100) re-does the ``q k^T`` and ``dO v^T`` products the dk/dv kernel (0.264 ms) does, for
7 tile products per tile pair where 5 suffice. The first one-kernel form (the dk/dv kernel
adding ``ds @ k`` into an fp32 dq with atomics, one program per key block) measured 0.819 ms
for that one kernel on an H100 (thirtieth session, ``benchmarks/h100_session30.sh 1``):
~67 M fp32 atomics a call (arithmetic: 4,096 x 2 (row, head) x ~4 tile pairs x 32 x 64)
cost more than the dq kernel they replaced.

Here one program owns a whole (sequence, head), so no other program touches its dq rows:

* **Every load of a tile pair first.** q, dO, O, the logsumexp, the bias tile and the
  query block's dq so far are loaded together at the top of the pair, so their latencies
  overlap (a row is two to four tile pairs; the kernel is latency-bound, not bandwidth- or
  MMA-bound: at TransAct's shape its 2 and 4 warps took the same 0.392 ms, thirty-first
  session). ``delta = rowsum(O * dO)`` is recomputed from the O and dO tiles of each pair:
  no pass of its own over the row, no store, no barrier before the products.
* **Key blocks outer, query blocks inner.** dk and dv of a key block accumulate in
  registers and are stored once. dq of a query block is the sum over the key blocks that
  see it: the first of them stores its share into an fp32 scratch row (``DQ_ACC``,
  uninitialised: the first store needs no zeros), the next ones load, add and store, and
  the last stores the sum in dq's dtype into dq itself (no cast pass). A barrier after
  each key block orders its scratch stores before the next block's loads. A row of one
  block (most of TransAct's at 64-row blocks) never touches the scratch.
* **Two orientations** (the config's ``KEY_MAJOR``). Query-major tiles ``[queries, keys]``
  (``s = q k^T``) make p and ds the A operands of dv's and dk's products transposed: two
  round trips through shared memory a pair. Key-major tiles ``[keys, queries]``
  (``s^T = k q^T``, :func:`_key_major_pair`) feed p^T and ds^T to those products from
  registers and transpose only ds for dq's; a per-key bias is then one column loaded once a
  key block, and a row of one tile pair (most of TransAct's at 64-row blocks) takes a
  straight path: every load at once, no scratch, no barrier. Compiled for sm_90 at
  TransAct's shape, key-major 64-row blocks take 255 registers and no spills (query-major:
  255 and 14 words), 32-row ones 168 (174).
* **Every step masked.** A short row is one or two tiles, where the phases the long-row
  kernels split into (unmasked whole blocks, masked ragged ones) would save nothing; and a
  ragged key block's columns past the row (k = 0 there, so ``exp(0 - lse)``, inf where a
  -inf key bias hides the row's every key) are zeroed by the select, never multiplied.

The rows' uncovered slots (a packed buffer's spare ones) are zeroed by the program of the
sequence whose chunks reach them, as in the other kernels (``_zero_uncovered``), so dq, dk
and dv are ``written_rows`` buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import config_choice
from .config_choice import Preferred, Tiles
from .jagged_attention import (
    _any_uncovered,
    _bias_grad_tile,
    _bias_tile,
    _load_rows,
    _row_stat,
    _sequence,
    _store_rows,
    _visible,
    _zero_uncovered,
    grid_rows,
    operand_sizes,
)
from .runtime import MIN_DOT, autotune_configs, mma
from .uncovered_rows import contiguous_strides, uninitialised

__all__ = ["softmax_row_backward"]


def _cfg(block: int, warps: int, stages: int, maxnreg: int | None = None,
         key_major: bool = False) -> triton.Config:
    return triton.Config({"BLOCK": block, "KEY_MAJOR": int(key_major)}, num_warps=warps,
                         num_stages=stages, maxnreg=maxnreg)


# Key-major 64-row blocks (the pick where GPU-tested, ``_prefer``): a row of at most 64
# tokens (most of TransAct's) is one tile pair, its dq never in the scratch, and the
# one-pair path loads everything at once.
# The kernel is latency-bound and its registers bound how many programs an SM holds: at
# TransAct's launch 32-row blocks take 168-174 registers a thread (2 programs of 4 warps an
# SM, by 65,536 registers; 22.5 KiB of shared memory would allow 10), 64-row ones 255.
# Timed at TransAct's region shape (``attention_gpu_time.py --transact-blocks``, one H100,
# ms): key-major 64 0.304 against query-major 64's 0.333 (thirty-fourth session); s32:
# query-major 64 0.338, 32 0.416, 32 capped at 168 registers 0.359 and at 128 0.369. The
# configs that timed slower still are not here (two stages: 0.751-1.010; a cap of 96: 0.523;
# 64 with 8 warps: 0.603-0.735), so ``GEMC_AUTOTUNE=1`` never takes them; the GPU tests run
# every config here (``tests/kernels/test_fused_softmax_backward.py``). The interpreter
# keeps one config of each orientation, for the CPU tests to force both.
_CONFIGS = autotune_configs([_cfg(64, 4, 1, key_major=True), _cfg(64, 4, 1), _cfg(32, 4, 1),
                             _cfg(32, 4, 1, 168), _cfg(32, 4, 1, 128)],
                            [_cfg(MIN_DOT, 1, 1), _cfg(MIN_DOT, 1, 1, key_major=True)])
KEY_MAJOR_CANDIDATES = [_cfg(32, 4, 1, key_major=True)]
"""Key-major configs outside the tuner's list: 32-row blocks timed 0.421 ms at TransAct's
shape (thirty-fourth session, one H100), slower than the query-major ones there, so
``GEMC_AUTOTUNE=1`` does not take it; the GPU tests force it and ``attention_gpu_time.py
--transact-blocks`` times it."""
_TUNE_KEY = ["HEAD_DIM", "CAUSAL", "HAS_BIAS", "KEY_BIAS", "BIAS_GRAD", "inv_max_len"]


def _tiles(cfg: triton.Config, args: dict) -> Tiles:
    """q, dO, O and the dq scratch (and the bias tile, the logsumexp) streamed, k and v
    resident, p and ds converted for the products (ds twice: dk's and dq's)."""
    block = cfg.kwargs["BLOCK"]
    d, e, eb = operand_sizes(args)
    return Tiles(streamed=3 * block * d * e + block * d * 4 + block * block * eb + block * 4,
                 resident=2 * block * d * e, scratch=3 * block * block * 4)


def _prefer(args: dict) -> list[Preferred]:
    """Key-major 64-row blocks where their GPU tests have passed, query-major 64 elsewhere.
    Why not key-major everywhere: the thirty-fourth session's GPU tests of the key-major
    configs reached only rows without causality and without a bias or with a per-key one
    (TransAct's attention) before the call's cut; a causal row or a full bias tile takes
    code of the kernel that only the interpreter has run (``tests/kernels/
    test_fused_softmax_backward.py`` forces every config on the GPU:
    ``benchmarks/h100_session34.sh``)."""
    gpu_tested = not (args.get("CAUSAL") or args.get("BIAS_GRAD")
                      or (args.get("HAS_BIAS") and not args.get("KEY_BIAS")))
    # the interpreter's config of the same orientation: the CPU tests run what a GPU would
    return [({"BLOCK": 64, "KEY_MAJOR": int(gpu_tested)}, 4, 1),
            ({"BLOCK": 64, "KEY_MAJOR": 0}, 4, 1),
            ({"BLOCK": MIN_DOT, "KEY_MAJOR": int(gpu_tested)}, 1, 1)]


@triton.jit
def _key_major_bias(bias_base, offs_n, offs_m, row_len, sbi, sbj, HAS_BIAS: tl.constexpr,
                    KEY_BIAS: tl.constexpr):
    """The bias of a transposed tile ``[keys, queries]``: a per-key bias as a column
    ``[keys, 1]`` (one load of ``BLOCK`` values), a full one as the tile; 0.0 without one
    (never added)."""
    if not HAS_BIAS:
        return 0.0
    elif KEY_BIAS:
        key = tl.load(bias_base + offs_n.to(tl.int64) * sbj, mask=offs_n < row_len, other=0.0)
        return key.to(tl.float32)[:, None]
    else:
        return _bias_tile(bias_base, offs_n, offs_m, row_len, sbj, sbi, False)


@triton.jit
def _key_major_pair(dk, dv, k, v, q, do, o, lse, bias_t, offs_m, offs_n, row_len, scale,
                    db_base, sdi, sdj, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr,
                    BIAS_GRAD_ADD: tl.constexpr):
    """One tile pair with its tiles transposed, keys by queries: ``dk`` and ``dv`` with the
    pair's shares added, and the pair's share of dq (scaled). Why transposed: p^T and ds^T
    are then the A operands of dv's and dk's products as they come out of the products
    before them (registers), and only ds, dq's A operand, is transposed (through shared
    memory); the query-major form transposes p and ds both. ``bias_t``: the bias of the
    tile ``[keys, queries]`` or a per-key column ``[keys, 1]``."""
    # delta = rowsum(O * dO), recomputed from the tiles loaded anyway: no pass of its own
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    s_t = mma(k, tl.trans(q), IEEE) * scale
    if HAS_BIAS:
        s_t += bias_t
    visible_t = (offs_n[:, None] < row_len) & (offs_m[None, :] < row_len)
    if CAUSAL:
        visible_t = visible_t & (offs_m[None, :] >= offs_n[:, None])
    p_t = tl.where(visible_t, tl.exp(s_t - lse[None, :]), 0.0)
    dp_t = mma(v, tl.trans(do), IEEE)
    ds_t = p_t * (dp_t - delta[None, :])
    if BIAS_GRAD:  # each visible tile is visited once, by this program
        _bias_grad_tile(db_base, ds_t, offs_n, offs_m, row_len, sdj, sdi,
                        offs_n[:, None] < row_len, BIAS_GRAD_ADD)
    dv += mma(p_t.to(do.dtype), do, IEEE)
    dk += mma(ds_t.to(q.dtype), q, IEEE)
    dq = mma(tl.trans(ds_t.to(k.dtype)), k, IEEE) * scale
    return dk, dv, dq


@config_choice.autotune(_CONFIGS, _TUNE_KEY, name="jagged_attention._bwd_softmax_row_kernel",
                        tiles=_tiles, prefer=_prefer,
                        accumulates=lambda a: ("DBIAS",) if a.get("BIAS_GRAD")
                        and a.get("BIAS_GRAD_ADD") else ())
@triton.jit
def _bwd_softmax_row_kernel(
    Q, K, V, Out, DO, DQ, DK, DV, DQ_ACC, LSE, offsets_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dkh,
    stride_dvt, stride_dvh, stride_at, stride_ah,
    stride_lse_h, n_heads, scale, inv_max_len, pad_len, n_rows, total_rows,
    BIAS, DBIAS, stride_bb, stride_bh, stride_bi, stride_bj,
    stride_dbb, stride_dbh, stride_dbi, stride_dbj,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, HAS_BIAS: tl.constexpr,
    KEY_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, BIAS_GRAD_ADD: tl.constexpr,
    BLOCK: tl.constexpr, KEY_MAJOR: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // n_heads
    h = pid % n_heads
    start, row_len = _sequence(offsets_ptr, b, pad_len)
    offs_d = tl.arange(0, BLOCK_D)
    # this sequence's chunks of the outputs' uncovered rows, for its head (n_rows: the rows
    # per sequence the chunks span, jagged_attention.grid_rows), tested once for all of
    # them: a packed sequence's chunks inside the covered rows (nearly every one) zero none
    chunks = tl.cdiv(n_rows, BLOCK)
    n_seqs = tl.num_programs(0) // n_heads
    if _any_uncovered(b * chunks, chunks, offsets_ptr, n_seqs, total_rows, pad_len, BLOCK):
        for c in range(0, chunks):
            chunk = b * chunks + c
            _zero_uncovered(DQ + h * stride_dqh, chunk, offsets_ptr, n_seqs, total_rows,
                            pad_len, stride_dqt, offs_d, HEAD_DIM, BLOCK)
            _zero_uncovered(DK + h * stride_dkh, chunk, offsets_ptr, n_seqs, total_rows,
                            pad_len, stride_dkt, offs_d, HEAD_DIM, BLOCK)
            _zero_uncovered(DV + h * stride_dvh, chunk, offsets_ptr, n_seqs, total_rows,
                            pad_len, stride_dvt, offs_d, HEAD_DIM, BLOCK)
    lse_base = LSE + h * stride_lse_h
    bias_base = BIAS + b.to(tl.int64) * stride_bb + h * stride_bh
    db_base = DBIAS + b.to(tl.int64) * stride_dbb + h * stride_dbh
    if KEY_MAJOR:
        if row_len <= BLOCK:
            # one tile pair (most of TransAct's rows at 64-row blocks): every load at once
            # (the loop below loads k and v, then q, dO and O), no dq scratch, no barrier
            offs = tl.arange(0, BLOCK)
            k = _load_rows(K + h * stride_kh, start, offs, row_len, stride_kt, offs_d,
                           HEAD_DIM, EVEN_D, True)
            v = _load_rows(V + h * stride_vh, start, offs, row_len, stride_vt, offs_d,
                           HEAD_DIM, EVEN_D, True)
            q = _load_rows(Q + h * stride_qh, start, offs, row_len, stride_qt, offs_d,
                           HEAD_DIM, EVEN_D, True)
            do = _load_rows(DO + h * stride_doh, start, offs, row_len, stride_dot, offs_d,
                            HEAD_DIM, EVEN_D, True)
            o = _load_rows(Out + h * stride_oh, start, offs, row_len, stride_ot, offs_d,
                           HEAD_DIM, EVEN_D, True)
            lse = _row_stat(lse_base, start, offs, row_len, True)
            bias_t = _key_major_bias(bias_base, offs, offs, row_len, stride_bi, stride_bj,
                                     HAS_BIAS, KEY_BIAS)
            zeros = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
            dk, dv, dq = _key_major_pair(zeros, zeros, k, v, q, do, o, lse, bias_t, offs,
                                         offs, row_len, scale, db_base, stride_dbi,
                                         stride_dbj, CAUSAL, IEEE, HAS_BIAS, BIAS_GRAD,
                                         BIAS_GRAD_ADD)
            _store_rows(DQ + h * stride_dqh, start, offs, row_len, stride_dqt, offs_d, dq,
                        HEAD_DIM)
            _store_rows(DK + h * stride_dkh, start, offs, row_len, stride_dkt, offs_d,
                        dk * scale, HEAD_DIM)
            _store_rows(DV + h * stride_dvh, start, offs, row_len, stride_dvt, offs_d, dv,
                        HEAD_DIM)
            return
    last_n = (tl.cdiv(row_len, BLOCK) - 1) * BLOCK
    for start_n in range(0, row_len, BLOCK):
        offs_n = start_n + tl.arange(0, BLOCK)
        k = _load_rows(K + h * stride_kh, start, offs_n, row_len, stride_kt, offs_d, HEAD_DIM,
                       EVEN_D, True)
        v = _load_rows(V + h * stride_vh, start, offs_n, row_len, stride_vt, offs_d, HEAD_DIM,
                       EVEN_D, True)
        if KEY_MAJOR and KEY_BIAS:  # one per key: a column, loaded once a key block
            key_bias = _key_major_bias(bias_base, offs_n, offs_n, row_len, stride_bi,
                                       stride_bj, HAS_BIAS, True)
        dk = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
        # causal: a key block is seen by its own query block and the ones after it
        lo = start_n if CAUSAL else 0
        for start_m in range(lo, row_len, BLOCK):
            offs_m = start_m + tl.arange(0, BLOCK)
            # every load of the tile pair first, so their latencies overlap one another
            # and the products below
            q = _load_rows(Q + h * stride_qh, start, offs_m, row_len, stride_qt, offs_d,
                           HEAD_DIM, EVEN_D, True)
            do = _load_rows(DO + h * stride_doh, start, offs_m, row_len, stride_dot, offs_d,
                            HEAD_DIM, EVEN_D, True)
            o = _load_rows(Out + h * stride_oh, start, offs_m, row_len, stride_ot, offs_d,
                           HEAD_DIM, EVEN_D, True)
            lse = _row_stat(lse_base, start, offs_m, row_len, True)
            acc_ptrs = DQ_ACC + h * stride_ah + (start + offs_m[:, None]) * stride_at \
                + offs_d[None, :]
            inside = (offs_m[:, None] < row_len) & (offs_d[None, :] < HEAD_DIM)
            if KEY_MAJOR:
                if KEY_BIAS:
                    bias_t = key_bias
                else:
                    bias_t = _key_major_bias(bias_base, offs_n, offs_m, row_len, stride_bi,
                                             stride_bj, HAS_BIAS, False)
                dk, dv, dq = _key_major_pair(dk, dv, k, v, q, do, o, lse, bias_t, offs_m,
                                             offs_n, row_len, scale, db_base, stride_dbi,
                                             stride_dbj, CAUSAL, IEEE, HAS_BIAS, BIAS_GRAD,
                                             BIAS_GRAD_ADD)
                # the query block's dq so far (the earlier key blocks' sum), loaded only by
                # a block after the first
                if start_n > 0:
                    dq += tl.load(acc_ptrs, mask=inside, other=0.0)
            else:
                if HAS_BIAS:
                    bias = _bias_tile(bias_base, offs_m, offs_n, row_len, stride_bi,
                                      stride_bj, KEY_BIAS)
                # the query block's dq so far: the earlier key blocks' sum (none before
                # block 0). Loaded here, its fp32 tile live across the products, the 64-row
                # pick spills (255 registers, 14 words); loaded after dq's product (s31's
                # place) it compiles without spills for sm_90
                dq_before = tl.load(acc_ptrs, mask=inside & (start_n > 0), other=0.0)
                # delta = rowsum(O * dO), recomputed by each key block from the tiles it
                # loads anyway: no pass of its own, no barrier, no buffer
                delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
                s = mma(q, tl.trans(k), IEEE) * scale
                if HAS_BIAS:
                    s += bias
                p = tl.where(_visible(offs_m, offs_n, row_len, CAUSAL),
                             tl.exp(s - lse[:, None]), 0.0)
                dp = mma(do, tl.trans(v), IEEE)
                ds = p * (dp - delta[:, None])
                if BIAS_GRAD:  # each visible tile is visited once, by this program
                    _bias_grad_tile(db_base, ds, offs_m, offs_n, row_len, stride_dbi,
                                    stride_dbj, offs_m[:, None] < row_len, BIAS_GRAD_ADD)
                dv += mma(tl.trans(p.to(do.dtype)), do, IEEE)
                dk += mma(tl.trans(ds.to(q.dtype)), q, IEEE)
                dq = mma(ds.to(k.dtype), k, IEEE) * scale + dq_before
            # the query block's sum over the key blocks that see it: from the first (key
            # block 0) to the last (its own under a causal mask, else the row's last)
            last = start_m if CAUSAL else last_n
            if start_n == last:
                _store_rows(DQ + h * stride_dqh, start, offs_m, row_len, stride_dqt, offs_d,
                            dq, HEAD_DIM)
            else:
                tl.store(acc_ptrs, dq, mask=inside)
        _store_rows(DK + h * stride_dkh, start, offs_n, row_len, stride_dkt, offs_d,
                    dk * scale, HEAD_DIM)
        _store_rows(DV + h * stride_dvh, start, offs_n, row_len, stride_dvt, offs_d, dv,
                    HEAD_DIM)
        tl.debug_barrier()  # this key block's dq sums, stored by some threads, loaded next


def softmax_row_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, do: torch.Tensor,
                         dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                         offsets: torch.Tensor, max_len: int, scale: float, meta: dict,
                         bias_args: tuple, pad_len: int = 0) -> None:
    """Writes dq, dk, dv (``written_rows`` buffers of q's shape and dtype) of the softmax
    attention whose forward gave ``out`` and ``lse``: every row a sequence covers, and
    zeros into every other row; the bias's gradient as the meta-parameters say
    (``bias_args``: ``jagged_attention._bias_args``)."""
    total, heads, _ = q.shape
    batch = offsets.numel() - 1
    dq_acc = uninitialised(tuple(q.shape), contiguous_strides(q.shape), torch.float32,
                           q.device)
    kernel_meta = {key: meta[key] for key in ("HEAD_DIM", "BLOCK_D", "EVEN_D", "CAUSAL",
                                              "IEEE", "HAS_BIAS", "KEY_BIAS", "BIAS_GRAD",
                                              "BIAS_GRAD_ADD")}
    _bwd_softmax_row_kernel[(batch * heads,)](
        q, k, v, out, do, dq, dk, dv, dq_acc, lse, offsets,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), do.stride(0), do.stride(1), dq.stride(0), dq.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), dq_acc.stride(0),
        dq_acc.stride(1), lse.stride(0), heads, scale, 1.0 / max_len, pad_len,
        grid_rows(total, batch, max_len), total, *bias_args, **kernel_meta,
    )
