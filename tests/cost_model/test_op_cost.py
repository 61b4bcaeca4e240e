"""Op costs: the roofline bounds hold for any shape; calibration is read and used."""

from __future__ import annotations

import pytest
from gemc.cost_model import kernels
from gemc.cost_model.hardware import GPUS, get_gpu
from gemc.cost_model.op_cost import (
    attention_time,
    embedding_time,
    gemm_time,
    memory_time,
    optimizer_time,
)
from hypothesis import given, settings
from hypothesis import strategies as st

dims = st.integers(1, 1 << 15)
dtypes = st.sampled_from(["bf16", "fp32", "fp16", "fp8", "tf32"])
gpus = st.sampled_from(sorted(GPUS))


@settings(max_examples=80, deadline=None)
@given(gpus, dtypes, st.integers(1, 64), dims, dims, dims, st.booleans())
def test_gemm_time_respects_roofline(gpu_name, dtype, batch, m, n, k, calibrated) -> None:
    from gemc.cost_model.calibration import Calibration

    from tests.cost_model.conftest import synthetic_calibration_dict
    gpu = get_gpu(gpu_name)
    cal = Calibration(synthetic_calibration_dict()) if calibrated else None
    t, source = gemm_time(batch, m, n, k, dtype, gpu, cal)
    assert t >= kernels.gemm_flops(batch, m, n, k) / gpu.peak_flops(dtype)
    elt = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}[dtype]
    assert t >= kernels.gemm_bytes(batch, m, n, k, elt) / gpu.hbm_bandwidth
    assert source in ("calibrated", "roofline")


@settings(max_examples=60, deadline=None)
@given(gpus, st.floats(0, 1e11), st.floats(0, 1e10))
def test_memory_time_respects_roofline(gpu_name, nbytes, flops) -> None:
    gpu = get_gpu(gpu_name)
    t, _ = memory_time(nbytes, gpu, None, flops=flops)
    assert t >= nbytes / gpu.hbm_bandwidth and t >= flops / gpu.fp32_flops


@settings(max_examples=60, deadline=None)
@given(gpus, st.integers(1, 64), st.integers(1, 16), st.integers(1, 8192),
       st.integers(1, 8192), st.sampled_from([32, 64, 128]), st.booleans())
def test_attention_respects_roofline(gpu_name, b, h, q, kv, d, causal) -> None:
    gpu = get_gpu(gpu_name)
    fwd, bwd, _ = attention_time(b, h, q, kv, d, causal, "bf16", gpu, None)
    flops = kernels.attention_flops(b, h, q, kv, d, causal)
    assert fwd >= flops / gpu.bf16_flops
    assert bwd >= kernels.ATTENTION_BWD_FLOPS * flops / gpu.bf16_flops
    assert fwd >= kernels.attention_bytes(b, h, q, kv, d, 2) / gpu.hbm_bandwidth


@settings(max_examples=60, deadline=None)
@given(gpus, st.integers(1, 10**8), st.sampled_from([8, 64, 128, 256]),
       st.integers(1, 1 << 20), st.integers(1, 1 << 16), st.booleans())
def test_embedding_respects_roofline(gpu_name, rows, dim, nnz, bags, dense) -> None:
    gpu = get_gpu(gpu_name)
    fwd, bwd, _ = embedding_time(rows, dim, nnz, bags, "fp32", gpu, None, dense_grad=dense)
    assert fwd >= kernels.embedding_fwd_bytes(nnz, dim, bags, 4) / gpu.hbm_bandwidth
    assert bwd >= kernels.embedding_bwd_bytes(nnz, dim, bags, rows, 4,
                                              dense_grad=dense) / gpu.hbm_bandwidth


def test_calibrated_gemm_reproduces_a_measured_point(calibration) -> None:
    rows = calibration.data["gemm"]["bf16"]
    m, n, k, measured = rows[len(rows) // 2]
    t, source = gemm_time(1, m, n, k, "bf16", get_gpu("h200"), calibration)
    assert source == "calibrated"
    assert t == pytest.approx(measured, rel=1e-6)


def test_calibrated_embedding_and_optimizer(calibration) -> None:
    h200 = get_gpu("h200")
    fwd_c, bwd_c, src = embedding_time(1_000_000, 128, 4096 * 20, 4096, "fp32", h200,
                                       calibration, dense_grad=True)
    rec = next(r for r in calibration.data["embedding_bag"]
               if (r["rows"], r["dim"], r["bag_size"]) == (1_000_000, 128, 20))
    assert src == "calibrated"
    assert fwd_c == pytest.approx(rec["fwd_s"], rel=1e-6)
    assert bwd_c == pytest.approx(rec["bwd_s"], rel=1e-6)
    t, src = optimizer_time("adamw", 25e6, "fp32", h200, calibration, tensors=10)
    assert src == "calibrated" and t > 20 * 1e8 / h200.hbm_bandwidth
    t_rl, src_rl = optimizer_time("adamw", 25e6, "fp32", h200, None, fused=True)
    assert src_rl == "roofline" and t_rl < t


def test_optimizer_bytes_know_their_optimizers() -> None:
    assert kernels.optimizer_bytes("adamw", 10, 4) == 7 * 40
    assert kernels.optimizer_bytes("sgd", 10, 4) == 3 * 40
    with pytest.raises(ValueError, match="unknown optimizer"):
        kernels.optimizer_bytes("lion", 10, 4)


def test_unique_rows_saturate() -> None:
    assert kernels.expected_unique_rows(10, 10**6) == pytest.approx(10)
    assert kernels.expected_unique_rows(10**9, 1000) == pytest.approx(1000, rel=1e-3)


def test_gemm_past_the_measured_shapes_extrapolates_time() -> None:
    """Past the calibration's largest M, a GEMM costs the largest measured one plus the
    marginal time per row: continuous at the edge, cheaper per row as rows grow (the fixed
    cost amortises), the same either way round, never under the roofline."""
    from gemc.cost_model.calibration import default_calibration

    cal = default_calibration("h200")
    h200 = get_gpu("h200")
    (cap_m, _, _), best = cal.gemm_span("bf16")
    n, k = 512, 512
    at_cap, _ = gemm_time(1, cap_m, n, k, "bf16", h200, cal)
    just_past, _ = gemm_time(1, cap_m + 1, n, k, "bf16", h200, cal)
    assert just_past == pytest.approx(at_cap, rel=1e-3)
    big = 32 * cap_m
    t_big, source = gemm_time(1, big, n, k, "bf16", h200, cal)
    assert source == "calibrated"
    assert at_cap < t_big < 32 * at_cap
    assert t_big == pytest.approx(gemm_time(1, n, big, k, "bf16", h200, cal)[0])
    assert t_big >= kernels.gemm_flops(1, big, n, k) / (h200.peak_flops("bf16") * best)
