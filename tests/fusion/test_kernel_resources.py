"""benchmarks/kernel_resources.py: generated kernels compiled for sm_90 offline, with
ptxas's register counts. Guards the register budget of the looping backward passes (a
4096-element tile needed 220 registers a thread, 8 warps per SM; see the tool's doc)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_backward_passes_fit_the_register_budget(tmp_path: Path) -> None:
    out = tmp_path / "res.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # a fresh process: kernels for the GPU
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "kernel_resources.py"), "--cases",
         "pointwise,norm,reduction", "--first", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["case"].split()[0], r["kernel"]) for r in rows} >= {
        ("silu(a*b+c)*d", "bwd"), ("residual+layernorm+mask", "bwd"), ("masked", "bwd")}
    for r in rows:
        assert 0 < r["registers"] <= 255 and r["spill_store_bytes"] == 0, r
        if r["kernel"] == "bwd" and r["num_warps"] >= 4:
            assert r["registers"] <= 96, r  # >= 20 warps per SM
