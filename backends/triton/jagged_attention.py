"""Jagged multi-head attention, forward and backward in Triton, with no padding anywhere.

Inputs are the jagged values ``q, k, v: [total_len, heads, head_dim]`` of B sequences laid
end to end, and ``offsets: [B+1]`` (int32 or int64): sequence ``b`` owns rows
``offsets[b]:offsets[b+1]``. Queries of sequence ``b`` attend only to keys of sequence
``b`` (the key-padding mask is implicit in the lengths); ``causal=True`` also hides keys
after the query. Masks are computed in-kernel, so no ``[B, L, L]`` mask and no padded copy
of q/k/v ever exist: work and memory scale with ``sum(len_b ** 2)``, not ``B * max_len ** 2``.

Two score functions (``kind``):

``"softmax"``
    ``out_i = sum_j softmax_j(scale * q_i . k_j) v_j``, computed flash-attention style (online
    softmax over key blocks); the forward saves only the row logsumexp.

``"silu"`` (HSTU, "Actions Speak Louder than Words", Zhai et al. 2024)
    ``out_i = sum_j silu(scale * q_i . k_j) / N_b * v_j`` over the keys ``j`` visible to
    ``i`` (same sequence, and ``j <= i`` when causal). The normaliser ``N_b`` is chosen by
    ``silu_normalizer``:

    * ``"max_len"`` (default, what the HSTU reference kernels do): ``N_b = max_len``, the
      ``max_len`` argument of the call, the same for every sequence of the batch. Pass the
      model's fixed maximum history length to make the output independent of the batch.
    * ``"own_len"``: ``N_b = len_b``, the length of the query's own sequence.

    There is no softmax, so nothing is saved but the inputs.

The backward recomputes the scores block by block (no attention matrix is stored): one
kernel walks the query blocks of each key block to produce dk and dv, another walks the key
blocks of each query block to produce dq (and, for softmax, first computes
``delta_i = rowsum(dO_i * O_i)`` for its rows, which the dk/dv kernel then reads). Neither
uses atomics, so results are deterministic. Where one kernel does both for the silu
(``FUSED_DQ`` under :data:`FUSED_SILU_BACKWARD`), the dk/dv kernel adds dq into a zeroed
fp32 buffer with atomics, and dq's last bits vary from run to run. The softmax backward of
short rows under :data:`FUSED_SOFTMAX_SHORT_ROWS` is one program per (sequence, head)
instead (:mod:`.softmax_row_backward`: no atomics).

Grid: one program per (query block, sequence, head) of the forward and dq kernels, and per
(key block, sequence, head) of the dk/dv kernel; a program whose block starts past its
sequence's end exits at once, after zeroing its chunk of the rows no sequence covers (the
outputs are never zero-filled first: :func:`written_rows`). ``max_len`` (the longest
sequence, passed to avoid a host sync) sizes the grid (:func:`grid_rows`: more blocks only
where the buffers have more than ``B * max_len`` rows); sequences longer than ``max_len``
are an error the kernels cannot see.

Inputs may be fp32 or bf16 (fp16 works too); all accumulation is fp32, products of fp32
inputs are IEEE fp32 (no TF32), and outputs and gradients have the input dtype.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import triton
import triton.language as tl

from gemc import softmax_backward_rule

from . import config_choice
from .config_choice import Preferred, Tiles
from .jagged import jagged_to_padded_reference, padded_to_jagged_reference
from .runtime import (
    MIN_DOT,
    autotune_configs,
    check_launchable,
    check_offsets,
    is_interpreted,
    max_length,
    mma,
    next_pow2,
)
from .uncovered_rows import contiguous_strides, uninitialised

__all__ = ["jagged_attention", "jagged_attention_reference", "JaggedAttentionFunction"]

AttentionKind = Literal["softmax", "silu"]
SiluNormalizer = Literal["max_len", "own_len"]

_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": a fully masked row never computes inf - inf


def _cfg(block_m: int, block_n: int, warps: int, stages: int,
         maxnreg: int | None = None) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps,
                         num_stages=stages, maxnreg=maxnreg)


# Hopper, head_dim 64, bf16: 128-row query tiles keep the tensor cores fed in the forward;
# the dk/dv kernel holds two [BLOCK_N, D] accumulators, so it prefers long key tiles and short
# query tiles, and the dq kernel the reverse (as in the Triton fused-attention tutorial).
# The last config of each list is for short rows (:data:`SHORT_ROWS`); the forward's is
# capped at 96 registers a thread (its uncapped twin before it): at TransAct's shape the
# uncapped one takes 118 (4 programs an SM), capped 96 with 4 words of spills (Triton's
# n_spills; 5 programs), 0.143 ms against 0.154 (thirty-second session, one H100,
# ``attention_gpu_time.py --transact-blocks``; a cap of 80, 14 words of spills: 0.144).
_FWD_CONFIGS = autotune_configs(
    [_cfg(128, 64, 4, 3), _cfg(128, 64, 8, 3), _cfg(64, 64, 4, 4), _cfg(128, 128, 8, 3),
     _cfg(64, 32, 4, 2), _cfg(64, 32, 4, 2, 96)],
    _cfg(MIN_DOT, MIN_DOT, 1, 1),
)
_BWD_KV_CONFIGS = autotune_configs(
    [_cfg(32, 128, 4, 3), _cfg(64, 128, 8, 3), _cfg(64, 64, 4, 3), _cfg(32, 64, 4, 4),
     _cfg(32, 32, 4, 1)],
    _cfg(MIN_DOT, MIN_DOT, 1, 1),
)
_BWD_Q_CONFIGS = autotune_configs(
    [_cfg(128, 32, 4, 3), _cfg(128, 64, 8, 3), _cfg(64, 64, 4, 3), _cfg(64, 32, 4, 4),
     _cfg(64, 32, 4, 2)],
    _cfg(MIN_DOT, MIN_DOT, 1, 1),
)
# ``inv_max_len`` (1 / the longest row) keys each row length on its own: a model's attentions
# over short and long histories of one head dim each get their own pick (:data:`SHORT_ROWS`)
_TUNE_KEY = ["HEAD_DIM", "CAUSAL", "SILU", "FAST_SIGMOID", "FUSED_DQ", "inv_max_len"]

SHORT_ROWS = softmax_backward_rule.SHORT_ROWS
"""Rows at most this long (``max_len``) at head dim <= 64 take the short-row configs. Why:
at TransAct's shape (rows of ~50 tokens, at most 100; head dim 48; B=4096, 2 heads) each
program does one or two tiles, so no loop is there to pipeline and what bounds the kernels
is how many programs an SM holds: with the long-row picks (two to four pipeline stages,
64-wide key tiles) ncu read 12-19% occupancy (registers and shared memory: 2-3 blocks an
SM) on an H100. Fewer stages and narrower tiles, timed one kernel at a time
(``benchmarks/launch_overhead_probe.py --sweep``, H100, twenty-eighth session): forward
0.27 -> 0.152 ms at 64x32 (4 warps, 2 stages), dq 0.19 -> 0.169 at 64x32 (2 stages), dk/dv
0.317 -> 0.264 at 32x32 (1 stage)."""

FAST_SIGMOID = False
"""The silu kernels' sigmoid as ``0.5 + 0.5 * tanh.approx(x / 2)`` (one special-function
instruction per score) instead of ``1 / (1 + exp(-x))`` (two: ``ex2`` and ``rcp``), for bf16
and fp16 inputs on the GPU (never fp32, never under the interpreter). Why: at HSTU's head
dim 128 the special-function unit's time per score is about the tensor cores' (16 MUFU ops
a clock per SM against ~4,096 bf16 FLOPs, 512 of them a score in the forward), so the
sigmoid, not the matmuls, can bound the kernel. ``tanh.approx.f32``'s relative error
(2^-10.99) is under bf16's rounding (2^-8). Measured on the H200 (``benchmarks/kernels.py
--cases silu_variants``, HSTU's h200 shape, 2026-12-04): forward 0.255 -> 0.126 ms with the
heuristic configs, 0.154 -> 0.125 autotuned; fwd+bwd 1.161 -> 0.993 / 1.038 -> 0.933 ms;
max abs error against the fp32 formula 0.026-0.029 (exact sigmoid: 0.030-0.032). Off by
default all the same: in ``--cases zoo`` (HSTU's attention with its relative bias, the
issue's figure) the same session measured fwd+bwd 0.657 ms with it against 0.516 without,
in one call, while the same code without it ran 0.516-0.743 ms across processes: the
difference is inside the noise, and the bias case was not timed with the fast sigmoid
alone. Needs repeated timings before it is switched on."""

FUSED_SILU_BACKWARD = False
"""The silu backward as one kernel: the dk/dv kernel also computes each tile's ``ds @ k``
and adds it into an fp32 dq with atomics, instead of a second kernel walking the key blocks
of each query block again for dq. Why: the silu backward needs no row statistics (no
softmax), so nothing orders dq after dk/dv; one pass computes ``q k^T`` and ``dO v^T`` once
per tile instead of twice (5 tile products instead of 7, and half the sigmoids). The price:
fp32 atomics into dq (``T x H x D`` per key block a query sees) and a dq whose sum order,
so its last bits, varies from run to run. Off: on the H200 (``benchmarks/kernels.py --cases
silu_variants``, 2026-12-04) it ran fwd+bwd 0.73-0.78 ms against 0.93-1.16 but its gradients
were wrong (max abs error 21-78 against the fp32 formula, every variant that used it), while
the interpreter's runs agree with the formula. The cause, found on the CPU (thirteenth
session) and not yet confirmed on the GPU: Triton 3.6 times even the one config gemc's
hook leaves, so the first launch ran the kernel hundreds of times adding into the same dq
(the error was larger where several configs were timed, 46-78, than with one, 21-25);
its timer now runs nothing where one config is left (``config_choice.ConfigChoice.bench``) and a
timed run starts from a zeroed dq (``accumulates``). Stays off until the H200 shows the
error at the two-kernel path's (``benchmarks/h200_pending12.sh``, part 4)."""


