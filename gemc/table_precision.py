"""Storage precisions of embedding tables: their bytes, and how a row is stored and rounded.

An embedding table's weights are most of a recommendation model's memory, and a lookup
reads a few rows per id, so storing them narrower shrinks both the memory and the lookup /
exchange bytes. Three storage formats, one name each (used by the plan, the cost model,
the solver, the Triton kernel and the sharded runner alike):

``fp32``
    4 bytes an element; the default, exact.
``bf16``
    2 bytes an element. A row is updated in fp32 (dequantised, the optimizer's arithmetic,
    then rounded back), and the rounding back is *stochastic*: an update smaller than half a
    bf16 ulp (1/256 of the weight's magnitude) would otherwise vanish every step, the known
    failure of round-to-nearest low-precision training; stochastic rounding keeps the
    stored weight unbiased in expectation (E[round(x)] = x).
``fp8``
    e4m3 values (1 byte an element) plus one fp32 scale per row (``amax / 448``, so the
    largest element of the row lands on e4m3's largest finite value). Every update
    requantises the whole row with a fresh scale, stochastically as for bf16.

The optimizer state is kept fp32 whatever the weights (row-wise Adagrad's one value per row
costs 4 bytes a row; Adam's two moments per element are fp32 too, since an fp8/bf16 second
moment loses the small values that set the step size).

This module is the formats' names and bytes, without torch (the plan format imports it, and
the command line's argument checks import the plan format before torch:
tests/test_cli_lazy_imports.py); how a row is stored and rounded is ``gemc.table_quant``'s.
"""

from __future__ import annotations

TABLE_PRECISIONS = ("fp32", "bf16", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn

__all__ = [
    "TABLE_PRECISIONS",
    "FP8_MAX",
    "element_bytes",
    "weight_bytes",
    "check_precision",
]


def check_precision(precision: str) -> str:
    if precision not in TABLE_PRECISIONS:
        raise ValueError(f"table precision must be one of {TABLE_PRECISIONS}, got {precision!r}")
    return precision


def element_bytes(precision: str) -> float:
    """Bytes one stored element takes (the fp8 row scale is counted by ``weight_bytes``)."""
    return {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0}[check_precision(precision)]


def weight_bytes(precision: str, rows: float, dim: float) -> float:
    """Bytes of a ``rows x dim`` block of stored weights, fp8's per-row scale included."""
    scale = 4.0 * rows if precision == "fp8" else 0.0
    return element_bytes(precision) * rows * dim + scale
