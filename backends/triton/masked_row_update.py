"""The sparse optimizer's step on a table-sized (dense) gradient, without a host sync.

A table on gemc.table_lookup's ``dense_grad`` route (the captured graph's own lookup, one
rank) reaches the optimizer as a gradient the size of the table, zero on the rows the step
did not look up. The optimizer updates only the rows whose gradient is not all zero (an
unused row and its state are left alone: row-wise Adagrad with weight decay and lazy Adam
would otherwise move them). Finding those rows with ``nonzero`` waits for the GPU to count
them (DIN h200: 18 host syncs a step, the GPU idle behind each) and scanning the gradient
with ``abs().sum(1)`` first streamed it three times (7.5 ms a step). Here one program per
block of rows reads its gradient rows once, decides which are used, and applies the update
to those in registers: the weights and optimizer state of the other rows are neither read
nor written. One launch, one pass over the gradient, no host sync.

A data-parallel replica (several ranks) passes its rows' used flags (``used``, all-reduced
with its gradient in the step's one bucket: ``sparse_optim.ReplicaBucket``): a row any
replica looked up is updated even when its summed gradient is exactly zero, as the
reference's sparse gradient lists it (lazy Adam then decays its moments and moves it).

The formulas are :mod:`gemc.backends.torch.sparse_optim`'s and the fused embedding-bag
kernel's (whose lazy Adam this kernel calls), fp32 tables only (a bf16 / fp8 table has no dense gradient). Off CUDA without the
Triton interpreter the same update runs as ATen ops over the whole table (the CPU
implementation, not a fallback of the GPU path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .embedding_bag import lazy_adam_update
from .runtime import cdiv, kernel_runs_on, next_pow2

ROWWISE_ADAGRAD = 0
ADAM = 1
OPTIMIZERS = {"rowwise_adagrad": ROWWISE_ADAGRAD, "adam": ADAM}


@triton.jit
def _masked_row_update_kernel(
    weight, grad, state1, state2, used_rows, rows, dim,
    lr, eps, beta1, beta2, step_size, weight_decay,
    OPTIMIZER: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, HAS_USED: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_D)
    row_ok = r < rows
    inside = row_ok[:, None] & (c < dim)[None, :]
    offs = r.to(tl.int64)[:, None] * dim + c[None, :]
    g = tl.load(grad + offs, mask=inside, other=0.0)
    if HAS_USED:  # the caller's flags (a replica's, all-reduced): any non-zero is used
        used = tl.load(used_rows + r, mask=row_ok, other=0.0) != 0.0
    else:
        # a row is used when any element of its gradient is not zero (NaN counts, -0.0
        # not: ``abs().sum(1) != 0``, the rule the row update has always had)
        used = tl.max(tl.where(g != 0.0, 1, 0), 1) > 0
    row_used = row_ok & used
    mask = inside & used[:, None]
    w = tl.load(weight + offs, mask=mask, other=0.0)
    if OPTIMIZER == 0:  # row-wise Adagrad
        if HAS_WEIGHT_DECAY:
            g = g + weight_decay * w
        # a row's accumulator is held by every thread of the row and written back by one:
        # all read it before any writes (embedding_bag._fused_update_kernel's race)
        acc = tl.load(state1 + r, mask=row_used, other=0.0)
        tl.debug_barrier()
        acc = acc + tl.sum(g * g, 1) / dim
        tl.store(state1 + r, acc, mask=row_used)
        w = w - lr * g / (tl.sqrt(acc)[:, None] + eps)
    else:
        w, m, v = lazy_adam_update(
            w, g, tl.load(state1 + offs, mask=mask, other=0.0),
            tl.load(state2 + offs, mask=mask, other=0.0),
            lr, eps, beta1, beta2, step_size, weight_decay, HAS_WEIGHT_DECAY)
        tl.store(state1 + offs, m, mask=mask)
        tl.store(state2 + offs, v, mask=mask)
    tl.store(weight + offs, w, mask=mask)


@torch.no_grad()
def masked_row_update_(
    weight: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], *,
    optimizer: str, lr: float, eps: float, betas: tuple[float, float], weight_decay: float,
    step_size: float, used: torch.Tensor | None = None,
) -> None:
    """Update, in place, the rows of the fp32 ``weight`` ``[rows, dim]`` whose ``grad`` row
    is not all zero (or, given ``used`` ``[rows]``, whose flag there is not zero), and their
    optimizer ``state`` (``{"sum": [rows]}`` for row-wise Adagrad, ``{"exp_avg",
    "exp_avg_sq"}`` ``[rows, dim]`` for lazy Adam, whose bias correction the caller folds
    into ``step_size``)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
    if weight.dtype != torch.float32 or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError("the masked row update needs a contiguous fp32 [rows, dim] weight, "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    if grad.shape != weight.shape:
        raise ValueError(f"gradient {tuple(grad.shape)} != weight {tuple(weight.shape)}")
    if used is not None and used.shape != weight.shape[:1]:
        raise ValueError(f"used-row flags {tuple(used.shape)} != the weight's rows "
                         f"({weight.shape[0]},): pass one flag a row of the table")
    grad = grad.float().contiguous()
    flags = None if used is None else used.float().contiguous()
    adam = optimizer == "adam"
    state1 = state["exp_avg"] if adam else state["sum"]
    state2 = state["exp_avg_sq"] if adam else state1
    if not all(s.is_contiguous() for s in (state1, state2)):
        raise ValueError("the masked row update needs contiguous optimizer state")
    rows, dim = weight.shape
    if rows == 0 or dim == 0:
        return
    if not kernel_runs_on(weight):
        _masked_row_update_aten(weight, grad, state1, state2, adam, lr, eps, betas,
                                weight_decay, step_size, flags)
        return
    block_d = next_pow2(dim, 16)
    block_r = max(1, min(64, 4096 // block_d))
    beta1, beta2 = betas
    _masked_row_update_kernel[(cdiv(rows, block_r),)](
        weight, grad, state1, state2, grad if flags is None else flags, rows, dim,
        float(lr), float(eps), float(beta1), float(beta2), float(step_size),
        float(weight_decay),
        OPTIMIZER=OPTIMIZERS[optimizer], HAS_WEIGHT_DECAY=weight_decay != 0.0,
        HAS_USED=flags is not None, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4,
    )


def _masked_row_update_aten(weight, grad, state1, state2, adam, lr, eps, betas,  # noqa: ANN001
                            weight_decay, step_size, flags=None) -> None:
    used = grad.ne(0).any(dim=1, keepdim=True) if flags is None else flags.ne(0).unsqueeze(1)
    g, w = grad, weight
    if adam:
        beta1, beta2 = betas
        m = state1 + (g - state1) * (1 - beta1)
        v = state2 + (g * g - state2) * (1 - beta2)
        state1.copy_(torch.where(used, m, state1))
        state2.copy_(torch.where(used, v, state2))
        if weight_decay:
            w = w * (1 - lr * weight_decay)
        new = w - step_size * m / (v.sqrt() + eps)
    else:
        if weight_decay:
            g = g + weight_decay * w
        acc = state1 + g.pow(2).sum(dim=1) / w.shape[1]
        state1.copy_(torch.where(used[:, 0], acc, state1))
        new = w - lr * g / (acc.sqrt().unsqueeze(1) + eps)
    weight.copy_(torch.where(used, new, weight))
