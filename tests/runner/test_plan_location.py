"""A plan finds its model from any working directory (issue 22's "gemc run from another
directory than the compile's").

The compile runs in a project folder with a relative entrypoint (``models/m.py:build``) and
writes ``plans/p.json``; ``gemc run`` then starts in another folder, as a subprocess on the
CPU, after the project has moved, with the plan alone elsewhere, and with the model gone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from gemc.plan import load_plan
from tests.runner.harness import REPO

MODEL_SRC = REPO / "tests" / "models" / "authored.py"


def _gemc(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "gemc.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _run(plan: Path, cwd: Path) -> subprocess.CompletedProcess:
    return _gemc("run", str(plan), "--device", "cpu", "--steps", "2", "--no-kernels",
                 "--quiet", cwd=cwd)


def test_gemc_run_finds_the_model_from_anywhere(tmp_path: Path) -> None:
    proj, elsewhere = tmp_path / "proj", tmp_path / "elsewhere"
    (proj / "models").mkdir(parents=True)
    elsewhere.mkdir()
    shutil.copy(MODEL_SRC, proj / "models" / "m.py")
    done = _gemc("compile", "models/m.py:build", "--topology", "h200:1x1",
                 "--out", "plans/p.json", "--quiet", cwd=proj)
    assert done.returncode == 0, done.stderr[-2000:]
    model = load_plan(proj / "plans" / "p.json")["model"]
    assert model["entrypoint"] == "models/m.py:build"  # as typed
    assert model["entrypoint_from_plan"] == "../models/m.py:build"
    assert model["entrypoint_absolute"] == f"{(proj / 'models' / 'm.py').resolve()}:build"

    # 1. from another directory: relative to the plan's folder
    got = _run(proj / "plans" / "p.json", elsewhere)
    assert got.returncode == 0, got.stderr[-2000:]
    report = json.loads((proj / "plans" / "p.run.json").read_text())
    assert report["local_batch"] == 4 and len(report["losses"]) == 2

    # 2. the plan alone, copied away: the absolute path of the compile
    shutil.copy(proj / "plans" / "p.json", elsewhere / "p.json")
    got = _run(elsewhere / "p.json", tmp_path)
    assert got.returncode == 0, got.stderr[-2000:]

    # 3. the project moved (plan and model together): relative to the plan again
    moved = tmp_path / "moved"
    proj.rename(moved)
    got = _run(moved / "plans" / "p.json", elsewhere)
    assert got.returncode == 0, got.stderr[-2000:]

    # 4. a different model there: the fingerprint check still refuses it
    text = (moved / "models" / "m.py").read_text()
    (moved / "models" / "m.py").write_text(text.replace("hidden: int = 16", "hidden: int = 24"))
    got = _run(moved / "plans" / "p.json", elsewhere)
    assert got.returncode == 2, got.stderr[-2000:]
    assert "compiled for a different model" in got.stderr
    assert f"(loaded from {moved / 'plans' / '../models/m.py'}:build)" in got.stderr
    assert "Traceback" not in got.stderr

    # 5. nowhere to be found: one message naming every place tried
    got = _run(elsewhere / "p.json", tmp_path)
    assert got.returncode == 2, got.stderr[-2000:]
    assert "model file is not found: models/m.py" in got.stderr
    assert "relative to the plan's folder" in got.stderr
    assert "where it was compiled" in got.stderr
    assert "Traceback" not in got.stderr
