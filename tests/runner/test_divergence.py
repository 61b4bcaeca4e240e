"""The loss safeguard: blow-ups are flagged (against the run's own statistics, a reference
trajectory, or as non-finite), a noisy but stable run is not, and the message names the
plan's low-precision tables and sites to revert. Induced blow-ups: synthetic series, and a
real run with a learning rate 3 orders of magnitude too high."""

from __future__ import annotations

import copy
import json
import random
import warnings
from pathlib import Path

import pytest
from gemc.backends.torch.divergence import (
    DivergenceGuard,
    TrainingDiverged,
    load_reference,
    low_precision_sites,
)
from gemc.backends.torch.runner import RunOptions, run

from gemc.errors import GemcUserError

PLAN = {"tables": [{"fqn": "t0.weight", "precision": "fp8"},
                   {"fqn": "t1.weight", "precision": "bf16"},
                   {"fqn": "t2.weight"}],
        "precision": [{"target": "top.0", "dtype": "fp8"}, {"target": "*", "dtype": "fp32"}]}


def _noisy(n: int, seed: int = 7) -> list[float]:
    """A stable, noisy loss: 0.7 +- 25% batch to batch (as the test model's runs are)."""
    rng = random.Random(seed)
    return [0.7 * (1 + rng.uniform(-0.25, 0.25)) for _ in range(n)]


def test_sites_name_low_precision_tables_and_sites():
    assert low_precision_sites(PLAN) == ["table t0.weight (fp8)", "table t1.weight (bf16)",
                                         "precision site top.0 (fp8)"]


def test_stable_run_is_not_flagged_and_a_blow_up_is():
    guard = DivergenceGuard(low_precision_sites(PLAN), action="warn")
    series = _noisy(200)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a false alarm would raise here
        assert all(guard.observe(i + 1, v) is None for i, v in enumerate(series))
    with pytest.warns(UserWarning, match=r"step 201: .*t0\.weight \(fp8\).*top\.0 \(fp8\)"):
        verdict = guard.observe(201, 25.0)
    assert verdict is not None and verdict.step == 201
    assert guard.report()["diverged"][0]["step"] == 201
    # the blown-up value did not become the new normal: the next one is flagged too
    with pytest.warns(UserWarning):
        assert guard.observe(202, 25.0) is not None


def test_early_and_non_finite_blow_ups_and_grad_norm():
    guard = DivergenceGuard([], action="stop")
    guard.observe(1, 0.8)
    with pytest.raises(TrainingDiverged, match="more than 10x") as err:
        guard.observe(2, 13.0)
    assert "every table and site of this plan is fp32" in str(err.value)
    guard = DivergenceGuard(["table t0.weight (bf16)"], action="stop")
    with pytest.raises(TrainingDiverged, match="loss is nan"):
        guard.observe(1, float("nan"))
    guard = DivergenceGuard([], action="stop")
    for i, v in enumerate(_noisy(30)):
        guard.observe(i + 1, v, grad_norm=1.0 + 0.1 * (i % 3))
    with pytest.raises(TrainingDiverged, match="grad_norm 500"):
        guard.observe(31, 0.7, grad_norm=500.0)


def test_a_non_finite_first_loss_is_the_forwards_not_the_learning_rate():
    """Step 1's loss comes from the initial weights: NaN there (a softmax over a row that
    is all padding, say) is no learning-rate problem, and the message says where to look;
    NaN later keeps the learning-rate advice."""
    guard = DivergenceGuard([], action="stop")
    with pytest.raises(TrainingDiverged, match="no update has run") as err:
        guard.observe(1, float("nan"))
    assert "detect_anomaly" in err.value.fix and "learning rate" not in err.value.fix
    guard = DivergenceGuard([], action="stop")
    guard.observe(1, 0.7)
    with pytest.raises(TrainingDiverged) as err:
        guard.observe(2, float("nan"))
    assert err.value.fix == "lower the learning rate, check the data"


def test_reference_trajectory_needs_several_steps_above():
    ref = {i + 1: v for i, v in enumerate(_noisy(40))}
    guard = DivergenceGuard(["table t0.weight (fp8)"], action="stop", reference=ref,
                            warmup=1000)  # only the reference speaks here
    for step in range(1, 11):
        guard.observe(step, ref[step] * 1.3)  # 30% worse: within the 50% tolerance
    guard.observe(11, ref[11] * 2)  # one bad batch
    guard.observe(12, ref[12])
    guard.observe(13, ref[13] * 2)
    guard.observe(14, ref[14] * 2)
    with pytest.raises(TrainingDiverged, match="step 15: .*reference trajectory"):
        guard.observe(15, ref[15] * 2)


def test_reference_file_forms(tmp_path: Path):
    report = tmp_path / "run.json"
    report.write_text(json.dumps({"losses": [{"step": 1, "loss": 0.5, "ms": 1.0}]}))
    assert load_reference(report) == {1: 0.5}
    plain = tmp_path / "list.json"
    plain.write_text("[0.5, 0.25]")
    assert load_reference(plain) == {1: 0.5, 2: 0.25}
    plain.write_text('{"x": 1}')
    with pytest.raises(GemcUserError, match="neither a run report"):
        load_reference(plain)


@pytest.fixture(scope="module")
def fp8_plan(base_plans) -> dict:
    plan = copy.deepcopy(base_plans[1])
    plan["kernels"], plan["precision"] = [], []
    for t in plan["tables"]:
        t["precision"] = "fp8"
    return plan


def test_runner_stops_an_induced_blow_up_naming_the_tables(fp8_plan):
    """lr 3.0 on the dense layers (the default is 1e-3): the loss jumps 16x in a step."""
    with pytest.raises(TrainingDiverged, match=r"step 2: .*table t0\.weight \(fp8\)"):
        run(fp8_plan, RunOptions(device="cpu", progress=False, steps=10, lr=3.0,
                                 divergence="stop"))


def test_runner_warns_against_a_reference_and_keeps_training(fp8_plan, tmp_path: Path):
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps([0.2] * 10))  # a reference far below this run's ~0.7
    with pytest.warns(UserWarning, match="reference trajectory"):
        res = run(fp8_plan, RunOptions(device="cpu", progress=False, steps=6,
                                       reference_losses=str(ref)))
    assert len(res.losses) == 6
    assert res.report["divergence"]["diverged"][0]["step"] == 3
