"""benchmarks/bwd_sweep.py runs end to end at --smoke sizes (CPU interpreter), checks every
variant's gradients, restores the host's launch settings and writes a well-formed report,
so the GPU sweep cannot rot between the sessions that run it."""

from __future__ import annotations

import json

from gemc.backends.triton.codegen import host

from tests.benchmark_module import load_benchmark


def test_bwd_sweep_smoke_writes_json(tmp_path):
    bench = load_benchmark("bwd_sweep")
    before = host.loop_launch()
    out = tmp_path / "sweep.json"
    bench.main(["--smoke", "--out", str(out)])
    assert host.loop_launch() == before
    report = json.loads(out.read_text())
    assert set(report["cases"]) == {"norm", "pointwise", "reduction"}
    rows = report["variants"]
    assert not [r for r in rows if r.get("error") or r.get("skipped")], rows
    assert len(rows) == 3 * 4  # the default, two row-program counts, one pipelined
    assert all(r["grad_ok"] and r["fwd+bwd_ms"] > 0 and r["bwd_ms"] > 0 for r in rows), rows
    assert {(r["programs"], r["iters"] > 1) for r in rows if r["case"] == "pointwise"} >= {
        (3, True), (0, False)}
    assert report["best"]["env"].startswith("GEMC_LOOP_TILE=")


def test_sweep_grid_orders_the_default_first_and_pipelines_only_loops():
    bench = load_benchmark("bwd_sweep")
    V = bench.Variant
    default = V(1024, 1056, 1)
    got = bench.grid([1024, 2048], [1056, 0], [1, 2], [1024], [1056, 0], default)
    assert got == [default, V(2048, 1056, 1), V(1024, 0, 1), V(2048, 0, 1), V(1024, 1056, 2)]


def test_sweep_sets_and_restores_the_autotuners_timing():
    """The GPU-only path that shortens the looping kernel's autotuning: set on the
    autotuner, then removed so Triton's own benchmarker comes back."""
    bench = load_benchmark("bwd_sweep")
    fusion = bench.fusion
    _, entry = fusion.gemc_kernel(fusion.cases(True)["pointwise"][0], bench.torch.float32)
    module = host.load_source(entry["code"])
    bench.tune_with(module, 25)
    assert vars(module.bwd)["do_bench"].__name__ == "bench"
    bench.tune_with(module, None)
    assert "do_bench" not in vars(module.bwd)  # (reading it here would ask for a GPU driver)
