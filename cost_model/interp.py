"""Interpolation of measured efficiencies over problem shapes, in log space.

Efficiencies of GPU kernels change smoothly with the *logarithm* of their sizes (tile
quantisation aside), so we interpolate over log2 of the shape: linear in 1-D, inverse
distance weighting of the nearest measured points in n-D. Outside the measured range the
nearest measurements are held (a GEMM larger than any measured one runs at the largest
one's efficiency), never extrapolated.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class LogCurve1D:
    """y(x), piecewise linear in log2(x), held constant past the ends."""

    def __init__(self, xs: Sequence[float], ys: Sequence[float]) -> None:
        order = np.argsort(np.asarray(xs, dtype=np.float64))
        self.lx = np.log2(np.maximum(np.asarray(xs, dtype=np.float64)[order], 1e-30))
        self.y = np.asarray(ys, dtype=np.float64)[order]
        if self.lx.size == 0:
            raise ValueError("a curve needs at least one point")

    def __call__(self, x: float) -> float:
        return float(np.interp(np.log2(max(x, 1e-30)), self.lx, self.y))


class LogIDW:
    """y(point) by inverse-distance weighting of the k nearest points in log2 space."""

    def __init__(self, points: Sequence[Sequence[float]], ys: Sequence[float], *,
                 k: int = 4, power: float = 2.0) -> None:
        pts = np.asarray(points, dtype=np.float64)
        if pts.ndim != 2 or pts.shape[0] == 0:
            raise ValueError("LogIDW needs a non-empty 2-D array of points")
        self.lp = np.log2(np.maximum(pts, 1e-30))
        self.y = np.asarray(ys, dtype=np.float64)
        self.k = min(k, len(self.y))
        self.power = power
        self._cache: dict[tuple[float, ...], float] = {}

    def __call__(self, point: Sequence[float]) -> float:
        key = tuple(float(p) for p in point)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        q = np.log2(np.maximum(np.asarray(key, dtype=np.float64), 1e-30))
        d = np.sqrt(((self.lp - q) ** 2).sum(axis=1))
        idx = np.argsort(d)[: self.k]
        if d[idx[0]] < 1e-9:
            value = float(self.y[idx[0]])
        else:
            w = 1.0 / d[idx] ** self.power
            value = float((w * self.y[idx]).sum() / w.sum())
        if len(self._cache) < 100_000:
            self._cache[key] = value
        return value
