"""benchmarks/first_step_profile.py: a py-spy collapsed-stack file split by owner."""

from __future__ import annotations

import re

from tests.benchmark_module import load_benchmark

RAW = """\
<module> (zoo.py:10);run (gemc/backends/torch/runner.py:5);__call__ (torch/_dynamo/eval_frame.py:3);compile_fx (torch/_inductor/compile_fx.py:9) 300
<module> (zoo.py:10);run (gemc/backends/torch/runner.py:5);__call__ (torch/_dynamo/eval_frame.py:3);wait (torch/_inductor/async_compile.py:2) 100
<module> (zoo.py:10);run (gemc/backends/torch/runner.py:5);run (triton/runtime/jit.py:1);compile (triton/compiler/compiler.py:4) 50
<module> (zoo.py:10);run (gemc/backends/torch/runner.py:5);call (torch/_inductor/runtime/triton_heuristics.py:7);benchmark_all_configs (torch/_inductor/runtime/triton_heuristics.py:8);do_bench (triton/testing.py:1) 40
<module> (zoo.py:10);step (gemc/backends/torch/sparse_optim.py:5) 10
not a stack line
"""


def test_samples_split_by_owner_from_the_leaf_up(tmp_path, capsys) -> None:
    prof = load_benchmark("first_step_profile")
    path = tmp_path / "gem.gemc.pyspy.txt"
    path.write_text(RAW)
    assert prof.main([str(path), "--rate", "100"]) == 0
    out = capsys.readouterr().out
    assert "5.0 s sampled (500 samples at 100 Hz)" in out
    lines = {m[1]: m[0] for m in re.finditer(r"^  ([a-z /]+?)\s+\d+\.\d+ s .*$", out, re.M)}
    assert "3.00 s" in lines["inductor"] and "1.00 s" in lines["inductor wait on workers"]
    assert "0.50 s" in lines["triton compile"]
    # the autotuning benchmark's Triton frame is a leaf under Inductor's autotuner: the
    # Triton *compiler* pattern does not claim it, the autotuning one does
    assert "0.40 s" in lines["inductor runtime autotune"] and "0.10 s" in lines["gemc"]
    # inclusive: every sample passes through the runner but the optimizer's
    assert "4.90 s  run (torch/runner.py)" in out


def test_a_missing_or_empty_file_is_one_named_error(tmp_path, capsys) -> None:
    prof = load_benchmark("first_step_profile")
    assert prof.main([str(tmp_path / "none.txt")]) == 2
    (tmp_path / "empty.txt").write_text("nothing here\n")
    assert prof.main([str(tmp_path / "empty.txt")]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "no collapsed stacks" in err


STEP_RAW = """\
<module> (zoo.py:10);_run (gemc/backends/torch/runner.py:300);capture (gemc/capture.py:4) 100
<module> (zoo.py:10);_run (gemc/backends/torch/runner.py:560);make_batch (examples/dlrm/model.py:9) 70
<module> (zoo.py:10);_run (gemc/backends/torch/runner.py:567);_compile (torch/_dynamo/convert_frame.py:3) 30
<module> (zoo.py:10);_run (gemc/backends/torch/runner.py:573);backward (torch/_tensor.py:1);_engine_run_backward (torch/autograd/graph.py:869) 50
BackwardCFunction.apply (torch/autograd/function.py:317);CachingAutotuner.run (torch/_inductor/runtime/triton_heuristics.py:1448);CachingAutotuner.benchmark_all_configs (torch/_inductor/runtime/triton_heuristics.py:1139);InductorBenchmarker.benchmark_gpu (torch/_inductor/runtime/benchmarking.py:417) 20
"""


def test_step_samples_leave_out_setup_batches_and_the_wait_for_the_backward(tmp_path,
                                                                          capsys) -> None:
    """--step: the step loop's samples (not set-up, not the batch's creation, not the main
    thread waiting in the autograd engine) and the engine thread's; a class-qualified
    autotuner frame is autotuning, not the compiled code running, though the frames below
    it are Inductor's runtime."""
    prof = load_benchmark("first_step_profile")
    path = tmp_path / "dlrm.gemc.pyspy.txt"
    path.write_text(STEP_RAW)
    assert prof.main([str(path), "--step", "--top", "0"]) == 0
    out = capsys.readouterr().out
    assert "training steps only" in out and "0.5 s sampled (50 samples" in out
    lines = {m[1]: m[0] for m in re.finditer(r"^  ([a-z /]+?)\s+\d+\.\d+ s .*$", out, re.M)}
    assert "0.30 s" in lines["dynamo"] and "0.20 s" in lines["inductor runtime autotune"]
    assert "compiled graph running" not in lines