KEY_BLOCK_ENV = "GEMC_SILU_KEY_BLOCK_BACKWARD"
FUSED_SOFTMAX_ENV = softmax_backward_rule.ENV


_switch_from_env = softmax_backward_rule.switch_from_env


def _key_block_from_env() -> bool:
    """``GEMC_SILU_KEY_BLOCK_BACKWARD`` (:func:`_switch_from_env`)."""
    return _switch_from_env(KEY_BLOCK_ENV, "the key-block silu backward",
                            "the two-kernel one")


def _fused_softmax_from_env() -> bool:
    """``GEMC_FUSED_SOFTMAX_SHORT_ROWS`` (``gemc.softmax_backward_rule``; unset: on)."""
    return softmax_backward_rule.enabled_from_env()


SILU_KEY_BLOCK_BACKWARD = _key_block_from_env()
"""The silu backward by :mod:`.silu_key_block_backward`: one program per (sequence, key
block) writes dk, dv and (looping over the heads where they share the bias) the bias's
gradient summed over the heads, with no atomics, no zeroed fp32 buffer and no cast pass;
dq as ``FUSED_SILU_BACKWARD`` says (relaxed atomics from the same program, or the dq
kernel). Why: issue 17's HSTU shape, where the backward took ~6x the forward and the bias
doubled it (the module's docstring counts each cost). On by default since the twenty-first
session, measured on an H100 (BENCHMARKS.md): its 11 kernel tests pass on the GPU (the
interpreter's cannot see a race between the heads of one program); HSTU's step 52.40 ->
45.52 ms, its loss the same to 3e-4 (``benchmarks/h100_session21.sh``); at HSTU's zoo
shape with its bias (``kernels.py --cases silu_variants``) fwd+bwd 0.900-1.412 ms by the
other flags against 1.369 for the defaults' two-kernel path, max abs error 4.9e-4 against
1.6-3.1e-2 for every other variant. Not yet timed on an H200.
``GEMC_SILU_KEY_BLOCK_BACKWARD=0`` runs the two-kernel backward."""

FUSED_SOFTMAX_SHORT_ROWS = _fused_softmax_from_env()
"""The softmax backward of short rows (:func:`fused_softmax_backward`: ``max_len`` at most
:data:`SHORT_ROWS`, head dim <= 64) as one kernel with one program per (sequence, head)
(:mod:`.softmax_row_backward`): delta, then dq, dk and dv from each tile pair once, dq's
sums over the key blocks in an fp32 scratch the program owns, no atomics. Why: at
TransAct's shape (rows of ~51 tokens, at most 101; head dim 48) a row is one or two tiles,
and the two-kernel path's dq kernel (0.168 ms on an H100, against dk/dv's 0.264) re-does
the ``q k^T`` and ``dO v^T`` products the dk/dv kernel does. Its first form, the dk/dv
kernel adding dq with fp32 atomics, measured 0.819-0.823 ms on an H100 (thirtieth session,
``benchmarks/h100_session30.sh 1``; ~67 M atomics a call by arithmetic), against 0.432 for the two
kernels, and was replaced by this one. This one, on one H100 (``h100_session30.sh 3``):
0.402-0.409 ms against the two kernels' 0.434; TransAct's region fwd+bwd 0.565-0.571 ms by
CUDA graph replay against 0.581-0.587 (cuDNN's padded masked SDPA: 0.958-0.960). **On by
default** since the thirty-first session, when its numeric tests passed on an H100 at rows
of 100 (two 64-row blocks: dq through the scratch; ``h100_session31.sh 1``).
``GEMC_FUSED_SOFTMAX_SHORT_ROWS=0`` runs the two kernels."""


def written_rows(like: torch.Tensor, count: int = 1, zeroed: bool = False
                 ) -> list[torch.Tensor]:
    """``count`` contiguous buffers of ``like``'s shape and dtype for outputs the kernels
    write in full: :func:`uninitialised`, no fill. The kernel that stores a buffer's rows
    also stores zeros into the rows no sequence covers (:func:`_zero_uncovered`), so
    neither a ``torch.zeros`` of every row nor a zero-fill launch of its own is needed.
    ``zeroed``: ``torch.zeros`` instead, for a call whose kernels do not run (no sequence,
    or ``max_len == 0``: every row is uncovered and nothing launches to zero it)."""
    if zeroed:
        return [torch.zeros(like.shape, dtype=like.dtype, device=like.device)
                for _ in range(count)]
    strides = contiguous_strides(like.shape)
    return [uninitialised(tuple(like.shape), strides, like.dtype, like.device)
            for _ in range(count)]


