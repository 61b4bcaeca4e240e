"""benchmarks/precision.py --gemms (benchmarks/precision_gemms.py) on the CPU: both variants
compiled (AOTAutograd, fp8 emulated) on two token counts with one compile each, and the fp8
row's SQNR where row-wise e4m3 puts it."""

from __future__ import annotations

import json

from tests.benchmark_module import load_benchmark


def test_smoke_writes_both_variants_per_shape_with_their_sqnr(tmp_path) -> None:
    bench = load_benchmark("precision")
    out = tmp_path / "g.json"
    assert bench.main(["--gemms", "--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [(r["m"], r["k"], r["n"]) for r in rows] == [(64, 32, 48), (96, 32, 48)]
    for r in rows:
        bf16, fp8 = r["variants"]["bf16"], r["variants"]["fp8 rowwise"]
        assert bf16["speedup_vs_bf16"] == 1.0 and fp8["ms"] > 0
        assert min(bf16[f"sqnr_{t}_db"] for t in ("y", "dx", "dw")) > 40
        assert all(24 < fp8[f"sqnr_{t}_db"] < 40 for t in ("y", "dx", "dw"))
    assert rows[1]["variants"]["fp8 rowwise"]["first_call_s"] < 1.0  # M dynamic: no recompile
