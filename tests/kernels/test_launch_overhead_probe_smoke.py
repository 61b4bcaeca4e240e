"""``benchmarks/launch_overhead_probe.py --smoke`` runs on the CPU (interpreted): the host
timings of HSTU's attention call and of each of its steps come back, the step timers are
taken off again, and ``--transact`` / ``--sweep`` run TransAct's region attention. The
per-launch rows and the sweep's kernel times need a GPU (no Triton launch is a
``JITFunction.run`` under the interpreter); this keeps the script from rotting between
device calls."""

from __future__ import annotations

import importlib

from tests.benchmark_module import load_benchmark


def test_smoke_times_the_call_and_each_step_and_puts_the_steps_back() -> None:
    probe = load_benchmark("launch_overhead_probe")
    ja = importlib.import_module("gemc.backends.triton.jagged_attention")
    before = (ja._attention_backward, ja.JaggedAttentionFunction.__dict__["forward"])
    result = probe.main(["--smoke"])
    assert result["whole_fwd_bwd_us"] > 0 and result["forward_no_grad_us"] > 0
    steps = result["steps_us"]
    assert set(steps) == {f"{m.rsplit('.', 1)[-1]}.{a}" for m, a in probe.STEPS} | {"whole call"}
    # the call ran through the timed steps: its backward and the autograd call took time
    assert steps["jagged_attention._attention_backward"] > 0
    assert steps["autograd.grad"] >= steps["jagged_attention.JaggedAttentionFunction.backward"]
    assert (ja._attention_backward, ja.JaggedAttentionFunction.__dict__["forward"]) == before


def test_transact_and_sweep_modes_run_the_region_attention() -> None:
    probe = load_benchmark("launch_overhead_probe")
    result = probe.main(["--smoke", "--transact", "1"])
    assert result["fwd_bwd_ms"] > 0 and "jagged_attention._fwd_kernel" in result["configs"]
    ja = importlib.import_module("gemc.backends.triton.jagged_attention")
    configs = list(ja._fwd_kernel.configs)
    rows = probe.main(["--smoke", "--sweep"])["sweep"]
    # each kernel ran at the sweep's first two configs (smoke), none failed, and each
    # kernel's own configs are back
    assert [(r["kernel"], tuple(r["config"])) for r in rows] == [
        (k, c) for k in ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel")
        for c in probe.SWEEP[:2]]
    assert not any("error" in r for r in rows)
    assert list(ja._fwd_kernel.configs) == configs
