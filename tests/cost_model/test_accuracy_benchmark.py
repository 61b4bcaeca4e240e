"""The accuracy benchmark runs end to end in its prediction-only smoke mode."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "cost_model_accuracy.py"


def test_smoke_prediction_only(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("cost_model_accuracy", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "acc.json"
    rc = module.main(["--smoke", "--no-measure", "--models", "dlrm", "--dtypes", "fp32,bf16",
                      "--batch-sizes", "16", "--calibration", "none", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["summary"]["configs"] == 2 and not report["summary"]["failed"]
    row = report["configs"][0]
    assert row["predicted"]["step_ms"] > 0
    assert row["predicted"]["memory_gb"]["peak"] > 0
