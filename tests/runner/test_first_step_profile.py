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


def _step_raw(loop: range) -> str:
    """Samples at the runner's set-up (before its step loop) and inside the loop: a batch's
    creation, a compile, the wait on the backward; and the autograd engine's thread."""
    a, b, c = loop.start + 2, loop.start + 5, loop.start + 10
    runner = "gemc/backends/torch/runner.py"
    return f"""\
<module> (zoo.py:10);_run ({runner}:{loop.start - 50});capture (gemc/capture.py:4) 100
<module> (zoo.py:10);_run ({runner}:{a});make_batch (examples/dlrm/model.py:9) 70
<module> (zoo.py:10);_run ({runner}:{b});_compile (torch/_dynamo/convert_frame.py:3) 30
<module> (zoo.py:10);_run ({runner}:{c});backward (torch/_tensor.py:1);_engine_run_backward (torch/autograd/graph.py:869) 50
BackwardCFunction.apply (torch/autograd/function.py:317);CachingAutotuner.run (torch/_inductor/runtime/triton_heuristics.py:1448);CachingAutotuner.benchmark_all_configs (torch/_inductor/runtime/triton_heuristics.py:1139);InductorBenchmarker.benchmark_gpu (torch/_inductor/runtime/benchmarking.py:417) 20
<module> (zoo.py:10);_run ({runner}:{loop.stop + 5});close (gemc/backends/torch/runner.py:9) 40
"""


def test_step_samples_leave_out_setup_batches_and_the_wait_for_the_backward(tmp_path,
                                                                          capsys) -> None:
    """--step: the step loop's samples (not set-up, not the batch's creation, not the main
    thread waiting in the autograd engine) and the engine thread's; a class-qualified
    autotuner frame is autotuning, not the compiled code running, though the frames below
    it are Inductor's runtime."""
    prof = load_benchmark("first_step_profile")
    path = tmp_path / "dlrm.gemc.pyspy.txt"
    loop = prof.step_loop_lines()
    assert 20 < len(loop) < 200 and "for step in" in prof.RUNNER.read_text().splitlines()[
        loop.start - 1]
    path.write_text(_step_raw(loop))
    assert prof.main([str(path), "--step", "--top", "0"]) == 0
    out = capsys.readouterr().out
    assert "training steps only" in out and "0.5 s sampled (50 samples" in out
    lines = {m[1]: m[0] for m in re.finditer(r"^  ([a-z /]+?)\s+\d+\.\d+ s .*$", out, re.M)}
    assert "0.30 s" in lines["dynamo"] and "0.20 s" in lines["inductor runtime autotune"]
    assert "compiled graph running" not in lines


MODULE = "c" + "a" * 51
SITES_RAW = f"""\
BackwardCFunction.apply (torch/autograd/function.py:317);Runner.call (/tmp/x/{MODULE}.py:3);CachingAutotuner.run (torch/_inductor/runtime/triton_heuristics.py:1448);CachingAutotuner.benchmark_all_configs (torch/_inductor/runtime/triton_heuristics.py:1139);InductorBenchmarker.benchmark_gpu (torch/_inductor/runtime/benchmarking.py:417) 20
BackwardCFunction.apply (torch/autograd/function.py:317);Runner.call (/tmp/x/{MODULE}.py:4);CachingAutotuner.run (torch/_inductor/runtime/triton_heuristics.py:1448);CachingAutotuner.benchmark_all_configs (torch/_inductor/runtime/triton_heuristics.py:1139) 5
BackwardCFunction.apply (torch/autograd/function.py:317);Runner.call (/tmp/x/{MODULE}.py:3);CachingAutotuner.run (torch/_inductor/runtime/triton_heuristics.py:1448);CachingAutotuner.benchmark_all_configs (torch/_inductor/runtime/triton_heuristics.py:1139) 10
<module> (zoo.py:10);run (gemc/backends/torch/runner.py:5) 50
"""


def test_autotuning_samples_are_named_by_the_kernel_their_launch_line_runs(tmp_path,
                                                                          capsys) -> None:
    """--code: the generated module's line above each runtime-autotuning sample names the
    kernel tuned there (from zoo.py --keep-output-code's copy); without the module the
    site is the line itself."""
    prof = load_benchmark("first_step_profile")
    raw = tmp_path / "mmoe.gemc.pyspy.txt"
    raw.write_text(SITES_RAW)
    stacks = prof.parse(raw)
    bare = prof.autotuned_sites(stacks)
    assert bare == {f"{MODULE[:10]}..py:3": 30, f"{MODULE[:10]}..py:4": 5}
    code = tmp_path / "code"
    code.mkdir()
    (code / f"{MODULE}.py").write_text(
        "class Runner:\n    def call(self, args):\n"
        "        triton_red_fused_sum_7.run(buf0, buf1, 64, stream=stream0)\n"
        "        extern_kernels.mm(buf1, buf2, out=buf3)\n")
    named = prof.autotuned_sites(stacks, code)
    assert named[f"triton_red_fused_sum_7 ({MODULE[:10]}..py:3)"] == 30
    assert named[f"{MODULE[:10]}..py:4"] == 5  # not a kernel's .run line: the line stays
    assert prof.main([str(raw), "--code", str(code)]) == 0
    out = capsys.readouterr().out
    assert "2 launch site(s)" in out and "0.30 s  triton_red_fused_sum_7" in out


def test_zoo_keeps_only_the_generated_output_modules(tmp_path) -> None:
    zoo = load_benchmark("zoo")
    cache = tmp_path / "cache"
    (cache / "ab").mkdir(parents=True)
    (cache / "ab" / f"{MODULE}.py").write_text("class Runner:\n    def call(self, args): ...\n")
    (cache / "ab" / ("c" + "b" * 51 + ".py")).write_text("@triton.jit\ndef triton_poi_0(): ...\n")
    assert zoo.keep_output_code(cache, tmp_path / "kept") == 1
    assert [f.name for f in (tmp_path / "kept").iterdir()] == [f"{MODULE}.py"]
