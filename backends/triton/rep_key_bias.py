"""The per-key bias of an attention over a layout with padding representatives, in one kernel.

A region with padding representatives (``passes/pad_reps``) runs its key-padding attention
on the region's tokens: each row's real slots and, last, one representative standing for
the row's padded positions (``packed_tokens.rep_attention``). Each key is biased by a
``[B, L]`` fp32 row read by ``gemc::jagged_attention_values`` as its ``key_bias``:

* a real slot ``p < width - 1``: its own mask entry ``m[b, p]``;
* the row's last slot ``p = width - 1`` (its representative or, in a full row, itself):
  ``logsumexp`` of the entries ``m[b, p']`` for ``p' >= width - 1``, since ``c`` identical
  keys with entries ``m_p`` weigh ``sum_p exp(s + m_p) = exp(s + logsumexp(m))`` in the
  softmax; ``-inf`` where none of them is kept;
* ``p >= width``: 0 (never read).

``m`` is the additive mask as fp32, or 0 where a bool keep-mask is True and ``-inf`` where
it is False; ``width`` the layout's ``offsets[b + 1] - offsets[b]``.

Why a kernel: the same formula in torch ops (a cast, ``masked_fill``, ``logcumsumexp``
between two flips, ``arange``, two ``where``, ``any``) is ten launches a call, each a few
microseconds of host work for a ``[B, L]`` tensor the GPU reads in under one (issue 17).
Here each program reads its rows of the mask once (the logsumexp max-subtracted) and
writes their bias rows and kept flags: 0.005 ms of kernel at TransAct's h200 shape on an
H100 at one row a program (``benchmarks/attention_gpu_time.py --models transact``,
twenty-seventh session); :data:`ROW_ELEMENTS` says why several now.

A row keeping no key at all is ``-inf`` at its slots: the attention kernel gives its
queries 0 and no gradient, which is what eager's ``scaled_dot_product_attention`` gives
such a row (torch 2.13, and 2.11's math and memory-efficient backends:
``tests/kernels/test_sdpa_empty_rows.py``), and SDPA is the only op whose attention runs
over representatives (``passes/pad_reps._per_key_attention``). So no guard pass over the
output is needed (the ``torch.where(kept, out, nan)`` this replaced gave NaN where eager
gives 0). The kept flags are returned for the callers that want them.

The op takes no gradient: the mask is a mask (``gemc::jagged_attention_values`` passes
none to its ``key_bias`` either); :func:`packed_tokens.rep_attention` says so loudly where
a mask requires one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from gemc.guard_sample import mask_rows

from .runtime import (
    INTERPRETED,
    check_launchable,
    check_offsets,
    kernel_op,
    launched_directly,
    next_pow2,
)


@triton.jit
def _rep_key_bias_kernel(mask_ptr, stride_b, stride_l, offsets_ptr, bias_ptr, kept_ptr,
                         batch, length, ADDITIVE: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK_L: tl.constexpr):
    """``ROWS`` rows a program: their bias rows and whether each keeps some key."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    pos = tl.arange(0, BLOCK_L)
    real = rows < batch
    inside = real[:, None] & (pos[None, :] < length)
    ptrs = mask_ptr + rows[:, None].to(tl.int64) * stride_b + pos[None, :].to(tl.int64) * stride_l
    if ADDITIVE:
        m = tl.load(ptrs, mask=inside, other=float("-inf")).to(tl.float32)
    else:
        raw = tl.load(ptrs, mask=inside, other=0)
        m = tl.where(raw != 0, 0.0, float("-inf"))
    m = tl.where(inside, m, float("-inf"))
    width = (tl.load(offsets_ptr + rows + 1, mask=real, other=0)
             - tl.load(offsets_ptr + rows, mask=real, other=0)).to(tl.int32)[:, None]
    # the last slot's logsumexp over p >= width - 1, its largest entry subtracted first
    tail = tl.where(inside & (pos[None, :] >= width - 1), m, float("-inf"))
    top = tl.max(tail, 1)
    finite = (top > float("-inf")) & (top < float("inf"))
    shift = tl.where(finite, top, 0.0)
    total = tl.sum(tl.exp(tail - shift[:, None]), 1)
    lse = tl.where(total > 0.0, shift + tl.log(tl.where(total > 0.0, total, 1.0)),
                   float("-inf"))
    kept = tl.max(tl.where(m > float("-inf"), 1, 0), 1)
    bias = tl.where(pos[None, :] < width - 1, m,
                    tl.where(pos[None, :] == width - 1, lse[:, None], 0.0))
    tl.store(bias_ptr + rows[:, None].to(tl.int64) * length + pos[None, :], bias, mask=inside)
    tl.store(kept_ptr + rows, kept > 0, mask=real)


