"""The cost model's attention prices against a GPU run of ``kernels.py --cases zoo``.

    .venv/bin/python benchmarks/attention_price_check.py benchmarks/results/session25/kernels_zoo.json

Why: a choice between gemc's attention kernel and the model's own padded SDPA (branch
``s25-attnchoice``) is only as good as the two prices it compares, and that branch's choice
gave the GEM example's attentions to SDPA where the kernel measures 2-4x faster. This prints,
for each zoo attention the run timed (the shapes of ``kernels._zoo_attentions`` at the
run's preset, lengths uniform in 1..L), what ``cost_model.op_cost`` prices for padded masked
SDPA (``attention_time(masked=True)``) and for gemc's jagged kernel
(``jagged_attention_time`` at the run's fill, E[len] / L) beside the run's fwd+bwd
milliseconds, and the two ratios. No GPU needed: the measurements are the file's. The
prices are for ``--gpu`` (default the file's own GPU when the cost model knows it, the H200
calibration applied for an H200).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import kernels as kbench  # noqa: E402  (benchmarks/kernels.py: the zoo's shapes)
from gemc.cost_model import op_cost  # noqa: E402
from gemc.cost_model.calibration import load_calibration  # noqa: E402
from gemc.cost_model.hardware import get_gpu  # noqa: E402

GEMC = "triton jagged"
CUDNN = "sdpa padded cudnn (masked)"


def measured(run: dict) -> dict[str, dict[str, float]]:
    """Per zoo model (the case's name before its colon): fwd+bwd ms of gemc's kernel and
    of padded masked cuDNN SDPA."""
    out: dict[str, dict[str, float]] = {}
    for row in run["results"]:
        if row.get("mode") != "fwd+bwd" or row.get("error") or row["variant"] not in (GEMC, CUDNN):
            continue
        out.setdefault(row["case"].split(":")[0], {})[row["variant"]] = float(row["ms"])
    return out


def rows(run: dict, gpu_name: str, preset: str = "h200") -> list[dict]:
    """One row per timed softmax/SiLU zoo attention: priced and measured ms and ratios."""
    gpu = get_gpu(gpu_name)
    calib = load_calibration(REPO / "cost_model/data/h200.json") if gpu_name == "h200" else None
    times = measured(run)
    out = []
    for name, shape in kbench._zoo_attentions(preset):
        got = times.get(name, {})
        if GEMC not in got or CUDNN not in got:
            continue
        length = shape["max_len"]
        fill = (length + 1) / (2 * length)  # lengths uniform in 1..L
        fwd, bwd, source = op_cost.attention_time(
            shape["batch"], shape["heads"], length, length, shape["head_dim"], shape["causal"],
            "bf16", gpu, calib, masked=True)
        kernel = op_cost.jagged_attention_time(
            shape["batch"], shape["heads"], length, shape["head_dim"], shape["causal"], "bf16",
            fill, gpu, calib)
        out.append({"model": name, "shape": {k: shape[k] for k in
                                             ("batch", "max_len", "heads", "head_dim", "causal")},
                    "priced_sdpa_ms": 1e3 * (fwd + bwd), "sdpa_source": source,
                    "priced_gemc_ms": 1e3 * kernel, "fill": fill,
                    "measured_sdpa_ms": got[CUDNN], "measured_gemc_ms": got[GEMC],
                    "priced_ratio": (fwd + bwd) / kernel,
                    "measured_ratio": got[CUDNN] / got[GEMC]})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a kernels.py --cases zoo JSON (--out)")
    ap.add_argument("--gpu", default=None, help="price for this GPU (default: the run's)")
    args = ap.parse_args(argv)
    run = json.loads(args.run.read_text())
    gpu_name = args.gpu or ("h100" if "H100" in json.dumps(run.get("environment", {}))
                            else "h200")
    print(f"prices for {gpu_name}; measured: {args.run}")
    print("| model | shape | priced SDPA ms | priced gemc ms | priced SDPA/gemc "
          "| measured cuDNN ms | measured gemc ms | measured cuDNN/gemc |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows(run, gpu_name):
        s = r["shape"]
        print(f"| {r['model']} | B={s['batch']} L={s['max_len']} H={s['heads']} "
              f"d={s['head_dim']}{' causal' if s['causal'] else ''} | {r['priced_sdpa_ms']:.3f} "
              f"({r['sdpa_source']}) | {r['priced_gemc_ms']:.3f} | {r['priced_ratio']:.2f}x "
              f"| {r['measured_sdpa_ms']:.3f} | {r['measured_gemc_ms']:.3f} "
              f"| {r['measured_ratio']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
