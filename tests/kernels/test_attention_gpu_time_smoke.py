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


def test_host_profile_counts_the_launches_of_a_fwd_bwd(tmp_path) -> None:
    """``--profile-host`` on the CPU: HSTU's silu fwd+bwd (key-block backward) launches
    three kernels a call (forward, dq, dk/dv: the uncovered rows' zeros are the kernels'
    own), none through ``Autotuner.run`` once its configs are decided."""
    bench = load_benchmark("attention_gpu_time")
    out = tmp_path / "host.txt"
    bench.main(["--smoke", "--models", "hstu", "--profile-host", str(out)])
    line = next(x for x in out.read_text().splitlines() if x.startswith("launches a call"))
    assert "interpreted launches (InterpretedFunction.run) 3," in line + ",", line
    assert "Autotuner.run 0," in line and "direct (DirectAutotuner.run) 3" in line, line


def test_defaults_only_keeps_the_default_configs_with_and_without_the_bias() -> None:
    """``--defaults-only`` (a short device call): HSTU's gemc rows are its default launch
    configs alone, with and without its relative bias; none autotuned or with a switch."""
    bench = load_benchmark("attention_gpu_time")
    results = bench.main(["--smoke", "--models", "hstu", "--defaults-only"])
    assert [r["variant"] for r in results["models"]["hstu"]["rows"]] == ["gemc", "gemc +bias"]


def test_versus_cudnn_gives_both_measures_and_none_where_one_is_missing() -> None:
    """The summary against padded cuDNN: TransAct's figure is its region under
    ``torch.compile``, another model's the default ``gemc`` row; a ratio by do_bench and
    one by graph replay; None where a measure is missing or an error string stands in."""
    bench = load_benchmark("attention_gpu_time")
    rows = {"transact": {"rows": [
        {"variant": "gemc region (eager call)", "do_bench_ms": 9.0, "graph_ms": 9.0},
        {"variant": "gemc region (torch.compile)", "do_bench_ms": 2.0, "graph_ms": 0.5},
        {"variant": "sdpa cudnn masked", "do_bench_ms": 1.0, "graph_ms": 1.0}]},
        "mmoe": {"rows": [{"variant": "gemc", "do_bench_ms": 0.5, "graph_ms": "RuntimeError"},
                          {"variant": "sdpa cudnn masked", "do_bench_ms": 1.5,
                           "graph_ms": 1.4}]},
        "hstu": {"rows": [{"variant": "gemc", "do_bench_ms": 0.5}]}}
    got = bench.versus_cudnn(rows)
    assert got["transact"] == {"gemc_row": "gemc region (torch.compile)", "by_do_bench": 0.5,
                               "by_graph": 2.0}
    assert got["mmoe"]["by_do_bench"] == 3.0 and got["mmoe"]["by_graph"] is None
    assert got["hstu"] == {"gemc_row": "gemc", "by_do_bench": None, "by_graph": None}


def test_transact_blocks_runs_and_forcing_a_config_makes_the_heuristic_pick_it() -> None:
    """``--transact-blocks`` off a GPU runs each list's first config (checked against padded
    SDPA); :func:`_force_config` adds a config a kernel lacks and makes its heuristic hook
    pick it (what each GPU row relies on), and the hook is put back after the sweep."""
    import triton
    from gemc.backends.triton import config_choice as cc
    from gemc.backends.triton import softmax_row_backward  # noqa: F401

    bench = load_benchmark("attention_gpu_time")
    name = "jagged_attention._bwd_softmax_row_kernel"
    hook, tuner = cc._KERNELS[name]
    before_prefer, before = hook.prefer, list(tuner.configs)
    results = bench.main(["--smoke", "--transact-blocks"])
    rows = results["models"]["transact_blocks"]["rows"]
    assert [r["variant"] for r in rows] == ["fwd 64x32 4w 2s 96r", "row kernel 64 keys 4w 1s"]
    for r in rows:
        assert "error" not in r and r["max_err"] < 1e-4, r
    assert hook.prefer is before_prefer
    try:
        params = {"BLOCK": 16, "KEY_MAJOR": 1}
        bench._force_config(name, params, 2, 1)
        made = [triton.Config({"BLOCK": b, "KEY_MAJOR": 1}, num_warps=w, num_stages=1)
                for b, w in ((64, 4), (16, 2))]
        assert hook._heuristic(made, {}) is made[1]
        assert any(dict(c.kwargs) == params and c.num_warps == 2 for c in tuner.configs)
    finally:
        hook.prefer, tuner.configs[:] = before_prefer, before
