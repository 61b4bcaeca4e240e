"""benchmarks/precision.py --gemms (benchmarks/fp8_gemms.py) runs end to end at --smoke size
(CPU, emulated fp8) and writes a well-formed report whose fp8 variants are fp8."""

from __future__ import annotations

import json

from tests.benchmark_module import load_benchmark


def test_gemms_smoke_writes_json(tmp_path):
    bench = load_benchmark("precision")
    out = tmp_path / "fp8_gemms.json"
    assert bench.main(["--gemms", "--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "fp8_gemms"
    (row,) = report["results"]
    v = row["variants"]
    assert set(v) == {"bf16", "fp8 eager quant", "fp8 one-pass quant", "fp8 fused",
                      "fp8 fused, wgrad bf16"}
    assert all(r["ms"] > 0 for r in v.values())
    # bf16 is far more accurate than fp8; every fp8 variant holds the pass's 25 dB bound
    for name, r in v.items():
        assert r["sqnr_y_db"] >= 25, (name, r)
        if name != "bf16":
            assert r["sqnr_y_db"] < v["bf16"]["sqnr_y_db"] - 6, (name, r)
    # wgrad in bf16 is more accurate than wgrad in fp8
    assert v["fp8 fused, wgrad bf16"]["sqnr_dw_db"] > v["fp8 fused"]["sqnr_dw_db"] + 6
