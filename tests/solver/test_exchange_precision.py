"""The pooled exchange's wire precision as a plan choice: priced by its bytes and its cast
kernels, the solver's arithmetic still the step model's, ``auto`` choosing a lower
precision only where the SQNR bound and the priced gain both hold, and bad option values
answered with a named error."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from gemc.cost_model.op_cost import DEFAULT_KERNEL_LAUNCH_S
from gemc.cost_model.topology import parse_topology
from gemc.cost_model.types import RegionCost, StepOptions, TableCost

import gemc.solver.exchange_choice as exchange_choice
from gemc.cli import main
from gemc.config import CompileConfig
from gemc.errors import GemcUserError
from gemc.exchange_precision import CAST_KERNELS, WirePrecision
from gemc.solver.candidates import AllToAll
from gemc.solver.evaluate import evaluate
from gemc.solver.exchange_choice import plan_with_exchange, with_exchange
from gemc.solver.planners import run_planner
from gemc.solver.problem import Assignment, DenseChoice, Problem, TableChoice, predict
from tests.conftest import TOY
from tests.solver.synth import make_problem
from tests.solver.test_evaluate import random_assignment

BF16, FP8 = WirePrecision.of("bf16"), WirePrecision.of("fp8")
DIM = 128


def _exchange_bound(topology: str) -> Problem:
    """Eight table-wise tables (dim 128, global batch 64K) with one small MLP: the pooled
    exchange is a large part of the step."""
    topo = parse_topology(topology)
    tables = tuple(TableCost(f"t{i}", 10**6, DIM, 65536 // topo.world_size * 20,
                             65536 // topo.world_size, ranks=(i % topo.world_size,))
                   for i in range(8))
    mlp = RegionCost("mlp", 10**6, 1e11, 1e-3)
    return Problem((mlp,), tables, topo, options=StepOptions())


def _table_wise(problem: Problem) -> Assignment:
    return Assignment({"mlp": DenseChoice()},
                      {t.fqn: TableChoice("table_wise", t.ranks) for t in problem.tables})


def test_exchange_time_shrinks_in_proportion_to_bytes():
    """Same plan, the wire narrower: the all-to-all's bandwidth part scales by the wire's
    bytes per element (bf16 1/2; fp8 forward 1 + 4/128, bf16 backward 2, of 2 x 4); the
    casts add their HBM bytes to the holders and their launches once."""
    p = _exchange_bound("h200:2x8")
    a = _table_wise(p)
    ref = predict(p, a)
    const = 2 * AllToAll.of(p).const_s  # latency: the same at any width
    for wire, ratio in ((BF16, 0.5), (FP8, (DIM + 4 + 2 * DIM) / (2 * 4 * DIM))):
        got = predict(with_exchange(p, wire), a)
        assert got.breakdown["all_to_all"] - const == pytest.approx(
            ratio * (ref.breakdown["all_to_all"] - const), rel=1e-9)
        assert got.breakdown["exchange_cast"] == pytest.approx(
            (CAST_KERNELS[wire.forward] + CAST_KERNELS[wire.backward]) * DEFAULT_KERNEL_LAUNCH_S)
        assert got.breakdown["sparse_compute"] > ref.breakdown["sparse_compute"]
    assert ref.breakdown["exchange_cast"] == 0.0
    # across hosts the bytes dominate: bf16 is predicted faster overall
    assert predict(with_exchange(p, BF16), a).step_s < 0.95 * ref.step_s


@pytest.mark.parametrize("topology", ["h200:1x4", "h200:2x8"])
@pytest.mark.parametrize("forward", ["bf16", "fp8"])
def test_evaluate_equals_predict_step_at_every_wire(topology, forward):
    p = make_problem(topology, n_tables=8, seed=3)
    p = with_exchange(p, WirePrecision.of(forward))
    a = random_assignment(p, random.Random(3))
    ev, ref = evaluate(p, a), predict(p, a)
    assert ev.step_s == pytest.approx(ref.step_s, rel=1e-9)
    for k, v in ref.breakdown.items():
        assert ev.breakdown[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def test_auto_takes_the_lower_precision_only_where_it_pays():
    across = plan_with_exchange(_exchange_bound("h200:2x8"), "auto", "greedy")
    block = across.report["exchange"]
    assert block["forward"] in ("bf16", "fp8") and block["backward"] == "bf16"
    assert "SQNR" in block["reason"] and "faster" in block["reason"]
    assert block["sqnr_db"]["bf16"] > 40 and block["sqnr_db"]["fp8"] > 25
    steps = block["solver_step_ms"]
    assert steps[block["forward"]] < 0.99 * steps["fp32"]
    assert across.evaluation.step_s < 0.99 * 1e-3 * steps["fp32"]
    # nothing exchanged on one rank: no gain, fp32 kept, and the plan says why
    alone = plan_with_exchange(replace(_exchange_bound("h200:1x8"),
                                       topology=parse_topology("h200:1x1"),
                                       tables=tuple(replace(t, ranks=(0,)) for t in
                                                    _exchange_bound("h200:1x8").tables)),
                               "auto", "greedy")
    assert alone.report["exchange"]["forward"] == "fp32"
    assert "no lower precision pays" in alone.report["exchange"]["reason"]


def test_auto_respects_the_sqnr_bound(monkeypatch):
    """With bounds no cast meets, auto keeps fp32 across hosts and names the SQNR."""
    monkeypatch.setitem(exchange_choice.MIN_SQNR_DB, "bf16", 90.0)
    monkeypatch.setitem(exchange_choice.MIN_SQNR_DB, "fp8", 90.0)
    chosen = plan_with_exchange(_exchange_bound("h200:2x8"), "auto", "greedy")
    block = chosen.report["exchange"]
    assert block["forward"] == "fp32"
    assert "bf16 not taken: SQNR bf16" in block["reason"] and "< 90 dB" in block["reason"]


def test_fixed_precision_is_planned_at_that_precision():
    p = _exchange_bound("h200:2x8")
    fixed = plan_with_exchange(p, "fp8", "greedy")
    assert fixed.report["exchange"] == {"forward": "fp8", "backward": "bf16",
                                        "reason": "fp8: fixed by --exchange-precision fp8"}
    again = run_planner(with_exchange(p, FP8), "greedy")
    assert fixed.evaluation.step_s == pytest.approx(again.evaluation.step_s)


@pytest.mark.parametrize("value", ["fp16", "int8", "BF16"])
def test_bad_values_name_the_flag_and_the_fix(value):
    with pytest.raises(GemcUserError) as err:
        CompileConfig(planner="greedy", exchange_precision=value).validate()
    text = str(err.value)
    assert "--exchange-precision" in text and repr(value) in text
    assert "fp32, bf16, fp8, auto" in text


def test_auto_needs_a_solver_planner_and_the_cli_answers_with_exit_2(tmp_path, capsys):
    with pytest.raises(GemcUserError, match="--planner cpsat"):
        CompileConfig(planner="default", exchange_precision="auto").validate()
    CompileConfig(planner="default", exchange_precision="bf16").validate()  # fixed: fine
    code = main(["compile", f"{TOY}:build", "--topology", "h200:1x2",
                 "--out", str(tmp_path / "p.json"), "--exchange-precision", "fp16"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--exchange-precision" in err and "fp32, bf16, fp8, auto" in err
    assert not (tmp_path / "p.json").exists()
