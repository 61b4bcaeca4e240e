"""Compile time and peak memory of `gemc compile`, whole process, as a user runs it.

    .venv/bin/python benchmarks/compile_time.py [--repeats 5] [--out results.json]

Runs each case as a fresh process (imports included) `--repeats` times and reports the
median wall time and the peak RSS (from the kernel's accounting of the child).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CASES = [
    ("gem tiny", "examples/gem/model.py:build", "tiny", "h200:1x8", True, 20.0),
    ("dlrm tiny", "examples/dlrm/model.py:build", "tiny", "h200:1x8", True, 20.0),
    ("gem gem-xl", "examples/gem/model.py:build", "gem-xl", "h200:512x8", False, 120.0),
    ("dlrm xl", "examples/dlrm/model.py:build", "xl", "h200:512x8", False, 120.0),
]


def run_once(
    entry: str, preset: str, topology: str, dumps: bool, workdir: Path
) -> tuple[float, float]:
    cmd = [
        sys.executable,
        "-m",
        "gemc.cli",
        "compile",
        entry,
        "--set",
        f"preset={preset}",
        "--topology",
        topology,
        "--out",
        str(workdir / "plan.json"),
        "--quiet",
    ]
    if dumps:
        cmd += ["--dump-dir", str(workdir / "dumps")]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
    # The max over this helper's children so far: every child runs the same case.
    return seconds, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", help="run only cases whose name contains this")
    parser.add_argument("--out", help="write results as JSON here")
    args = parser.parse_args()
    rows = []
    # Each case runs in a helper process of its own, so RUSAGE_CHILDREN's peak (a max over
    # all children ever) is that case's alone.
    for name, entry, preset, topo, dumps, target in CASES:
        if args.only and args.only not in name:
            continue
        repeats = args.repeats if dumps else max(1, args.repeats // 2)
        probe = [
            sys.executable,
            __file__,
            "--_case",
            json.dumps([entry, preset, topo, dumps, repeats]),
        ]
        out = subprocess.run(probe, capture_output=True, text=True, cwd=REPO)
        if out.returncode != 0:
            raise SystemExit(out.stderr)
        times, peak_gb = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(
            {
                "case": name,
                "topology": topo,
                "runs": len(times),
                "median_s": statistics.median(times),
                "min_s": min(times),
                "max_s": max(times),
                "peak_rss_gb": peak_gb,
                "target_s": target,
                "ok": statistics.median(times) <= target,
            }
        )
    print(
        f"{'case':<12} {'topology':<11} {'runs':>4} {'median s':>9} {'min s':>7} {'max s':>7} {'peak GB':>8} {'target s':>9}  ok"
    )
    for r in rows:
        print(
            f"{r['case']:<12} {r['topology']:<11} {r['runs']:>4} {r['median_s']:>9.2f} {r['min_s']:>7.2f} "
            f"{r['max_s']:>7.2f} {r['peak_rss_gb']:>8.2f} {r['target_s']:>9.0f}  {'yes' if r['ok'] else 'NO'}"
        )
    meta = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
    }
    try:
        import torch

        meta["torch"] = torch.__version__
    except ImportError:
        pass
    print(json.dumps(meta))
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def _case(spec: str) -> None:
    entry, preset, topo, dumps, repeats = json.loads(spec)
    times, peak = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            seconds, peak = run_once(entry, preset, topo, dumps, Path(tmp))
            times.append(seconds)
    print(json.dumps([times, peak]))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_case":
        _case(sys.argv[2])
    else:
        main()
