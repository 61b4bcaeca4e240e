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


def test_sparse_rows_smoke_checks_the_sum_and_states_both_prices(tmp_path: Path) -> None:
    """``--sparse-rows``: the runner's row sum checked against ``index_add_`` (exact on the
    CPU), timed, and beside it the cost model's charge for the hottest row's duplicates
    at the coalesce rate and at the measured atomic chain's (53x apart)."""
    module = load_benchmark("scatter_add_contention")
    out = tmp_path / "rows.json"
    assert module.main(["--smoke", "--no-grid", "--sparse-rows", "--iters", "1",
                        "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["case"], r["rows"]) for r in results] == [("sparse_rows", 3), ("sparse_rows", 4)]
    for r in results:
        assert r["ms"] > 0 and r["max_rel_err_vs_index_add"] < 1e-6
        assert r["hottest_row_ids"] == pytest.approx(4096 / r["rows"])
        assert r["priced_ms"] > 50 * r["atomic_chain_ms"]
