"""The collective model against published nccl-tests measurements. One command, CPU only.

    python benchmarks/collectives_vs_published.py [--out DIR]

Every row is one published figure -- a collective, a placement (hosts x GPUs per host),
a message size and the time or bandwidth someone measured -- next to what
``gemc.cost_model.collectives.collective_time`` predicts for the same placement on gemc's
own topology (``parse_topology("h100:HxG")``: NVSwitch inside a host, one 400 Gb/s NIC per
GPU on a rail-optimised fabric). Figures are compared as *time* at the stated size, or
as nccl-tests bus bandwidth (``busbw = size / time * F(n)``, F = 2(n-1)/n for
all-reduce, (n-1)/n otherwise, nccl-tests doc/PERFORMANCE.md) where the source states a
bus bandwidth. ``tests/cost_model/test_collectives_published.py`` holds the model within
``TOLERANCE_PCT`` of every row, so a change that moves the model away from the hardware
fails.

Sources (full URLs in ``SOURCES``):
- AP: AutoParallel's fitted H100 NVSwitch + 400G RoCE tables (``(latency_us, bandwidth
  GB/s)`` per (nodes, GPUs per node), fitted from nccl-tests by its
  ``benchmarks/nccl_cost_model/tools/fit_profile.py``; the time of ``n`` bytes is
  ``latency + n / bandwidth`` in its ``_table_algo_time``): the large-message rows here
  are that formula at 1 GiB.
- NV290: NVIDIA's answer in nccl-tests issue #290 (H100, NDR 400 Gb/s): "46-48 GB/s per
  NIC" for a ring across hosts.
- PERF: nccl-tests doc/PERFORMANCE.md (the bus-bandwidth definition the model uses).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

GIB = 1 << 30
# The model must stay within this of every published row (percent of the published time).
TOLERANCE_PCT = 25.0

SOURCES = {
    "AP": "https://github.com/meta-pytorch/autoparallel/blob/"
          "331b7d9e7dd42abec4e47bb7826f1518e8ba9c05/autoparallel/cost_models/"
          "h100_nvswitch_roce_400g.py",
    "NV290": "https://github.com/NVIDIA/nccl-tests/issues/290",
    "PERF": "https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md",
}


@dataclass(frozen=True)
class Published:
    """One published figure: ``time_us`` at ``nbytes`` (nccl-tests' "size")."""

    source: str
    op: str
    hosts: int
    gpus_per_host: int
    nbytes: int
    time_us: float
    note: str


def _ap(op: str, hosts: int, gpus: int, latency_us: float, gbps: float,
        nbytes: int = GIB) -> Published:
    """An AutoParallel table entry evaluated as its own formula does."""
    return Published("AP", op, hosts, gpus, nbytes, latency_us + nbytes / (1e3 * gbps),
                     f"AP table ({hosts}, {gpus}) = ({latency_us} us, {gbps} GB/s)")


def _busbw(source: str, op: str, hosts: int, gpus: int, busbw_gbps: float, note: str,
           nbytes: int = GIB) -> Published:
    """A published bus bandwidth turned into the time of ``nbytes``."""
    from gemc.cost_model.collectives import bus_factor

    n = hosts * gpus
    return Published(source, op, hosts, gpus, nbytes,
                     nbytes * bus_factor(op, n) / (busbw_gbps * 1e3), note)


def published() -> list[Published]:
    """The rows, each traceable to SOURCES (values copied from the cited file/thread)."""
    return [
        # inside one 8-GPU NVSwitch host
        _ap("all_reduce", 1, 8, 160.463996, 211.734617),
        _ap("all_gather", 1, 8, 162.703998, 386.14917),
        _ap("reduce_scatter", 1, 8, 168.112002, 392.045997),
        _ap("all_to_all", 1, 8, 40.56, 374.401576),
        # across hosts, all 8 GPUs of each
        _ap("all_reduce", 2, 8, 180.816002, 193.078468),
        _ap("all_gather", 2, 8, 209.648006, 322.575188),
        _ap("reduce_scatter", 2, 8, 218.512006, 377.026681),
        _ap("all_to_all", 2, 8, 107.584, 82.508803),
        _ap("all_reduce", 8, 8, 192.351997, 171.39765),
        _ap("all_gather", 8, 8, 361.696005, 304.997313),
        _ap("reduce_scatter", 8, 8, 344.976008, 358.533501),
        _ap("all_to_all", 8, 8, 173.759997, 46.789495),
        _ap("all_to_all", 32, 8, 636.143982, 43.056701),
        # one GPU per host: a ring over one NDR NIC each
        _busbw("NV290", "all_reduce", 2, 1, 47.0,
               "NVIDIA: 'For NDR @ 400Gbps you should see 46-48GB/s per NIC' (midpoint)"),
        _ap("all_reduce", 2, 1, 176.128, 41.93219),
        _ap("reduce_scatter", 2, 1, 177.248001, 80.256864),
        _ap("all_to_all", 8, 1, 64.735997, 45.992665),
    ]


def model_time_us(row: Published) -> float:
    from gemc.cost_model.collectives import collective_time
    from gemc.cost_model.topology import parse_topology

    topo = parse_topology(f"h100:{row.hosts}x{row.gpus_per_host}")
    return 1e6 * collective_time(row.op, float(row.nbytes), range(topo.world_size), topo)


def compare() -> list[dict[str, object]]:
    out = []
    for row in published():
        model = model_time_us(row)
        out.append({**asdict(row), "model_us": model,
                    "model_algbw_gbps": row.nbytes / model / 1e3,
                    "published_algbw_gbps": row.nbytes / row.time_us / 1e3,
                    "error_pct": 100.0 * (model - row.time_us) / row.time_us})
    return out


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="directory for collectives_vs_published.json")
    args = p.parse_args(argv)
    rows = compare()
    print(f"{'src':<6}{'op':<16}{'HxG':>6}{'size':>8}{'published us':>14}{'model us':>11}"
          f"{'pub algbw':>11}{'model algbw':>13}{'error':>9}")
    for r in rows:
        print(f"{r['source']:<6}{r['op']:<16}{r['hosts']}x{r['gpus_per_host']:<4}"
              f"{r['nbytes'] / GIB:>6.2f}G{r['time_us']:>14.1f}{r['model_us']:>11.1f}"
              f"{r['published_algbw_gbps']:>11.1f}{r['model_algbw_gbps']:>13.1f}"
              f"{r['error_pct']:>+8.1f}%")
    errs = [abs(float(r["error_pct"])) for r in rows]
    summary = {"rows": len(rows), "mean_abs_error_pct": sum(errs) / len(errs),
               "max_abs_error_pct": max(errs), "tolerance_pct": TOLERANCE_PCT}
    print(json.dumps(summary))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"benchmark": "collectives_vs_published", "date": datetime.now(UTC).isoformat(),
               "commit": _commit(), "sources": SOURCES, "summary": summary, "rows": rows}
        (out / "collectives_vs_published.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {out / 'collectives_vs_published.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
