"""The breakdown benchmark: kernel attribution on a synthetic CUDA trace, and a CPU smoke run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.benchmark_module import load_benchmark


@pytest.fixture(scope="module")
def bd():
    return load_benchmark("cost_model_breakdown")


@pytest.mark.parametrize(("chain", "kernel", "phase", "category"), [
    (["aten::linear", "aten::addmm"], "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT", "fwd", "gemm"),
    (["autograd::engine::evaluate_function: AddmmBackward0", "AddmmBackward0", "aten::mm"],
     "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "bwd", "gemm"),
    (["autograd::engine::evaluate_function: AddmmBackward0", "AddmmBackward0", "aten::sum"],
     "void at::native::reduce_kernel<512, 1>(...)", "bwd", "pointwise"),
    (["aten::embedding_bag", "aten::_embedding_bag"], "embedding_bag_kernel_sum_mean", "fwd",
     "embedding_fwd"),
    (["EmbeddingBagBackward0", "aten::_embedding_bag_backward", "aten::zeros", "aten::zero_"],
     "void at::native::vectorized_elementwise_kernel<4, FillFunctor<float>>", "bwd",
     "embedding_bwd"),
    (["Optimizer.step#AdamW.step", "aten::_foreach_lerp_"], "multi_tensor_apply_kernel", "opt",
     "optimizer"),
    (["aten::scaled_dot_product_attention", "aten::_efficient_attention_forward"],
     "fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "fwd", "attention"),
    (["ScaledDotProductEfficientAttentionBackward0"], "fmha_cutlassB", "bwd", "attention"),
    (["aten::layer_norm", "aten::native_layer_norm"], "vectorized_layer_norm_kernel", "fwd",
     "norm"),
    (["aten::gelu"], "void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>",
     "fwd", "pointwise"),
])
def test_classify(bd, chain, kernel, phase, category) -> None:
    assert bd.classify(chain, kernel, phase) == category


class _Ev:
    """Stands in for torch's _KinetoEvent."""

    def __init__(self, name, cuda, start, dur, corr=0, linked=0, tid=1, act=""):
        self._v = (name, cuda, start, dur, corr, linked, tid, act)

    def name(self):
        return self._v[0]

    def device_type(self):
        return torch.autograd.DeviceType.CUDA if self._v[1] else torch.autograd.DeviceType.CPU

    def start_ns(self):
        return self._v[2]

    def duration_ns(self):
        return self._v[3]

    def correlation_id(self):
        return self._v[4]

    def linked_correlation_id(self):
        return self._v[5]

    def start_thread_id(self):
        return self._v[6]

    def activity_type(self):
        return self._v[7]


def _trace(t0: int, corr0: int) -> list[_Ev]:
    """One step: forward mm (1 ms kernel), backward embedding (2 ms, on the autograd
    thread), optimizer foreach (3 ms), with a 0.5 ms GPU gap; times in ns."""
    us = 1000
    c = corr0
    ev = [_Ev("gemc::step", False, t0, 10_000 * us, c + 1, act="user_annotation"),
          _Ev("gemc::forward", False, t0 + 10, 1000 * us, c + 2, act="user_annotation"),
          _Ev("aten::mm", False, t0 + 100, 50 * us, c + 3, act="cpu_op"),
          _Ev("cudaLaunchKernel", False, t0 + 200, 5 * us, c + 100, c + 3, act="cuda_runtime"),
          _Ev("nvjet_tst_mm", True, t0 + 500 * us, 1000 * us, c + 100, c + 3, tid=7,
              act="kernel"),
          _Ev("gemc::backward", False, t0 + 2000 * us, 3000 * us, c + 4, act="user_annotation"),
          _Ev("EmbeddingBagBackward0", False, t0 + 2100 * us, 100 * us, c + 5, tid=2,
              act="cpu_op"),
          _Ev("aten::_embedding_bag_backward", False, t0 + 2110 * us, 50 * us, c + 6, tid=2,
              act="cpu_op"),
          _Ev("cudaLaunchKernel", False, t0 + 2120 * us, 5 * us, c + 101, c + 6, tid=2,
              act="cuda_runtime"),
          _Ev("compute_grad_weight_bags", True, t0 + 2000 * us, 2000 * us, c + 101, c + 6,
              tid=7, act="kernel"),
          _Ev("gemc::optimizer", False, t0 + 5000 * us, 4000 * us, c + 7,
              act="user_annotation"),
          _Ev("aten::_foreach_lerp_", False, t0 + 5100 * us, 10 * us, c + 8, act="cpu_op"),
          _Ev("cudaLaunchKernel", False, t0 + 5105 * us, 5 * us, c + 102, c + 8,
              act="cuda_runtime"),
          _Ev("multi_tensor_apply_kernel", True, t0 + 4500 * us, 3000 * us, c + 102, c + 8,
              tid=7, act="kernel"),
          _Ev("gemc::step", True, t0, 10_000 * us, c + 1, tid=7, act="gpu_user_annotation")]
    return ev


