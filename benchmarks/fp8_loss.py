"""fp8 against bf16 loss curves of a zoo model, on the same batches and initial weights (issue 21).

Why: issue 21 wants row-wise fp8 within 0.5% of bf16's loss over 500 steps, and the first
H200 reading (Wukong, ``zoo.py``'s ``gemc-fp8``: 0.956 against 0.854, BENCHMARKS.md) put
fp8's loss after 10 steps next to bf16's after 30. Loss curves only say something side by
side, step by step, with every variant trained on the same batches from the same weights;
this prints them so, with the ratios, for any model of ``examples/zoo/`` at a preset whose
fields can be overridden (``--set``: fewer layers, a smaller batch, so the widths that make a
linear fp8 stay and the run fits a CPU)::

    python benchmarks/fp8_loss.py --model wukong --batch-size 256 --set num_layers=2 \\
        --set rows=2000 --steps 200 --variants bf16,fp8 --out /tmp/l.json  # CPU: 12 + 29 min
    python benchmarks/fp8_loss.py --model wukong --preset h200 --steps 500 --device cuda
    python benchmarks/fp8_loss.py --unit                                # one linear, seconds

The plan is compiled here for ``h200:1x1`` (as ``zoo.py`` does) and every variant trains it
through the runner (:func:`gemc.backends.torch.runner.run`), so the fp8 path is gemc's own:

``fp32``            the whole model in fp32 (``--precision fp32``): how far bf16 alone moves
                    the curve, the yardstick for fp8's distance from bf16;
``bf16``            the plan's precision, any fp8 site of it dropped (gemc's bf16 row);
``fp8``             ``--fp8-linears N``: row-wise fp8 (all three GEMMs) forced on every
                    linear with in and out features >= N, zoo.py's ``gemc-fp8``;
``fp8-wgrad-bf16``  the same sites, the weight gradient GEMM in bf16 (torchao's
                    ``ROWWISE_WITH_GW_HP``: no operand quantised along the tokens);
``fp8-fwd-only``    the same sites, only the forward GEMM in fp8;
``fp8-bwd-only``    the same sites, only the two backward GEMMs in fp8;
``fp8-ends-bf16``   the same sites but the first and the last (in module order) left bf16;
``fp8-tensorwise``  the same sites, tensor-wise scaling;
``fp8-site=FQN``    row-wise fp8 on that one linear only (which site's error matters);
``fp8-e5m2-grads``  a what-if, not a gemc recipe: the output gradient quantised to e5m2
                    (power-of-two scale per row, largest value in [2^15, 2^16)), x and W e4m3,
                    emulated (dequantised into an fp32 matmul); CPU only.

Printed: the losses every ``--every`` steps side by side, and per variant against
``--baseline`` (default bf16) the ratio of the mean losses over the last ``--window`` steps
(``final_ratio``), the mean and the largest per-step ratio and how many steps exceed
``--tol`` (0.5%). The same against fp32 when it ran. ``--sqnr-step S`` also records, in each
fp8 variant's step S (module mode only), every fp8 site's x, W and output gradient and
prints the SQNR of y, dx and dW as the site's recipe computes them against float64: the
GEMM error on the model's own tensors, mid-training (the measurement of the runner's fp8
audit, :mod:`gemc.backends.torch.fp8_audit`, which makes it every ``--fp8-audit-every``
steps of a run; ``--audit-every N`` passes that to the fp8 variants, default off here so
the variants' curves are the recipes' own).

``--cycle N``: step s trains on batch ``s % N`` (a fitting run: the zoo's labels are random,
so on fresh batches the loss settles at their entropy; on a few cycled ones it falls
towards 0).

``--unit``: one linear ``[M, K] -> N`` under bf16 autocast, fresh Gaussian inputs, y, dx,
dW and db of gemc's row-wise fp8 linear and of bf16 against float64 (SQNR dB; row-wise
e4m3 is ~28-29 dB), and whether the two quantizers (``GEMC_FP8_QUANTIZER=aten`` and
``triton``, interpreted on a CPU) give the same bits.

On a CPU the fp8 GEMMs are emulated (the same e4m3 values and scales, dequantised into an
fp32 matmul: :mod:`gemc.backends.torch.fp8`), which equals ``torch._scaled_mm`` up to the
order of fp32 accumulation; a GPU run differs from it by that order only. Runs module mode
by default (``--graph``: the plan's kernels through torch.compile, as zoo.py runs; on a CPU
Inductor's C++ compile of a big graph takes minutes per variant).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # before anything imports Triton: its interpreter is read then
    import torch as _t

    if not _t.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()
WHAT_IF_E5M2 = "fp8-e5m2-grads"
RECIPE_VARIANTS = {  # variant -> (fwd, dgrad, wgrad) labels on the forced sites
    "fp8-wgrad-bf16": ("fp8-row", "fp8-row", "bf16"),
    "fp8-fwd-only": ("fp8-row", "bf16", "bf16"),
    "fp8-bwd-only": ("bf16", "fp8-row", "fp8-row"),
    "fp8-ends-bf16": ("fp8-row", "fp8-row", "fp8-row"),
    "fp8-tensorwise": ("fp8-tensor", "fp8-tensor", "fp8-tensor"),
    WHAT_IF_E5M2: ("fp8-row", "fp8-row", "fp8-row"),
}
FIXED_VARIANTS = ("fp32", "bf16", "fp8", *RECIPE_VARIANTS)


# ----------------------------------------------------------------------------- the model


def build(model: str = "wukong", preset: str = "h200", batch_size: int | None = None,
          seed: int = 0, overrides: str = "{}", cycle: int = 0) -> Any:
    """The zoo model ``model`` at ``preset`` with the JSON ``overrides`` replacing fields of
    its ``Config`` (the entrypoint the plan records, so the runner rebuilds the same);
    ``cycle`` > 0: step s trains on batch ``s % cycle`` (a fitting run, whose loss falls
    towards 0, where random labels on fresh batches stay at their entropy)."""
    from gemc.entrypoint import load_entrypoint

    fn = load_entrypoint(f"{REPO / 'examples' / 'zoo' / model}.py:build")
    module = sys.modules[fn.__module__]
    presets = getattr(module, "PRESETS", None)
    if not isinstance(presets, dict) or preset not in presets:
        raise ValueError(f"zoo model {model!r} has no preset {preset!r}")
    cfg = presets[preset]
    extra = json.loads(overrides)
    names = {f.name for f in fields(cfg)}
    unknown = sorted(set(extra) - names)
    if unknown:
        raise ValueError(f"{model}'s Config has no field(s) {unknown}; it has {sorted(names)}")
    extra = {k: tuple(v) if isinstance(v, list) else v for k, v in extra.items()}
    presets["_fp8_loss"] = replace(cfg, **extra)
    spec = fn(preset="_fp8_loss", batch_size=batch_size, seed=seed)
    if cycle > 0:
        fresh = spec.make_batch
        spec.make_batch = lambda step, device: fresh(step % cycle, device)
    return spec


def _override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set {text!r} is not FIELD=VALUE (e.g. num_layers=2)")
    try:
        return key.strip(), json.loads(value)
    except ValueError:
        return key.strip(), value


# ----------------------------------------------------------------------------- variants


def _recipe(labels: tuple[str, str, str]) -> dict[str, dict[str, Any]]:
    from gemc.fp8_recipe import FP8_ROW, FP8_TENSOR, GemmChoice

    by_label = {"fp8-row": FP8_ROW, "fp8-tensor": FP8_TENSOR, "bf16": GemmChoice("bf16")}
    return {g: by_label[lab].to_dict() for g, lab in zip(("fwd", "dgrad", "wgrad"), labels)}


def precision_entries(variant: str, plan_entries: list[dict[str, Any]],
                      forced: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(plan precision entries, extra RunOptions) of ``variant``; ``forced``: the linears
    ``--fp8-linears`` forces, in module order."""
    base = [e for e in plan_entries if str(e.get("dtype", "")).lower() != "fp8"]
    if variant == "bf16":
        return base, {}
    if variant == "fp32":
        return base, {"precision": "fp32"}
    if variant == "fp8":
        return base, {"forced": True}
    if variant.startswith("fp8-site="):
        site = variant.partition("=")[2]
        if site not in forced:
            raise SystemExit(f"fp8_loss: {site!r} is not one of the fp8-able linears: "
                             f"{', '.join(forced)}")
        sites, labels = [site], ("fp8-row",) * 3
    elif variant in RECIPE_VARIANTS:
        sites, labels = list(forced), RECIPE_VARIANTS[variant]
        if variant == "fp8-ends-bf16":
            sites = sites[1:-1]
    else:
        raise SystemExit(f"fp8_loss: unknown variant {variant!r}; use one of "
                         f"{', '.join(FIXED_VARIANTS)} or fp8-site=FQN")
    recipe = _recipe(labels)
    return base + [{"target": s, "dtype": "fp8", "recipe": recipe} for s in sites], {}


