"""The collective model stays within a stated tolerance of published nccl-tests figures
(benchmarks/collectives_vs_published.py holds the rows and their sources)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "collectives_vs_published.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("collectives_vs_published", _PATH)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


BENCH = _bench()


@pytest.mark.parametrize("row", BENCH.compare(), ids=lambda r: f"{r['source']}-{r['op']}-"
                         f"{r['hosts']}x{r['gpus_per_host']}")
def test_within_tolerance_of_published(row: dict) -> None:
    assert abs(row["error_pct"]) <= BENCH.TOLERANCE_PCT, (
        f"{row['op']} {row['hosts']}x{row['gpus_per_host']}: model {row['model_us']:.0f} us "
        f"vs published {row['time_us']:.0f} us ({row['note']})")


def test_every_row_cites_a_source() -> None:
    rows = BENCH.published()
    assert {r.source for r in rows} <= set(BENCH.SOURCES)
    # inside a host, across hosts, all four collectives
    assert {r.op for r in rows} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    assert any(r.hosts == 1 for r in rows) and any(r.hosts >= 8 for r in rows)


def test_one_gpu_per_host_drives_one_nic() -> None:
    """A 2x1 ring runs over one 400G NIC (~46 GB/s bus bandwidth), not the host's eight."""
    from gemc.cost_model.topology import parse_topology

    topo = parse_topology("h100:2x1")
    assert topo.link_bandwidth((0, 1)).network == pytest.approx(50e9, rel=0.01)


def test_main_writes_json(tmp_path: Path) -> None:
    assert BENCH.main(["--out", str(tmp_path)]) == 0
    assert (tmp_path / "collectives_vs_published.json").is_file()
