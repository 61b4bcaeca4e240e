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

This module is the formats' vocabulary and prices, without torch (the plan format imports
it, and the command line's argument checks import the plan format before torch:
tests/test_cli_lazy_imports.py); the casts themselves are ``gemc.exchange_codec``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

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
