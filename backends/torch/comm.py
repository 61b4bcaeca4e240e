"""Collectives the sharded embeddings need, with autograd where gradients cross ranks.

``all_to_all_single`` moves the pooled embeddings from the ranks that own the rows back to
the ranks that asked for them; its backward is the reverse exchange, so gradients reach
the owners through ordinary autograd. The other helpers move ids and sizes and carry no
gradient.

Every rank must call every collective in the same order. A rank that sends nothing still
takes part: ``autograd_all_to_all`` gives such a rank an empty input that requires grad,
so its backward exchange runs too (otherwise the ranks that do send would wait forever).

The differentiable exchange can travel narrower than its tensor (``precision``, a
:class:`gemc.exchange_precision.WirePrecision`: bf16, or fp8 rows with a scale each): the
sender casts just before the collective, the receiver casts back just after it, forward
and (with the backward's own precision) backward; autograd sees an fp32 exchange whose
values were rounded (the gradient of the rounding is taken as identity).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gemc.exchange_codec import decode_rows, encode_rows
from gemc.exchange_precision import FP32_WIRE, SCALE_BYTES, WirePrecision


@dataclass(frozen=True)
class RowLayout:
    """The rows a flat exchange carries, which fp8's per-row scales need: the widths of
    the rows sent (in destination order) and received (in source order), and how many
    rows go to / come from each rank."""

    send_widths: torch.Tensor  # int64, one per row sent
    send_rows: list[int]       # rows sent to each rank
    recv_widths: torch.Tensor
    recv_rows: list[int]

    def swapped(self) -> RowLayout:
        return RowLayout(self.recv_widths, self.recv_rows, self.send_widths, self.send_rows)


def _cast_exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   precision: str, rows: RowLayout | None,
                   group: dist.ProcessGroup | None) -> torch.Tensor:
    """``all_to_all_single`` of ``x`` (split by ``in_splits`` elements) sent as
    ``precision``, returned in ``x``'s dtype."""
    if precision == "fp32":
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits),
                               group=group)
        return out
    if x.dim() != 1:
        raise ValueError("a cast exchange moves a flat tensor of rows")
    send_peers = recv_peers = None
    if precision == "fp8":
        if rows is None:
            raise ValueError("an fp8 exchange needs its RowLayout (one scale per row)")
        send_w, recv_w = rows.send_widths, rows.recv_widths
        send_peers = list(zip(in_splits, rows.send_rows))
        recv_peers = list(zip(out_splits, rows.recv_rows))
        wire_in = [n + SCALE_BYTES * r for n, r in send_peers]
        wire_out = [n + SCALE_BYTES * r for n, r in recv_peers]
    else:  # bf16: the same elements, narrower
        send_w = recv_w = x.new_empty(0, dtype=torch.int64)
        wire_in, wire_out = list(in_splits), list(out_splits)
    wire = encode_rows(x, send_w, precision, send_peers)
    got = wire.new_empty(sum(wire_out))
    dist.all_to_all_single(got, wire.contiguous(), wire_out, wire_in, group=group)
    return decode_rows(got, recv_w, precision, x.dtype, recv_peers)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0; backward sends the gradients back the same way,
    each direction at its wire precision."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, precision, rows):  # type: ignore[override]
        ctx.splits = (list(in_splits), list(out_splits))
        ctx.group, ctx.backward_precision = group, precision.backward
        ctx.rows = rows.swapped() if rows is not None else None
        return _cast_exchange(x, list(out_splits), list(in_splits), precision.forward, rows,
                              group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        in_splits, out_splits = ctx.splits
        grad_in = _cast_exchange(grad.contiguous(), in_splits, out_splits,
                                 ctx.backward_precision, ctx.rows, ctx.group)
        return grad_in, None, None, None, None, None


def autograd_all_to_all(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup | None = None,
    *,
    precision: WirePrecision = FP32_WIRE,
    rows: RowLayout | None = None,
) -> torch.Tensor:
    """Differentiable ``all_to_all_single``: ``x`` is split by ``in_splits`` to the ranks,
    sent at ``precision`` (``rows``: the row layout an fp8 direction needs)."""
    if not x.requires_grad and torch.is_grad_enabled():
        # An empty send still has to join the backward exchange (see the module doc).
        x = x.detach().requires_grad_(True)
    return _AllToAll.apply(x, out_splits, in_splits, group, precision, rows)


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


def count_all_to_all(log: list[tuple[str, int]] | None = None) -> list[int]:
    """Count ``dist.all_to_all_single`` calls from now on in this process (``[n]``; reset
    it by assigning ``counter[0] = 0``): how a benchmark or test sees the exchanges a step
    issues. The embedding exchange looks the function up on ``dist`` at every call.
    ``log``: also append each call's input (dtype name, elements): what went on the wire."""

    def sent(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        if log is not None:
            data = args[1] if len(args) > 1 else kwargs["input"]
            log.append((str(data.dtype).removeprefix("torch."), int(data.numel())))

    return count_calls("all_to_all_single", sent)


def count_calls(name: str, on_call: Callable[..., None] | None = None) -> list[int]:
    """Count calls of the collective ``dist.<name>`` from now on in this process (``[n]``;
    reset by assigning ``counter[0] = 0``), calling ``on_call`` with each call's
    arguments. Only callers that look the function up on ``dist`` at every call are seen
    (the runner's do: the embedding exchange, the sparse optimizer's replica bucket)."""
    calls = [0]
    inner = getattr(dist, name)

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        if on_call is not None:
            on_call(*args, **kwargs)
        return inner(*args, **kwargs)

    setattr(dist, name, counted)
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