@contextlib.contextmanager
def e5m2_gradients() -> Iterator[None]:
    """The what-if ``fp8-e5m2-grads``: gemc's backward GEMMs with their gradient operand
    (``a``: dy of the dgrad, dy^T of the wgrad) quantised to e5m2 per row, emulated."""
    from gemc.backends.torch import fp8

    original = fp8._op_gemm

    def quantize_e5m2(t: torch.Tensor) -> torch.Tensor:
        amax = fp8._amax(t, 1).clamp(min=fp8.AMAX_FLOOR)
        mant, exp = torch.frexp(amax)
        exp = exp - 16 + (mant >= 57344.0 / 65536).to(exp.dtype)  # largest in [2^15, 2^16)
        scale = torch.ldexp(torch.ones_like(amax), exp)
        return (t.float() / scale).to(torch.float8_e5m2).float() * scale

    def gemm(a: torch.Tensor, b: torch.Tensor, choice: Any, out_dtype: torch.dtype,
             emulate: bool, quantizer: str = fp8.ATEN_QUANT) -> torch.Tensor:
        if choice.dtype != "fp8" or choice.scaling != fp8.ROWWISE:
            return original(a, b, choice, out_dtype, emulate, quantizer)
        if not emulate:
            raise SystemExit(f"fp8_loss: {WHAT_IF_E5M2} is emulated only (run it on a CPU)")
        qb, sb = fp8.quantize(b.detach(), fp8.ROWWISE, dim=0)
        out = quantize_e5m2(a.detach()) @ fp8.dequantize(qb, sb)
        return out.to(fp8.FP8_OUT_DTYPE).to(out_dtype)

    fp8._op_gemm = gemm
    try:
        yield
    finally:
        fp8._op_gemm = original


