"""benchmarks/table_exchange.py on 2 CPU processes (gloo): the batched and the per-table
lookups agree (the benchmark checks outputs and gradients itself and fails otherwise), and
the batched one issues a fixed number of collectives however many tables there are, and
bf16 / fp8 wires send the bytes and keep the SQNR they are priced and chosen by."""

from __future__ import annotations

import json
from pathlib import Path

from tests.benchmark_module import load_benchmark


def test_smoke_batched_exchange_is_four_collectives_for_any_table_count(tmp_path: Path) -> None:
    bench = load_benchmark("table_exchange")
    out = tmp_path / "exchange.json"
    rows = bench.main(["--smoke", "--out", str(out), "--exchange-precision", "fp32,bf16,fp8"])
    assert [r["tables"] for r in rows] == [2, 6]
    for r in rows:
        assert r["per_table_all_to_all"] == 4 * r["tables"]
        assert r["batched_all_to_all"] == 4
        # the pooled exchanges' bytes: bf16 half of fp32's both ways; fp8 forward 1 byte
        # an element + a 4-byte scale a row (dim 64), bf16 back
        wire = r["exchange"]
        fp32 = wire["fp32"]["pooled_bytes"]
        assert fp32 > 0 and wire["fp32"]["sqnr_db"] is None  # exact
        assert wire["bf16"]["pooled_bytes"] == fp32 / 2
        assert wire["bf16"]["pooled_bytes"] > wire["fp8"]["pooled_bytes"] > fp32 * 3 / 8
        assert wire["bf16"]["sqnr_db"] > 40 and 25 < wire["fp8"]["sqnr_db"] < wire["bf16"]["sqnr_db"]
    assert json.loads(out.read_text())["rows"] == rows


def test_smoke_host_reduce_halves_the_bytes_that_cross_hosts(tmp_path: Path) -> None:
    """4 ranks as 2 hosts x 2 (``--gpus-per-host 2``): row-wise tables sum their partials
    inside each host, so rank 0 exchanges one pooled block per table and direction with
    the other host instead of two; the direct path (checked equal by the benchmark) does
    not, and the reduce costs one more all-to-all and its backward."""
    bench = load_benchmark("table_exchange")
    rows = bench.main(["--smoke", "--world", "4", "--gpus-per-host", "2",
                       "--out", str(tmp_path / "reduce.json")])
    assert [r["tables"] for r in rows] == [2, 6]
    for row in rows:
        on, off = row["host_reduce"]["on"], row["host_reduce"]["off"]
        assert off["cross_host_bytes"] > 0
        assert on["cross_host_bytes"] * 2 == off["cross_host_bytes"]
        assert on["all_to_all"] == off["all_to_all"] + 2 == 6
