"""How an embedding table's row is stored and rounded in each storage precision
(``gemc.table_precision`` names the formats, their bytes, and why each rounds as it does):
the storage dtype, the format's grid, fp8's row scale, stochastic rounding, and quantising /
dequantising rows.

The torch functions here are the reference arithmetic; the Triton kernel
(``gemc.backends.triton.embedding_bag``) implements the same grid and the same rounding
rule with its own random stream, so the two agree to within one grid step, not bitwise.
A module of its own because it computes with torch, and the formats' names are read by the
plan format and the command line, which import no torch (tests/test_cli_lazy_imports.py).
"""

from __future__ import annotations

import torch

from gemc.table_precision import FP8_MAX, check_precision

_MANTISSA_BITS = {"bf16": 7, "fp8": 3}
_FP8_MIN_NORMAL_EXP = -6  # e4m3: 2**-6 is the smallest normal; below, the grid step is 2**-9

__all__ = [
    "storage_dtype",
    "grid_step",
    "row_scale",
    "stochastic_round",
    "quantize_rows",
    "dequantize_rows",
]


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
    stored tables and the fp8 exchange (gemc.exchange_codec)."""
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
