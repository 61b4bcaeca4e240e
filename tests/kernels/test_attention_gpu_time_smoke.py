"""``benchmarks/attention_gpu_time.py --smoke`` runs on the CPU (interpreted): each gemc
variant of a zoo attention is timed without error. The GPU-only timings (CUDA graph,
profiler, host issue) are not reachable here; this keeps the script from rotting between
device calls."""

from __future__ import annotations

from tests.benchmark_module import load_benchmark


def test_smoke_times_each_gemc_variant() -> None:
    bench = load_benchmark("attention_gpu_time")
    results = bench.main(["--smoke", "--models", "mmoe"])
    rows = results["models"]["mmoe"]["rows"]
    assert [r["variant"] for r in rows] == ["gemc", "gemc autotuned"]
    for r in rows:
        assert "error" not in r and r["do_bench_ms"] > 0, r


def test_smoke_times_transacts_region_attention_eager_compiled_and_its_bias() -> None:
    """TransAct's attention in its packed region (issue 17): the eager call, the call under
    ``torch.compile`` (the form a training step runs) and the bias op alone, each timed."""
    bench = load_benchmark("attention_gpu_time")
    results = bench.main(["--smoke", "--models", "transact"])
    entry = results["models"]["transact"]
    assert [r["variant"] for r in entry["rows"]] == [
        "gemc region (eager call)", "gemc region (torch.compile)",
        "gemc::rep_key_bias alone (fwd)"]
    for r in entry["rows"]:
        assert "error" not in r and r["do_bench_ms"] > 0, r
    assert 0 < entry["tokens"] <= entry["shape"]["batch"] * entry["shape"]["max_len"]
