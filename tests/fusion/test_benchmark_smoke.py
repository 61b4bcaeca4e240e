"""benchmarks/fusion.py runs end to end at --smoke sizes and writes a well-formed report."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "fusion.py"


def test_fusion_benchmark_smoke_writes_json(tmp_path):
    spec = importlib.util.spec_from_file_location("gemc_fusion_benchmark", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    out = tmp_path / "fusion.json"
    bench.main(["--smoke", "--no-compile", "--cases", "gemm_gelu,norm,reduction",
                "--out", str(out)])
    report = json.loads(out.read_text())
    rows = report["results"]
    assert not [r for r in rows if r["error"]], [r for r in rows if r["error"]]
    fused = [r for r in rows if r["variant"] == "gemc fused"]
    assert {r["mode"] for r in fused} == {"fwd", "fwd+bwd"} and len(fused) == 6
    assert all(r["max_abs_err"] is not None and r["max_abs_err"] < 1e-4 for r in fused)
    assert all(r["predicted_after_ms"] < r["predicted_before_ms"]
               for r in fused if r["mode"] == "fwd+bwd")
    assert len(report["targets"]) == 3
