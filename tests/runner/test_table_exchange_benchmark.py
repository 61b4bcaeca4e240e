"""benchmarks/table_exchange.py on 2 CPU processes (gloo): the batched and the per-table
lookups agree (the benchmark checks outputs and gradients itself and fails otherwise), and
the batched one issues a fixed number of collectives however many tables there are."""

from __future__ import annotations

import json
from pathlib import Path

from tests.benchmark_module import load_benchmark


def test_smoke_batched_exchange_is_four_collectives_for_any_table_count(tmp_path: Path) -> None:
    bench = load_benchmark("table_exchange")
    out = tmp_path / "exchange.json"
    rows = bench.main(["--smoke", "--out", str(out)])
    assert [r["tables"] for r in rows] == [2, 6]
    for r in rows:
        assert r["per_table_all_to_all"] == 4 * r["tables"]
        assert r["batched_all_to_all"] == 4
    assert json.loads(out.read_text())["rows"] == rows