# ----------------------------------------------------------------------------- SQNR in training

NAMES = {"fwd": "y", "dgrad": "dx", "wgrad": "dW"}  # the GEMMs by the tensor each makes


class SiteRecorder:
    """Records, at one step, each fp8 linear's input, weight and output gradient (module
    mode: the run's :class:`~gemc.backends.torch.fp8.Fp8Linear` modules)."""

    def __init__(self, step: int) -> None:
        self.step, self.done = step, 0
        self.records: dict[str, dict[str, Any]] = {}

    def on_ready(self, trainables: Any) -> None:
        from gemc.backends.torch import fp8

        for name, module in trainables.model.named_modules():
            if isinstance(module, fp8.Fp8Linear):
                module.register_forward_hook(self._hook(name))

    def on_step(self, done: int) -> None:
        self.done = done

    def _hook(self, name: str) -> Any:
        def hook(module: Any, args: tuple[Any, ...], out: torch.Tensor) -> None:
            if self.done != self.step or not out.requires_grad:
                return
            rec = self.records[name] = {"x": args[0].detach().clone(),
                                        "w": module.weight.detach().clone(),
                                        "recipe": module.recipe, "quantizer": module.quantizer}
            out.register_hook(lambda g: rec.__setitem__("dy", g.detach().clone()))
        return hook

    def table(self) -> list[dict[str, Any]]:
        """Per site: SQNR of y, dx, dW in the site's recipe and in bf16, vs float64 (the
        runner's fp8 audit's measurement, :func:`gemc.backends.torch.fp8_audit.gemm_sqnr`,
        with a float64 yardstick)."""
        from gemc.backends.torch.fp8_audit import coherence_db, gemm_sqnr, wgrad_by_operand

        from gemc.fp8_recipe import BF16, Fp8Recipe

        rows = []
        for name, rec in self.records.items():
            if "dy" not in rec:
                continue
            x, w, dy = rec["x"], rec["w"], rec["dy"]
            row: dict[str, Any] = {"site": name, "shape": [*x.shape[:-1], w.shape[1],
                                                          w.shape[0]]}
            for label, recipe in (("fp8", rec["recipe"]), ("bf16", Fp8Recipe.uniform(BF16))):
                dbs = gemm_sqnr(x, w, dy, recipe, quantizer=rec["quantizer"],
                                out_dtype=torch.bfloat16, reference=torch.float64)
                row[label] = {NAMES[g]: round(v, 2) for g, v in dbs.items()}
            row["dW_coherence_db"] = round(coherence_db(x, dy), 2)
            row["dW_one_operand"] = {k: round(v, 2) for k, v in
                                     wgrad_by_operand(x, dy).items()}
            rows.append(row)
        return rows


