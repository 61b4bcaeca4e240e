"""Precision of the sharded-embedding exchange: what the pooled rows and their gradients
travel as between ranks, and what that costs in accuracy.

Why: a sharded table's pooled outputs cross ranks twice a step (the forward all-to-all to
the requesters, the gradients back in the backward). Across hosts those bytes are the
exchange's time; sending them narrower halves (bf16) or about quarters (fp8) it, as
FBGEMM / TorchRec's quantized comms do. The rows are cast just before the collective and
back just after it, so every shape and the meaning of every tensor stay as at fp32.

Wire formats, one name each (the plan's ``exchange`` block, the cost model, the runner):

``fp32``
    the model's own dtype, untouched.
``bf16``
    each element rounded to nearest bf16 (8 significant bits; about 50 dB SQNR).
``fp8``
    e4m3 values with one fp32 scale per row (``amax / 448``: the row's largest element
    lands on e4m3's largest finite value), rounded to nearest; a destination's rows travel
    as their fp8 bytes followed by their scales' 4 bytes each, in one ``uint8`` tensor
    (gloo has no fp8 dtype and NCCL moves fp8 as bytes anyway; one collective, not a second
    one for the scales). 4 significant bits: about 32 dB on Gaussian rows.

The backward of an fp8 forward travels bf16 (:func:`backward_of`), FBGEMM's and
TorchRec's default pairing: gradients feed the tables' optimizer directly, every step, and
their rows mix a few large and many small entries (a bag's gradient is the same for all its
ids, but the sum over bags a row gets is not); e4m3's 3 mantissa bits and the row scale
flush the small ones (below ``amax / 2**9`` they round to zero), which is bias in the
update, not the zero-mean noise the forward's rounding adds to the loss.
Casting back is exact for bf16 and fp8 alike, so the only error is the rounding above.
The straight-through rule holds for autograd: the gradient of cast-and-back is identity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gemc.probe_types import sqnr_db
from gemc.table_precision import row_scale

EXCHANGE_PRECISIONS = ("fp32", "bf16", "fp8")
EXCHANGE_MODES = (*EXCHANGE_PRECISIONS, "auto")
SCALE_BYTES = 4  # fp8: the fp32 row scale sent after each row
# SQNR (dB) a wire precision must keep on representative rows for ``auto`` to choose it:
# bf16's rounding is ~50 dB, so 40 catches a format or range problem, never noise; fp8
# rowwise sits near 30 dB on Gaussian rows, and 25 dB is the GEMM precision pass's own
# default bound (--min-sqnr-db) for the values a model computes with.
MIN_SQNR_DB = {"bf16": 40.0, "fp8": 25.0}
# What casting one direction of the exchange costs as the runner does it (encode before the
# collective, decode after; eager torch ops, counted by tests/test_exchange_precision.py):
# kernels launched, and HBM bytes moved per element of an fp32 source (reads + writes of
# every op, index tensors included: fp8's row amax, scale broadcast, divide, cast, pack).
CAST_KERNELS = {"fp32": 0, "bf16": 2, "fp8": 17}
CAST_BYTES_PER_ELEMENT = {"fp32": 0.0, "bf16": 12.0, "fp8": 92.0}

__all__ = [
    "EXCHANGE_PRECISIONS",
    "EXCHANGE_MODES",
    "MIN_SQNR_DB",
    "CAST_KERNELS",
    "CAST_BYTES_PER_ELEMENT",
    "casts",
    "WirePrecision",
    "FP32_WIRE",
    "wire_of_plan",
    "fixed_exchange",
    "check_exchange",
    "backward_of",
    "wire_row_bytes",
    "encode_rows",
    "decode_rows",
    "representative_sqnr_db",
]


def check_exchange(precision: str) -> str:
    if precision not in EXCHANGE_PRECISIONS:
        raise ValueError(f"exchange precision must be one of {EXCHANGE_PRECISIONS}, "
                         f"got {precision!r}")
    return precision


def backward_of(forward: str) -> str:
    """The gradients' wire precision for a forward one: the same, but bf16 under fp8."""
    return "bf16" if check_exchange(forward) == "fp8" else forward


@dataclass(frozen=True)
class WirePrecision:
    """The two exchanges of a step: pooled rows forward, their gradients backward."""

    forward: str = "fp32"
    backward: str = "fp32"

    def __post_init__(self) -> None:
        check_exchange(self.forward)
        check_exchange(self.backward)

    @classmethod
    def of(cls, forward: str) -> WirePrecision:
        return cls(forward, backward_of(forward))


FP32_WIRE = WirePrecision()  # both exchanges in the model's own dtype


def wire_of_plan(plan: dict) -> WirePrecision:
    """The plan's exchange precision (its optional ``exchange`` block; fp32 without one,
    which is what every plan before the block meant)."""
    block = plan.get("exchange") or {}
    return WirePrecision(block.get("forward", "fp32"), block.get("backward", "fp32"))


def casts(precision: str, dtype_bytes: float) -> bool:
    """Whether a ``precision`` wire casts rows of ``dtype_bytes`` elements (a bf16 wire
    leaves a bf16 model's rows as they are)."""
    return precision == "fp8" or (precision == "bf16" and dtype_bytes > 2)


