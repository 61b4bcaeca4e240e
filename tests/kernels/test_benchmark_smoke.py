"""benchmarks/kernels.py runs end to end at --smoke sizes and writes a well-formed report."""

from __future__ import annotations

import json

from tests.benchmark_module import load_benchmark


def test_benchmark_smoke_writes_json(tmp_path):
    bench = load_benchmark("kernels")
    out = tmp_path / "kernels.json"
    bench.main(["--smoke", "--no-compile", "--cases", "attention,query,embedding,jagged",
                "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["preset"] == "smoke"
    rows = report["results"]
    assert not [r for r in rows if r["error"]], [r for r in rows if r["error"]]
    variants = {(r["case"], r["mode"], r["variant"]) for r in rows}
    assert ("softmax attention causal", "fwd+bwd", "triton jagged") in variants
    assert ("embedding step", "fwd+bwd+opt", "eager EmbeddingBag + AdamW") in variants
    assert ("history queries over dense keys", "fwd+bwd", "triton jagged queries") in variants
    assert ("jagged_to_padded", "fwd+bwd", "eager index_put") in variants
    # The Triton results agree with eager at the benchmark's own size.
    checked = [r for r in rows if r["max_abs_err"] is not None]
    assert checked and all(r["max_abs_err"] < 0.05 for r in checked)
    assert all(r["ms"] > 0 for r in rows)
    assert [t["required_speedup"] for t in report["targets"]] == [2.0, 3.0]
