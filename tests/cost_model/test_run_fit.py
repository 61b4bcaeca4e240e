"""`gemc calibrate --from-run`: measured runs folded back move the next prediction towards
them, for time and for memory, and bad run reports are named errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gemc.cost_model.calibration import DATA_DIR, load_calibration
from gemc.cost_model.run_fit import RunReportError, calibrate_from_runs, fit_runs, read_run

from gemc.api import compile as gemc_compile
from gemc.cli import main

GEM = str(Path(__file__).resolve().parents[2] / "examples" / "gem" / "model.py") + ":build"
BASE = DATA_DIR / "h200.json"


def _plan(calibration: str = "auto") -> dict[str, Any]:
    return gemc_compile(GEM, {"preset": "tiny"}, topology="h200:1x1", planner="greedy",
                        calibration=calibration)


@pytest.fixture(scope="module")
def plan() -> dict[str, Any]:
    return _plan()


def _report(plan: dict[str, Any], step_ms: float, peak_bytes: float) -> dict[str, Any]:
    """A run report as backends/torch/report.py writes it (the fields the fit reads)."""
    pred = plan["predicted"]
    return {"device": "cuda", "step_ms": step_ms, "vs_predicted": {
        "step_ms": {"measured": step_ms, "predicted": pred["step_ms"]},
        "memory_per_rank": [{"rank": 0, "measured_bytes": peak_bytes,
                             "predicted_bytes": pred["per_rank"][0]["memory_gb"] * 1e9}],
        "kind_ms": pred["kind_ms"], "gpu": plan["topology"]["gpu"],
        "memory_breakdown_gb": pred["per_rank"][0]["memory"]}}


def _write(tmp: Path, name: str, doc: Any) -> str:
    path = tmp / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def test_plan_carries_what_the_fit_needs(plan):
    pred = plan["predicted"]
    assert sum(pred["kind_ms"].values()) == pytest.approx(pred["step_ms"], rel=1e-4)
    assert pred["per_rank"][0]["memory"]["activations"] > 0


@pytest.mark.parametrize("scale", [1.6, 0.6])
def test_run_fit_moves_the_next_prediction_towards_the_run(plan, tmp_path, scale):
    """Measured slower (faster) than predicted -> the next compile predicts more (less);
    measured more (less) memory -> more (less) predicted memory."""
    pred = plan["predicted"]
    mem = pred["per_rank"][0]["memory_gb"] * 1e9
    act = pred["per_rank"][0]["memory"]["activations"] * 1e9
    run = _write(tmp_path, "r.run.json", _report(plan, scale * pred["step_ms"],
                                                 mem + (scale - 1) * act))
    out = tmp_path / "fitted.json"
    doc = calibrate_from_runs([run], BASE, out)
    assert load_calibration(out).data["run_fit"] == doc["run_fit"]
    again = _plan(str(out))["predicted"]
    before, after = pred["step_ms"], again["step_ms"]
    assert (after > before) if scale > 1 else (after < before)
    # the fit closes most of the gap on the run it saw
    assert abs(after - scale * before) < 0.5 * abs(scale - 1) * before
    assert doc["run_fit"]["activation_factor"] == pytest.approx(scale, rel=0.02)
    m_before, m_after = pred["max_memory_gb"], again["max_memory_gb"]
    assert (m_after > m_before) if scale > 1 else (m_after < m_before)


def test_fit_spreads_over_kinds_and_composes_with_the_base(plan, tmp_path):
    run = read_run(_write(tmp_path, "r.run.json",
                          _report(plan, 2.0 * plan["predicted"]["step_ms"], 1e9)))
    fit = fit_runs([run])
    used = {k for k, v in plan["predicted"]["kind_ms"].items() if v > 0}
    assert set(fit.factors) == used and all(f > 1 for f in fit.factors.values())
    assert abs(fit.residuals[0]["step_residual_pct"]) < 10
    # refitting a fitted file multiplies: the factors do not reset to the new run alone
    first = tmp_path / "a.json"
    calibrate_from_runs([run.source], BASE, first)
    second = calibrate_from_runs([run.source], first, tmp_path / "b.json")
    a = load_calibration(first).factor("gemm")
    assert second["run_fit"]["factors"]["gemm"] == pytest.approx(min(5.0, a * a), rel=1e-3)


def test_a_measured_kind_pins_its_factor(plan, tmp_path):
    doc = _report(plan, plan["predicted"]["step_ms"], 1e9)
    gemm = plan["predicted"]["kind_ms"]["gemm"]
    doc["vs_predicted"]["measured_kind_ms"] = {"gemm": 3.0 * gemm}
    fit = fit_runs([read_run(_write(tmp_path, "r.run.json", doc))])
    assert fit.factors["gemm"] > 2.0 > max(v for k, v in fit.factors.items() if k != "gemm")


@pytest.mark.parametrize(("content", "field"), [
    ("{not json", "r.run.json:1"),
    ({"steps": 3}, "vs_predicted"),
    ({"device": "cpu", "vs_predicted": {}}, "device"),
    ({"device": "cuda", "vs_predicted": {"step_ms": {"measured": None}}},
     "vs_predicted.step_ms.measured"),
    ({"device": "cuda", "vs_predicted": {"step_ms": {"measured": 10.0}}},
     "vs_predicted.kind_ms"),
    ({"device": "cuda", "vs_predicted": {"step_ms": {"measured": 10.0},
                                         "kind_ms": {"warp": 1.0}}},
     "vs_predicted.kind_ms.warp"),
])
def test_bad_run_reports_are_named(tmp_path, content, field):
    path = _write(tmp_path, "r.run.json", content)
    with pytest.raises(RunReportError) as err:
        read_run(path)
    assert field in err.value.where and err.value.fix


def test_missing_run_report_is_named(tmp_path):
    with pytest.raises(RunReportError, match="cannot read") as err:
        read_run(tmp_path / "absent.run.json")
    assert "absent.run.json" in err.value.where


def test_cli_from_run(plan, tmp_path, capsys):
    run = _write(tmp_path, "r.run.json", _report(plan, 1.3 * plan["predicted"]["step_ms"], 1e9))
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--from-run", run, "--base", "auto", "--out", str(out)]) == 0
    assert load_calibration(out).factor("gemm") > 1.0
    assert "fitted" in capsys.readouterr().out
    # a bad report: exit 2 with the file named
    bad = _write(tmp_path, "bad.run.json", {"steps": 1})
    assert main(["calibrate", "--from-run", bad, "--out", str(out)]) == 2
    assert "bad.run.json" in capsys.readouterr().err


def _obs(name: str, kinds: dict[str, float], measured: float):
    from gemc.cost_model.run_fit import RunObservation
    return RunObservation(name, "h200", measured, kinds, {}, None, None, None)


def test_ridge_by_leave_one_out_keeps_a_shared_rate_and_drops_model_noise():
    """A rate every run shares (GEMMs 1.5x slower than priced) is learnt at a weak pull
    and predicts a run the fit did not see; errors that are each model's own (a missing
    term, not a rate) choose a strong pull, so the fit does not carry them to the next."""
    from gemc.cost_model.run_fit import RIDGE_GRID, fit_runs

    shared = [_obs(f"r{i}", {"gemm": g, "memory": m}, 1.5 * g + m)
              for i, (g, m) in enumerate([(10, 5), (4, 12), (20, 3), (7, 7)])]
    fit = fit_runs(shared)
    assert fit.ridge == min(RIDGE_GRID)
    assert fit.factors["gemm"] == pytest.approx(1.5, rel=0.05)
    unseen = _obs("u", {"gemm": 8, "memory": 8}, 1.5 * 8 + 8)
    pred = sum(fit.factors[k] * v for k, v in unseen.predicted_kind_ms.items())
    assert pred == pytest.approx(unseen.measured_step_ms, rel=0.05)

    noisy = [_obs(f"n{i}", {"gemm": g, "memory": m}, (g + m) * s)
             for i, (g, m, s) in enumerate([(10, 5, 2.0), (4, 12, 0.5), (20, 3, 1.6),
                                            (7, 7, 0.6)])]
    assert fit_runs(noisy).ridge > min(RIDGE_GRID)


def test_activation_factor_fits_relative_memory_error():
    """The memory fit minimises the runs' squared *relative* errors (the accuracy is judged
    relative): a 21 GB run whose activations read 2x and a 1.5 GB run whose read 0.5x pull
    alike (-47% / +34%), where absolute least squares (a = 1.99) put the small one +99%."""
    from gemc.cost_model.run_fit import RunObservation, activation_factor

    def obs(static: float, act: float, peak: float) -> RunObservation:
        return RunObservation("r", "h200", 1.0, {"gemm": 1.0}, {}, peak * 1e9, static * 1e9,
                              act * 1e9)

    runs = [obs(1.0, 10.0, 21.0), obs(1.0, 1.0, 1.5)]
    a = activation_factor(runs)

    def rel_sq(f: float) -> float:
        return sum(((r.predicted_static_bytes + f * r.predicted_activation_bytes
                     - r.measured_peak_bytes) / r.measured_peak_bytes) ** 2 for r in runs)

    assert rel_sq(a) < rel_sq(a - 0.01) and rel_sq(a) < rel_sq(a + 0.01)
    assert a == pytest.approx(1.0067, abs=1e-3)
    def worst(f: float) -> float:
        return max(abs(r.predicted_static_bytes + f * r.predicted_activation_bytes
                       - r.measured_peak_bytes) / r.measured_peak_bytes for r in runs)

    assert worst(1.985) == pytest.approx(0.99, abs=0.01)  # absolute least squares' a
    assert worst(a) < 0.5
    assert activation_factor([_obs("t", {"gemm": 1.0}, 1.0)]) is None


def test_two_runs_choose_their_ridge_by_predicting_each_other():
    """With two runs each is held out once: a slowdown both share (the whole step 1.4x)
    keeps the weak pull; one run's own error (the other predicted well as is) chooses a
    strong pull, so a fit on the two does not carry it to a third model."""
    from gemc.cost_model.run_fit import RIDGE_GRID, fit_runs

    shared = [_obs("a", {"gemm": 10, "memory": 5}, 1.4 * 15),
              _obs("b", {"gemm": 4, "memory": 12}, 1.4 * 16)]
    assert fit_runs(shared).ridge == min(RIDGE_GRID)
    own = [_obs("a", {"gemm": 10, "host": 4}, 1.5 * 14),
           _obs("b", {"gemm": 6, "host": 4}, 10.0)]
    fit = fit_runs(own)
    assert fit.ridge > min(RIDGE_GRID)
    assert fit.factors["host"] < 1.3
