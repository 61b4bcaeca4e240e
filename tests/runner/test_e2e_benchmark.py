"""benchmarks/e2e.py on the CPU (tiny preset, Triton interpreted): the three variants run,
train the same model to the same losses, and the per-kernel profile is written."""

from __future__ import annotations

import json
from pathlib import Path

from tests.benchmark_module import load_benchmark


def _module():
    return load_benchmark("e2e")


def test_interpreter_only_for_cpu_runs() -> None:
    e2e = _module()
    assert e2e.interpreted_triton("cpu", True)
    assert e2e.interpreted_triton(None, False)
    assert not e2e.interpreted_triton(None, True)  # a GPU machine, device not given
    assert not e2e.interpreted_triton("cuda", True)


def test_smoke_runs_all_variants_with_matching_losses(tmp_path: Path) -> None:
    e2e = _module()
    out = tmp_path / "e2e.json"
    assert e2e.main(["--smoke", "--steps", "2", "--profile", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["variants"]}
    assert set(rows) == {"eager", "compile", "gemc"}
    for name, row in rows.items():
        assert len(row["losses"]) == 2 and row["step_ms"] > 0, name
        assert row["max_rel_loss_diff_vs_eager"] < 2e-2, name  # bf16 autocast everywhere
        profile = Path(f"{out}.{name}.kernels.txt").read_text()
        assert profile.startswith("device time per step:") and "ms/step" in profile
    assert "kernels applied" in rows["gemc"]["note"]
