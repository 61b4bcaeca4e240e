"""The command line as a user runs it: a run killed mid-save, then resumed.

Two launches of the real entry points, 2 ranks on CPU, on the test model with every table
sharded differently and FSDP regions:

1. ``python -m gemc.run plan`` (no torchrun in the environment: gemc starts it) for 12 steps
   with a checkpoint every 4, killed inside the save of step 8 (after the data is written,
   before it is published): step 4 must stay the last good checkpoint;
2. ``torchrun -m gemc.run plan --resume``: continues from step 4 to 12; steps 5..12 must
   match the single-process reference (which an uninterrupted run matches, see
   test_distributed), and the report must say where it resumed from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from gemc.backends.torch.optimizers import resolve_optimizers
from gemc.backends.torch.reference import reference_losses

from gemc.api import load_model
from gemc.plan import write_plan
from tests.runner.harness import MODEL, REPO, torchrun, variant


def test_killed_in_save_then_resumed(base_plans, tmp_path) -> None:
    r = [0, 1]
    plan = variant(
        base_plans[2],
        {
            "t0.weight": ("row_wise", r),
            "t1.weight": ("column_wise", r),
            "t2.weight": ("table_wise", [1]),
            "t3.weight": ("data_parallel", r),
            "t4.weight": ("grid", r, [2, 1]),
        },
        {"": "ddp", "bottom": "fsdp", "top": "fsdp"},
        optimizer={"embedding": {"kind": "adam", "lr": 0.01}},
    )
    path = tmp_path / "plan.json"
    write_plan(path, plan)
    ck = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update({"OMP_NUM_THREADS": "1", "GEMC_RUN_CRASH_IN_SAVE": "8"})
    common = ["--steps", "12", "--checkpoint-dir", str(ck), "--checkpoint-every", "4"]
    first = subprocess.run(
        [sys.executable, "-m", "gemc.run", str(path), *common, "--device", "cpu", "--quiet"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert first.returncode != 0, first.stderr[-2000:]
    assert "starting 2 processes" in first.stderr
    assert (ck / "step-00000004" / ".metadata").is_file()
    assert (ck / "step-00000008.tmp").is_dir() and not (ck / "step-00000008").exists()
    assert (ck / "latest").read_text().strip() == "step-00000004"

    report = tmp_path / "run.json"
    second = torchrun(2, path, *common, "--resume", "--device", "cpu", "--report", str(report))
    assert second.returncode == 0, second.stderr[-3000:]
    rep = json.loads(report.read_text())
    assert rep["resumed_from"].endswith("step-00000004")
    assert [e["step"] for e in rep["losses"]] == list(range(5, 13))
    assert (ck / "latest").read_text().strip() == "step-00000012"
    assert not (ck / "step-00000008.tmp").exists()
    assert rep["world_size"] == 2 and rep["backend"] == "gloo"
    assert rep["vs_predicted"]["step_ms"]["measured"] > 0
    assert len(rep["per_rank"]) == 2 and rep["per_rank"][1]["memory"]["peak_bytes"] > 0

    dense_cfg, emb_cfg = resolve_optimizers(plan.get("optimizer"))
    ref = reference_losses(
        load_model(MODEL, {}), steps=12, world_size=2, dense_cfg=dense_cfg, emb_cfg=emb_cfg
    )
    got = [e["loss"] for e in rep["losses"]]
    bad = [(s, g, r) for s, g, r in zip(range(5, 13), got, ref[4:]) if abs(g - r) > 1e-4 * abs(r)]
    assert not bad, bad
