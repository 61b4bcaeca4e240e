"""The accuracy benchmark runs end to end in its prediction-only smoke mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_module import load_benchmark


def test_smoke_prediction_only(tmp_path: Path) -> None:
    module = load_benchmark("cost_model_accuracy")
    out = tmp_path / "acc.json"
    rc = module.main(["--smoke", "--no-measure", "--models", "dlrm", "--dtypes", "fp32,bf16",
                      "--batch-sizes", "16", "--calibration", "none", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["summary"]["configs"] == 2 and not report["summary"]["failed"]
    row = report["configs"][0]
    assert row["predicted"]["step_ms"] > 0
    assert row["predicted"]["memory_gb"]["peak"] > 0
    # the breakdown by category and phase covers every predicted kernel millisecond
    cats = row["predicted"]["by_category_ms"]
    assert sum(sum(p.values()) for p in cats.values()) == \
        pytest.approx(row["predicted"]["gpu_busy_ms"], rel=1e-9)
    assert cats["optimizer"]["opt"] > 0 and cats["embedding_bwd"]["bwd"] > 0