def fixed_exchange(mode: str | None) -> dict:
    """The plan's ``exchange`` block for a precision the user fixed (None: the default)."""
    mode = mode or "fp32"
    wire = WirePrecision.of(mode)
    why = ("fp32: the default (--exchange-precision bf16 / fp8 / auto sends it narrower)"
           if mode == "fp32" else f"{mode}: fixed by --exchange-precision {mode}")
    return {"forward": wire.forward, "backward": wire.backward, "reason": why}


def wire_row_bytes(precision: str, cols: float, dtype_bytes: float) -> float:
    """Bytes one row of ``cols`` elements of a ``dtype_bytes`` tensor takes on the wire
    (a narrower wire never widens a row that is already narrower)."""
    if precision == "fp32":
        return dtype_bytes * cols
    if precision == "bf16":
        return min(2.0, dtype_bytes) * cols
    check_exchange(precision)
    return cols + SCALE_BYTES


def _peers(peers: list[tuple[int, int]] | None, elements: int,
           rows: int) -> list[tuple[int, int]]:
    return [(elements, rows)] if peers is None else peers


def encode_rows(flat: torch.Tensor, widths: torch.Tensor, precision: str,
                peers: list[tuple[int, int]] | None = None) -> torch.Tensor:
    """The wire form of ``flat``: rows of ``widths[r]`` elements one after the other,
    ``peers`` the (elements, rows) each destination gets, in order (None: one).

    fp32: ``flat``; bf16: ``flat`` rounded to bf16 (rows need no bounds); fp8: ``uint8``,
    per destination its rows' e4m3 bytes, then their fp32 scales' bytes (values stay where
    they were, so casting them is one pass; the sizes come from the host, no sync)."""
    if precision == "fp32":
        return flat
    if check_exchange(precision) == "bf16":
        return flat.to(torch.bfloat16)
    x = flat.float()
    n = x.numel()
    amax = torch.segment_reduce(x.abs(), "max", lengths=widths, unsafe=True, initial=0.0)
    scale = row_scale(amax)
    # |x| / scale <= 448 up to the division's rounding, which e4m3 rounds back to 448
    values = (x / torch.repeat_interleave(scale, widths, output_size=n)).to(
        torch.float8_e4m3fn).view(torch.uint8)
    peers = _peers(peers, n, widths.numel())
    value_parts = values.split([e for e, _ in peers])
    scale_parts = scale.view(torch.uint8).split([SCALE_BYTES * r for _, r in peers])
    return torch.cat([part for pair in zip(value_parts, scale_parts) for part in pair])


def decode_rows(wire: torch.Tensor, widths: torch.Tensor, precision: str,
                dtype: torch.dtype, peers: list[tuple[int, int]] | None = None
                ) -> torch.Tensor:
    """``flat`` in ``dtype`` from its wire form (the inverse of :func:`encode_rows` up to
    the rounding; ``peers``: the (elements, rows) each source sent)."""
    if precision in ("fp32", "bf16"):
        return wire.to(dtype)
    rows = widths.numel()
    peers = _peers(peers, wire.numel() - SCALE_BYTES * rows, rows)
    parts = wire.split([p for e, r in peers for p in (e, SCALE_BYTES * r)])
    values = torch.cat(parts[0::2]).view(torch.float8_e4m3fn)
    scale = torch.cat(parts[1::2]).view(torch.float32)
    n = values.numel()
    return (values.float() * torch.repeat_interleave(scale, widths, output_size=n)).to(dtype)


def representative_rows(dim: int, rows: int = 512, seed: int = 0) -> list[torch.Tensor]:
    """Rows like the exchange moves, seeded: pooled outputs of N(0, 1)-initialised tables
    are sums of a bag's rows, Gaussian; their gradients are heavier-tailed (a row's entries
    mix bags of very different weight), modelled as Gaussian times a log-normal per
    element. Each row gets its own scale over six decades (bags of 1 to 10^3 ids, losses
    of any size): fp8's row scale must absorb it, bf16's exponent does."""
    gen = torch.Generator().manual_seed(seed)
    row_scale_ = torch.exp(torch.empty(rows, 1).uniform_(-7.0, 7.0, generator=gen))
    gaussian = torch.randn(rows, dim, generator=gen) * row_scale_
    heavy = torch.randn(rows, dim, generator=gen) * torch.exp(
        torch.randn(rows, dim, generator=gen)) * row_scale_
    return [gaussian, heavy]


def representative_sqnr_db(precision: str, dim: int) -> float:
    """The lowest SQNR (dB) of a cast to ``precision`` and back over
    :func:`representative_rows` of width ``dim``: the number ``auto`` checks against
    ``MIN_SQNR_DB``."""
    worst = math.inf
    for sample in representative_rows(dim):
        widths = torch.full((sample.shape[0],), dim, dtype=torch.int64)
        flat = sample.reshape(-1)
        back = decode_rows(encode_rows(flat, widths, precision), widths, precision,
                           torch.float32)
        worst = min(worst, sqnr_db(flat, back))
    return worst
