"""bf16 / fp8 tables trained by the runner on 2 CPU processes (gloo).

The test model's six tables (bags sum/mean, per-sample weights, padding_idx, a plain
nn.Embedding) are sharded four ways (table-wise, row-wise, column-wise, data-parallel) and
stored fp32, bf16 or fp8 as the plan says; the three runs start from the same
initialisation (rounded to nearest at load) and train 10 steps with row-wise Adagrad.

Tolerance: bf16 keeps 8 significant bits (relative rounding <= 2**-9 = 0.2% per element),
fp8 e4m3 4 bits (<= 2**-4 = 6%, on a scale set by each row's largest element). The loss
is a smooth function of the pooled rows through the dense layers, so the relative
difference of the loss stays at the order of the per-element rounding; stochastic
rounding of the updates adds zero-mean noise, not drift. So bf16 must stay within 1% of
fp32's loss at every step and fp8 within 6%, and both must actually differ from fp32
(the storage is in effect, not silently fp32).
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest

from gemc.plan import write_plan
from tests.runner.harness import run_scenarios, variant

STEPS = 10
RESUME_AT, RESUMED_TO = 3, 5  # fp8's resumed run: stopped after step 3, resumed to step 5
RTOL = {"bf16": 0.01, "fp8": 0.06}


@pytest.fixture(scope="module")
def plan_w2(base_plans) -> dict:
    r = [0, 1]
    return variant(base_plans[2], {"t0.weight": ("table_wise", [1]), "t1.weight": ("row_wise", r),
                          "t2.weight": ("column_wise", r), "t3.weight": ("data_parallel", r),
                          "t4.weight": ("row_wise", [1, 0]), "t5.weight": ("table_wise", [0])},
                   optimizer={"embedding": {"kind": "rowwise_adagrad", "lr": 0.05}})


def _run_quietly(plan: dict, **kw) -> tuple[list[float], list[str]]:
    from gemc.backends.torch.runner import RunOptions, run

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = run(plan, RunOptions(device="cpu", progress=False, **kw))
    return [v for _, v in res.losses], [str(w.message) for w in caught
                                       if "not applied" in str(w.message)]


@pytest.fixture(scope="module")
def toy_graph() -> tuple[dict, list[float]]:
    """The one-table toy compiled for one GPU (kernels kept), and its fp32 losses."""
    from gemc.api import compile as gemc_compile
    from tests.conftest import TOY

    base = gemc_compile(f"{TOY}:build", {}, topology="h200:1x1")
    base["precision"] = []
    assert [k["kind"] for k in base["kernels"]][0] == "batched_embedding_bag"
    return base, _run_quietly(_with_precision(base, "fp32"), steps=6)[0]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_graph_mode_runs_the_fused_kernel_on_low_precision_tables(toy_graph, precision):
    """One rank, the plan's kernels kept: the batched lookup (Triton, fused row-wise Adagrad)
    stores the table bf16 / fp8. Its first loss equals the sharded path's (the same stored
    values and, for fp8, row scales handed over), and it trains near fp32's."""
    base, fp32 = toy_graph
    fused, fell_back = _run_quietly(_with_precision(base, precision), steps=6)
    assert not fell_back
    sharded, _ = _run_quietly(_with_precision(base, precision), steps=1, kernels=False)
    assert abs(fused[0] - sharded[0]) <= 1e-5 * abs(sharded[0])
    off = max(abs(a - b) / abs(b) for a, b in zip(fused, fp32))
    assert 0 < off < RTOL[precision]


def test_graph_mode_falls_back_loudly_for_tables_outside_a_batched_lookup(base_plans):
    """The test model's nn.Embedding / padding_idx tables are looked up by the graph's own
    ops, which would read bf16 bits as they are: every lookup then goes through the
    sharded tables, and a warning names the tables."""
    base = copy.deepcopy(base_plans[1])
    base["precision"] = []
    _, fell_back = _run_quietly(_with_precision(base, "bf16"), steps=2)
    assert len(fell_back) == 1 and "t3.weight" in fell_back[0] and "bf16/fp8" in fell_back[0]


def _with_precision(plan: dict, precision: str) -> dict:
    out = copy.deepcopy(plan)
    for t in out["tables"]:
        t["precision"] = precision
        t["precision_reason"] = "set by the test"
    return out


def test_low_precision_tables_train_near_fp32(plan_w2, tmp_path: Path) -> None:
    scenarios = []
    for precision in ("fp32", "bf16", "fp8"):
        path = tmp_path / f"{precision}.json"
        write_plan(path, _with_precision(plan_w2, precision))
        scenarios.append({"name": precision, "plan": str(path), "phases": [{"steps": STEPS}]})
    # fp8 stopped at step 3 (a checkpoint every 2 steps, and the last), resumed to step 5:
    # the exact resume needs a few steps on each side, not the whole run (10 fp8 steps cost
    # ~13 s interpreted; the stochastic rounding's stream differs every step)
    ck = tmp_path / "ck"
    scenarios.append({"name": "fp8-resumed", "plan": str(tmp_path / "fp8.json"), "phases": [
        {"steps": RESUME_AT, "checkpoint_dir": str(ck), "checkpoint_every": 2},
        {"steps": RESUMED_TO, "checkpoint_dir": str(ck), "resume": True}]})
    got = run_scenarios(2, scenarios, tmp_path / "losses.json")
    fp32 = [v for _, v in got["fp32"][0]]
    assert len(fp32) == STEPS
    for precision, rtol in RTOL.items():
        losses = [v for _, v in got[precision][0]]
        off = [abs(a - b) / abs(b) for a, b in zip(losses, fp32)]
        assert max(off) < rtol, f"{precision}: loss off fp32's by {max(off):.3%} (> {rtol:.0%})"
        assert max(off) > 0, f"{precision}: identical to fp32: the storage is not in effect"
    # the weights, their row scales and the rounding's random stream resume exactly
    first, rest = got["fp8-resumed"]
    assert [s for s, _ in rest] == list(range(RESUME_AT + 1, RESUMED_TO + 1))
    assert first + rest == got["fp8"][0][:RESUMED_TO]
