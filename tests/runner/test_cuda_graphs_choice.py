"""``--compile-mode auto`` (the default): CUDA graphs where the plan predicts the host bounds
the step, on one CUDA GPU under the Inductor executor; a named mode is taken as asked."""

from __future__ import annotations

import pytest
from gemc.backends.torch.cuda_graphs_choice import AUTO, CUDA_GRAPHS, resolve_compile_mode


def _predicted(launches: int, device_ms: float, per_us: float = 42.0) -> dict:
    return {"device_step_ms": device_ms, "host": {"launches": launches, "per_launch_us": per_us}}


def _auto(predicted, device_type="cuda", executor="inductor", world_size=1, requested=AUTO):
    return resolve_compile_mode(requested, device_type=device_type, executor=executor,
                                world_size=world_size, predicted=predicted)


@pytest.mark.parametrize("launches, device_ms, on", [
    (370, 5.26, True),     # TransAct h200's plan: 15.5 ms to issue, 5.3 on the GPU
    (881, 46.65, False),   # GEM h200's: 37 ms to issue, 46.7 on the GPU
    (453, 19.13, False),   # SASRec/BST's: 19.03 ms to issue, just under its GPU time
    (100, 4.2, False),     # equal: the GPU is not left waiting
])
def test_auto_takes_cuda_graphs_where_the_host_is_predicted_to_bound_the_step(
        launches, device_ms, on):
    mode, why = _auto(_predicted(launches, device_ms))
    assert mode == (CUDA_GRAPHS if on else None)
    assert why.startswith("auto: the host bounds" if on else "auto: the GPU bounds")
    assert f"{launches} launches" in why


@pytest.mark.parametrize("kw, reason", [
    ({"device_type": "cpu"}, "need a CUDA device"),
    ({"executor": "interpreter"}, "interpreter executor"),
    ({"world_size": 4}, "4 ranks"),
])
def test_auto_stays_off_where_cuda_graphs_have_not_run(kw, reason):
    mode, why = _auto(_predicted(370, 5.26), **kw)
    assert mode is None and reason in why


@pytest.mark.parametrize("predicted", [None, {}, {"device_step_ms": 3.0},
                                       {"device_step_ms": None, "host": {"launches": 9}}])
def test_auto_stays_off_without_a_prediction_to_compare(predicted):
    assert _auto(predicted) == (None, "auto: the plan predicts no host and device time to "
                                      "compare")


@pytest.mark.parametrize("requested, mode", [("default", None), (CUDA_GRAPHS, CUDA_GRAPHS),
                                             ("max-autotune", "max-autotune")])
def test_a_named_mode_is_taken_as_asked_anywhere(requested, mode):
    """``default`` turns CUDA graphs off even where auto would take them; a mode named on a
    CPU or on several ranks is the user's to ask for."""
    for kw in ({}, {"device_type": "cpu"}, {"world_size": 8}):
        assert _auto(_predicted(370, 5.26), requested=requested, **kw) == \
            (mode, f"asked for ({requested})")


def test_an_unknown_mode_is_refused_by_name():
    from gemc.errors import GemcUserError

    with pytest.raises(GemcUserError, match="(?s)'fast'.*--compile-mode.*auto, default, "
                       "reduce-overhead"):
        _auto(_predicted(370, 5.26), requested="fast")


def test_the_cli_accepts_the_modes_and_defaults_to_auto():
    import argparse

    from gemc.backends.torch.cli import add_run_parser

    parser = argparse.ArgumentParser(prog="gemc")
    add_run_parser(parser.add_subparsers(dest="command", required=True))
    assert parser.parse_args(["run", "p.json"]).compile_mode == AUTO
    assert parser.parse_args(["run", "p.json", "--compile-mode", "default"]).compile_mode \
        == "default"
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "p.json", "--compile-mode", "fast"])


def test_the_benchmark_reports_each_models_decision_from_its_plan():
    """``benchmarks/cuda_graphs_auto.py`` compiles a model as zoo.py does and reports its
    plan's launches, issue and device times and the auto decision they make."""
    from tests.benchmark_module import load_benchmark

    bench = load_benchmark("cuda_graphs_auto")
    (row,) = bench.main(["--models", "transact", "--preset", "tiny", "--planner", "greedy"])
    assert "error" not in row, row
    assert row["launches"] > 0 and row["device_ms"] > 0
    on = row["issue_ms"] > row["device_ms"]
    assert row["mode"] == (CUDA_GRAPHS if on else None)
    assert row["reason"].startswith("auto: the host bounds" if on else "auto: the GPU bounds")
