"""benchmarks/scatter_add_contention.py: its CPU smoke run writes the grid it measured
(eager and gemc::gather_rows, the uniform grid and HSTU's two gathers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_module import load_benchmark


def test_smoke_writes_every_cell(tmp_path: Path) -> None:
    module = load_benchmark("scatter_add_contention")
    out = tmp_path / "c.json"
    assert module.main(["--smoke", "--hstu", "--iters", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    cells = {(r["case"], r["rows"], r["variant"]) for r in doc["results"]}
    assert cells == {(case, rows, variant) for variant in ("eager", "gemc")
                     for case, rows in (("uniform", 4), ("uniform", 64), ("hstu_pos", 127),
                                        ("hstu_ts", 129))}
    for r in doc["results"]:
        assert r["ms"] > 0 and r["x_stream"] == pytest.approx(r["ms"] / r["stream_ms"])


def test_stream_rule_counts_ids_rows_and_gradient() -> None:
    module = load_benchmark("scatter_add_contention")
    # 1 id into 1 row of width 1: ids 8 + 2x4 fwd, 8 + 4 + 2x4 bwd = 36 bytes
    assert module.stream_ms(1, 1, 1, 36e3) == pytest.approx(1.0)
