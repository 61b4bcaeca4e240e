"""Fit the batched lookup kernel's price to its measured steps (issue 19).

The data: ``benchmarks/kernels.py --cases narrow_split`` runs (one table of ``rows`` x width,
``bags`` x 100 ids, forward + fused backward + row-wise Adagrad; one pass, and a column
shard's two phases) at several widths, rows and bags, as ``benchmarks/lookup_price_sweep.sh``
and ``benchmarks/h200_session20.sh 1`` record them. The model
(``gemc.cost_model.op_cost.batched_embedding_time``):

    one pass   = (bytes + BATCHED_ID_BYTES * ids) / (HBM * BATCHED_LOOKUP_EFFICIENCY)
    two phases = one pass + BATCHED_SPLIT_ID_BYTES * ids / (HBM * BATCHED_LOOKUP_EFFICIENCY)

with ``bytes`` = ``op_cost.batched_embedding_bytes``. This prints the least-squares fit
(relative errors) of the three constants, then every point measured against the model as it
is in the code and against the fit, so a change of the constants is checked here. Points
under ``--min-ids`` ids are left out of the fit: there the rank's kernel floor
(``kernels.SHARD_STEP_FLOOR_S``, priced per rank, not per table) is the step.

    python benchmarks/fit_lookup_price.py benchmarks/results/lookup_price_s21/*.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from gemc.cost_model import op_cost
from gemc.cost_model.hardware import gpu_from_device_name

DEFAULT_ROWS = 40_000_000  # narrow_split rows before the files recorded them


def load_points(paths: list[Path]) -> tuple[list[dict], str]:
    """Every (rows, width, ids, bags, one pass s, two phases s) in ``paths`` and the GPU's
    name (the files must agree on it)."""
    points, gpus = [], set()
    for path in paths:
        try:
            data = json.loads(path.read_text())
            cells = data["narrow_split"]
            gpus.add(data["environment"]["gpu"])
        except (OSError, ValueError, KeyError) as exc:
            raise SystemExit(f"fit_lookup_price: {path} is not a narrow_split result "
                             f"({exc}); give the JSON files benchmarks/kernels.py --cases "
                             "narrow_split --out wrote") from None
        for width, c in cells.items():
            if c.get("one_pass_ms") is None or c.get("two_phase_ms") is None:
                continue
            batch = c.get("batch", 4096)
            points.append({"rows": c.get("rows", DEFAULT_ROWS), "width": int(width),
                           "ids": batch * c.get("pooling", 100), "bags": batch,
                           "one": c["one_pass_ms"] * 1e-3, "two": c["two_phase_ms"] * 1e-3,
                           "full": int(width) == 128})
    if len(gpus) != 1:
        raise SystemExit(f"fit_lookup_price: the files come from {sorted(gpus) or 'no'} GPUs;"
                         " fit one GPU's runs at a time")
    return sorted(points, key=lambda p: (p["rows"], p["width"], p["ids"])), gpus.pop()


def fit(points: list[dict], hbm: float, min_ids: int) -> tuple[float, float, float]:
    """(efficiency, id bytes, split id bytes) minimising the relative errors."""
    used = [p for p in points if p["ids"] >= min_ids]
    nbytes = [op_cost.batched_embedding_bytes(p["rows"], p["width"], p["ids"], p["bags"],
                                              "fp32", "rowwise_adagrad") for p in used]
    # one pass: t * hbm = u * bytes + v * ids, u = 1 / efficiency, v = id bytes / efficiency
    a = np.array([[b / p["one"], p["ids"] / p["one"]] for b, p in zip(nbytes, used)])
    (u, v), *_ = np.linalg.lstsq(a, np.full(len(used), hbm), rcond=None)
    # the second phase: (two - one) * hbm = w * ids, on the split shards
    split = [p for p in used if not p["full"]]
    w = float(np.mean([(p["two"] - p["one"]) * hbm / p["ids"] for p in split]))
    return 1.0 / u, v / u, w / u


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="narrow_split JSON results")
    ap.add_argument("--min-ids", type=int, default=1_000_000,
                    help="fit only points with at least this many ids (default 1,000,000)")
    args = ap.parse_args(argv)
    points, gpu_name = load_points(args.files)
    gpu = gpu_from_device_name(gpu_name)
    if gpu is None:
        raise SystemExit(f"fit_lookup_price: no GPU spec for {gpu_name!r}")
    eff, id_bytes, split_bytes = fit(points, gpu.hbm_bandwidth, args.min_ids)
    print(f"{gpu_name}: fitted efficiency {eff:.3f}, {id_bytes:.0f} bytes an id, "
          f"{split_bytes:.0f} more an id in the second phase "
          f"(code: {op_cost.BATCHED_LOOKUP_EFFICIENCY}, {op_cost.BATCHED_ID_BYTES:.0f}, "
          f"{op_cost.BATCHED_SPLIT_ID_BYTES:.0f})")
    print(f"{'rows':>10} {'width':>5} {'ids':>9}  {'one ms':>7} {'code':>7} {'fit':>7}  "
          f"{'two ms':>7} {'code':>7} {'fit':>7}")
    for p in points:
        b = op_cost.batched_embedding_bytes(p["rows"], p["width"], p["ids"], p["bags"], "fp32",
                                            "rowwise_adagrad")
        code = [1e3 * op_cost.batched_embedding_time(p["rows"], p["width"], p["ids"],
                                                     p["bags"], "fp32", gpu, None,
                                                     "rowwise_adagrad", split_squares=s)
                for s in (False, not p["full"])]
        one = 1e3 * (b + id_bytes * p["ids"]) / (gpu.hbm_bandwidth * eff)
        two = one + (0.0 if p["full"] else 1e3 * split_bytes * p["ids"]
                     / (gpu.hbm_bandwidth * eff))
        mark = "" if p["ids"] >= args.min_ids else "  (under --min-ids: the floor's)"
        print(f"{p['rows']:>10} {p['width']:>5} {p['ids']:>9}  {1e3 * p['one']:7.3f} "
              f"{code[0]:7.3f} {one:7.3f}  {1e3 * p['two']:7.3f} {code[1]:7.3f} "
              f"{two:7.3f}{mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