def test_analyze_a_synthetic_cuda_trace(bd) -> None:
    events = _trace(0, 0) + _trace(20_000_000, 1000)
    out = bd.analyze(events, skip_steps=1)
    assert out["device"] == "cuda" and out["steps"] == 1
    cats = out["by_category_ms"]
    assert cats["gemm"]["fwd"] == pytest.approx(1.0)
    assert cats["embedding_bwd"]["bwd"] == pytest.approx(2.0)
    assert cats["optimizer"]["opt"] == pytest.approx(3.0)
    assert out["gpu_busy_ms"] == pytest.approx(6.0)
    assert out["gpu_span_ms"] == pytest.approx(7.0)  # 0.5 .. 7.5 ms
    assert out["phases"]["bwd"]["gpu_busy_ms"] == pytest.approx(2.0)
    assert out["top_kernels"][0]["name"] == "multi_tensor_apply_kernel"
    assert out["top_ops_by_category_ms"]["embedding_bwd"] == {"EmbeddingBagBackward0": 2.0}


def test_gpu_user_annotations_are_not_kernels(bd) -> None:
    """torch mirrors record_function ranges (the optimizer's ``Optimizer.step#AdamW.step``)
    on the GPU timeline, with no activity type on some versions: not a kernel, so the
    optimizer's 3 ms of kernels must not count twice (nor land in "pointwise" when the
    range starts outside a phase)."""
    def with_annotations(t0: int, corr0: int, act: str) -> list:
        us = 1000
        ev = _trace(t0, corr0)
        ev.insert(11, _Ev("Optimizer.step#AdamW.step", False, t0 + 5050 * us, 100 * us,
                          corr0 + 9, act="user_annotation" if act else ""))
        ev.append(_Ev("Optimizer.step#AdamW.step", True, t0 + 4500 * us, 3000 * us,
                      corr0 + 9, tid=7, act=act))
        ev.append(_Ev("gemc::optimizer", True, t0 + 4500 * us, 3000 * us, corr0 + 7, tid=7,
                      act=act))
        return ev

    for act in ("", "gpu_user_annotation"):
        events = with_annotations(0, 0, act) + with_annotations(20_000_000, 1000, act)
        out = bd.analyze(events, skip_steps=1)
        cats = out["by_category_ms"]
        assert cats["optimizer"]["opt"] == pytest.approx(3.0), act
        assert sum(cats.get("pointwise", {}).values()) == 0.0, act
        assert out["kernels_by_category"]["optimizer"] == 1, act
        assert all(k["name"] != "Optimizer.step#AdamW.step" for k in out["top_kernels"])


def test_smoke_on_cpu(bd, tmp_path: Path, capsys) -> None:
    out = tmp_path / "bd.json"
    rc = bd.main(["--smoke", "--configs", "dlrm/tiny/b8/fp32", "--calibration", "none",
                  "--steps", "1", "--warmup", "1", "--profile-steps", "1", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    row = report["configs"][0]
    assert row["measured"]["device"] == "cpu"
    cats = {r["category"] for r in row["comparison"]}
    assert {"gemm", "embedding_fwd", "embedding_bwd", "optimizer"} <= cats
    assert row["measured"]["by_category_ms"]["embedding_fwd"]["fwd"] > 0
    assert "pred fwd" in capsys.readouterr().out
