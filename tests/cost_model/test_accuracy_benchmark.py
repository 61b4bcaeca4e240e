"""The accuracy benchmark runs end to end in its prediction-only smoke mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_module import load_benchmark


def test_smoke_prediction_only(tmp_path: Path) -> None:
    module = load_benchmark("cost_model_accuracy")
    out = tmp_path / "acc.json"
    rc = module.main(["--mode", "eager", "--smoke", "--no-measure", "--models", "dlrm", "--dtypes", "fp32,bf16",
                      "--batch-sizes", "16", "--calibration", "none", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["summary"]["configs"] == 2 and not report["summary"]["failed"]
    row = report["configs"][0]
    assert row["predicted"]["step_ms"] > 0
    assert row["predicted"]["memory_gb"]["peak"] > 0
    # the breakdown by category and phase covers every predicted kernel millisecond
    cats = row["predicted"]["by_category_ms"]
    assert sum(sum(p.values()) for p in cats.values()) == \
        pytest.approx(row["predicted"]["gpu_busy_ms"], rel=1e-9)
    assert cats["optimizer"]["opt"] > 0 and cats["embedding_bwd"]["bwd"] > 0


def test_plan_mode_smoke(tmp_path: Path) -> None:
    """Plan mode on the CPU: compile both examples' tiny plans, gemc run them, score, and
    refit each from the other's run (a crash check: CPU times mean nothing)."""
    module = load_benchmark("cost_model_accuracy")
    rc = module.main(["--smoke", "--models", "gem,dlrm", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "cost_model_accuracy.json").read_text())
    assert not doc["summary"]["failed"], doc["models"]
    for row in doc["models"]:
        assert row["predicted"]["step_ms"] > 0 and row["measured"]["step_ms"] > 0
        assert "time_error_pct" in row and "memory_error_pct" in row
    assert [r["model"] for r in doc["refit"]] == ["dlrm", "gem"]
    assert all("time_error_pct" in r for r in doc["refit"]), doc["refit"]
    assert (tmp_path / "refit_0.calibration.json").is_file()


def test_leave_half_out_from_saved_zoo_rows(tmp_path: Path) -> None:
    """Without a GPU: measurements from zoo result rows (here synthetic: every model 1.5x
    slower than predicted, 1.2x its predicted memory) score the plans compiled now, and the
    calibration refitted on one model's row moves the other model's prediction towards
    its own measurement (the fit generalises, in direction)."""
    module = load_benchmark("cost_model_accuracy")
    variants = {}
    base = {}
    for key in ("gem", "dlrm"):
        entry = module.plan_models(key)[key]
        plan = module.compile_plan(entry, "tiny", "h200:1x1", "auto", tmp_path / f"{key}.p.json")
        base[key] = module._predicted(plan)
        variants[key] = [{"variant": "eager", "step_ms": 1.0, "peak_memory_bytes": 1},
                         {"variant": "gemc", "step_ms": 1.5 * base[key]["step_ms"],
                          "peak_memory_bytes": 1.2e9 * base[key]["peak_gb"]}]
    zoo = tmp_path / "zoo_rows.json"
    zoo.write_text(json.dumps({"variants": variants}))
    out = tmp_path / "acc"
    rc = module.main(["--preset", "tiny", "--out", str(out), "--measured-from-zoo", str(zoo)])
    assert rc == 0
    doc = json.loads((out / "cost_model_accuracy.json").read_text())
    assert sorted(r["model"] for r in doc["models"]) == ["dlrm", "gem"]
    for row in doc["models"]:
        assert row["time_error_pct"] == pytest.approx(100 * (1 / 1.5 - 1), abs=0.5)
        assert json.loads(Path(row["run_report"]).read_text())["device"] == "cuda"
    assert sorted(r["model"] for r in doc["refit"]) == ["dlrm", "gem"]
    for r in doc["refit"]:
        assert r["trained_on"] != [r["model"]]
        assert r["predicted"]["step_ms"] > base[r["model"]]["step_ms"]
        assert abs(r["time_error_pct"]) < abs(100 * (1 / 1.5 - 1))
        assert r["predicted"]["peak_gb"] > base[r["model"]]["peak_gb"]


def test_a_run_of_other_kernels_is_judged_apart_and_never_fitted_on(tmp_path: Path) -> None:
    """A zoo row whose run applied other kernels than the plan compiled now (a pass since
    matched more of the graph) is marked, with the kinds that changed, and the refit does
    not train on it; a row that does not say what ran is kept."""
    module = load_benchmark("cost_model_accuracy")
    plan = {"kernels": [{"name": "norm_0"}, {"name": "jagged_silu_attention_1"},
                        {"name": "norm_2"}]}
    assert module.program_change(plan, {"kernel_kinds": {"norm": 2,
                                                         "jagged_silu_attention": 1}}) == {}
    assert module.program_change(plan, {"kernel_kinds": {"norm": 2, "pointwise": 3}}) == {
        "jagged_silu_attention": [0, 1], "pointwise": [3, 0]}
    assert module.program_change(plan, {}) is None
    # a table the plan now routes otherwise than the run did is another program too
    routed = {**plan, "tables": [{"fqn": "a", "lookup": "sparse"}, {"fqn": "b"}]}
    ran = {"kernel_kinds": {"norm": 2, "jagged_silu_attention": 1},
           "table_routes": module.route_counts(["dense_grad", "batched"])}
    assert module.program_change(routed, ran) == {"lookup_dense_grad": [1, 0],
                                                  "lookup_sparse": [0, 1]}
    assert module.program_change({**routed, "tables": [{"fqn": "a", "lookup": "dense_grad"},
                                                       {"fqn": "b"}]}, ran) == {}
    zoo = tmp_path / "zoo.json"
    zoo.write_text(json.dumps({"variants": {"hstu": [
        {"variant": "gemc", "step_ms": 2.0, "peak_memory_bytes": 3e9,
         "runner_report": {"kernels_applied": ["norm_0", "pointwise_1", "pointwise_2"]}}]}}))
    assert module.zoo_measurements([str(zoo)])["zoo/hstu"]["kernel_kinds"] == {
        "norm": 1, "pointwise": 2}

    trained: list[list[str]] = []

    def fit(reports, base, path, require_gpu):  # noqa: ANN001
        trained.append(list(reports))
        raise RuntimeError("stop before compiling")

    rows = [{"model": m, "measured": {}, "run_report": m, "same_program": same}
            for m, same in (("a", True), ("b", False), ("c", None), ("d", False))]
    refit = module._leave_half_out(rows, object(), "tiny", "h200:1x1", tmp_path,
                                   smoke=True, fit=fit)
    assert trained == [["a", "c"]]
    assert "no run of the same program" in refit[1]["error"]
