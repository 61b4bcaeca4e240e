"""The command line as a user runs it: a run killed mid-save, then resumed.

Two launches of the real entry points, 2 ranks on CPU, on the test model with every table
sharded differently and FSDP regions:

1. ``python -m gemc.run plan`` (no torchrun in the environment: gemc starts it) for 6 steps
   with a checkpoint every 2, killed inside the save of step 4 (after the data is written,
   before it is published): step 2 must stay the last good checkpoint;
2. ``torchrun -m gemc.run plan --resume``: continues from step 2 to 6; steps 3..6 must
   match the single-process reference (which an uninterrupted run matches, see
   test_distributed), and the report must say where it resumed from.

(12 steps, a checkpoint every 4 and the kill at step 8 before: twice the steps, each run
interpreted on two processes, for the same sequence of saves, kill and resume.)
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
    env.update({"OMP_NUM_THREADS": "1", "GEMC_RUN_CRASH_IN_SAVE": "4"})
    common = ["--steps", "6", "--checkpoint-dir", str(ck), "--checkpoint-every", "2"]
    first = subprocess.run(
        [sys.executable, "-m", "gemc.run", str(path), *common, "--device", "cpu", "--quiet"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert first.returncode != 0, first.stderr[-2000:]
    assert "starting 2 processes" in first.stderr
    assert (ck / "step-00000002" / ".metadata").is_file()
    assert (ck / "step-00000004.tmp").is_dir() and not (ck / "step-00000004").exists()
    assert (ck / "latest").read_text().strip() == "step-00000002"

    report = tmp_path / "run.json"
    second = torchrun(2, path, *common, "--resume", "--device", "cpu", "--report", str(report))
    assert second.returncode == 0, second.stderr[-3000:]
    rep = json.loads(report.read_text())
    assert rep["resumed_from"].endswith("step-00000002")
    assert [e["step"] for e in rep["losses"]] == list(range(3, 7))
    assert (ck / "latest").read_text().strip() == "step-00000006"
    assert not (ck / "step-00000004.tmp").exists()
    assert rep["world_size"] == 2 and rep["backend"] == "gloo"
    assert rep["vs_predicted"]["step_ms"]["measured"] > 0
    assert len(rep["per_rank"]) == 2 and rep["per_rank"][1]["memory"]["peak_bytes"] > 0

    dense_cfg, emb_cfg = resolve_optimizers(plan.get("optimizer"))
    ref = reference_losses(
        load_model(MODEL, {}), steps=6, world_size=2, dense_cfg=dense_cfg, emb_cfg=emb_cfg
    )
    got = [e["loss"] for e in rep["losses"]]
    bad = [(s, g, r) for s, g, r in zip(range(3, 7), got, ref[2:]) if abs(g - r) > 1e-4 * abs(r)]
    assert not bad, bad
