"""The cost model's attention prices against a GPU run of ``kernels.py --cases zoo``.

    .venv/bin/python benchmarks/attention_price_check.py benchmarks/results/session25/kernels_zoo.json
    .venv/bin/python benchmarks/attention_price_check.py RUN --fit   # refit the constants

Why: a choice between gemc's attention kernel and the model's own padded SDPA
(``passes/attention_choice``) is only as good as the two prices it compares. This prints,
for each zoo attention the run timed (the shapes of ``kernels._zoo_attentions`` at the
run's preset, lengths uniform in 1..L, and TransAct's guarded attention of
``kernels.transact_case``: S queries over each row's kept keys, compacted), what
``cost_model.attention_fit`` prices beside the run's fwd+bwd milliseconds, with the error of
each price: padded masked SDPA (cuDNN); gemc's kernels on the GPU (beside the kernel time of
``attention_gpu_time.log`` where it has the model: graph replay); gemc's call timed alone
(``do_bench``: GPU and host overlapping, a guarded call's serialised by its sync); and the
two ratios. ``--fit`` recomputes the module's fitted constants from the same files (least
squares on the relative error; see ``cost_model/attention_fit.py``). No GPU needed: the
measurements are the files'. Prices are for ``--gpu`` (default the run's GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import kernels as kbench  # noqa: E402  (benchmarks/kernels.py: the zoo's shapes)
from gemc.cost_model import attention_fit as fit  # noqa: E402
from gemc.cost_model import op_cost  # noqa: E402
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


def gpu_times(log: Path | None) -> dict[str, dict[str, float]]:
    """Per model, graph-replay ms of each variant in an ``attention_gpu_time.py`` log
    (``gemc``: its default row; ``cudnn``: padded masked cuDNN); empty without the file."""
    out: dict[str, dict[str, float]] = {}
    if log is None or not log.exists():
        return out
    model = None
    for line in log.read_text().splitlines():
        if line.startswith("== "):
            model = line.split()[1]
        elif line.startswith('{"variant"') and model is not None:
            row = json.loads(line)
            name = {"gemc": "gemc", "sdpa cudnn masked": "cudnn"}.get(row["variant"])
            if name:
                out.setdefault(model, {})[name] = float(row["graph_ms"])
    return out


def shapes(run: dict, preset: str = "h200") -> list[tuple[str, dict[str, Any]]]:
    """(model, shape) of every attention the run timed: ``_zoo_attentions`` and TransAct's
    (its preset's head shape, the run's mean kept keys)."""
    from examples.zoo import transact

    out = [(name, {**s, "fill": (s["max_len"] + 1) / (2 * s["max_len"]), "guarded": False})
           for name, s in kbench._zoo_attentions(preset)]
    facts = (run.get("zoo") or {}).get("transact") or {}
    if "mean_kept_keys" in facts:
        cfg = transact.PRESETS[preset]
        d = cfg.action_dim + 2 * cfg.item_dim
        out.append(("transact", dict(batch=cfg.batch_size, max_len=cfg.seq_len,
                                     heads=cfg.num_heads, head_dim=d // cfg.num_heads,
                                     kind="softmax", causal=False, guarded=True,
                                     fill=float(facts["mean_kept_keys"]) / cfg.seq_len)))
    return out


def priced(shape: dict[str, Any], gpu_name: str) -> tuple[float, fit.GemcAttentionPrice]:
    """(padded masked SDPA s, gemc's call) at ``shape`` on ``gpu_name``, as
    ``passes/attention_choice`` prices them (no calibration: the fitted law alone)."""
    gpu = get_gpu(gpu_name)
    b, h, length, d = shape["batch"], shape["heads"], shape["max_len"], shape["head_dim"]
    sdpa = fit.masked_sdpa_s(b, h, length, length, d, gpu)
    if shape["guarded"]:  # every query row over the kept keys, compacted (k and v)
        scores = fit.varlen_tiles(b, h, length, length, shape["fill"])
        moved = fit.compaction_bytes(b * h * length * d, 2, 2)
        copies, _ = op_cost.memory_time(moved, gpu, None, "copy")
        host = fit.GEMC_GUARDED_CALL_HOST_S
    else:
        scores = fit.jagged_tiles(b, h, length, shape["fill"], shape["causal"])
        copies, host = 0.0, fit.GEMC_CALL_HOST_S[shape["kind"]]
    kernel = fit.gemc_kernel_s(scores, d, shape["kind"], gpu)
    return sdpa, fit.GemcAttentionPrice(kernel, copies, host, shape["guarded"])


def rows(run: dict, gpu_name: str, preset: str = "h200", log: Path | None = None
         ) -> list[dict]:
    """One row per timed zoo attention: priced and measured ms, errors and ratios."""
    times, gpu_ms = measured(run), gpu_times(log)
    out = []
    for name, shape in shapes(run, preset):
        got = times.get(name, {})
        if GEMC not in got or CUDNN not in got:
            continue
        sdpa, gemc = priced(shape, gpu_name)
        kernel_ms = gpu_ms.get(name, {}).get("gemc")
        out.append({
            "model": name,
            "shape": {k: shape[k] for k in ("batch", "max_len", "heads", "head_dim", "causal",
                                            "kind", "guarded")},
            "fill": shape["fill"],
            "priced_sdpa_ms": 1e3 * sdpa, "measured_sdpa_ms": got[CUDNN],
            "priced_gemc_gpu_ms": 1e3 * gemc.gpu_s, "measured_gemc_gpu_ms": kernel_ms,
            "priced_gemc_ms": 1e3 * gemc.isolated_s, "measured_gemc_ms": got[GEMC],
            "priced_gemc_step_ms": 1e3 * gemc.in_step_s,
            "priced_ratio": sdpa / gemc.isolated_s,
            "measured_ratio": got[CUDNN] / got[GEMC],
            "sdpa_source": fit.SOURCE})
    return out


def refit(run: dict, log: Path | None, preset: str = "h200") -> dict[str, float]:
    """The fitted constants of ``cost_model/attention_fit.py`` from a run on an H100:
    least squares on the relative error (each row's time over its measurement near 1)."""
    gpu = get_gpu("h100")
    times, gpu_ms = measured(run), gpu_times(log)
    cases = [(n, s) for n, s in shapes(run, preset) if CUDNN in times.get(n, {})]
    # masked SDPA: t = E (beta / BW + 14 d / (peak eps)), linear in (beta, 1 / eps)
    a = [[fit.masked_sdpa_s(s["batch"], s["heads"], s["max_len"], s["max_len"], 0, gpu)
          / fit.SDPA_MASKED_BYTES_PER_SCORE / (1e-3 * times[n][CUDNN]),
          float(s["batch"]) * s["heads"] * fit.tiled(s["max_len"]) ** 2 * 14 * s["head_dim"]
          / gpu.peak_flops("bf16") / (1e-3 * times[n][CUDNN])] for n, s in cases]
    aa = [[sum(r[i] * r[j] for r in a) for j in range(2)] for i in range(2)]
    ab = [sum(r[i] for r in a) for i in range(2)]
    det = aa[0][0] * aa[1][1] - aa[0][1] * aa[1][0]
    beta = (ab[0] * aa[1][1] - ab[1] * aa[0][1]) / det
    inv_eps = (aa[0][0] * ab[1] - aa[1][0] * ab[0]) / det

    def rate(kind: str, names: tuple[str, ...]) -> float:
        # t = W / eps: 1 / eps = sum(W/m) / sum((W/m)^2)
        w = []
        for n, s in cases:
            if n in names:
                m = gpu_ms.get(n, {}).get("gemc") or times[n][GEMC]
                scores = fit.jagged_tiles(s["batch"], s["heads"], s["max_len"], s["fill"],
                                          s["causal"])
                w.append(fit.gemc_kernel_s(scores, s["head_dim"], kind, gpu)
                         * {"softmax": fit.GEMC_SOFTMAX_EFFICIENCY,
                            "silu": fit.GEMC_SILU_EFFICIENCY}[kind] / (1e-3 * m))
        return sum(x * x for x in w) / sum(w)

    out = {"SDPA_MASKED_BYTES_PER_SCORE": beta, "SDPA_MASKED_EFFICIENCY": 1.0 / inv_eps,
           "GEMC_SOFTMAX_EFFICIENCY": rate("softmax", ("sasrec_bst", "mmoe")),
           "GEMC_SILU_EFFICIENCY": rate("silu", ("hstu",))}
    guarded = [(n, s) for n, s in cases if s["guarded"]]
    if guarded:
        n, s = guarded[0]
        _, call = priced(s, "h100")
        kernel = call.kernel_s * fit.GEMC_SOFTMAX_EFFICIENCY / out["GEMC_SOFTMAX_EFFICIENCY"]
        out["GEMC_GUARDED_CALL_HOST_S"] = 1e-3 * times[n][GEMC] - kernel - call.copies_s
    return out


def out_of_sample() -> list[dict[str, Any]]:
    """The fitted law on the H200 against measurements not fitted: the bf16 records of
    ``cost_model/data/h200.json``'s ``attention_masked`` (padded masked SDPA, PyTorch's
    backend choice) and ``results/kernels_attention_h200.json`` (B 4,096, L 512, H 4, d 64,
    causal, lengths uniform in 1..L: eager padded masked SDPA, gemc's jagged softmax and
    SiLU kernels by ``do_bench``, GPU-bound at this size)."""
    gpu = get_gpu("h200")
    out = []
    calib = json.loads((REPO / "cost_model/data/h200.json").read_text())
    for r in calib["attention_masked"]:
        if r["dtype"] != "bf16":
            continue
        t = fit.masked_sdpa_s(r["batch"], r["heads"], r["q_len"], r["kv_len"], r["head_dim"],
                              gpu)
        out.append({"what": f"masked SDPA B={r['batch']} H={r['heads']} q={r['q_len']} "
                            f"kv={r['kv_len']} d={r['head_dim']} (h200.json)",
                    "priced_ms": 1e3 * t, "measured_ms": 1e3 * (r["fwd_s"] + r["bwd_s"])})
    run = json.loads((REPO / "benchmarks/results/kernels_attention_h200.json").read_text())
    c = run["config"]
    b, length, h, d = c["batch"], c["max_len"], c["heads"], c["head_dim"]
    fill = (length + 1) / (2 * length)
    prices = {("softmax attention causal", "eager padded"):
              fit.masked_sdpa_s(b, h, length, length, d, gpu)}
    for kind in ("softmax", "silu"):
        prices[(f"{kind} attention causal", "triton jagged")] = fit.gemc_kernel_s(
            fit.jagged_tiles(b, h, length, fill, True), d, kind, gpu)
    for row in run["results"]:
        key = (row["case"], row["variant"])
        if row["mode"] == "fwd+bwd" and key in prices:
            out.append({"what": f"{row['variant']} {row['case']} B={b} L={length} H={h} d={d} "
                                "(kernels_attention_h200.json)",
                        "priced_ms": 1e3 * prices[key], "measured_ms": float(row["ms"])})
    return out


def _err(priced_ms: float, measured_ms: float | None) -> str:
    if measured_ms is None or not math.isfinite(measured_ms):
        return "-"
    return f"{100 * (priced_ms / measured_ms - 1):+.0f}%"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a kernels.py --cases zoo JSON (--out)")
    ap.add_argument("--gpu", default=None, help="price for this GPU (default: the run's)")
    ap.add_argument("--gpu-time", type=Path, default=None,
                    help="attention_gpu_time.py's log (default: beside the run)")
    ap.add_argument("--fit", action="store_true", help="print the refitted constants")
    ap.add_argument("--h200", action="store_true",
                    help="also the fitted law against the H200 measurements (not fitted)")
    args = ap.parse_args(argv)
    run = json.loads(args.run.read_text())
    log = args.gpu_time or args.run.parent / "attention_gpu_time.log"
    if args.fit:
        for key, value in refit(run, log).items():
            print(f"{key} = {value:.4g}")
        return 0
    gpu_name = args.gpu or ("h100" if "H100" in json.dumps(run.get("environment", {}))
                            else "h200")
    print(f"prices for {gpu_name} ({fit.SOURCE}); measured: {args.run}")
    print("| model | shape | SDPA priced / measured ms | err | gemc GPU priced / measured ms "
          "| err | gemc call priced / measured ms | err | SDPA/gemc priced / measured |")
    print("|---|---|---|---:|---|---:|---|---:|---|")
    for r in rows(run, gpu_name, log=log):
        s = r["shape"]
        gpu_meas = r["measured_gemc_gpu_ms"]
        print(f"| {r['model']} | B={s['batch']} L={s['max_len']} H={s['heads']} "
              f"d={s['head_dim']} {s['kind']}{' causal' if s['causal'] else ''}"
              f"{' guarded' if s['guarded'] else ''} fill {r['fill']:.2f} "
              f"| {r['priced_sdpa_ms']:.3f} / {r['measured_sdpa_ms']:.3f} "
              f"| {_err(r['priced_sdpa_ms'], r['measured_sdpa_ms'])} "
              f"| {r['priced_gemc_gpu_ms']:.3f} / "
              f"{'-' if gpu_meas is None else f'{gpu_meas:.3f}'} "
              f"| {_err(r['priced_gemc_gpu_ms'], gpu_meas)} "
              f"| {r['priced_gemc_ms']:.3f} / {r['measured_gemc_ms']:.3f} "
              f"| {_err(r['priced_gemc_ms'], r['measured_gemc_ms'])} "
              f"| {r['priced_ratio']:.2f}x / {r['measured_ratio']:.2f}x |")
    if args.h200:
        print("\nout of sample, H200 (the law scaled by its bandwidth and peak):")
        print("| measurement | priced ms | measured ms | err |\n|---|---:|---:|---:|")
        for r in out_of_sample():
            print(f"| {r['what']} | {r['priced_ms']:.3f} | {r['measured_ms']:.3f} "
                  f"| {_err(r['priced_ms'], r['measured_ms'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
