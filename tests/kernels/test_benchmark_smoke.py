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


def test_zoo_attention_case_times_every_model_with_a_history(tmp_path):
    """``--cases zoo`` at the zoo's tiny shapes: per model with a history, gemc's kernel and
    the padded baselines timed and checked against eager; the summary names every model."""
    bench = load_benchmark("kernels")
    out = tmp_path / "zoo.json"
    bench.main(["--smoke", "--no-compile", "--cases", "zoo", "--out", str(out)])
    report = json.loads(out.read_text())
    rows = report["results"]
    assert not [r for r in rows if r["error"]], [r for r in rows if r["error"]]
    cases = {r["case"] for r in rows}
    assert cases == {"hstu: silu attention causal", "sasrec_bst: softmax attention",
                     "mmoe: softmax attention causal"}
    variants = {(r["case"], r["variant"]) for r in rows if r["mode"] == "fwd+bwd"}
    assert ("hstu: silu attention causal", "sdpa padded (softmax, masked)") in variants
    checked = [r for r in rows if r["max_abs_err"] is not None]
    assert len(checked) == 6 and all(r["max_abs_err"] < 0.05 for r in checked)
    zoo = report["zoo"]
    assert set(zoo) == {"hstu", "sasrec_bst", "mmoe", "din", "dlrm_dcnv2", "wukong"}
    for model in ("hstu", "sasrec_bst", "mmoe"):
        assert zoo[model]["gemc_ms"] > 0 and zoo[model]["vs_sdpa_masked"] > 0
    assert zoo["hstu"]["vs_padded_silu_eager"] > 0
