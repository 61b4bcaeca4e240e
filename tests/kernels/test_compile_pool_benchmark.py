"""benchmarks/compile_pool.py: a plan's generated kernels compile for Hopper on a machine
without a GPU (Triton's bundled ptxas), serially and in both pools, and the timings are
written (the figures themselves are only meaningful on an idle many-core machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gemc.plan import write_plan

REPO = Path(__file__).resolve().parents[2]


def test_a_generated_kernel_compiles_for_sm90_serially_and_in_pools(tmp_path: Path) -> None:
    from gemc.api import compile as gemc_compile

    plan = gemc_compile(str(REPO / "tests" / "models" / "toy.py") + ":build", {},
                        topology="h200:1x1")
    assert any(k.get("code") for k in plan["kernels"])
    write_plan(tmp_path / "plan.json", plan)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "compile_pool.py"), "--plan",
         str(tmp_path / "plan.json"), "--limit", "1", "--workers", "1", "--out",
         str(tmp_path / "pool.json")], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads((tmp_path / "pool.json").read_text())
    assert res["kernels"] == 1 and res["workers"] == 1
    assert all(res[f"{m}_s"] > 0 for m in ("serial", "processes", "threads"))
    assert "serial:" in done.stdout
