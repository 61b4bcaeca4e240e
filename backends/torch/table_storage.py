"""A table shard's rows in fp32, whatever its storage precision (gemc.table_precision).

The sparse optimizer reads the rows a step used, computes their new values in fp32 and
writes them back through :class:`StoredRows`: an fp32 shard takes them as they are; a bf16
shard rounds them stochastically; an fp8 shard requantises each row with a fresh scale
(``amax / 448``), stochastically. The rounding draws from a generator seeded by
``(run seed, table, step)`` and not by the rank, so the replicas of a data-parallel table,
which apply the same all-reduced update, round it identically and stay equal.
"""

from __future__ import annotations

import torch

from gemc.table_quant import dequantize_rows, quantize_rows


class StoredRows:
    """Read rows as fp32; write fp32 rows back in the storage format (see module doc)."""

    def __init__(self, weight: torch.Tensor, precision: str = "fp32",
                 row_scale: torch.Tensor | None = None,
                 generator: torch.Generator | None = None) -> None:
        self.weight, self.precision = weight, precision
        self.row_scale, self.generator = row_scale, generator

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        if self.precision == "fp32":
            return self.weight[rows].float()
        scale = None if self.row_scale is None else self.row_scale[rows]
        return dequantize_rows(self.weight[rows], scale)

    def write(self, rows: torch.Tensor, values: torch.Tensor,
              keep: torch.Tensor | None = None) -> None:
        """Store ``values`` at ``rows``; ``keep`` (one bool a row, optional): where False
        the stored row (and fp8 scale) stays as it is, bytes unchanged, instead of being
        rounded again (a replica's update runs over the whole table: its unused rows must
        not drift by re-rounding, the reference never writes them)."""
        if self.precision == "fp32":
            self.weight[rows] = values.to(self.weight.dtype)
            return
        stored, scale = quantize_rows(values, self.precision, self.generator)
        if keep is not None and keep.dim() == 1:
            stored = torch.where(keep.unsqueeze(1), stored, self.weight[rows])
            if scale is not None:
                assert self.row_scale is not None
                scale = torch.where(keep, scale, self.row_scale[rows])
        self.weight[rows] = stored
        if scale is not None:
            assert self.row_scale is not None
            self.row_scale[rows] = scale
