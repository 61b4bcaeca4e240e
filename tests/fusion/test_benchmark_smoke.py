"""benchmarks/fusion.py runs end to end at --smoke sizes and writes a well-formed report."""

from __future__ import annotations

import json

from tests.benchmark_module import load_benchmark


def test_fusion_benchmark_smoke_writes_json(tmp_path):
    bench = load_benchmark("fusion")
    out = tmp_path / "fusion.json"
    bench.main(["--smoke", "--no-compile", "--cases", "gemm_gelu,norm,reduction",
                "--profile-host", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    rows = report["results"]
    assert not [r for r in rows if r["error"]], [r for r in rows if r["error"]]
    fused = [r for r in rows if r["variant"] == "gemc fused"]
    assert {r["mode"] for r in fused} == {"fwd", "fwd+bwd"} and len(fused) == 6
    assert all(r["max_abs_err"] is not None and r["max_abs_err"] < 1e-4 for r in fused)
    assert all(r["predicted_after_ms"] < r["predicted_before_ms"]
               for r in fused if r["mode"] == "fwd+bwd")
    assert len(report["targets"]) == 3
    profiled = [r for r in fused if r["host_profile"]]  # --profile-host: gemc's fwd+bwd only
    assert [r["mode"] for r in profiled] == ["fwd+bwd"] * 3
    assert all("ncalls" in r["host_profile"] for r in profiled)