# ----------------------------------------------------------------------------- runs


def run_variant(variant: str, plan: dict[str, Any], forced: list[str], args: argparse.Namespace,
                folder: Path) -> dict[str, Any]:
    """Train ``variant``; returns its losses, wall time and (with --sqnr-step) SQNRs."""
    from gemc.backends.torch.runner import RunOptions, run

    from gemc.plan import write_plan

    entries, extra = precision_entries(variant, plan["precision"], forced)
    plan = {**plan, "precision": entries}
    path = folder / f"{variant.replace('=', '_')}.plan.json"
    write_plan(path, plan)
    recorder = SiteRecorder(args.sqnr_step) if args.sqnr_step is not None \
        and variant.startswith("fp8") and not args.graph else None
    opts = RunOptions(
        steps=args.steps, device=args.device, seed=args.seed, progress=args.progress,
        kernels=args.graph, divergence="off", warmup_steps=0,
        fp8_audit_every=args.audit_every,
        precision=extra.get("precision"),
        fp8_min_features=args.fp8_linears if extra.get("forced") else None,
        on_ready=recorder.on_ready if recorder else None,
        on_step=recorder.on_step if recorder else None)
    ctx = e5m2_gradients() if variant == WHAT_IF_E5M2 else contextlib.nullcontext()
    t0 = time.perf_counter()
    with ctx:  # the SQNR table too: the what-if's GEMMs are patched only in here
        result = run(path, opts)
        table = recorder.table() if recorder is not None else None
    row: dict[str, Any] = {
        "variant": variant, "losses": [loss for _, loss in result.losses],
        "wall_s": round(time.perf_counter() - t0, 1),
        "fp8_sites": sorted(e["target"] for e in entries if e.get("dtype") == "fp8")
        or result.report.get("forced_fp8_linears", []),
        "execution": result.report.get("execution")}
    audit = result.report.get("fp8_audit") or {}
    if audit.get("audits"):  # --audit-every: the runner's audit series and switches
        row["fp8_audit"] = {k: audit[k] for k in ("every", "bound_db", "audits", "seconds",
                                                  "switched", "switches")}
        row["fp8_audit"]["series"] = {n: s["series"] for n, s in audit["sites"].items()}
    if table is not None:
        row["sqnr_step"] = args.sqnr_step
        row["sqnr"] = table
    return row


def compare(losses: list[float], ref: list[float], window: int, tol: float) -> dict[str, Any]:
    """A curve against a reference on the same steps."""
    n = min(len(losses), len(ref))
    ratios = [a / b for a, b in zip(losses[:n], ref[:n])]
    w = min(window, n)
    return {
        "final_ratio": statistics.fmean(losses[n - w:n]) / statistics.fmean(ref[n - w:n]),
        "mean_ratio": statistics.fmean(ratios),
        "max_dev": max(abs(r - 1) for r in ratios),
        "steps_over_tol": sum(abs(r - 1) > tol for r in ratios),
        "window": w, "steps": n}


