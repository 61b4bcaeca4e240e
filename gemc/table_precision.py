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

The torch functions here are the reference arithmetic; the Triton kernel
(``gemc.backends.triton.embedding_bag``) implements the same grid and the same rounding
rule with its own random stream, so the two agree to within one grid step, not bitwise.
"""

from __future__ import annotations

import torch

TABLE_PRECISIONS = ("fp32", "bf16", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_MANTISSA_BITS = {"bf16": 7, "fp8": 3}
_FP8_MIN_NORMAL_EXP = -6  # e4m3: 2**-6 is the smallest normal; below, the grid step is 2**-9

__all__ = [
    "TABLE_PRECISIONS",
    "FP8_MAX",
    "element_bytes",
    "weight_bytes",
    "storage_dtype",
    "grid_step",
    "row_scale",
    "stochastic_round",
    "quantize_rows",
    "dequantize_rows",
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


def storage_dtype(precision: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16,
            "fp8": torch.float8_e4m3fn}[check_precision(precision)]


def grid_step(x: torch.Tensor, precision: str) -> torch.Tensor:
    """The spacing of the stored format's grid at ``|x|`` (fp8: in scaled units).

    With ``|x| = m * 2**e``, ``m`` in [1, 2): bf16 steps ``2**(e-7)``; e4m3 steps
    ``2**(max(e, -6) - 3)`` (its subnormals share the smallest normal's step).
    """
    if precision == "fp32":
        return torch.zeros_like(x, dtype=torch.float32)
    _, e = torch.frexp(x.float().abs())
    e = e - 1  # frexp's mantissa is in [0.5, 1)
    if precision == "fp8":
        e = e.clamp(min=_FP8_MIN_NORMAL_EXP)
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), e - _MANTISSA_BITS[precision])


def row_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp8's scale of rows whose largest magnitudes are ``amax``: ``amax / 448`` (the largest
    element lands on e4m3's largest finite value), 1 for an all-zero row. One rule for the
    stored tables and the fp8 exchange (gemc.exchange_precision)."""
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def stochastic_round(
    x: torch.Tensor, precision: str, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``x`` (fp32; fp8: already in scaled units) rounded to a neighbour on the format's grid,
    up with probability (distance to the lower neighbour) / (grid step): unbiased.

    Returns fp32 values that the storage dtype holds exactly (fp8: clamped to +-448).
    """
    x = x.float()
    if precision == "fp32":
        return x
    step = grid_step(x, precision)
    u = torch.rand(x.shape, generator=generator, device=x.device)
    q = torch.floor(x.abs() / step + u) * step
    if precision == "fp8":
        q = q.clamp(max=FP8_MAX)
    return torch.copysign(q, x)


def quantize_rows(
    rows: torch.Tensor, precision: str, generator: torch.Generator | None = None,
    *, stochastic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(stored values in ``storage_dtype``, fp32 per-row scale or None) of fp32 ``rows``.

    ``stochastic=False`` rounds to nearest (initialisation, where there is no update to
    lose); an update always rounds stochastically. fp8 takes a fresh scale per row
    (``amax / 448``; an all-zero row gets scale 1).
    """
    rows = rows.float()
    if precision == "fp32":
        return rows.clone(), None
    scale = None
    if precision == "fp8":
        scale = row_scale(rows.abs().amax(dim=-1))
        rows = (rows / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    if stochastic:
        rows = stochastic_round(rows, precision, generator)
    return rows.to(storage_dtype(precision)), scale


def dequantize_rows(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 values of stored rows (times their row scale under fp8)."""
    out = stored.float()
    return out if scale is None else out * scale.unsqueeze(-1)
