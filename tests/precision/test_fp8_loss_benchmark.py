"""benchmarks/fp8_loss.py on the CPU: the fp8 and bf16 loss curves of a zoo model on the same
batches and initial weights, the mid-training SQNR of each fp8 site, and one linear's SQNR
with both quantizers' bits compared (issue 21's loss question)."""

from __future__ import annotations

import json

from tests.benchmark_module import load_benchmark


def test_curves_start_together_and_variants_put_fp8_where_they_say(tmp_path) -> None:
    bench = load_benchmark("fp8_loss")
    out = tmp_path / "l.json"
    assert bench.main(["--preset", "tiny", "--fp8-linears", "16", "--steps", "3",
                       "--variants", "bf16,fp8,fp8-wgrad-bf16,fp8-site=top_mlp.0",
                       "--sqnr-step", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["variant"]: r for r in report["rows"]}
    forced = report["forced_sites"]
    assert "top_mlp.0" in forced and len(forced) >= 3
    assert sorted(rows["fp8"]["fp8_sites"]) == sorted(forced)  # the runner's --fp8-linears
    assert rows["fp8-wgrad-bf16"]["fp8_sites"] == sorted(forced)
    assert rows["fp8-site=top_mlp.0"]["fp8_sites"] == ["top_mlp.0"]
    assert all(len(r["losses"]) == 3 for r in rows.values())
    bf16 = rows["bf16"]["losses"]
    for name in ("fp8", "fp8-wgrad-bf16", "fp8-site=top_mlp.0"):
        # same weights, same first batch: fp8 moves the first loss by its GEMM error only
        assert abs(rows[name]["losses"][0] / bf16[0] - 1) < 0.02, name
        assert rows[name]["losses"] != bf16
        assert set(rows[name]["vs"]["bf16"]) >= {"final_ratio", "max_dev", "steps_over_tol"}
    sqnr = {s["site"]: s for s in rows["fp8"]["sqnr"]}
    assert set(sqnr) == set(forced)
    for s in sqnr.values():
        assert 15 < s["fp8"]["y"] < 45 and s["bf16"]["y"] > 40
        assert all(15 < v < 45 for v in s["dW_one_operand"].values())
    for s in rows["fp8-wgrad-bf16"]["sqnr"]:  # the wgrad in bf16: dW as bf16's
        assert s["fp8"]["dW"] > 40 and s["fp8"]["dx"] < 40


def test_unit_sqnr_and_quantizers_bits() -> None:
    bench = load_benchmark("fp8_loss")
    rows = bench.unit(64, 64, 48)
    by = {r["gemms"]: r for r in rows}
    for tensor in ("y", "dx", "dW"):
        assert by["bf16"][tensor] > 45
        assert 25 < by["fp8-row aten"][tensor] < 33  # row-wise e4m3 on Gaussian data
        assert by["aten == triton (bits)"][tensor] is True