def report_text(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by = {r["variant"]: r for r in rows}
    names = [r["variant"] for r in rows]
    lines = ["step  " + "".join(f"{n[:14]:>15}" for n in names)]
    n = max(len(r["losses"]) for r in rows)
    for s in range(n):
        if s % args.every and s != n - 1:
            continue
        lines.append(f"{s + 1:4d}  " + "".join(
            f"{by[v]['losses'][s]:15.4f}" if s < len(by[v]["losses"]) else f"{'-':>15}"
            for v in names))
    for base in dict.fromkeys((args.baseline, "fp32")):
        if base not in by:
            continue
        lines.append(f"\nagainst {base} (final_ratio: mean loss over the last {min(args.window, n)} "
                     f"steps / {base}'s; dev: |loss / {base}'s - 1| per step, tol {args.tol:g}):")
        for v in names:
            if v == base:
                continue
            c = by[v].setdefault("vs", {})[base] = compare(
                by[v]["losses"], by[base]["losses"], args.window, args.tol)
            lines.append(f"  {v:24s} final_ratio {c['final_ratio']:.4f}  mean_ratio "
                         f"{c['mean_ratio']:.4f}  max_dev {c['max_dev']:.4f}  steps over tol "
                         f"{c['steps_over_tol']}/{c['steps']}")
    for r in rows:
        audit = r.get("fp8_audit")
        if audit:
            lines.append(f"\n{r['variant']}: fp8 audit every {audit['every']} steps "
                         f"(bound {audit['bound_db']:g} dB; {audit['audits']} audits, "
                         f"{audit['seconds']:.1f} s): dB of y, dx, dW per audited step")
            for site, series in audit["series"].items():
                cells = " ".join(f"{p['step']}:" + "/".join(
                    f"{p[g]:.1f}" if g in p else "-" for g in ("fwd", "dgrad", "wgrad"))
                    for p in series)
                lines.append(f"  {site:28s} {cells}")
            for sw in audit["switches"]:
                lines.append(f"  switched: {sw['site']} {sw['gemm']} at step {sw['step']} "
                             f"({sw['sqnr_db']:.1f} dB)")
    for r in rows:
        if r.get("sqnr"):
            lines.append(f"\n{r['variant']}: SQNR dB vs float64 after {r['sqnr_step']} steps "
                         "(y, dx, dW: the site's recipe | bf16; coherence of dW's terms; dW "
                         "with only dy, only x e4m3)")
            for s in r["sqnr"]:
                f, b, one = s["fp8"], s["bf16"], s["dW_one_operand"]
                lines.append(f"  {s['site']:28s} {str(s['shape']):20s} {f['y']:6.2f} "
                             f"{f['dx']:6.2f} {f['dW']:6.2f} | {b['y']:6.2f} {b['dx']:6.2f} "
                             f"{b['dW']:6.2f} | {s['dW_coherence_db']:6.2f} | {one['dy']:6.2f} "
                             f"{one['x']:6.2f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- one linear


def unit(m: int, k: int, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """y, dx, dW, db of one linear against float64, bf16 and row-wise fp8 by each quantizer;
    and whether the quantizers' results are bit-identical."""
    from gemc.backends.torch import fp8

    from gemc.fp8_recipe import FP8_ROW, Fp8Recipe
    from gemc.probe_types import sqnr_db

    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n)
    x, dy = torch.randn(m, k), torch.randn(m, n) * 1e-2
    xr = x.double().requires_grad_()
    w, b = (p.detach().double().requires_grad_() for p in (lin.weight, lin.bias))
    ref = dict(zip(("dx", "dW", "db"), torch.autograd.grad(xr @ w.t() + b, (xr, w, b),
                                                           dy.double())))
    ref["y"] = (xr @ w.t() + b).detach()
    rows, got = [], {}
    for name in ("bf16", *(f"fp8-row {q}" for q in fp8.QUANTIZERS)):
        layer = lin if name == "bf16" else fp8.Fp8Linear.from_linear(
            lin, Fp8Recipe.uniform(FP8_ROW), quantizer=name.split()[1])
        xx = x.clone().requires_grad_()
        with torch.autocast("cpu" if x.device.type == "cpu" else "cuda", dtype=torch.bfloat16):
            y = layer(xx)
        dx, dw, db = torch.autograd.grad(y, (xx, lin.weight, lin.bias), dy.to(y.dtype))
        got[name] = {"y": y.detach(), "dx": dx, "dW": dw, "db": db}
        rows.append({"gemms": name, "shape": [m, k, n],
                     **{t: round(sqnr_db(ref[t], got[name][t]), 2) for t in ref}})
    a, t = got["fp8-row aten"], got["fp8-row triton"]
    rows.append({"gemms": "aten == triton (bits)", "shape": [m, k, n],
                 **{key: bool(torch.equal(a[key], t[key])) for key in a}})
    return rows


# ----------------------------------------------------------------------------- main


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="wukong", help="a module of examples/zoo/")
    p.add_argument("--preset", default="h200")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--set", dest="overrides", action="append", type=_override, default=[],
                   metavar="FIELD=VALUE", help="replace a field of the preset's Config "
                   "(JSON values: num_layers=2, top_hidden=[2048,1024])")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--cycle", type=int, default=0, metavar="N",
                   help="train on N batches in turn (default 0: a fresh batch every step)")
    p.add_argument("--variants", default="fp32,bf16,fp8",
                   help=f"comma-separated, of {', '.join(FIXED_VARIANTS)}, fp8-site=FQN")
    p.add_argument("--fp8-linears", type=int, default=1024, metavar="N",
                   help="the linears fp8 variants take: in and out features >= N (zoo.py's "
                   "gemc-fp8: 1024)")
    p.add_argument("--baseline", default="bf16")
    p.add_argument("--window", type=int, default=None,
                   help="steps of final_ratio's means (default: a fifth of --steps, >= 10)")
    p.add_argument("--tol", type=float, default=0.005, help="issue 21's 0.5%%")
    p.add_argument("--every", type=int, default=None, help="print every N-th step's losses")
    p.add_argument("--sqnr-step", type=int, default=None, metavar="S",
                   help="fp8 variants: SQNR of every fp8 site's GEMMs at step S (module mode)")
    p.add_argument("--audit-every", type=int, default=0, metavar="N",
                   help="the runner's fp8 audit every N steps in each variant (gemc run "
                   "--fp8-audit-every; default 0 here: the curves are the recipes' own)")
    p.add_argument("--graph", action="store_true",
                   help="graph mode with the plan's kernels through torch.compile (zoo.py's "
                   "gemc rows); default: module mode")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--progress", action="store_true", help="the runner's progress bar")
    p.add_argument("--unit", action="store_true", help="one linear's SQNR table, then exit")
    p.add_argument("--unit-shape", default="256,2048,1024", metavar="M,K,N")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.window = args.window or max(10, args.steps // 5)
    args.every = args.every or max(1, args.steps // 20)
    return args


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.unit:
        m, k, n = (int(v) for v in args.unit_shape.split(","))
        rows = unit(m, k, n, args.seed)
        for r in rows:
            print("  ".join(f"{key} {val}" for key, val in r.items()))
        if args.out:
            args.out.write_text(json.dumps({"unit": rows}, indent=1) + "\n")
        return 0 if all(rows[-1][t] for t in ("y", "dx", "dW", "db")) else 1
    from gemc.backends.torch.precision import forced_fp8_entries

    from gemc.api import compile as gemc_compile
    from gemc.api import load_model

    model_args: dict[str, Any] = {"model": args.model, "preset": args.preset, "seed": args.seed,
                                  "overrides": json.dumps(dict(args.overrides))}
    if args.batch_size:
        model_args["batch_size"] = args.batch_size
    if args.cycle:
        model_args["cycle"] = args.cycle
    entry = f"{HERE}:build"
    t0 = time.perf_counter()
    plan = gemc_compile(entry, model_args, topology="h200:1x1", planner="default")
    spec = load_model(entry, model_args, device="meta")
    forced = [e["target"] for e in forced_fp8_entries(spec.model, args.fp8_linears,
                                                      plan["precision"])]
    print(f"fp8_loss: {args.model} {model_args}: plan in {time.perf_counter() - t0:.1f} s; "
          f"{len(forced)} linear(s) with in/out >= {args.fp8_linears}: {', '.join(forced)}",
          file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:  # the variants' plans and run reports
        for variant in args.variants.split(","):
            rows.append(run_variant(variant.strip(), plan, forced, args, Path(tmp)))
            r = rows[-1]
            print(f"fp8_loss: {r['variant']}: {len(r['losses'])} steps in {r['wall_s']} s, "
                  f"last loss {r['losses'][-1]:.4f}", file=sys.stderr)
    text = report_text(rows, args)
    print(text)
    if args.out:
        args.out.write_text(json.dumps({
            "model": args.model, "model_args": model_args, "steps": args.steps,
            "device": args.device, "torch": torch.__version__, "fp8_linears": args.fp8_linears,
            "forced_sites": forced, "rows": rows}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
