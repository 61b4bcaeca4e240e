"""The exchange's casts: pooled rows to their wire form and back (``gemc.exchange_precision``
names the formats and says why each is what it is), and the SQNR a format keeps on rows like
the exchange moves, which ``--exchange-precision auto`` checks against ``MIN_SQNR_DB``.

A module of its own because it computes with torch: the formats' names and prices are read
by the plan format and the command line, which import no torch (tests/test_cli_lazy_imports.py).
"""

from __future__ import annotations

import math

import torch

from gemc.exchange_precision import SCALE_BYTES, check_exchange
from gemc.probe_types import sqnr_db
from gemc.table_quant import row_scale

__all__ = ["encode_rows", "decode_rows", "representative_rows", "representative_sqnr_db"]


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
