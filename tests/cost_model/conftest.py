"""Shared fixtures: a synthetic calibration shaped like a real H200 file."""

from __future__ import annotations

import pytest
from gemc.cost_model.calibration import FORMAT, VERSION, Calibration


def synthetic_calibration_dict() -> dict:
    """Plausible H200 numbers: GEMM efficiency rising with size, HBM ~90% at large sizes."""
    def gemm_rows(peak: float) -> list[list[float]]:
        rows = []
        for m in (256, 1024, 4096, 16384):
            for n in (256, 1024, 4096):
                for k in (256, 1024, 4096):
                    flops = 2.0 * m * n * k
                    eff = 0.75 * min(1.0, flops / 2e10) ** 0.3
                    rows.append([m, n, k, flops / (peak * eff) + 2e-6])
        return rows

    def mem_rows(eff_big: float) -> list[list[float]]:
        return [[b, b / (4.8e12 * eff_big * min(1.0, b / 5e7) ** 0.2) + 2e-6]
                for b in (1e5, 1e6, 1e7, 1e8, 1e9)]

    return {
        "format": FORMAT, "version": VERSION, "date": "2026-01-01T00:00:00Z",
        "gpu": {"name": "h200", "device_name": "NVIDIA H200"},
        "software": {"torch": "2.11.0", "cuda": "13.0", "driver": "580.00"},
        "launch": {"kernel_s": 2e-6, "eager_op_s": 8e-6, "eager_view_op_s": 3e-6,
                   "eager_bwd_op_s": 12e-6},
        "gemm": {"bf16": gemm_rows(989.5e12), "fp32": gemm_rows(67e12)},
        "copy": mem_rows(0.9), "pointwise": mem_rows(0.85),
        "norm": [[b, t, 2 * t] for b, t in mem_rows(0.7)],
        "embedding_bag": [
            {"rows": r, "dim": d, "bags": 4096, "bag_size": s, "dtype": "fp32",
             "fwd_s": 4096 * s * d * 4 / 1.5e12 + 5e-6,
             "bwd_s": (4096 * s * d * 4 * 3 + r * d * 4) / 1.5e12 + 1e-5}
            for r in (10_000, 1_000_000) for d in (64, 128) for s in (1, 20)],
        "attention": [
            {"batch": 32, "heads": 4, "q_len": q, "kv_len": q, "head_dim": 64,
             "causal": c, "dtype": "bf16",
             "fwd_s": 4 * 32 * 4 * q * q * 64 / (2 if c else 1) / 4e14 + 5e-6,
             "bwd_s": 10 * 32 * 4 * q * q * 64 / (2 if c else 1) / 3e14 + 1e-5}
            for q in (128, 512, 2048) for c in (False, True)],
        "optimizer": {"adamw_foreach": [[b, b * 20 / (4.8e12 * 0.85) + 1e-4]
                                        for b in (1e6, 1e8, 1e10)]},
        "collectives": {"skipped": "one GPU visible"},
    }


@pytest.fixture(scope="session")
def calibration() -> Calibration:
    return Calibration(synthetic_calibration_dict(), source="synthetic")
