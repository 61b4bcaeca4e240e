"""Batched embedding bags: many tables in one launch, backward fused with the optimizer.

Layout (like FBGEMM's table-batched embeddings):

* one flat fp32 ``weights`` buffer holds every table; table ``t`` (``rows_t x dim_t``,
  row-major) starts at element ``weight_offset[t]``. Tables may have different dims: a
  program handles one (table, sample) bag, reads ``dim_t`` and masks the columns past it.
* ids come KeyedJaggedTensor style, table-major: one flat ``ids`` tensor (int32/int64,
  row indices local to their table) and ``offsets`` of length ``T*B+1``; bag ``(t, b)`` is
  ``ids[offsets[t*B+b] : offsets[t*B+b+1]]``. Optional ``per_sample_weights`` (one per id,
  ``sum`` pooling only, as in ``nn.EmbeddingBag``) scale each row; they are constants (no
  gradient flows to them).
* pooling ``sum`` or ``mean`` (``mean`` divides by the bag size); an empty bag gives zeros.
* output: one ``[B, sum(dim_t)]`` fp32 tensor, table ``t`` in columns
  ``[column[t], column[t] + dim_t)`` in table order (``split_output`` gives per-table views).

Training (the "fused backward-optimizer" of FBGEMM TBE): the module's weights are a buffer,
not a parameter, and no ``.grad`` is ever made. ``forward`` runs an autograd function whose
backward, given the pooled-output gradient, updates the weights and the optimizer state in
place, touching only the rows the batch used:

1. host (a few torch ops, no sync): give every id a global row key ``row_base[t] + id``,
   stable-sort the keys and find each key's run end with ``searchsorted``;
2. one Triton program per sorted id; the first id of each run (one per distinct row) sums
   ``coef_i * grad_out[b_i, column[t] : column[t] + dim_t]`` over its run (``coef`` is the
   per-sample weight, divided by the bag size under ``mean``), then applies the optimizer to
   that row and writes it back. Each row is owned by exactly one program: no atomics, and the
   result is deterministic.

Storage precision (``precision``, :mod:`gemc.table_precision`): the weights are stored
``fp32``, ``bf16`` or ``fp8`` (e4m3 values plus one fp32 scale per row in ``row_scale``).
Both kernels read the stored format and dequantise on load (the lookup is exact to the
dequantised values); the update computes the new row in fp32 and writes it back rounded
*stochastically* to the stored grid (fp8: requantised with a fresh row scale
``amax / 448``), drawing its random bits from ``(seed, step, element)``, so a run is
reproducible. Both formats are handled as raw bits (bf16 as int16, e4m3 as uint8) with
integer arithmetic, which rounds exactly and does not depend on the Triton build's float
conversions. The optimizer state stays fp32.

Optimizers (``lr``, ``eps``, ``weight_decay``):

``rowwise_adagrad``
    one accumulator per row: ``g += weight_decay * w`` (L2), ``acc += mean(g ** 2)``,
    ``w -= lr * g / (sqrt(acc) + eps)``.
``adam``
    *lazy* Adam, the semantics of ``torch.optim.SparseAdam``: per-element ``m``, ``v`` of the
    touched rows only, ``m += (1 - beta1) (g - m)``, ``v += (1 - beta2) (g^2 - v)``,
    ``w -= lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + eps)``, where ``t`` is one
    global step count incremented by every backward (``SparseAdam`` steps every parameter each
    ``step()``, even one whose batch used none of its rows). Rows not touched keep their
    ``m``, ``v`` and weights, unlike dense Adam whose momentum moves every row each step.
    ``weight_decay`` is decoupled (AdamW style) and applied to touched rows only:
    ``w *= 1 - lr * weight_decay`` before the update.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import triton
import triton.language as tl
from torch import nn

from gemc.table_precision import check_precision
from gemc.table_quant import dequantize_rows, quantize_rows, storage_dtype

from . import config_choice
from .config_choice import Preferred, Tiles
from .runtime import (
    autotune_configs,
    check_launchable,
    check_offsets,
    is_interpreted,
    next_pow2,
)

__all__ = ["BatchedEmbeddingBag", "Pooling", "OptimizerKind"]

Pooling = Literal["sum", "mean"]
OptimizerKind = Literal["rowwise_adagrad", "adam"]

_ROWWISE_ADAGRAD = 0
_ADAM = 1
# the fused update's phases (``_fused_update_kernel``'s PHASE): all at once; a row-wise
# Adagrad row's squares only; the update from squares summed over the row's column shards
_ONE_PASS: tl.constexpr = tl.constexpr(0)
_SQUARES: tl.constexpr = tl.constexpr(1)
_SUMMED: tl.constexpr = tl.constexpr(2)

# Bags of 1-30 ids and rows of 64-128 fp32: a [BLOCK_L, BLOCK_D] gather tile per step keeps
# BLOCK_L rows in flight per program; few warps, since one program's tile is small.
_FWD_CONFIGS = autotune_configs(
    [
        triton.Config({"BLOCK_L": 16}, num_warps=2),
        triton.Config({"BLOCK_L": 32}, num_warps=4),
        triton.Config({"BLOCK_L": 8}, num_warps=1),
        triton.Config({"BLOCK_L": 16}, num_warps=4),
    ],
    triton.Config({"BLOCK_L": 4}, num_warps=1),
)


_STORAGE = {"fp32": 0, "bf16": 1, "fp8": 2}


@triton.jit
def _load_stored(ptr, offs, mask, STORAGE: tl.constexpr):
    """fp32 values of stored elements (fp8: before the row scale)."""
    if STORAGE == 0:
        out = tl.load(ptr + offs, mask=mask, other=0.0)
    elif STORAGE == 1:  # bf16 bits: the high half of an fp32
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        out = (bits << 16).to(tl.float32, bitcast=True)
    else:  # e4m3: sign, 4 exponent bits (bias 7), 3 mantissa bits; subnormal step 2**-9
        code = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32)
        e = (code >> 3) & 15
        m = code & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
        out = tl.where((code & 128) != 0, -mag, mag)
    return out


@triton.jit
def _store_rounded(ptr, row_scale, key, offs, mask, w, seed, STORAGE: tl.constexpr):
    """Store the fp32 row ``w``: as is, or stochastically rounded to bf16 / to e4m3 with a
    fresh row scale (see gemc.table_precision for the grid and the rule)."""
    if STORAGE == 0:
        tl.store(ptr + offs, w, mask=mask)
    elif STORAGE == 1:
        # adding a uniform 16-bit integer to the magnitude bits and truncating rounds up
        # with probability (dropped bits) / 2**16: unbiased, carries into the exponent
        noise = (tl.randint(seed, offs.to(tl.int32)) & 0xFFFF).to(tl.int32)
        bits = (w.to(tl.int32, bitcast=True) + noise) & -65536
        tl.store(ptr + offs, (bits >> 16).to(tl.int16), mask=mask)
    else:
        amax = tl.max(tl.where(mask, tl.abs(w), 0.0), 0)
        scale = tl.where(amax > 0, amax / 448.0, 1.0)
        y = tl.minimum(tl.abs(w) / scale, 448.0)
        exp = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 255) - 127, -6)
        step = ((exp + 124) << 23).to(tl.float32, bitcast=True)  # 2**(exp - 3)
        u = tl.rand(seed, offs.to(tl.int32))
        q = tl.minimum(tl.floor(y / step + u) * step, 448.0)  # exact on the e4m3 grid
        qbits = q.to(tl.int32, bitcast=True)
        qexp = ((qbits >> 23) & 255) - 127
        code = tl.where(qexp >= -6, ((qexp + 7) << 3) | ((qbits >> 20) & 7),
                        (q * 512.0).to(tl.int32))
        code = code | tl.where(w < 0, 128, 0)
        tl.store(ptr + offs, code.to(tl.uint8), mask=mask)
        tl.store(row_scale + key, scale)


def _gather_tiles(cfg: triton.Config, args: dict) -> Tiles:
    """One [BLOCK_L, BLOCK_D] fp32 gather tile in flight per stage (far below any limit)."""
    return Tiles(streamed=cfg.kwargs["BLOCK_L"] * int(args.get("BLOCK_D", 128)) * 4)


def _gather_prefer(args: dict) -> list[Preferred]:
    """The H200's pick for the GEM example's bags (issue 16's first-step log). Only the
    interpreter-free fallback: the kernel autotunes on cold runs too (``tune_cold``), since
    its four configs cost 1.7 s there and the best one depends on the model's bag sizes
    (MMoE, Wukong and DLRM-DCNv2 ran 12-30% slower at b15cb54, on this pick, than at
    3c7f966, tuned; whether this pick is the cause was not measured)."""
    return [({"BLOCK_L": 8}, 1, None)]


@config_choice.autotune(_FWD_CONFIGS, ["BLOCK_D", "MEAN", "HAS_WEIGHTS", "STORAGE"],
                        name="embedding_bag._pooled_forward_kernel", tiles=_gather_tiles,
                        prefer=_gather_prefer, tune_cold=True)
@triton.jit
def _pooled_forward_kernel(
    weights, row_scale, ids, offsets, per_sample_weights, weight_offset, row_base, table_dim,
    table_column, out, batch, out_stride,
    MEAN: tl.constexpr, HAS_WEIGHTS: tl.constexpr, STORAGE: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):
    bag = tl.program_id(0)  # t * batch + b, the KJT order of offsets
    t = bag // batch
    b = bag % batch
    start = tl.load(offsets + bag).to(tl.int64)
    count = (tl.load(offsets + bag + 1).to(tl.int64) - start).to(tl.int32)
    base = weights + tl.load(weight_offset + t)
    dim = tl.load(table_dim + t)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_d < dim
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(0, count, BLOCK_L):
        offs_l = j + tl.arange(0, BLOCK_L)
        id_ok = offs_l < count
        idx = tl.load(ids + start + offs_l, mask=id_ok, other=0).to(tl.int64)
        rows = _load_stored(base, idx[:, None] * dim + offs_d[None, :],
                            id_ok[:, None] & col_ok[None, :], STORAGE)
        if STORAGE == 2:
            scale = tl.load(row_scale + tl.load(row_base + t) + idx, mask=id_ok, other=0.0)
            rows = rows * scale[:, None]
        if HAS_WEIGHTS:
            psw = tl.load(per_sample_weights + start + offs_l, mask=id_ok, other=0.0)
            rows = rows * psw.to(tl.float32)[:, None]
        acc += tl.sum(rows, 0)
    if MEAN:
        acc = acc / tl.maximum(count, 1).to(tl.float32)
    dst = out + b.to(tl.int64) * out_stride + tl.load(table_column + t) + offs_d
    tl.store(dst, acc, mask=col_ok)


@triton.jit
def lazy_adam_update(w, g, m, v, lr, eps, beta1, beta2, step_size, weight_decay,
                     HAS_WEIGHT_DECAY: tl.constexpr):
    """Lazy Adam (torch.optim.SparseAdam, decoupled weight decay) on rows read in fp32:
    the new ``(w, m, v)``; ``step_size`` carries the bias correction. Shared with the
    masked update of a dense gradient (:mod:`.masked_row_update`)."""
    m = m + (g - m) * (1.0 - beta1)
    v = v + (g * g - v) * (1.0 - beta2)
    if HAS_WEIGHT_DECAY:
        w = w * (1.0 - lr * weight_decay)
    return w - step_size * m / (tl.sqrt(v) + eps), m, v


# ``seed`` changes every step (``_rounding_seed``): Triton would specialise on it (an int
# divisible by 16 compiles a variant of its own), so a run would compile the kernel again
# (0.30-0.37 s on the H200: its first-step compile in the twelfth session's zoo rows) at the
# first step whose seed changes class
@triton.jit(do_not_specialize=["seed"])
def _fused_update_kernel(
    weights, momentum1, momentum2, sorted_keys, run_end, sorted_bag, sorted_coef,
    grad_out, grad_stride, row_base, weight_offset, table_dim, table_column, batch,
    lr, eps, beta1, beta2, step_size, weight_decay, row_scale, seed, head_squares,
    squares_dim,
    OPTIMIZER: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, STORAGE: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, PHASE: tl.constexpr,
):
    i = tl.program_id(0)
    key = tl.load(sorted_keys + i)
    previous = tl.load(sorted_keys + i - 1, mask=i > 0, other=-1)
    if previous == key:  # not the first id of its row's run: the run's head owns the row
        return
    count = (tl.load(run_end + i) - i).to(tl.int32)
    t = tl.load(sorted_bag + i) // batch
    dim = tl.load(table_dim + t)
    column = tl.load(table_column + t)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_d < dim
    g = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(0, count, BLOCK_L):
        offs_l = i + j + tl.arange(0, BLOCK_L)
        id_ok = offs_l < i + count
        sample = tl.load(sorted_bag + offs_l, mask=id_ok, other=0) % batch
        coef = tl.load(sorted_coef + offs_l, mask=id_ok, other=0.0)
        src = grad_out + sample.to(tl.int64)[:, None] * grad_stride + column + offs_d[None, :]
        go = tl.load(src, mask=id_ok[:, None] & col_ok[None, :], other=0.0)
        g += tl.sum(go.to(tl.float32) * coef[:, None], 0)
    row = (key - tl.load(row_base + t)).to(tl.int64)
    element = tl.load(weight_offset + t) + row * dim + offs_d
    w = _load_stored(weights, element, col_ok, STORAGE)
    if STORAGE == 2:
        w = w * tl.load(row_scale + key)
    if OPTIMIZER == 0:  # row-wise Adagrad
        if HAS_WEIGHT_DECAY:
            g = g + weight_decay * w
        if PHASE == _SQUARES:  # this shard's columns' share of the row's squares
            tl.store(head_squares + i, tl.sum(g * g, 0))
            return
        if PHASE == _SUMMED:  # the row's squares over every column shard, summed by the caller
            mean_sq = tl.load(head_squares + i) / tl.load(squares_dim + t).to(tl.float32)
        else:
            mean_sq = tl.sum(g * g, 0) / dim.to(tl.float32)
        # The accumulator is a scalar: every thread of the program loads it and thread 0
        # alone stores it back. Without the barrier a warp running behind read the new value
        # and added the squares twice: its columns of the row moved by 1/sqrt(2) of the step
        # (the summed phase, which has no reduction to hold the warps together, on an H100
        # and an H200; the one pass had the same order; test_embedding_bag_state_race).
        acc = tl.load(momentum1 + key)
        tl.debug_barrier()
        acc = acc + mean_sq
        tl.store(momentum1 + key, acc)
        w = w - lr * g / (tl.sqrt(acc) + eps)
    else:
        w, m, v = lazy_adam_update(
            w, g, tl.load(momentum1 + element, mask=col_ok, other=0.0),
            tl.load(momentum2 + element, mask=col_ok, other=0.0),
            lr, eps, beta1, beta2, step_size, weight_decay, HAS_WEIGHT_DECAY)
        tl.store(momentum1 + element, m, mask=col_ok)
        tl.store(momentum2 + element, v, mask=col_ok)
    _store_rounded(weights, row_scale, key, element, col_ok, w, seed, STORAGE)


class _PooledLookup(torch.autograd.Function):
    """Forward: pooled lookup. Backward: the in-place optimizer update; returns no gradients.

    ``anchor`` is a 0-d tensor that requires grad, so the output is part of the autograd graph
    (and this backward runs) although the weights themselves are not a leaf that wants grad.
    """

    @staticmethod
    def forward(ctx, anchor, ids, offsets, per_sample_weights, module, launch):  # type: ignore[override]
        ctx.module, (ctx.layout, ctx.slices) = module, launch
        ctx.save_for_backward(ids, offsets, per_sample_weights)
        return module._pooled(ids, offsets, per_sample_weights, ctx.layout)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        ids, offsets, per_sample_weights = ctx.saved_tensors
        ctx.module._fused_update(grad_out, ids, offsets, per_sample_weights, ctx.layout,
                                 ctx.slices)
        return None, None, None, None, None, None


@dataclass(frozen=True)
class _Layout:
    """The tables one launch covers (all of the module's, or a subset: ``tables``), as the
    kernels address them: each table's start in the flat buffer, its first row key, its
    width and its columns in the launch's output."""

    tables: tuple[int, ...]
    weight_offset: torch.Tensor
    row_base: torch.Tensor
    table_dim: torch.Tensor
    table_column: torch.Tensor
    dims: tuple[int, ...]
    squares_dim: torch.Tensor  # each row's full width (BatchedEmbeddingBag.split_rows)

    @property
    def num_tables(self) -> int:
        return len(self.tables)

    @property
    def total_dim(self) -> int:
        return sum(self.dims)


class BatchedEmbeddingBag(nn.Module):
    """``T`` embedding bags in one flat buffer; the optimizer step runs inside ``backward``.

    ``tables``: ``(rows, dim)`` per table. See the module docstring for the input layout,
    pooling, output columns and the two optimizers. Use it as
    ``out = bag(ids, offsets); loss(out).backward()``: after ``backward`` the weights have
    moved; do not give this module's weights to another optimizer.

    ``precision`` is the weights' storage (``fp32``, ``bf16``, ``fp8``; see the module
    docstring); ``seed`` seeds the stochastic rounding of the low-precision updates.
    """

    def __init__(
        self,
        tables: Sequence[tuple[int, int]],
        pooling: Pooling = "sum",
        optimizer: OptimizerKind = "rowwise_adagrad",
        lr: float = 0.01,
        eps: float = 1.0e-8,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        device: torch.device | str | None = None,
        precision: str = "fp32",
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.precision = check_precision(precision)
        self.seed = int(seed)
        if not tables:
            raise ValueError("need at least one table")
        if pooling not in ("sum", "mean"):
            raise ValueError(f"pooling must be 'sum' or 'mean', got {pooling!r}")
        if optimizer not in ("rowwise_adagrad", "adam"):
            raise ValueError(f"optimizer must be 'rowwise_adagrad' or 'adam', got {optimizer!r}")
        self.rows = [int(r) for r, _ in tables]
        self.dims = [int(d) for _, d in tables]
        if min(self.rows) < 1 or min(self.dims) < 1:
            raise ValueError(f"every table needs rows >= 1 and dim >= 1, got {list(tables)}")
        self.pooling = pooling
        self.optimizer = optimizer
        self.lr, self.eps, self.betas, self.weight_decay = lr, eps, tuple(betas), weight_decay
        self.step = 0  # optimizer steps taken (Adam's bias correction)
        # Whether each backward counts a step. False where the caller keeps the count
        # (several launches a step: the owners' fused lookups, gemc.backends.torch.
        # owner_lookup): a backward then updates at step ``self.step + 1``.
        self.counts_steps = True
        # the factor on every gradient the backward reads (the owners' fused lookups:
        # 1 / world size, each rank's loss being its own batch's mean), folded into the
        # per-id coefficients
        self.grad_scale = 1.0
        self._layouts: dict[tuple[tuple[int, ...], torch.device], _Layout] = {}
        # row-wise Adagrad tables whose rows are column shards (``split_rows``): their
        # update waits for the row's squares summed over every shard (``pending``)
        self.split: frozenset[int] = frozenset()
        self.pending: list[_PendingUpdate] = []

        sizes = [r * d for r, d in zip(self.rows, self.dims)]
        weight_offset = [0] + list(_cumsum(sizes))[:-1]
        row_base = [0] + list(_cumsum(self.rows))[:-1]
        column = [0] + list(_cumsum(self.dims))[:-1]
        self.total_rows, self.total_dim = sum(self.rows), sum(self.dims)
        self.block_d = next_pow2(max(self.dims), 16)
        total = sum(sizes)
        self.register_buffer("weights", torch.empty(total, device=device,
                                                    dtype=storage_dtype(precision)))
        self.register_buffer("row_scale", torch.ones(
            self.total_rows if precision == "fp8" else 0, device=device))
        self.register_buffer("weight_offset", torch.tensor(weight_offset, device=device))
        self.register_buffer("row_base", torch.tensor(row_base, device=device))
        self.register_buffer("table_dim", torch.tensor(self.dims, dtype=torch.int32,
                                                       device=device))
        self.register_buffer("table_column", torch.tensor(column, dtype=torch.int32,
                                                          device=device))
        # each row's full width, over its column shards (``split_rows``): Adagrad's mean
        self.register_buffer("squares_dim", torch.tensor(self.dims, dtype=torch.int32,
                                                         device=device), persistent=False)
        if optimizer == "rowwise_adagrad":
            self.register_buffer("momentum1", torch.zeros(self.total_rows, device=device))
            self.register_buffer("momentum2", torch.zeros(0, device=device))
        else:
            self.register_buffer("momentum1", torch.zeros(total, device=device))
            self.register_buffer("momentum2", torch.zeros(total, device=device))
        self._anchor = torch.zeros((), device=device, requires_grad=True)
        self.reset_parameters()

    # -- parameters and state ----------------------------------------------------------

    @property
    def num_tables(self) -> int:
        return len(self.rows)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Uniform(+-sqrt(1/rows)) per table (TorchRec's default), rounded to nearest in the
        storage format; zero optimizer state."""
        for dst, scale, rows in zip(self.split_weights(), self.split_row_scales(), self.rows):
            bound = math.sqrt(1.0 / rows)
            if self.precision == "fp32":  # in place: no table-sized temporary
                dst.uniform_(-bound, bound)
            else:  # one table's fp32 values at a time, then stored rounded
                self._store(dst, scale, torch.empty(dst.shape, device=dst.device)
                            .uniform_(-bound, bound))
        self.reset_optimizer_state()

    @torch.no_grad()
    def reset_optimizer_state(self) -> None:
        """Zero the accumulators / moments and the step count."""
        self.momentum1.zero_()
        self.momentum2.zero_()
        self.step = 0

    @torch.no_grad()
    def load_from_embedding_bags(self, bags: Sequence[nn.EmbeddingBag]) -> None:
        """Copy the weights of one ``nn.EmbeddingBag`` per table (optimizer state untouched)."""
        if len(bags) != self.num_tables:
            raise ValueError(f"expected {self.num_tables} bags, got {len(bags)}")
        self.load_weights([bag.weight for bag in bags])

    @torch.no_grad()
    def load_weights(self, tables: Sequence[torch.Tensor]) -> None:
        """Store one fp32 ``[rows, dim]`` tensor per table, rounded to nearest in the storage
        format (fp8: each row with its own scale)."""
        if len(tables) != self.num_tables:
            raise ValueError(f"expected {self.num_tables} tables, got {len(tables)}")
        views = list(zip(self.split_weights(), self.split_row_scales()))
        for t, ((dst, _), src) in enumerate(zip(views, tables)):
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"table {t}: weight {tuple(src.shape)} != {tuple(dst.shape)}")
        for (dst, scale), src in zip(views, tables):
            self._store(dst, scale, src.detach())

    def _store(self, dst: torch.Tensor, scale: torch.Tensor | None,
               src: torch.Tensor) -> None:
        """One table's stored values ``dst`` (and fp8 row scales ``scale``) from fp32
        ``src``: copied as they are into fp32 storage (no temporary of the table's size: a
        40M-row table is 19 GiB, and a second copy of it is what ran a GPU out of memory),
        rounded to nearest otherwise."""
        if self.precision == "fp32":
            dst.copy_(src)
            return
        values, scales = quantize_rows(src.to(dst.device), self.precision, stochastic=False)
        dst.copy_(values)
        if scale is not None and scales is not None:
            scale.copy_(scales)

    def split_row_scales(self) -> list[torch.Tensor] | list[None]:
        """Per-table ``[rows]`` views of the fp8 row scales (``None`` for fp32 / bf16)."""
        if self.precision != "fp8":
            return [None] * self.num_tables
        bases = [0] + list(_cumsum(self.rows))[:-1]
        return [self.row_scale[b : b + r] for b, r in zip(bases, self.rows)]

    def dequantized_weights(self) -> list[torch.Tensor]:
        """Per-table fp32 ``[rows, dim]`` values the lookups read (a copy unless fp32)."""
        return [w if self.precision == "fp32" else dequantize_rows(w, s)
                for w, s in zip(self.split_weights(), self.split_row_scales())]

    def split_weights(self) -> list[torch.Tensor]:
        """Per-table ``[rows, dim]`` views of the flat weight buffer (its storage dtype)."""
        return [
            self.weights[o : o + r * d].view(r, d)
            for o, r, d in zip(self._weight_offsets(), self.rows, self.dims)
        ]

    def split_optimizer_state(self) -> list[dict[str, torch.Tensor]]:
        """Per-table views: ``{"sum": [rows]}`` (Adagrad) or ``{"exp_avg", "exp_avg_sq"}``."""
        if self.optimizer == "rowwise_adagrad":
            bases = [0] + list(_cumsum(self.rows))[:-1]
            return [{"sum": self.momentum1[b : b + r]} for b, r in zip(bases, self.rows)]
        return [
            {"exp_avg": self.momentum1[o : o + r * d].view(r, d),
             "exp_avg_sq": self.momentum2[o : o + r * d].view(r, d)}
            for o, r, d in zip(self._weight_offsets(), self.rows, self.dims)
        ]

    def split_output(self, out: torch.Tensor) -> list[torch.Tensor]:
        """Per-table ``[B, dim_t]`` column views of a forward output."""
        return list(out.split(self.dims, dim=1))

    def extra_repr(self) -> str:
        return (f"tables={self.num_tables}, total_rows={self.total_rows}, "
                f"total_dim={self.total_dim}, pooling={self.pooling}, "
                f"optimizer={self.optimizer}, precision={self.precision}, "
                f"lr={self.lr}, eps={self.eps}, "
                f"betas={self.betas}, weight_decay={self.weight_decay}")

    def get_extra_state(self) -> Any:
        return {"step": self.step}

    def set_extra_state(self, state: Any) -> None:
        self.step = int(state["step"])

    def _weight_offsets(self) -> list[int]:
        return [0] + list(_cumsum([r * d for r, d in zip(self.rows, self.dims)]))[:-1]

    # -- forward and fused backward ----------------------------------------------------

    def forward(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        tables: Sequence[int] | None = None,
        id_counts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Pooled lookups of all tables: ``[B, sum(dims)]`` with ``B = (len(offsets)-1) / T``.
        ``tables``: look up only these tables (indices, in this order; ``T`` their count,
        the output's columns theirs): the others' rows and state are left alone.
        ``id_counts``: the ids of each looked-up table (the host's count; needed when one
        is a column shard, ``split_rows``: its squares' slice is that long)."""
        layout = self.layout(tables)
        self._check(ids, offsets, per_sample_weights, layout.num_tables)
        if self._anchor.device != self.weights.device:
            self._anchor = torch.zeros((), device=self.weights.device, requires_grad=True)
        slices = self._square_slices(layout, id_counts)
        return _PooledLookup.apply(self._anchor, ids, offsets, per_sample_weights, self,
                                   (layout, slices))

    def layout(self, tables: Sequence[int] | None = None) -> _Layout:
        """The launch layout of ``tables`` (None: every table), made once per subset and
        device: row keys and buffer offsets stay the module's, so one row has one key and
        one optimizer slot whichever launch looks it up."""
        which = tuple(range(self.num_tables)) if tables is None else tuple(int(t) for t in tables)
        key = (which, self.weights.device)
        got = self._layouts.get(key)
        if got is None or got.weight_offset.device != self.weights.device:
            index = torch.tensor(which, dtype=torch.long, device=self.weights.device)
            dims = tuple(self.dims[t] for t in which)
            column = [0] + list(_cumsum(dims))[:-1]
            got = self._layouts[key] = _Layout(
                which, self.weight_offset[index], self.row_base[index],
                self.table_dim[index],
                torch.tensor(column, dtype=torch.int32, device=self.weights.device), dims,
                self.squares_dim[index])
        return got

    def _check(self, ids, offsets, per_sample_weights, num_tables: int) -> None:
        bags = check_offsets(offsets)
        if bags % num_tables:
            raise ValueError(f"offsets must have T*B+1 entries (T={num_tables}), "
                             f"got {offsets.numel()}")
        if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise TypeError("ids must be a 1-D int32/int64 tensor")
        check_launchable(self.weights, ids, offsets)
        if per_sample_weights is not None:
            if self.pooling != "sum":
                raise ValueError("per_sample_weights need pooling='sum' (as nn.EmbeddingBag)")
            if per_sample_weights.shape != ids.shape:
                raise ValueError("per_sample_weights must have one weight per id")
            if per_sample_weights.requires_grad and torch.is_grad_enabled():
                raise ValueError("per_sample_weights are constants here (no gradient is "
                                 "computed for them); pass them detached")

    def _pooled(self, ids, offsets, per_sample_weights,
                layout: _Layout | None = None) -> torch.Tensor:
        layout = layout or self.layout()
        batch = (offsets.numel() - 1) // layout.num_tables
        out = torch.empty((batch, layout.total_dim), device=self.weights.device)
        if batch == 0:
            return out
        has_weights = per_sample_weights is not None
        _pooled_forward_kernel[(layout.num_tables * batch,)](
            self._stored_bits(), self._scales(), ids, offsets,
            per_sample_weights if has_weights else ids, layout.weight_offset,
            layout.row_base, layout.table_dim, layout.table_column, out, batch, out.stride(0),
            MEAN=self.pooling == "mean", HAS_WEIGHTS=has_weights,
            STORAGE=_STORAGE[self.precision], BLOCK_D=self.block_d,
        )
        return out

    def _stored_bits(self) -> torch.Tensor:
        return _stored_bits_of(self.weights)

    def _scales(self) -> torch.Tensor:
        # fp32 / bf16 have no row scale: any fp32 pointer does (the kernels never read it)
        return self.row_scale if self.precision == "fp8" else self.momentum1

    def _rounding_seed(self, step: int) -> int:
        """Step ``step``'s random stream of the stochastic rounding: a function of (seed,
        step), so a resumed run rounds as the uninterrupted one did."""
        return (self.seed * 1_000_003 + step * 7_919) % (2**31 - 1)

    @torch.no_grad()
    def _fused_update(self, grad_out, ids, offsets, per_sample_weights,
                      layout: _Layout | None = None,
                      slices: dict[int, tuple[int, int]] | None = None) -> None:
        """The backward's update of the rows ``ids`` touched. Where the launch holds a column
        shard of row-wise Adagrad (``slices``, see :meth:`split_rows`), only each row's
        squares over this shard's columns are computed now; the update waits in
        :attr:`pending` for the caller to sum them over the row's shards."""
        layout = layout or self.layout()
        step = self.step + 1
        if self.counts_steps:
            self.step = step
        nnz = ids.numel()
        batch = (offsets.numel() - 1) // layout.num_tables
        if nnz == 0 or batch == 0:
            return
        grad_out = grad_out if grad_out.stride(1) == 1 else grad_out.contiguous()
        lengths = (offsets[1:] - offsets[:-1]).long()
        bag = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=ids.device), lengths, output_size=nnz
        )
        keys = layout.row_base[bag // batch] + ids.long()
        if self.total_rows < 2**31:  # fewer radix passes for the sort
            keys = keys.int()
        sorted_keys, perm = torch.sort(keys, stable=True)
        run_end = torch.searchsorted(sorted_keys, sorted_keys, right=True)
        sorted_bag = bag[perm]
        coef = (per_sample_weights.float()[perm] if per_sample_weights is not None
                else torch.ones(nnz, device=ids.device))
        if self.pooling == "mean":
            coef = coef / lengths[sorted_bag].float()
        if self.grad_scale != 1.0:
            coef = coef * self.grad_scale
        two_phase = bool(slices) and self.optimizer == "rowwise_adagrad"
        update = _PendingUpdate(grad_out, sorted_keys, run_end, sorted_bag, coef, layout,
                                batch, step,
                                torch.zeros(nnz, device=ids.device) if two_phase else None,
                                slices or {})
        if two_phase:
            self._launch_update(update, _SQUARES.value)
            self.pending.append(update)
            return
        self._launch_update(update, _ONE_PASS.value)

    def _launch_update(self, u: _PendingUpdate, phase: int) -> None:
        beta1, beta2 = self.betas
        step_size = self.lr * math.sqrt(1.0 - beta2**u.step) / (1.0 - beta1**u.step)
        block_l = 4 if is_interpreted() else 8
        layout = u.layout
        _fused_update_kernel[(u.sorted_keys.numel(),)](
            self._stored_bits(), self.momentum1, self.momentum2, u.sorted_keys, u.run_end,
            u.sorted_bag, u.coef, u.grad_out, u.grad_out.stride(0), layout.row_base,
            layout.weight_offset, layout.table_dim, layout.table_column, u.batch,
            float(self.lr), float(self.eps), float(beta1), float(beta2), float(step_size),
            float(self.weight_decay), self._scales(), self._rounding_seed(u.step),
            self.momentum1 if u.head_squares is None else u.head_squares,  # any fp32
            layout.squares_dim,
            OPTIMIZER=_ROWWISE_ADAGRAD if self.optimizer == "rowwise_adagrad" else _ADAM,
            HAS_WEIGHT_DECAY=self.weight_decay != 0.0, STORAGE=_STORAGE[self.precision],
            BLOCK_D=self.block_d, BLOCK_L=block_l, PHASE=phase,
            num_warps=max(1, min(8, block_l * self.block_d // 512)),
        )

    # -- column shards of row-wise Adagrad ---------------------------------------------

    def split_rows(self, full_dims: dict[int, int]) -> None:
        """Tables (index -> the row's width over all its column shards) whose rows are
        column shards: row-wise Adagrad's accumulator takes the mean of the *whole* row's
        squared gradient, so their update is two-phase. The backward computes each touched
        row's squares over this shard's columns (:attr:`pending`); the caller sums them
        over the row's shards (:meth:`pending_squares`, e.g. an all-reduce over the
        shards' ranks) and then applies every pending update (:meth:`apply_pending`).
        Why not the sparse route (a gradient of one row per id, summed, then the same
        all-reduce): its eager lookup and optimizer launches per shard cost the step more
        than the second pass does (BENCHMARKS.md, narrow shards)."""
        if self.optimizer != "rowwise_adagrad":
            raise ValueError("only row-wise Adagrad couples a row's columns; "
                             f"{self.optimizer} updates each column on its own")
        for t, d in full_dims.items():
            if not 0 <= t < self.num_tables or d < self.dims[t]:
                raise ValueError(f"table {t}: full width {d} for a shard of "
                                 f"{self.dims[t] if 0 <= t < self.num_tables else '?'} columns")
            self.squares_dim[t] = int(d)
        self.split = self.split | frozenset(full_dims)
        self._layouts.clear()

    def _square_slices(self, layout: _Layout, id_counts: Sequence[int] | None
                       ) -> dict[int, tuple[int, int]] | None:
        """Where each split table's heads lie in the launch's sorted ids: (start, count)
        by table index. Why positions: a table's keys are one contiguous range, sorted
        by row, so every shard of its rows (the same ids, from the same requesters) has
        its rows' run heads at the same offsets of that range: the squares sum
        element-wise over the shards, no row index exchanged."""
        if not self.split.intersection(layout.tables) or not torch.is_grad_enabled():
            return None
        if id_counts is None or len(id_counts) != layout.num_tables:
            raise ValueError(f"tables {sorted(self.split.intersection(layout.tables))} are "
                             "column shards (split_rows): pass id_counts, the ids of each "
                             "looked-up table")
        slices, start = {}, 0
        for t, count in sorted(zip(layout.tables, id_counts)):
            slices[t] = (start, int(count))
            start += int(count)
        return slices

    def pending_squares(self, table: int) -> list[torch.Tensor]:
        """Views of the pending updates' squares of ``table`` (index), one per pending
        launch that looked it up: sum each over the row's column shards in place."""
        out = []
        for u in self.pending:
            if table in u.slices:
                start, count = u.slices[table]
                out.append(u.head_squares[start : start + count])
        return out

    @torch.no_grad()
    def apply_pending(self) -> None:
        """Every pending update, with the squares as summed now."""
        pending, self.pending = self.pending, []
        for u in pending:
            self._launch_update(u, _SUMMED.value)

    def discard_pending(self) -> None:
        """Drop the pending updates (a backward whose step was not taken)."""
        self.pending = []


@dataclass
class _PendingUpdate:
    """A fused update's inputs, sorted by row, kept for its second phase."""

    grad_out: torch.Tensor
    sorted_keys: torch.Tensor
    run_end: torch.Tensor
    sorted_bag: torch.Tensor
    coef: torch.Tensor
    layout: _Layout
    batch: int
    step: int
    head_squares: torch.Tensor | None  # fp32 [nnz]: a run head's squares, 0 elsewhere
    # (two phases only)
    slices: dict[int, tuple[int, int]]


def _stored_bits_of(weights: torch.Tensor) -> torch.Tensor:
    """The buffer as the kernels address it: fp32 as is, bf16 as int16, e4m3 as uint8."""
    if weights.dtype == torch.bfloat16:
        return weights.view(torch.int16)
    if weights.dtype == torch.float8_e4m3fn:
        return weights.view(torch.uint8)
    return weights


def _cumsum(xs: Sequence[int]):
    total = 0
    for x in xs:
        total += x
        yield total

