"""The warm-up of gemc's own kernels ahead of the first step (gemc.backends.triton.warm):
the launches it derives from the compiled graph's gemc ops, the region guard and the sparse
optimizer are the launches the first step makes; a failure warns and training goes on; a
worker compiles a launch into Triton's cache for the H200's target without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from gemc.backends.triton import warm as W

REPO = Path(__file__).resolve().parents[2]


def test_signature_specialises_ints_and_pointers_as_triton_does() -> None:
    launch = W.Launch("gemc.m", "k", (W.Arg(torch.bfloat16, True), W.Arg(torch.float32, False),
                                      1, 16, 17, 2**31, 0.5, None), (("B", 64),))
    _, args, kw = W.signature(launch)
    assert args[0] == ("ptr", "torch.bfloat16", True) and args[1][2] is False
    assert [a[2] for a in args[2:5]] == ["one", "d16", ""]
    assert args[5][1] == "i64" and args[6] == "fp32" and args[7] is None
    assert kw == (("B", ("int", "i32", "d16")),)
    assert W.signature(launch, skip=("B",))[2] == ()
    # the two specialisations of a size the graph does not fix
    for v in (48, 50):
        got = {W._specialise(x)[2] for x in W.int_variants(v)}
        assert got == {"d16", ""}
    assert W.int_variants(1) == [1]
    # an unaligned view's descriptor says so
    base = torch.empty(64, dtype=torch.bfloat16, device="meta")
    assert W.Arg.of(base[8:]).aligned and not W.Arg.of(base[1:]).aligned


def _entry(model: str) -> str:
    return {"mmoe": "examples/zoo/mmoe.py:build", "dlrm": "examples/dlrm/model.py:build"}[model]


@pytest.mark.parametrize("model", ["mmoe", "dlrm"])
def test_derived_launches_are_the_first_steps_launches(model: str, monkeypatch) -> None:
    """Every gemc kernel launch of the first step (recorded at the launch) has a derived
    warm-up launch of the same kernel, constexprs, dtypes, alignments and integer
    specialisations, and nothing derived is never launched."""
    from gemc.backends.torch import runner

    from gemc.api import compile as gemc_compile

    plan = gemc_compile(str(REPO / _entry(model)), {"preset": "tiny", "seed": 0},
                        topology="h200:1x1", planner="default")
    made: list[W.WarmUp] = []
    real_warm = runner.warm_kernels
    monkeypatch.setattr(runner, "warm_kernels", lambda d: made.append(real_warm(d)) or made[-1])
    monkeypatch.chdir(REPO)
    with W.record_launches() as launched:
        res = runner.run(plan, runner.RunOptions(steps=1, device="cpu", cache_dir="none",
                                                 progress=False))
    (warm,) = made
    derived = {W.signature(x, W.config_keys(x)) for x in warm.launches.values()}
    real = {W.signature(x, W.config_keys(x)) for x in launched}
    assert real, "the first step launched none of gemc's kernels"
    assert real - derived == set(), "launches the warm-up did not derive"
    assert derived - real == set(), "derived launches the step never made"
    report = res.report["first_step"]["kernel_warmup"]
    assert report["workers"] == 0 and not report["failures"]
    assert sum(r["variants"] for r in report["kernels"].values()) == len(derived)


def test_a_failing_derivation_or_compile_warns_and_names_the_kernel() -> None:
    warm = W.WarmUp(workers=0)

    def broken() -> None:
        raise RuntimeError("no shape")

    with pytest.warns(UserWarning, match="deriving the launches of gemc::x .*no shape"):
        assert warm.derive("gemc::x", broken) == []
    res = W.compile_launch(W.Launch("gemc.backends.triton.warm", "nothing_here", (), ()))
    assert res["error"] and res["kernel"] == "warm.nothing_here"

    class Done:
        def result(self) -> dict:
            return res

    with pytest.warns(UserWarning, match="compiling warm.nothing_here failed in the worker"):
        warm._done(Done())  # type: ignore[arg-type]
    assert len(warm.report()["failures"]) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        W.WarmUp(workers=0).start().close()  # no pool: nothing to start or stop


_HOPPER = textwrap.dedent("""
    import os, sys, torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime.driver import driver

    class Hopper(DriverBase):  # what a launch asks the driver, answered for an H200
        @classmethod
        def is_active(cls): return True
        def map_python_to_cpp_type(self, ty): return ty
        def get_current_target(self): return GPUTarget("cuda", 90, 32)
        def get_active_torch_device(self): return torch.device("cpu")
        def get_benchmarker(self): raise NotImplementedError
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0

    driver.set_active(Hopper())
    from gemc.backends.triton import warm as W
    from gemc.backends.triton.key_padding_attention import ADDITIVE_MASKED_GAP
    mask = torch.empty((8, 64), dtype=torch.uint8, device="meta")
    out = torch.empty(8, dtype=torch.int32, device="meta")
    launch = W.Launch("gemc.backends.triton.key_padding_attention", "_prefix_kernel",
                      (W.Arg.of(mask), 64, 1, 64, W.Arg.of(out), W.Arg.of(out)),
                      (("ADDITIVE", False), ("BLOCK_L", 64), ("GAP", ADDITIVE_MASKED_GAP)))
    res = W.compile_launch(launch)
    print(res)
    sys.exit(1 if res["error"] else 0)
""")


def test_a_worker_compiles_a_launch_into_tritons_cache_for_hopper(tmp_path: Path) -> None:
    """Triton compiles for GPUTarget("cuda", 90, 32) without a GPU (ptxas ships with the
    wheel): the warm-up's compile path writes the cache entry a launch would read."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _HOPPER], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = [p.name for p in tmp_path.rglob("*") if p.is_file()]
    assert any(f.endswith(".cubin") for f in files), files
    assert any(f == "_prefix_kernel.json" for f in files), files
