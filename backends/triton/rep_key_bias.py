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
Here one program per row reads the mask row once (the logsumexp max-subtracted) and writes
the bias row and the row's kept flag: 0.005 ms of kernel at TransAct's h200 shape on an
H100 (``benchmarks/attention_gpu_time.py --models transact``, twenty-seventh session).

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
                         length, ADDITIVE: tl.constexpr, BLOCK_L: tl.constexpr):
    """One program per row: its bias row and whether it keeps some key."""
    b = tl.program_id(0)
    pos = tl.arange(0, BLOCK_L)
    inside = pos < length
    ptrs = mask_ptr + b.to(tl.int64) * stride_b + pos.to(tl.int64) * stride_l
    if ADDITIVE:
        m = tl.load(ptrs, mask=inside, other=float("-inf")).to(tl.float32)
    else:
        raw = tl.load(ptrs, mask=inside, other=0)
        m = tl.where(raw != 0, 0.0, float("-inf"))
    m = tl.where(inside, m, float("-inf"))
    width = (tl.load(offsets_ptr + b + 1) - tl.load(offsets_ptr + b)).to(tl.int32)
    # the last slot's logsumexp over p >= width - 1, its largest entry subtracted first
    tail = tl.where(inside & (pos >= width - 1), m, float("-inf"))
    top = tl.max(tail, 0)
    finite = (top > float("-inf")) & (top < float("inf"))
    shift = tl.where(finite, top, 0.0)
    total = tl.sum(tl.exp(tail - shift), 0)
    lse = tl.where(total > 0.0, shift + tl.log(tl.where(total > 0.0, total, 1.0)),
                   float("-inf"))
    kept = tl.max(tl.where(m > float("-inf"), 1, 0), 0)
    bias = tl.where(pos < width - 1, m, tl.where(pos == width - 1, lse, 0.0))
    tl.store(bias_ptr + b.to(tl.int64) * length + pos, bias, mask=inside)
    tl.store(kept_ptr + b, kept > 0)


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
        wrap(_rep_key_bias_kernel)[(batch,)](
            rows, rows.stride(0), rows.stride(1), offsets, bias, kept, length,
            ADDITIVE=bool(additive), BLOCK_L=next_pow2(int(length), 16))
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