ROW_ELEMENTS = 2048
"""Mask entries a program reads (``ROWS`` rows of ``BLOCK_L``). Why several rows a program:
one row a program (TransAct's 4,096 of 128 slots) took 0.005 ms on an H100 for 1.6 MB read
and written (twenty-seventh to thirty-second sessions), two waves of programs each a load,
two reductions and a store long; 16 rows a program make it 256 programs, one wave."""


def _launch(mask: Tensor, offsets: Tensor, additive: bool,
            wrap: Callable[[Any], Any] = wrap_triton) -> tuple[Tensor, Tensor]:
    """The bias and the flags: two allocations, one kernel (``wrap``: how the kernel is
    launched: traceably in a ``triton_op``, ``runtime.launched_directly`` outside one)."""
    batch = check_offsets(offsets)
    rows = mask_rows(mask)
    if rows.dim() != 2 or rows.shape[0] not in (1, batch):
        raise ValueError(
            f"rep_key_bias: the key mask must be [B, L] (or [B, 1, ..., 1, L]) with B = "
            f"{batch} rows as the layout's offsets have, got {tuple(mask.shape)}; pass the "
            "attention's key mask, not its broadcast score mask")
    check_launchable(rows, offsets)
    length = rows.shape[1]
    rows = rows.expand(batch, length)
    if rows.dtype == torch.bool:
        rows = rows.view(torch.uint8)
    bias = torch.empty((batch, length), dtype=torch.float32, device=rows.device)
    # the kernel stores every row's flag: no zero-fill launch unless it does not run
    kept = (torch.empty if batch and length else torch.zeros)(batch, dtype=torch.bool,
                                                               device=rows.device)
    if batch and length:
        block_l = next_pow2(int(length), 16)
        per = max(1, ROW_ELEMENTS // block_l)
        wrap(_rep_key_bias_kernel)[(triton.cdiv(batch, per),)](
            rows, rows.stride(0), rows.stride(1), offsets, bias, kept, batch, length,
            ADDITIVE=bool(additive), ROWS=per, BLOCK_L=block_l)
    return bias, kept


def rep_key_bias(mask: Tensor, offsets: Tensor, additive: bool) -> tuple[Tensor, Tensor]:
    """``(bias [B, L] fp32, kept [B] bool)`` of a ``[B, L]`` key mask (a keep-mask: nonzero
    kept, or an additive one of any float dtype; or its rows viewed ``[B, 1, ..., 1, L]``; a
    ``[1, L]`` row broadcasts) over a layout's ``offsets [B + 1]`` (see the module doc).
    Not differentiable (a mask). Eager: the kernel launched directly (no op dispatch);
    while Dynamo traces: the op ``gemc::rep_key_bias``."""
    if torch.compiler.is_compiling():
        return torch.ops.gemc.rep_key_bias(mask, offsets, bool(additive))
    return _launch(mask, offsets, additive, launched_directly)


def _op(name: str = "rep_key_bias", interpreted: bool = INTERPRETED) -> Any:
    """``gemc::<name>``: a ``triton_op`` on a GPU, a ``custom_op`` under the interpreter
    (``runtime.kernel_op`` says why)."""
    def impl(mask: Tensor, offsets: Tensor, additive: bool) -> tuple[Tensor, Tensor]:
        return _launch(mask, offsets, additive)

    def fake(mask: Tensor, offsets: Tensor, additive: bool) -> tuple[Tensor, Tensor]:
        batch = offsets.shape[0] - 1
        return (mask.new_empty((batch, mask.shape[-1]), dtype=torch.float32),
                mask.new_empty((batch,), dtype=torch.bool))

    return kernel_op(name, impl, fake, interpreted)


rep_key_bias_op = _op()
