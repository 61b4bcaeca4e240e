"""Collectives the sharded embeddings need, with autograd where gradients cross ranks.

``all_to_all_single`` moves the pooled embeddings from the ranks that own the rows back to
the ranks that asked for them; its backward is the reverse exchange, so gradients reach
the owners through ordinary autograd. The other helpers move ids and sizes and carry no
gradient.

Every rank must call every collective in the same order. A rank that sends nothing still
takes part: ``autograd_all_to_all`` gives such a rank an empty input that requires grad,
so its backward exchange runs too (otherwise the ranks that do send would wait forever).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):  # type: ignore[override]
        ctx.splits = (list(in_splits), list(out_splits))
        ctx.group = group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        in_splits, out_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def autograd_all_to_all(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Differentiable ``all_to_all_single``: ``x`` is split by ``in_splits`` to the ranks."""
    if not x.requires_grad and torch.is_grad_enabled():
        # An empty send still has to join the backward exchange (see the module doc).
        x = x.detach().requires_grad_(True)
    return _AllToAll.apply(x, out_splits, in_splits, group)


def all_to_all(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Plain ``all_to_all_single`` (no gradient), returning a new tensor."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
    return out


def count_all_to_all() -> list[int]:
    """Count ``dist.all_to_all_single`` calls from now on in this process (``[n]``; reset
    it by assigning ``counter[0] = 0``): how a benchmark or test sees the exchanges a step
    issues. The embedding exchange looks the function up on ``dist`` at every call."""
    calls = [0]
    inner = dist.all_to_all_single

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        return inner(*args, **kwargs)

    dist.all_to_all_single = counted
    return calls


def exit_skipping_finalization(code: int) -> None:
    """Flush stdio and end the process now, without interpreter finalization.

    Why: with torch 2.13's gloo, a process that used a process group and returns normally
    sometimes dies in finalization with "terminate called without an active exception"
    (SIGABRT; about 1 run in 10 of two CPU ranks here, after ``destroy_process_group``,
    with no Python frame left), and torchrun then reports a finished run as failed. Call it
    only once everything is written (reports and checkpoints are, atomically, before the
    run returns).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
