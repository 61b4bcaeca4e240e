"""benchmarks/fp8_breakdown.py on the CPU (--smoke): every piece of the row-wise fp8 linear
step is timed and recorded, gemc's quantisation kernels (interpreted, soft rounding) give
the ATen path's fp8 bits for every operand, and the summary names a quantizer."""

from __future__ import annotations

import json

from tests.benchmark_module import load_benchmark


def test_smoke_times_every_piece_and_checks_the_kernels_bits(tmp_path) -> None:
    bench = load_benchmark("fp8_breakdown")
    out = tmp_path / "b.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["m"] for r in report["results"]] == [64, 96]
    for row in report["results"]:
        pieces = {**row["gemm"], **row["quant"], **row["unit"]}
        assert not [k for k, v in pieces.items() if "error" in v], pieces
        assert all(v["ms"] > 0 for v in pieces.values())
        for gemm in ("fwd", "dgrad", "wgrad"):
            assert f"fp8 {gemm} _scaled_mm" in pieces
        assert "dgrad.W (fp32) aten layout copy" in pieces  # W's columns, transposed
        assert "fwd.x (bf16) aten layout copy" not in pieces  # already row-major
        soft = {k: v for k, v in row["quant"].items() if k.endswith("triton soft")}
        assert len(soft) == 8 and all(v["bits_equal_aten"] and v["layout_ok"]
                                      for v in soft.values()), soft
        summary = row["summary"]
        assert set(summary["unit_ms"]) == {"bf16", "fp8 aten", "fp8 triton",
                                           "fp8 aten wgrad-bf16"}
        assert all(summary["unit_ms"].values())
        assert summary["quantizer_choice"] in ("aten", "triton")
        assert all(summary[k] > 0 for k in ("bf16_gemms_ms", "fp8_gemms_ms",
                                             "quant_aten_eager_ms", "quant_triton_hw_ms"))
