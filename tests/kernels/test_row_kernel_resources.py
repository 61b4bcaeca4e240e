"""``benchmarks/row_kernel_resources.py``: the row kernel's pick compiled for sm_90 offline
reports its registers, stack and shared memory from the cubin and its MMAs from the TTGIR,
named by the config the tuner took."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_pick_compiles_for_hopper_and_reports_its_resources(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "row_kernel_resources", REPO / "benchmarks" / "row_kernel_resources.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "res.json"
    rows = bench.main(["--configs", "pick", "--out", str(out)])
    assert json.loads(out.read_text()) == rows and len(rows) == 1
    row = rows[0]
    # the pick (key-major 64-row tiles, 4 warps) compiles to Hopper's warpgroup MMAs, five
    # on each of its two code paths (a row of one tile pair, the loop), within the 255
    # registers a thread sm_90 allows, in the shared memory an SM has
    assert row["config"].startswith("BLOCK=64, KEY_MAJOR=1, num_warps=4"), row
    assert 0 < row["registers"] <= 255 and row["stack_bytes"] >= 0, row
    assert 0 < row["shared_bytes"] <= 232448, row
    assert row["hopper_mma"] == 10 and row["ampere_mma"] == 0, row