def grid_rows(total: int, batch: int, max_len: int) -> int:
    """The rows per sequence a kernel's grid spans: ``max_len``, or more where the buffers
    have more than ``batch * max_len`` rows, so that the grid's (sequence, block) programs,
    one ``BLOCK``-row chunk of the buffer each (:func:`_zero_uncovered`), reach every row.
    Equal to ``max_len`` for a packed region's buffer (``B * max_len`` slots) and for the
    padded layout (``B * pad_len`` rows, ``pad_len <= max_len``)."""
    return max(max_len, -(-total // max(batch, 1)))


def uses_key_block_backward(meta: dict) -> bool:
    """Whether a backward with these meta-parameters runs :data:`SILU_KEY_BLOCK_BACKWARD`'s
    kernel (silu only; read at the backward, where the bias's buffer is made too)."""
    return bool(SILU_KEY_BLOCK_BACKWARD and meta.get("SILU"))


# Shared memory per config (config_choice.shared_memory_bytes): the loop's operand tiles are
# streamed (k, v and the bias tile in the forward and dq kernels; q, dO, the bias and the
# row statistics in the dk/dv kernel), the program's own rows stay resident, and score
# tiles (one fp32 tile in the forward, p and ds in the backward) go through a conversion.
def operand_sizes(args: dict) -> tuple[int, int, int]:
    """A launch's padded head dim, q's element bytes and the score bias's (0 without one):
    what every attention kernel's tile estimate (``config_choice.Tiles``) multiplies."""
    q = args.get("Q")
    # duck-typed: a warm-up passes its argument descriptors (warm.Arg) here too
    e = q.element_size() if hasattr(q, "element_size") else 2
    bias = args.get("BIAS")
    eb = (bias.element_size() if hasattr(bias, "element_size") else 4) \
        if args.get("HAS_BIAS") else 0
    return int(args.get("BLOCK_D", 64)), e, eb


def _sizes(cfg: triton.Config, args: dict) -> tuple[int, int, int, int, int]:
    return cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], *operand_sizes(args)


def _fwd_tiles(cfg: triton.Config, args: dict) -> Tiles:
    bm, bn, d, e, eb = _sizes(cfg, args)
    return Tiles(streamed=2 * bn * d * e + bm * bn * eb, resident=bm * d * e, scratch=bm * bn * 4)


def _dq_tiles(cfg: triton.Config, args: dict) -> Tiles:
    bm, bn, d, e, eb = _sizes(cfg, args)
    return Tiles(streamed=2 * bn * d * e + bm * bn * eb, resident=2 * bm * d * e,
                 scratch=2 * bm * bn * 4)


def _dkdv_tiles(cfg: triton.Config, args: dict) -> Tiles:
    bm, bn, d, e, eb = _sizes(cfg, args)
    stats = 0 if args.get("SILU") else 2 * bm * 4
    # the fused backward's ds also feeds ds @ k (one more score tile converted)
    tiles = 3 if args.get("FUSED_DQ") else 2
    return Tiles(streamed=2 * bm * d * e + bm * bn * eb + stats, resident=2 * bn * d * e,
                 scratch=tiles * bm * bn * 4)


# The cold first step's configs (no autotuning): what the H200 picked in bf16 (issue 16's
# first-step log), head dim 64 (the GEM example) and 128 (HSTU, with a bias).
def _pick(block_m: int, block_n: int, warps: int, stages: int,
          maxnreg: int | None = None) -> Preferred:
    return {"BLOCK_M": block_m, "BLOCK_N": block_n}, warps, stages, maxnreg


def short_rows(max_len: float, block_d: int) -> bool:
    """Whether rows of at most ``max_len`` tokens at a padded head dim ``block_d`` are short
    (:data:`SHORT_ROWS`, head dim <= 64): the short-row configs and the one-kernel softmax
    backward (:func:`fused_softmax_backward`) both read it."""
    return softmax_backward_rule.short_rows(max_len, block_d)


def fused_softmax_backward(max_len: int, block_d: int) -> bool:
    """Whether the softmax backward of a call runs as one kernel
    (:data:`FUSED_SOFTMAX_SHORT_ROWS`): short rows (:func:`short_rows`), the switch on."""
    return FUSED_SOFTMAX_SHORT_ROWS and short_rows(max_len, block_d)


def _short_rows(args: dict) -> bool:
    """Whether a launch's rows are short (:func:`short_rows`; ``inv_max_len`` its 1 / max_len)."""
    inv = float(args.get("inv_max_len") or 0.0)
    return inv > 0.0 and short_rows(1.0 / inv, int(args.get("BLOCK_D", 64)))


def _fwd_prefer(args: dict) -> list[Preferred]:
    if _short_rows(args):
        return [_pick(64, 32, 4, 2, 96)]
    return [_pick(64, 64, 4, 4)] if int(args.get("BLOCK_D", 64)) <= 64 else \
        [_pick(128, 64, 8, 3), _pick(64, 64, 4, 4)]


def _dq_prefer(args: dict) -> list[Preferred]:
    return [_pick(64, 32, 4, 2)] if _short_rows(args) else [_pick(64, 32, 4, 4)]


def _dkdv_prefer(args: dict) -> list[Preferred]:
    if _short_rows(args):
        return [_pick(32, 32, 4, 1)]
    return [_pick(64, 64, 4, 3)] if int(args.get("BLOCK_D", 64)) <= 64 else \
        [_pick(32, 64, 4, 4)]


# ---------------------------------------------------------------------------------------
# shared pieces of the three kernels
#
# Every loop over blocks is split into phases: blocks where every score is visible (whole
# blocks inside the sequence and, under a causal mask, strictly below the diagonal) run with
# MASK=False (plain loads, no compare/select on the [BLOCK_M, BLOCK_N] tile); the diagonal
# and the ragged last block run with MASK=True. Rows past the end of a sequence that are
# loaded as zeros (the partial query block's tail) contribute nothing and are never stored.
# ---------------------------------------------------------------------------------------


@triton.jit
def _sequence(offsets_ptr, b, pad_len):
    """Start row (int64) and length (int32) of sequence ``b``. ``pad_len > 0``: the rows are
    a padded ``[B, pad_len]`` layout read in place (row ``b`` starts at ``b * pad_len``; its
    length, from the offsets, clamped to ``pad_len``), so no copy into a packed buffer."""
    first = tl.load(offsets_ptr + b).to(tl.int64)
    end = tl.load(offsets_ptr + b + 1).to(tl.int64)
    length = end - first
    if pad_len > 0:
        first = b.to(tl.int64) * pad_len
        length = tl.minimum(length, pad_len)
    return first, length.to(tl.int32)


@triton.jit
def _load_rows(base, start, offs, row_len, stride_t, offs_d, HEAD_DIM: tl.constexpr,
               EVEN_D: tl.constexpr, MASK: tl.constexpr):
    """A [rows, BLOCK_D] tile of one head; with MASK, rows past the sequence read as zero."""
    ptrs = base + (start + offs[:, None]) * stride_t + offs_d[None, :]
    if MASK:
        x = tl.load(ptrs, mask=(offs[:, None] < row_len) & (offs_d[None, :] < HEAD_DIM),
                    other=0.0)
    elif EVEN_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def _store_rows(base, start, offs, row_len, stride_t, offs_d, x, HEAD_DIM: tl.constexpr):
    ptrs = base + (start + offs[:, None]) * stride_t + offs_d[None, :]
    mask = (offs[:, None] < row_len) & (offs_d[None, :] < HEAD_DIM)
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _any_uncovered(chunk, n_chunks, offsets_ptr, n_seqs, total_rows, pad_len,
                   BLOCK: tl.constexpr):
    """Whether chunks ``[chunk, chunk + n_chunks)`` (``BLOCK`` rows each) may hold a row
    that :func:`_zero_uncovered` zeros: any in the padded layout, else any outside
    ``[offsets[0], offsets[n_seqs])``. Why a test of its own: a program that zeros several
    chunks (one per head or per output) asks once, two scalar loads, where each call would
    load and branch again (their loads cannot be hoisted past the stores between them)."""
    lo = chunk.to(tl.int64) * BLOCK
    first = tl.load(offsets_ptr).to(tl.int64)
    end = tl.load(offsets_ptr + n_seqs).to(tl.int64)
    hi = tl.minimum(lo + n_chunks * BLOCK, total_rows)
    return (lo < total_rows) & ((pad_len > 0) | (lo < first) | (hi > end))


@triton.jit
def _zero_uncovered(base, chunk, offsets_ptr, n_seqs, total_rows, pad_len, stride_t, offs_d,
                    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """Zeros into the rows of chunk ``chunk`` (rows ``[chunk * BLOCK, +BLOCK)`` of a
    ``[total_rows, H, D]`` output, one head: ``base``) that no sequence covers, and nowhere
    else: with ``pad_len == 0`` the rows outside ``[offsets[0], offsets[n_seqs])`` (a packed
    buffer's spare slots); with ``pad_len > 0`` (the padded layout) row ``r``'s position
    ``r % pad_len`` at or past its sequence's length (clamped to ``pad_len``), and every
    row past ``n_seqs * pad_len``.

    Why here: each kernel that stores an output's rows calls it once per program, for its
    own chunk (:func:`grid_rows` sizes the grid so the chunks reach every row), so the
    outputs need neither a ``torch.zeros`` nor a zero-fill launch (issue 17: those
    launches were two of a fwd+bwd's five, each ~0.1 ms of host). A packed chunk inside
    ``[offsets[0], offsets[n_seqs])`` (nearly all of them) costs two scalar loads. The two
    layouts' bounds are computed as blocks of one type and selected (``tl.where``): a
    run-time branch whose arms give a variable different types does not compile for the
    GPU."""
    if _any_uncovered(chunk, 1, offsets_ptr, n_seqs, total_rows, pad_len, BLOCK):
        rows = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        padded = (tl.zeros_like(rows) + pad_len) > 0
        seq = tl.where(padded, rows // tl.maximum(pad_len, 1), 0)
        has = (rows < total_rows) & (seq < n_seqs)
        begin = tl.load(offsets_ptr + seq, mask=has, other=0).to(tl.int64)
        stop = tl.load(offsets_ptr + tl.where(padded, seq + 1, n_seqs), mask=has,
                       other=0).to(tl.int64)
        row0 = tl.where(padded, seq * pad_len, begin)
        length = tl.where(padded, tl.minimum(stop - begin, pad_len), stop - begin)
        covered = has & (rows >= row0) & (rows < row0 + length)
        zero = (rows < total_rows) & (covered == 0)
        ptrs = base + rows[:, None] * stride_t + offs_d[None, :]
        tl.store(ptrs, tl.zeros([BLOCK, offs_d.shape[0]], base.dtype.element_ty),
                 mask=zero[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _row_stat(base, start, offs, row_len, MASK: tl.constexpr):
    """Per-row fp32 statistic (logsumexp or delta) of one head."""
    if MASK:
        x = tl.load(base + start + offs, mask=offs < row_len, other=0.0)
    else:
        x = tl.load(base + start + offs)
    return x


@triton.jit
def _visible(offs_m, offs_n, row_len, CAUSAL: tl.constexpr):
    visible = (offs_m[:, None] < row_len) & (offs_n[None, :] < row_len)
    if CAUSAL:
        visible = visible & (offs_m[:, None] >= offs_n[None, :])
    return visible


@triton.jit
def _sigmoid(x, FAST: tl.constexpr):
    """``sigmoid(x)``; ``FAST``: through ``tanh.approx.f32`` (see :data:`FAST_SIGMOID`)."""
    if FAST:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [0.5 * x],
                                      dtype=tl.float32, is_pure=True, pack=1)
        return 0.5 * t + 0.5
    else:
        return tl.sigmoid(x)


@triton.jit
def _probs(s, offs_m, offs_n, row_len, lse, inv_norm, CAUSAL: tl.constexpr,
           SILU: tl.constexpr, MASK: tl.constexpr, FAST_SIGMOID: tl.constexpr):
    """Recomputed attention weights ``p`` and ``d p / d s`` (silu; None-like 0 for softmax)."""
    if SILU:
        sig = _sigmoid(s, FAST_SIGMOID)
        p = s * sig * inv_norm
        dp_ds = sig * (1.0 + s * (1.0 - sig)) * inv_norm
    else:
        p = tl.exp(s - lse[:, None])
        dp_ds = p  # unused: the softmax backward uses p and delta instead
    if MASK:
        visible = _visible(offs_m, offs_n, row_len, CAUSAL)
        p = tl.where(visible, p, 0.0)
        dp_ds = tl.where(visible, dp_ds, 0.0)
    return p, dp_ds


@triton.jit
def _inv_norm(row_len, inv_max_len, NORM_BY_OWN_LEN: tl.constexpr):
    if NORM_BY_OWN_LEN:
        return 1.0 / tl.maximum(row_len, 1).to(tl.float32)
    else:
        return inv_max_len


@triton.jit
def _query_blocks(start_n, row_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr):
    """A key block's query blocks, as three loops' bounds: ``[lo, diag)`` straddle the
    causal diagonal (masked), ``[diag, full)`` need no mask, ``[max(diag, full), row_len)``
    is the ragged last block (masked)."""
    full = (row_len // BLOCK_M) * BLOCK_M
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
        diag = tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M
    else:
        lo = 0
        diag = 0
    return lo, diag, full


@triton.jit
def _bias_tile(bias_base, offs_m, offs_n, row_len, sbi, sbj, KEY_BIAS: tl.constexpr):
    """The additive bias of a [BLOCK_M, BLOCK_N] score tile (positions within the sequence;
    rows or columns past its end read 0). ``KEY_BIAS``: the bias is one per key (the same
    for every query, ``sbi == 0``): one ``[BLOCK_N]`` load broadcast over the rows, which
    rows past the end then read too: those rows are never stored, and the one sum over
    rows (dk, dv) meets them only in masked blocks, whose ``p`` is zeroed there. Why: the
    tile load of a stride-0 bias issued ``BLOCK_M x BLOCK_N`` loads of ``BLOCK_N`` values
    and made TransAct's forward 4.6x slower than without its bias (0.873 vs 0.189 ms on an
    H100, twenty-seventh session)."""
    if KEY_BIAS:
        key = tl.load(bias_base + offs_n.to(tl.int64) * sbj, mask=offs_n < row_len, other=0.0)
        # one return type with the tile's (a jit function's returns must agree)
        return tl.broadcast_to(key.to(tl.float32)[None, :], (offs_m.shape[0], offs_n.shape[0]))
    ptrs = bias_base + offs_m[:, None].to(tl.int64) * sbi + offs_n[None, :].to(tl.int64) * sbj
    inside = (offs_m[:, None] < row_len) & (offs_n[None, :] < row_len)
    return tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)


@triton.jit
def _bias_grad_tile(db_base, ds, offs_m, offs_n, row_len, sdi, sdj, rows_inside,
                    ADD: tl.constexpr):
    """A score tile's share of the bias's gradient (``ds``). ``ADD``: the heads share one
    fp32 buffer (the bias is one for all heads), so each head adds its tile with atomics
    instead of writing a ``[B, H, Lb, Lb]`` buffer that a separate pass sums over H."""
    ptrs = db_base + offs_m[:, None].to(tl.int64) * sdi + offs_n[None, :].to(tl.int64) * sdj
    inside = rows_inside & (offs_n[None, :] < row_len)
    if ADD:
        tl.atomic_add(ptrs, ds, mask=inside)
    else:
        tl.store(ptrs, ds, mask=inside)


# ---------------------------------------------------------------------------------------
# one block step of each kernel
# ---------------------------------------------------------------------------------------


@triton.jit
def _fwd_step(acc, m_i, l_i, q, k_base, v_base, start, start_n, offs_m, offs_d, row_len,
              stride_kt, stride_vt, scale, inv_norm, bias_base, sbi, sbj,
              HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, SILU: tl.constexpr, IEEE: tl.constexpr,
              MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
              KEY_BIAS: tl.constexpr, FAST_SIGMOID: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load_rows(k_base, start, offs_n, row_len, stride_kt, offs_d, HEAD_DIM, EVEN_D, MASK)
    v = _load_rows(v_base, start, offs_n, row_len, stride_vt, offs_d, HEAD_DIM, EVEN_D, MASK)
    if HAS_BIAS:  # loaded with k and v, so its latency overlaps theirs and the product's
        bias = _bias_tile(bias_base, offs_m, offs_n, row_len, sbi, sbj, KEY_BIAS)
    s = mma(q, tl.trans(k), IEEE) * scale
    if HAS_BIAS:
        s += bias
    if SILU:
        p, _ = _probs(s, offs_m, offs_n, row_len, m_i, inv_norm, CAUSAL, SILU, MASK,
                      FAST_SIGMOID)
        acc += mma(p.to(v.dtype), v, IEEE)
    else:
        if MASK:
            visible = _visible(offs_m, offs_n, row_len, CAUSAL)
            s = tl.where(visible, s, _NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        if MASK:
            p = tl.where(visible, p, 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, IEEE)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _dq_step(dq, q, do, lse, delta, k_base, v_base, start, start_n, offs_m, offs_d, row_len,
             stride_kt, stride_vt, scale, inv_norm, bias_base, sbi, sbj, db_base, sdi, sdj,
             HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
             CAUSAL: tl.constexpr, SILU: tl.constexpr, IEEE: tl.constexpr,
             MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
             KEY_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr,
             FAST_SIGMOID: tl.constexpr, BIAS_GRAD_ADD: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load_rows(k_base, start, offs_n, row_len, stride_kt, offs_d, HEAD_DIM, EVEN_D, MASK)
    v = _load_rows(v_base, start, offs_n, row_len, stride_vt, offs_d, HEAD_DIM, EVEN_D, MASK)
    s = mma(q, tl.trans(k), IEEE) * scale
    if HAS_BIAS:
        s += _bias_tile(bias_base, offs_m, offs_n, row_len, sbi, sbj, KEY_BIAS)
    p, dp_ds = _probs(s, offs_m, offs_n, row_len, lse, inv_norm, CAUSAL, SILU, MASK,
                      FAST_SIGMOID)
    dp = mma(do, tl.trans(v), IEEE)
    if SILU:
        ds = dp * dp_ds
    else:
        ds = p * (dp - delta[:, None])
    if BIAS_GRAD:  # d loss / d bias = d loss / d s: each visible tile is visited once here
        _bias_grad_tile(db_base, ds, offs_m, offs_n, row_len, sdi, sdj,
                        offs_m[:, None] < row_len, BIAS_GRAD_ADD)
    return dq + mma(ds.to(k.dtype), k, IEEE)


@triton.jit
def _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, start, start_m, offs_n,
               offs_d, row_len, stride_qt, stride_dot, scale, inv_norm, bias_base, sbi, sbj,
               HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
               CAUSAL: tl.constexpr, SILU: tl.constexpr, IEEE: tl.constexpr,
               MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
               KEY_BIAS: tl.constexpr, FAST_SIGMOID: tl.constexpr,
               dq_base, stride_dqt, db_base, sdi, sdj, FUSED_DQ: tl.constexpr,
               BIAS_GRAD: tl.constexpr, BIAS_GRAD_ADD: tl.constexpr):
    """dk, dv of a key block after one more query block; ``FUSED_DQ``: also that query
    block's share of dq (``ds @ k``, added with atomics) and of the bias's gradient (``ds``:
    each tile visited once here), see :data:`FUSED_SILU_BACKWARD`; silu only (the softmax
    runs it as one program per row: :data:`FUSED_SOFTMAX_SHORT_ROWS`). The softmax's
    ``delta`` comes from the dq kernel (``delta_base``)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load_rows(q_base, start, offs_m, row_len, stride_qt, offs_d, HEAD_DIM, EVEN_D, MASK)
    do = _load_rows(do_base, start, offs_m, row_len, stride_dot, offs_d, HEAD_DIM, EVEN_D, MASK)
    s = mma(q, tl.trans(k), IEEE) * scale
    if HAS_BIAS:
        s += _bias_tile(bias_base, offs_m, offs_n, row_len, sbi, sbj, KEY_BIAS)
    dp = mma(do, tl.trans(v), IEEE)
    if SILU:
        p, dp_ds = _probs(s, offs_m, offs_n, row_len, offs_m, inv_norm, CAUSAL, SILU, MASK,
                          FAST_SIGMOID)
        ds = dp * dp_ds
    else:
        lse = _row_stat(lse_base, start, offs_m, row_len, MASK)
        delta = _row_stat(delta_base, start, offs_m, row_len, MASK)
        p, _ = _probs(s, offs_m, offs_n, row_len, lse, inv_norm, CAUSAL, SILU, MASK, False)
        ds = p * (dp - delta[:, None])
    if FUSED_DQ:
        inside = offs_m[:, None] < row_len
        dq = mma(ds.to(k.dtype), k, IEEE) * scale
        tl.atomic_add(dq_base + (start + offs_m[:, None]) * stride_dqt + offs_d[None, :], dq,
                      mask=inside & (offs_d[None, :] < HEAD_DIM))
        if BIAS_GRAD:
            _bias_grad_tile(db_base, ds, offs_m, offs_n, row_len, sdi, sdj, inside,
                            BIAS_GRAD_ADD)
    dv += mma(tl.trans(p.to(do.dtype)), do, IEEE)
    dk += mma(tl.trans(ds.to(q.dtype)), q, IEEE)
    return dk, dv


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def _key_phases(start_m, row_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr):
    """Key blocks of a query block: [0, full) need no mask, [full, end) do."""
    if CAUSAL:
        full = (start_m // BLOCK_N) * BLOCK_N
        end = tl.minimum(row_len, start_m + BLOCK_M)
    else:
        full = (row_len // BLOCK_N) * BLOCK_N
        end = row_len
    return full, end


def _accumulated(args: dict, outputs: tuple[str, ...], writes_bias_grad: bool
                 ) -> tuple[str, ...]:
    """A backward launch's outputs that it adds into (zeroed before each timed autotuning
    run, and once more after the timing): ``outputs`` and, where this launch writes the
    bias's gradient (``writes_bias_grad``) and the heads share its buffer, that buffer.
    Why ``writes_bias_grad``: the two-kernel path's dk/dv kernel does not write the bias's
    gradient (the dq kernel, launched before it, does). Zeroing it there erased the dq
    kernel's sums: on the H200 (Triton 3.6, which calls the hook after choosing even a
    single config), the first backward of each key returned a zero bias gradient (session
    19's ``silu_variants``: "exact sigmoid, heuristic configs, bias", max abs error 0.188,
    the reference's largest value)."""
    bias_grad_added = writes_bias_grad and args.get("BIAS_GRAD") and args.get("BIAS_GRAD_ADD")
    return outputs + ("DBIAS",) if bias_grad_added else outputs


@config_choice.autotune(_FWD_CONFIGS, _TUNE_KEY, name="jagged_attention._fwd_kernel",
                        tiles=_fwd_tiles, prefer=_fwd_prefer)
@triton.jit
def _fwd_kernel(
    Q, K, V, Out, LSE, offsets_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lse_h, n_heads, scale, inv_max_len, pad_len, total_rows,
    BIAS, DBIAS, stride_bb, stride_bh, stride_bi, stride_bj,
    stride_dbb, stride_dbh, stride_dbi, stride_dbj,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    CAUSAL: tl.constexpr, SILU: tl.constexpr, NORM_BY_OWN_LEN: tl.constexpr,
    IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, KEY_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, FUSED_DQ: tl.constexpr, BIAS_GRAD_ADD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    bias_base = BIAS + (tl.program_id(0) // n_heads).to(tl.int64) * stride_bb \
        + (tl.program_id(0) % n_heads) * stride_bh
    pid_bh = tl.program_id(0)
    # Heaviest (last, under a causal mask) query blocks first: shorter tail.
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    start, row_len = _sequence(offsets_ptr, b, pad_len)
    start_m = pid_m * BLOCK_M
    offs_d = tl.arange(0, BLOCK_D)
    # this program's chunk of the output's uncovered rows and (softmax) of the logsumexp's
    # (written_rows: neither is zero-filled; the logsumexp's a [H, rows] row of one value
    # a row: stride 1, one column)
    chunk = b * tl.num_programs(1) + tl.program_id(1)
    n_seqs = tl.num_programs(0) // n_heads
    if _any_uncovered(chunk, 1, offsets_ptr, n_seqs, total_rows, pad_len, BLOCK_M):
        _zero_uncovered(Out + h * stride_oh, chunk, offsets_ptr, n_seqs, total_rows, pad_len,
                        stride_ot, offs_d, HEAD_DIM, BLOCK_M)
        if not SILU:
            _zero_uncovered(LSE + h * stride_lse_h, chunk, offsets_ptr, n_seqs, total_rows,
                            pad_len, 1, offs_d, 1, BLOCK_M)
    if start_m >= row_len:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load_rows(Q + h * stride_qh, start, offs_m, row_len, stride_qt, offs_d, HEAD_DIM,
                   EVEN_D, True)
    k_base = K + h * stride_kh
    v_base = V + h * stride_vh
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    inv_norm = _inv_norm(row_len, inv_max_len, NORM_BY_OWN_LEN)
    full, end = _key_phases(start_m, row_len, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(0, full, BLOCK_N):
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base, v_base, start, start_n, offs_m,
                                  offs_d, row_len, stride_kt, stride_vt, scale, inv_norm,
                                  bias_base, stride_bi, stride_bj,
                                  HEAD_DIM, EVEN_D, BLOCK_N, CAUSAL, SILU, IEEE, False, HAS_BIAS,
                                  KEY_BIAS,
                                  FAST_SIGMOID)
    for start_n in range(full, end, BLOCK_N):
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base, v_base, start, start_n, offs_m,
                                  offs_d, row_len, stride_kt, stride_vt, scale, inv_norm,
                                  bias_base, stride_bi, stride_bj,
                                  HEAD_DIM, EVEN_D, BLOCK_N, CAUSAL, SILU, IEEE, True, HAS_BIAS,
                                  KEY_BIAS,
                                  FAST_SIGMOID)
    if not SILU:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        acc = acc / l_safe[:, None]
        lse_ptrs = LSE + h * stride_lse_h + start + offs_m
        tl.store(lse_ptrs, m_i + tl.log(l_safe), mask=offs_m < row_len)
    _store_rows(Out + h * stride_oh, start, offs_m, row_len, stride_ot, offs_d, acc, HEAD_DIM)


@config_choice.autotune(_BWD_Q_CONFIGS, _TUNE_KEY, name="jagged_attention._bwd_dq_kernel",
                        tiles=_dq_tiles, prefer=_dq_prefer,
                        accumulates=lambda a: _accumulated(a, (), True))
@triton.jit
def _bwd_dq_kernel(
    Q, K, V, Out, DO, DQ, LSE, DELTA, offsets_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_dot, stride_doh, stride_dqt, stride_dqh,
    stride_lse_h, n_heads, scale, inv_max_len, pad_len, total_rows,
    BIAS, DBIAS, stride_bb, stride_bh, stride_bi, stride_bj,
    stride_dbb, stride_dbh, stride_dbi, stride_dbj,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    CAUSAL: tl.constexpr, SILU: tl.constexpr, NORM_BY_OWN_LEN: tl.constexpr,
    IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, KEY_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, FUSED_DQ: tl.constexpr, BIAS_GRAD_ADD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    bias_base = BIAS + (tl.program_id(0) // n_heads).to(tl.int64) * stride_bb \
        + (tl.program_id(0) % n_heads) * stride_bh
    db_base = DBIAS + (tl.program_id(0) // n_heads).to(tl.int64) * stride_dbb \
        + (tl.program_id(0) % n_heads) * stride_dbh
    pid_bh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    start, row_len = _sequence(offsets_ptr, b, pad_len)
    start_m = pid_m * BLOCK_M
    offs_d = tl.arange(0, BLOCK_D)
    _zero_uncovered(DQ + h * stride_dqh, b * tl.num_programs(1) + tl.program_id(1),
                    offsets_ptr, tl.num_programs(0) // n_heads, total_rows, pad_len,
                    stride_dqt, offs_d, HEAD_DIM, BLOCK_M)
    if start_m >= row_len:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load_rows(Q + h * stride_qh, start, offs_m, row_len, stride_qt, offs_d, HEAD_DIM,
                   EVEN_D, True)
    do = _load_rows(DO + h * stride_doh, start, offs_m, row_len, stride_dot, offs_d, HEAD_DIM,
                    EVEN_D, True)
    inv_norm = _inv_norm(row_len, inv_max_len, NORM_BY_OWN_LEN)
    if SILU:
        lse = inv_norm  # unused
        delta = inv_norm  # unused
    else:
        o = _load_rows(Out + h * stride_oh, start, offs_m, row_len, stride_ot, offs_d, HEAD_DIM,
                       EVEN_D, True)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + h * stride_lse_h + start + offs_m, delta, mask=offs_m < row_len)
        lse = _row_stat(LSE + h * stride_lse_h, start, offs_m, row_len, True)
    k_base = K + h * stride_kh
    v_base = V + h * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full, end = _key_phases(start_m, row_len, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(0, full, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, k_base, v_base, start, start_n, offs_m, offs_d,
                      row_len, stride_kt, stride_vt, scale, inv_norm,
                      bias_base, stride_bi, stride_bj, db_base, stride_dbi, stride_dbj,
                      HEAD_DIM, EVEN_D, BLOCK_N, CAUSAL, SILU, IEEE, False, HAS_BIAS, KEY_BIAS,
                      BIAS_GRAD, FAST_SIGMOID, BIAS_GRAD_ADD)
    for start_n in range(full, end, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, k_base, v_base, start, start_n, offs_m, offs_d,
                      row_len, stride_kt, stride_vt, scale, inv_norm,
                      bias_base, stride_bi, stride_bj, db_base, stride_dbi, stride_dbj,
                      HEAD_DIM, EVEN_D, BLOCK_N, CAUSAL, SILU, IEEE, True, HAS_BIAS, KEY_BIAS,
                      BIAS_GRAD, FAST_SIGMOID, BIAS_GRAD_ADD)
    dq = dq * scale
    _store_rows(DQ + h * stride_dqh, start, offs_m, row_len, stride_dqt, offs_d, dq, HEAD_DIM)


@config_choice.autotune(_BWD_KV_CONFIGS, _TUNE_KEY, name="jagged_attention._bwd_dkdv_kernel",
                        tiles=_dkdv_tiles, prefer=_dkdv_prefer,
                        accumulates=lambda a: _accumulated(
                            a, ("DQ",) if a.get("FUSED_DQ") else (), bool(a.get("FUSED_DQ"))))
@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, DQ, LSE, DELTA, offsets_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    stride_dqt, stride_dqh,
    stride_lse_h, n_heads, scale, inv_max_len, pad_len, total_rows,
    BIAS, DBIAS, stride_bb, stride_bh, stride_bi, stride_bj,
    stride_dbb, stride_dbh, stride_dbi, stride_dbj,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    CAUSAL: tl.constexpr, SILU: tl.constexpr, NORM_BY_OWN_LEN: tl.constexpr,
    IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, KEY_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, FUSED_DQ: tl.constexpr, BIAS_GRAD_ADD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    bias_base = BIAS + (tl.program_id(0) // n_heads).to(tl.int64) * stride_bb \
        + (tl.program_id(0) % n_heads) * stride_bh
    db_base = DBIAS + (tl.program_id(0) // n_heads).to(tl.int64) * stride_dbb \
        + (tl.program_id(0) % n_heads) * stride_dbh
    dq_base = DQ + (tl.program_id(0) % n_heads) * stride_dqh
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)  # causal: early key blocks see the most queries, run them first
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    start, row_len = _sequence(offsets_ptr, b, pad_len)
    start_n = pid_n * BLOCK_N
    offs_d = tl.arange(0, BLOCK_D)
    chunk = b * tl.num_programs(1) + pid_n
    n_seqs = tl.num_programs(0) // n_heads
    _zero_uncovered(DK + h * stride_dkh, chunk, offsets_ptr, n_seqs, total_rows, pad_len,
                    stride_dkt, offs_d, HEAD_DIM, BLOCK_N)
    _zero_uncovered(DV + h * stride_dvh, chunk, offsets_ptr, n_seqs, total_rows, pad_len,
                    stride_dvt, offs_d, HEAD_DIM, BLOCK_N)
    if start_n >= row_len:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load_rows(K + h * stride_kh, start, offs_n, row_len, stride_kt, offs_d, HEAD_DIM,
                   EVEN_D, True)
    v = _load_rows(V + h * stride_vh, start, offs_n, row_len, stride_vt, offs_d, HEAD_DIM,
                   EVEN_D, True)
    q_base = Q + h * stride_qh
    do_base = DO + h * stride_doh
    lse_base = LSE + h * stride_lse_h
    delta_base = DELTA + h * stride_lse_h
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    inv_norm = _inv_norm(row_len, inv_max_len, NORM_BY_OWN_LEN)
    lo, diag, full = _query_blocks(start_n, row_len, BLOCK_M, BLOCK_N, CAUSAL)
    for start_m in range(lo, tl.minimum(diag, row_len), BLOCK_M):
        dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, start,
                            start_m, offs_n, offs_d, row_len, stride_qt, stride_dot, scale,
                            inv_norm, bias_base, stride_bi, stride_bj,
                            HEAD_DIM, EVEN_D, BLOCK_M, CAUSAL, SILU, IEEE, True, HAS_BIAS, KEY_BIAS,
                            FAST_SIGMOID, dq_base, stride_dqt, db_base, stride_dbi,
                            stride_dbj, FUSED_DQ, BIAS_GRAD, BIAS_GRAD_ADD)
    for start_m in range(diag, full, BLOCK_M):
        dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, start,
                            start_m, offs_n, offs_d, row_len, stride_qt, stride_dot, scale,
                            inv_norm, bias_base, stride_bi, stride_bj,
                            HEAD_DIM, EVEN_D, BLOCK_M, CAUSAL, SILU, IEEE, False, HAS_BIAS,
                            KEY_BIAS,
                            FAST_SIGMOID, dq_base, stride_dqt, db_base, stride_dbi,
                            stride_dbj, FUSED_DQ, BIAS_GRAD, BIAS_GRAD_ADD)
    for start_m in range(tl.maximum(diag, full), row_len, BLOCK_M):
        dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, start,
                            start_m, offs_n, offs_d, row_len, stride_qt, stride_dot, scale,
                            inv_norm, bias_base, stride_bi, stride_bj,
                            HEAD_DIM, EVEN_D, BLOCK_M, CAUSAL, SILU, IEEE, True, HAS_BIAS, KEY_BIAS,
                            FAST_SIGMOID, dq_base, stride_dqt, db_base, stride_dbi,
                            stride_dbj, FUSED_DQ, BIAS_GRAD, BIAS_GRAD_ADD)
    dk = dk * scale
    _store_rows(DK + h * stride_dkh, start, offs_n, row_len, stride_dkt, offs_d, dk, HEAD_DIM)
    _store_rows(DV + h * stride_dvh, start, offs_n, row_len, stride_dvt, offs_d, dv, HEAD_DIM)


# ---------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernels read it: any token and head strides, the head dim contiguous.
    Why not ``contiguous()``: a packed region's attention output leaves as a ``[1, H, T,
    D]`` view of ``[T, H, D]`` rows, so its gradient arrives head-major, and a copy of it
    (TransAct's ~0.2 M tokens: 40 MB each way) cost 0.053 ms of the region's 0.644-ms
    fwd+bwd on an H100 (twenty-eighth session, ``attention_gpu_time.py``)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _meta(q: torch.Tensor, causal: bool, kind: str, silu_normalizer: str, max_len: int
          ) -> dict:
    """The kernels' meta-parameters of a call; ``max_len`` (the longest row) decides whether
    a softmax backward runs as one kernel (:func:`fused_softmax_backward`)."""
    if kind not in ("softmax", "silu"):
        raise ValueError(f"kind must be 'softmax' or 'silu', got {kind!r}")
    if silu_normalizer not in ("max_len", "own_len"):
        raise ValueError(
            f"silu_normalizer must be 'max_len' or 'own_len', got {silu_normalizer!r}"
        )
    head_dim = q.shape[2]
    block_d = next_pow2(head_dim, MIN_DOT)
    return {
        "HEAD_DIM": head_dim,
        "BLOCK_D": block_d,
        "EVEN_D": block_d == head_dim,
        "CAUSAL": bool(causal),
        "SILU": kind == "silu",
        "NORM_BY_OWN_LEN": silu_normalizer == "own_len",
        "IEEE": q.dtype == torch.float32,
        "HAS_BIAS": False,  # set by the caller that passes a score bias
        "KEY_BIAS": False,  # set with it where the bias is one per key (_bias_tile)
        "BIAS_GRAD": False,
        "FAST_SIGMOID": FAST_SIGMOID and kind == "silu" and q.dtype != torch.float32
        and not is_interpreted(),
        "FUSED_DQ": FUSED_SILU_BACKWARD if kind == "silu"
        else fused_softmax_backward(max_len, block_d),
        "BIAS_GRAD_ADD": False,  # set with BIAS_GRAD where heads share the gradient buffer
    }


def _grid(batch: int, heads: int, rows: int, block: str):
    """One program per (sequence and head, ``block`` of ``rows``: :func:`grid_rows`)."""
    return lambda cfg: (batch * heads, triton.cdiv(rows, cfg[block]))


def _bias_args(bias: torch.Tensor | None, dbias: torch.Tensor | None, q: torch.Tensor
               ) -> tuple:
    """The kernels' bias operands: a 4-D (broadcast) bias and its fp32 gradient buffer with
    their strides, or a placeholder pointer with zero strides when absent."""
    b = bias if bias is not None else q
    d = dbias if dbias is not None else q
    bs = bias.stride() if bias is not None else (0, 0, 0, 0)
    ds = dbias.stride() if dbias is not None else (0, 0, 0, 0)
    return (b, d, *bs, *ds)


def _attention_forward(q, k, v, offsets, max_len: int, scale: float, meta: dict,
                       bias: torch.Tensor | None = None, dbias: torch.Tensor | None = None,
                       pad_len: int = 0):
    """``pad_len > 0``: q, k, v are ``[B * pad_len, H, D]`` padded rows (``_sequence``)."""
    total, heads, _ = q.shape
    batch = offsets.numel() - 1
    empty = total == 0 or batch == 0 or max_len == 0
    out = written_rows(q, zeroed=empty)[0]
    lse_rows = 0 if meta["SILU"] else total
    # the forward stores every row of it, zeros where no sequence covers one
    lse_shape = (heads, lse_rows)
    lse = torch.zeros(lse_shape, device=q.device, dtype=torch.float32) if empty else \
        uninitialised(lse_shape, contiguous_strides(lse_shape), torch.float32, q.device)
    if empty:
        return out, lse
    _fwd_kernel[_grid(batch, heads, grid_rows(total, batch, max_len), "BLOCK_M")](
        q, k, v, out, lse, offsets,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), heads, scale, 1.0 / max_len, pad_len,
        total, *_bias_args(bias, dbias, q), **meta,
    )
    return out, lse


def _attention_backward(q, k, v, out, lse, do, offsets, max_len: int, scale: float, meta,
                        bias: torch.Tensor | None = None, dbias: torch.Tensor | None = None,
                        pad_len: int = 0):
    total, heads, _ = q.shape
    batch = offsets.numel() - 1
    fused = bool(meta.get("FUSED_DQ"))  # dq summed by the dk/dv kernel, in fp32
    empty = total == 0 or batch == 0 or max_len == 0
    rows = grid_rows(total, batch, max_len)
    if fused and not meta["SILU"]:  # FUSED_SOFTMAX_SHORT_ROWS: one program per row
        from .softmax_row_backward import softmax_row_backward

        dq, dk, dv = written_rows(q, 3, zeroed=empty)
        if not empty:
            softmax_row_backward(q, k, v, out, lse, do, dq, dk, dv, offsets, max_len, scale,
                                 meta, _bias_args(bias, dbias, q), pad_len=pad_len)
        return dq, dk, dv
    if fused:  # the atomics add into it: zeroed
        dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        dk, dv = written_rows(k, 2, zeroed=empty)
    else:
        dq, dk, dv = written_rows(q, 3, zeroed=empty)
    if uses_key_block_backward(meta):
        from .silu_key_block_backward import silu_key_block_backward

        if not fused and not empty:  # the dq kernel, its bias gradient left to dk/dv's
            _bwd_dq_kernel[_grid(batch, heads, rows, "BLOCK_M")](
                q, k, v, out, do, dq, lse, lse, offsets,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                out.stride(0), out.stride(1), do.stride(0), do.stride(1), dq.stride(0),
                dq.stride(1), lse.stride(0), heads, scale, 1.0 / max_len, pad_len, total,
                *_bias_args(bias, None, q), **{**meta, "BIAS_GRAD": False},
            )
        # an empty batch still writes its bias gradient's zeros (the buffer is not zeroed)
        silu_key_block_backward(q, k, v, do, dq, dk, dv, offsets, max_len, scale, meta,
                                bias, dbias, pad_len=pad_len)
        return dq.to(q.dtype), dk, dv
    if empty:
        return dq.to(q.dtype), dk, dv
    delta = torch.empty_like(lse)  # the softmax's rowsum(O * dO), by the dq kernel
    if not fused:
        _bwd_dq_kernel[_grid(batch, heads, rows, "BLOCK_M")](
            q, k, v, out, do, dq, lse, delta, offsets,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), do.stride(0), do.stride(1), dq.stride(0),
            dq.stride(1), lse.stride(0), heads, scale, 1.0 / max_len, pad_len, total,
            *_bias_args(bias, dbias, q), **meta,
        )
    _bwd_dkdv_kernel[_grid(batch, heads, rows, "BLOCK_N")](
        q, k, v, do, dk, dv, dq, lse, delta, offsets,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        dq.stride(0), dq.stride(1),
        lse.stride(0), heads, scale, 1.0 / max_len, pad_len, total,
        *_bias_args(bias, dbias, q), **meta,
    )
    return dq.to(q.dtype), dk, dv


class JaggedAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: saves q, k, v, out and (softmax) the row logsumexp, nothing else."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, max_len, scale, meta, bias=None):  # type: ignore[override]
        bias4 = broadcast_bias(bias, offsets.numel() - 1, q.shape[1])
        out, lse = _attention_forward(q, k, v, offsets, max_len, scale, meta, bias4)
        ctx.save_for_backward(q, k, v, offsets, out, lse, bias)
        ctx.max_len, ctx.scale, ctx.meta = max_len, scale, meta
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, offsets, out, lse, bias = ctx.saved_tensors
        do = last_dim_contiguous(grad_out)
        bias4 = broadcast_bias(bias, offsets.numel() - 1, q.shape[1])
        meta, buffer, dbias4 = bias_grad_buffer(bias4, ctx.meta)
        dq, dk, dv = _attention_backward(
            q, k, v, out, lse, do, offsets, ctx.max_len, ctx.scale, meta, bias4, dbias4
        )
        return dq, dk, dv, None, None, None, None, \
            bias_grad_sum(buffer, bias) if buffer is not None else None


def broadcast_bias(bias: torch.Tensor | None, batch: int, heads: int) -> torch.Tensor | None:
    """A score bias that broadcasts to ``[B, H, Lb, Lb]`` as that 4-D view (no copy)."""
    if bias is None:
        return None
    lb = bias.shape[-1]
    return bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)).expand(
        batch, heads, lb, lb)


def bias_grad_buffer(bias4: torch.Tensor | None, meta: dict
                     ) -> tuple[dict, torch.Tensor | None, torch.Tensor | None]:
    """The backward's meta-parameters, and the zeroed fp32 buffer the kernels write the
    bias's gradient into with its ``[B, H, Lb, Lb]`` view (``None``s without a bias
    gradient). The buffer has one ``[Lb, Lb]`` block per sequence (sequences never share
    one: no atomics between them) and per head only where the bias has heads. Why not
    ``[B, H, Lb, Lb]`` always: with a bias shared by the heads (HSTU's relative bias,
    ``[B, 1, n, n]``) that buffer is H times larger, and zeroing it, then reading it back
    to sum over the heads, moved more bytes than the kernels' own writes (0.5 GB each at
    HSTU's h200 preset); the heads add into one block instead (``BIAS_GRAD_ADD``: fp32
    atomics, so the sum's order varies from run to run). Under
    :data:`SILU_KEY_BLOCK_BACKWARD` the buffer is not zeroed (that kernel writes every
    element, zeros included, with no atomics) and has the bias's dtype unless a sum over
    the batch follows (a bias without one)."""
    if bias4 is None or not meta["BIAS_GRAD"]:
        return meta, None, None
    batch, heads, lb, _ = bias4.shape
    shared = bias4.stride(1) == 0 and heads > 1
    shape = (batch, 1 if shared else heads, lb, lb)
    if uses_key_block_backward(meta):
        # every element written by the kernel, in the bias's dtype unless a batch sum
        # follows (:mod:`.silu_key_block_backward`)
        summed = bias4.stride(0) == 0 and batch > 1
        strides = (shape[1] * lb * lb, lb * lb, lb, 1)
        buffer = uninitialised(shape, strides, torch.float32 if summed else bias4.dtype,
                               bias4.device)
        return {**meta, "BIAS_GRAD_ADD": False}, buffer, buffer.expand(bias4.shape)
    buffer = torch.zeros(shape, dtype=torch.float32, device=bias4.device)
    return {**meta, "BIAS_GRAD_ADD": shared}, buffer, buffer.expand(bias4.shape)


def bias_grad_sum(buffer: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The bias's gradient in its own shape and dtype: the buffer summed over the
    dimensions the bias broadcasts along (its batch, where it has none)."""
    shape4 = (1,) * (4 - bias.dim()) + tuple(bias.shape)
    dims = [i for i, n in enumerate(shape4) if n == 1 and buffer.shape[i] != 1]
    summed = buffer.sum(dims, keepdim=True) if dims else buffer
    return summed.reshape(bias.shape).to(bias.dtype)


def _check_inputs(q, k, v, offsets) -> None:
    if q.dim() != 3 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            "q, k, v must all be [total_len, heads, head_dim], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise TypeError(f"q, k, v must share one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_offsets(offsets)


def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int | None = None,
    *,
    scale: float | None = None,
    causal: bool = False,
    kind: AttentionKind = "softmax",
    silu_normalizer: SiluNormalizer = "max_len",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention within each sequence of a jagged batch; returns ``[total_len, heads, head_dim]``.

    ``q, k, v``: ``[total_len, heads, head_dim]`` jagged values; ``offsets``: ``[B+1]``.
    ``max_len``: the longest sequence (>= every length); pass it to avoid a host sync, and for
    ``kind="silu", silu_normalizer="max_len"`` it is also the normaliser ``N``.
    ``scale`` defaults to ``1/sqrt(head_dim)``. See the module docstring for the semantics.
    ``bias``: an additive score bias broadcastable to ``[B, heads, Lb, Lb]`` (e.g. HSTU's
    relative position bias ``[Lb, Lb]``), indexed by positions within each sequence
    (``Lb`` >= every length): ``s_ij = scale * q_i . k_j + bias[b, h, i, j]``. Its gradient,
    when it requires one, goes through an fp32 buffer (:func:`bias_grad_buffer`).
    Rows of length-0 sequences do not exist, so they produce nothing and get no gradient.
    """
    _check_inputs(q, k, v, offsets)
    check_launchable(q, k, v, offsets)
    if max_len is None:
        max_len = max_length(offsets)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[2])
    meta = _meta(q, causal, kind, silu_normalizer, int(max_len))
    meta["HAS_BIAS"] = bias is not None
    meta["BIAS_GRAD"] = bias is not None and bias.requires_grad
    if bias is not None:
        lb = bias.shape[-1]
        if bias.dim() > 4 or bias.shape[-2] != lb:
            raise ValueError(f"bias must broadcast to [B, H, Lb, Lb], got {tuple(bias.shape)}")
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    return JaggedAttentionFunction.apply(q, k, v, offsets, int(max_len), float(scale), meta,
                                         bias)


def jagged_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int | None = None,
    *,
    scale: float | None = None,
    causal: bool = False,
    kind: AttentionKind = "softmax",
    silu_normalizer: SiluNormalizer = "max_len",
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Plain-PyTorch ``jagged_attention`` (differentiable), computed in ``compute_dtype``
    (fp32 unless asked; the inputs' own dtype gives eager PyTorch's rounding, the yardstick
    of a bf16 kernel's error) on padded tensors.

    softmax: pad, ``scaled_dot_product_attention`` with a key-padding (and causal) boolean
    mask, unpad. silu: pad, ``silu(scale * q k^T) * mask / N @ v`` written out, unpad. Padded
    query rows whose every key is masked (length-0 sequences) are given all keys so SDPA
    stays finite; those rows are dropped by the unpadding anyway.
    """
    _check_inputs(q, k, v, offsets)
    total, _, head_dim = q.shape
    if max_len is None:
        max_len = max_length(offsets)
    _meta(q, causal, kind, silu_normalizer, max_len)  # checks kind and normaliser
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    lengths = (offsets[1:] - offsets[:-1]).long()
    pos = torch.arange(max_len, device=q.device)
    visible = (pos[None, None, :] < lengths[:, None, None]).expand(-1, max_len, -1)
    if causal:
        visible = visible & (pos[:, None] >= pos[None, :])
    visible = visible[:, None]  # [B, 1, L, L]
    qp, kp, vp = (
        jagged_to_padded_reference(x.to(compute_dtype), offsets, max_len).transpose(1, 2)
        for x in (q, k, v)
    )  # [B, H, L, D]
    if kind == "softmax":
        safe = visible | ~visible.any(-1, keepdim=True)
        out = torch.nn.functional.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=safe, scale=scale
        )
    else:
        if silu_normalizer == "max_len":
            norm = torch.full_like(lengths, max_len, dtype=compute_dtype)
        else:
            norm = lengths.to(compute_dtype).clamp_min(1.0)
        s = scale * qp @ kp.transpose(-1, -2)
        p = torch.nn.functional.silu(s) * visible / norm[:, None, None, None]
        out = p @ vp
    return padded_to_jagged_reference(out.transpose(1, 2), offsets, total).to(q.dtype)
