"""Launch shapes of the generated looping backward passes, swept on the GPU.

    python benchmarks/bwd_sweep.py --out bwd_sweep.json     # H200: about 2 min (--budget-s)
    python benchmarks/bwd_sweep.py --smoke                  # CPU, TRITON_INTERPRET=1, tiny

Why: the forwards of the norm, pointwise and reduction groups of ``benchmarks/fusion.py`` run
at memory roofline, their backwards (one ``bwd`` kernel each, ``kernels._row_loop``) at
1.3-2 TB/s where Inductor reaches ~3.3; how a backward is launched (elements per tile,
programs along the rows, pipelining depth of the row loop) decides the bytes in flight per
SM, and only the GPU can say which shape wins. The settings are ``codegen.host``'s
``LOOP_TILE``, ``ROW_PROGRAMS`` (0: one row block per program) and ``LOOP_STAGES``, which the
host reads at every launch (``GEMC_LOOP_TILE`` / ``GEMC_ROW_PROGRAMS`` /
``GEMC_LOOP_STAGES`` set them at import).

For each variant and case (bf16, the h200 sizes of ``fusion.cases``): the settings are set
on the host module and the Triton autotuner's cache of the case's backward kernel cleared
(it caches a config per (M, N): without this every variant would reuse the first one's
``num_warps``); then gemc's fwd+bwd and its backward alone (``torch.autograd.grad`` with
``retain_graph`` over one forward) are timed with ``triton.testing.do_bench`` (median),
next to torch.compile and eager on the same function, and the variant's input gradients are
checked against an fp32 eager reference: the variant passes when its worst error, relative
to the gradient's largest magnitude, is within twice eager bf16's own (+1e-3). ``bwd TB/s``
counts the least traffic a backward can have: every input read, every output gradient read,
every input gradient written.

Variants run in order (the current defaults first, the pipelined ones last), each across all
cases, until ``--budget-s`` is spent; the rest are reported as skipped. The table ends with
the variant of the best geometric-mean fwd+bwd over the cases, as environment settings.
``--smoke``: tiny sizes, fp32, one wall-clock run per timing, no torch.compile (checks that
the sweep itself runs: ``tests/fusion/test_bwd_sweep_smoke.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fusion  # noqa: E402  (benchmarks/ is not a package)

CASES = ("norm", "pointwise", "reduction")
SETTINGS = ("LOOP_TILE", "ROW_PROGRAMS", "LOOP_STAGES")
ENV = {"LOOP_TILE": "GEMC_LOOP_TILE", "ROW_PROGRAMS": "GEMC_ROW_PROGRAMS",
       "LOOP_STAGES": "GEMC_LOOP_STAGES"}


@dataclasses.dataclass(frozen=True)
class Variant:
    tile: int  # LOOP_TILE
    programs: int  # ROW_PROGRAMS (0: one row block per program)
    stages: int  # LOOP_STAGES

    @property
    def label(self) -> str:
        progs = "1/blk" if self.programs <= 0 else str(self.programs)
        return f"tile={self.tile} progs={progs} stages={self.stages}"


def grid(tiles: Sequence[int], programs: Sequence[int], stages: Sequence[int],
         piped_tiles: Sequence[int], piped_programs: Sequence[int], default: Variant
         ) -> list[Variant]:
    """The default first; unpipelined variants before pipelined ones, which are tried only
    at ``piped_tiles`` x ``piped_programs`` (a loop of one block has nothing to pipeline, and
    a pipelined 4096-element tile needs 230+ registers a thread)."""
    out = [default]
    for s in stages:
        for p in (programs if s == 1 else piped_programs):
            if s > 1 and p <= 0:
                continue
            for t in (tiles if s == 1 else piped_tiles):
                v = Variant(t, p, s)
                if v not in out:
                    out.append(v)
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# ---- per case --------------------------------------------------------------------------


def _outputs(value: Any) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _grads(fn: Callable[..., Any], inputs: list[torch.Tensor],
           grads: list[torch.Tensor]) -> list[torch.Tensor | None]:
    return list(torch.autograd.grad(_outputs(fn(*inputs)), inputs, grads, allow_unused=True))


def _rel_errs(got: Sequence[torch.Tensor | None], ref: Sequence[torch.Tensor | None]
              ) -> list[float]:
    """Per input: max |got - ref| over the reference's largest magnitude."""
    out = []
    for g, r in zip(got, ref, strict=True):
        if r is None:
            out.append(0.0 if g is None else float(g.abs().max()))
            continue
        if g is None:
            out.append(math.inf)
            continue
        scale = max(float(r.abs().max()), 1e-6)
        out.append(float((g.to(r.dtype) - r).abs().max()) / scale)
    return out


class Timer:
    """do_bench's median on CUDA; one wall-clock run after a warm-up on the CPU."""

    def __init__(self, device: torch.device, warmup_ms: int, rep_ms: int) -> None:
        self.device, self.warmup_ms, self.rep_ms = device, warmup_ms, rep_ms

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.device.type == "cuda":
            import triton.testing

            fn()  # compile and autotune outside the measurement
            torch.cuda.synchronize()
            return float(triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms,
                                                 return_mode="median"))
        return fusion.bench_ms(fn, self.device)


@dataclasses.dataclass
class CaseState:
    """One case, set up once: inputs, output gradients, references, baselines."""

    name: str
    title: str
    fn: Callable[..., Any]
    call: Callable[..., Any]
    module: Any
    inputs: list[torch.Tensor]
    grads: list[torch.Tensor]
    ref: list[torch.Tensor | None]
    eager_err: list[float]
    rows: int
    bn: int
    bytes_bwd: int
    baseline: dict[str, float | None]


def setup_case(name: str, smoke: bool, device: torch.device, dtype: torch.dtype,
               compile_: bool, timer: Timer, gen: torch.Generator) -> CaseState:
    from gemc.backends.triton.codegen import host

    case = fusion.cases(smoke)[name][0]
    call, entry = fusion.gemc_kernel(case, dtype)
    module = host.load_source(entry["code"])
    impl = call.impl
    st = impl.st
    if st["kind"] == "reduction":
        rows, n = impl.a * impl.r, impl.n
    else:
        rows, n = host._mn(impl.shapes[st["outputs"][0]])
    bn = host.next_pow2(n, 16) if st["kind"] == "norm" else host._tile_n(n)
    inputs = [torch.randn(s, generator=gen, device=device).to(dtype).requires_grad_()
              for s in case.shapes]
    with torch.no_grad():
        outs = _outputs(case.fn(*inputs))
    grads = [torch.randn(o.shape, generator=gen, device=device).to(dtype) for o in outs]
    ref_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    ref_inputs = [x.detach().to(ref_dtype).requires_grad_() for x in inputs]
    ref = _grads(case.fn, ref_inputs, [g.to(ref_dtype) for g in grads])
    eager_err = _rel_errs(_grads(case.fn, inputs, grads), ref)
    size = dtype.itemsize
    bytes_bwd = (2 * sum(x.numel() for x in inputs) + sum(o.numel() for o in outs)) * size
    baseline: dict[str, float | None] = {}
    fns: list[tuple[str, Callable[..., Any]]] = [("eager", case.fn)]
    if compile_:
        fns.append(("compile", torch.compile(case.fn)))
    for label, fn in fns:
        baseline.update(time_fn(label, fn, inputs, grads, timer))
    state = CaseState(name, case.name, case.fn, call, module, inputs, grads, ref, eager_err,
                      rows, bn, bytes_bwd, baseline)
    baseline.update(time_fn("gemc", call, inputs, grads, timer, fwd_only=True))
    return state


def time_fn(label: str, fn: Callable[..., Any], inputs: list[torch.Tensor],
            grads: list[torch.Tensor], timer: Timer, fwd_only: bool = False
            ) -> dict[str, float | None]:
    """``<label> fwd``, ``fwd+bwd`` and ``bwd`` (backward alone, over one retained forward;
    None where the function cannot run its backward twice)."""
    out: dict[str, float | None] = {f"{label} fwd": timer(lambda: fn(*inputs))}
    if fwd_only:
        return out
    out[f"{label} fwd+bwd"] = timer(lambda: _grads(fn, inputs, grads))
    out[f"{label} bwd"] = time_bwd(fn, inputs, grads, timer)
    return out


def time_bwd(fn: Callable[..., Any], inputs: list[torch.Tensor], grads: list[torch.Tensor],
             timer: Timer) -> float | None:
    outs = _outputs(fn(*inputs))
    try:
        return timer(lambda: torch.autograd.grad(outs, inputs, grads, retain_graph=True,
                                                 allow_unused=True))
    except Exception as exc:  # noqa: BLE001 - a backward that frees what it saved
        print(f"  (bwd alone not timed: {str(exc).splitlines()[0][:120]})", file=sys.stderr)
        return None


# ---- per variant -----------------------------------------------------------------------


def apply(variant: Variant) -> None:
    from gemc.backends.triton.codegen import host

    host.LOOP_TILE, host.ROW_PROGRAMS, host.LOOP_STAGES = (variant.tile, variant.programs,
                                                           variant.stages)


LOOPED_KERNELS = ("bwd", "dz")  # the kernels host.looped_backward / the library path loop


def clear_autotune(module: Any) -> None:
    """Forget the looping kernels' per-key choices, so the next call tunes them afresh
    (the forward's choice does not depend on the settings swept)."""
    from triton.runtime.autotuner import Autotuner

    for name in LOOPED_KERNELS:
        kernel = getattr(module, name, None)
        if isinstance(kernel, Autotuner):
            kernel.cache.clear()


def tune_with(module: Any, rep_ms: int | None) -> None:
    """Let the looping kernels' autotuners time each config over ``rep_ms`` (None: Triton's
    default, 100 ms after 25 of warm-up): three configs a variant and case at the default
    cost ~30 s of the sweep's budget. Left alone where this Triton has no ``do_bench`` to
    set."""
    import triton.testing
    from triton.runtime.autotuner import Autotuner

    def bench(fn: Callable[[], Any], quantiles: Any = None) -> Any:
        return triton.testing.do_bench(fn, warmup=max(1, (rep_ms or 0) // 5), rep=rep_ms,
                                       quantiles=quantiles)

    for name in LOOPED_KERNELS:
        kernel = getattr(module, name, None)
        if not isinstance(kernel, Autotuner):
            continue
        own = vars(kernel)  # Triton 3.9: a cached property; older: maybe a plain attribute
        if rep_ms is None:
            if "_gemc_do_bench" in own:
                saved = own.pop("_gemc_do_bench")
                if saved is None:
                    own.pop("do_bench", None)
                else:
                    own["do_bench"] = saved
            continue
        own.setdefault("_gemc_do_bench", own.get("do_bench"))
        try:
            kernel.do_bench = bench
        except AttributeError:
            own.pop("_gemc_do_bench")


def run_variant(state: CaseState, variant: Variant, timer: Timer) -> dict[str, Any]:
    from gemc.backends.triton.codegen import host

    apply(variant)
    clear_autotune(state.module)
    bm = host._loop_rows(state.bn)
    programs, iters = host._row_programs(state.rows, bm)
    row: dict[str, Any] = {"case": state.name, **dataclasses.asdict(variant), "block_m": bm,
                           "block_n": state.bn, "launched_programs": programs, "iters": iters}
    try:
        errs = _rel_errs(_grads(state.call, state.inputs, state.grads), state.ref)
        tol = [2 * e + 1e-3 for e in state.eager_err]
        row["grad_rel_err"] = max(errs)
        row["grad_ok"] = all(e <= t for e, t in zip(errs, tol))
        bwd_kernel = getattr(state.module, "bwd", None)
        cfg = getattr(bwd_kernel, "best_config", None)
        row["num_warps"] = getattr(cfg, "num_warps", None)
        row["fwd+bwd_ms"] = timer(lambda: _grads(state.call, state.inputs, state.grads))
        row["bwd_ms"] = time_bwd(state.call, state.inputs, state.grads, timer)
        comp = state.baseline.get("compile fwd+bwd")
        row["x_compile"] = comp / row["fwd+bwd_ms"] if comp else None
        row["bwd_tbps"] = state.bytes_bwd / row["bwd_ms"] / 1e9 if row["bwd_ms"] else None
    except Exception as exc:  # noqa: BLE001 - a failing variant is a result
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return row


# ---- report ----------------------------------------------------------------------------


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def best_variant(rows: list[dict[str, Any]], cases: Sequence[str]) -> dict[str, Any] | None:
    """The variant with the least geometric-mean fwd+bwd over all cases (every case run,
    every gradient check passed)."""
    by: dict[tuple[int, int, int], dict[str, float]] = {}
    for r in rows:
        if r.get("fwd+bwd_ms") and r.get("grad_ok"):
            by.setdefault((r["tile"], r["programs"], r["stages"]), {})[r["case"]] = \
                r["fwd+bwd_ms"]
    scored = [(math.exp(sum(math.log(v[c]) for c in cases) / len(cases)), k)
              for k, v in by.items() if all(c in v for c in cases)]
    if not scored:
        return None
    score, (tile, programs, stages) = min(scored)
    values = {"LOOP_TILE": tile, "ROW_PROGRAMS": programs, "LOOP_STAGES": stages}
    first = next((s for s, k in scored if k == (rows[0]["tile"], rows[0]["programs"],
                                                 rows[0]["stages"])), None)
    per_case = {}
    for c in cases:
        mine = [r for r in rows if r["case"] == c and r.get("fwd+bwd_ms") and r.get("grad_ok")]
        top = min(mine, key=lambda r: r["fwd+bwd_ms"])
        per_case[c] = {"variant": Variant(top["tile"], top["programs"], top["stages"]).label,
                       "fwd+bwd_ms": top["fwd+bwd_ms"], "x_compile": top.get("x_compile")}
    return {"geomean_fwd_bwd_ms": score, "default_geomean_fwd_bwd_ms": first, **values,
            "env": " ".join(f"{ENV[k]}={v}" for k, v in values.items()),
            "best_per_case": per_case}


def print_report(states: list[CaseState], rows: list[dict[str, Any]],
                 best: dict[str, Any] | None) -> None:
    for s in states:
        b = s.baseline
        print(f"\n{s.title}: bwd moves >= {s.bytes_bwd / 1e9:.2f} GB; gemc fwd "
              f"{_fmt(b.get('gemc fwd'), '.3f')} ms; compile fwd "
              f"{_fmt(b.get('compile fwd'), '.3f')} fwd+bwd {_fmt(b.get('compile fwd+bwd'), '.3f')}"
              f" bwd {_fmt(b.get('compile bwd'), '.3f')}; eager fwd+bwd "
              f"{_fmt(b.get('eager fwd+bwd'), '.3f')} ms")
        head = (f"  {'variant':34} {'BM':>3} {'progs':>7} {'iters':>5} {'warps':>5} "
                f"{'fwd+bwd':>8} {'bwd':>7} {'x comp':>6} {'TB/s':>5} {'grad err':>9}")
        print(head)
        for r in (r for r in rows if r["case"] == s.name):
            label = Variant(r["tile"], r["programs"], r["stages"]).label
            if r.get("skipped") or r.get("error"):
                print(f"  {label:34} {r.get('error') or 'skipped (budget)'}")
                continue
            flag = "" if r["grad_ok"] else " FAIL"
            print(f"  {label:34} {r['block_m']:>3} {r['launched_programs']:>7} "
                  f"{r['iters']:>5} {_fmt(r['num_warps'], '>5')} "
                  f"{_fmt(r['fwd+bwd_ms'], '8.3f')} {_fmt(r['bwd_ms'], '7.3f')} "
                  f"{_fmt(r['x_compile'], '6.2f')} {_fmt(r['bwd_tbps'], '5.2f')} "
                  f"{r['grad_rel_err']:9.2e}{flag}")
    if best:
        print(f"\nbest geomean fwd+bwd {best['geomean_fwd_bwd_ms']:.3f} ms (the first variant, "
              f"today's defaults: {_fmt(best['default_geomean_fwd_bwd_ms'], '.3f')} ms): "
              f"{best['env']}")
        for c, b in best["best_per_case"].items():
            print(f"  best for {c}: {b['variant']} fwd+bwd {b['fwd+bwd_ms']:.3f} ms "
                  f"({_fmt(b['x_compile'], '.2f')}x compile)")


def environment(device: torch.device) -> dict[str, Any]:
    env = fusion.environment(device)
    if device.type == "cuda":
        env["sms"] = torch.cuda.get_device_properties(device).multi_processor_count
    return env


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, fp32 (CPU interpreter)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--tiles", default=None, help="LOOP_TILE values (default 1024,2048,4096)")
    ap.add_argument("--programs", default=None,
                    help="ROW_PROGRAMS values, 0 = one block per program "
                         "(default SMs x 8,16,32,128 and 0)")
    ap.add_argument("--stages", default="1,2", help="LOOP_STAGES values")
    ap.add_argument("--piped-tiles", default=None,
                    help="LOOP_TILE values tried with LOOP_STAGES > 1 (default 1024,2048)")
    ap.add_argument("--piped-programs", default=None,
                    help="ROW_PROGRAMS values tried with LOOP_STAGES > 1 (default SMs x 8,32)")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--budget-s", type=float, default=105.0,
                    help="start no variant after this many seconds (from the start of main)")
    ap.add_argument("--rep-ms", type=int, default=50, help="do_bench rep (warmup: a fifth)")
    ap.add_argument("--tune-rep-ms", type=int, default=25,
                    help="the autotuner's timing of each config (0: Triton's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    start = time.monotonic()
    device, dtype = fusion.device_and_dtype(ap, args.smoke)
    from gemc.backends.triton.codegen import host

    sms = torch.cuda.get_device_properties(device).multi_processor_count \
        if device.type == "cuda" else 1
    if args.smoke:  # 37 rows of 24 (32-wide tiles): 128 elements = 4 rows, 10 blocks
        tiles, programs, piped_tiles, piped = [128], [3, 0], [128], [3]
    else:
        tiles, piped_tiles = [1024, 2048, 4096], [1024, 2048]
        programs = [sms * 8, sms * 16, sms * 32, sms * 128, 0]
        piped = [sms * 8, sms * 32]
    tiles = _ints(args.tiles) if args.tiles else tiles
    programs = _ints(args.programs) if args.programs else programs
    piped_tiles = _ints(args.piped_tiles) if args.piped_tiles else piped_tiles
    piped = _ints(args.piped_programs) if args.piped_programs else piped
    saved = {k: getattr(host, k) for k in SETTINGS}
    default = Variant(saved["LOOP_TILE"], saved["ROW_PROGRAMS"], saved["LOOP_STAGES"])
    variants = grid(tiles, programs, _ints(args.stages), piped_tiles, piped, default)
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(wanted) - set(CASES)
    if unknown:
        ap.error(f"unknown cases: {sorted(unknown)}; known: {', '.join(CASES)}")
    timer = Timer(device, max(1, args.rep_ms // 5), args.rep_ms)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    compile_ = not (args.no_compile or args.smoke)
    states: list[CaseState] = []
    rows: list[dict[str, Any]] = []

    def report(final: bool) -> dict[str, Any]:
        """The JSON report; written after every variant too, so a run cut short (a device
        call's time limit) still leaves what it measured."""
        done = {"environment": {**environment(device), "interpreted": host.INTERPRETED},
                "smoke": args.smoke, "dtype": str(dtype), "seed": args.seed, "final": final,
                "defaults": dataclasses.asdict(default),
                "elapsed_s": time.monotonic() - start,
                "cases": {s.name: {"title": s.title, "rows": s.rows, "bytes_bwd": s.bytes_bwd,
                                   "eager_bf16_grad_rel_err": max(s.eager_err),
                                   **{k.replace(" ", "_"): v for k, v in s.baseline.items()}}
                          for s in states},
                "variants": rows, "best": best_variant(rows, [s.name for s in states])}
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.out.with_suffix(args.out.suffix + ".tmp")
            tmp.write_text(json.dumps(done, indent=2))
            tmp.replace(args.out)
        return done

    try:
        for name in wanted:
            print(f"... set up {name} ({time.monotonic() - start:.0f} s)", file=sys.stderr,
                  flush=True)
            states.append(setup_case(name, args.smoke, device, dtype, compile_, timer, gen))
            if device.type == "cuda" and args.tune_rep_ms:
                tune_with(states[-1].module, args.tune_rep_ms)
        for variant in variants:
            over = time.monotonic() - start > args.budget_s
            if not over:
                print(f"... {variant.label} ({time.monotonic() - start:.0f} s)",
                      file=sys.stderr, flush=True)
            for s in states:
                rows.append({"case": s.name, **dataclasses.asdict(variant), "skipped": True}
                            if over else run_variant(s, variant, timer))
            if not over:
                report(final=False)
    finally:
        for k, v in saved.items():
            setattr(host, k, v)
        for s in states:
            clear_autotune(s.module)
            if device.type == "cuda":
                tune_with(s.module, None)
    done = report(final=True)
    print_report(states, rows, done["best"])
    print(f"\n{sum(not r.get('skipped') for r in rows)} runs, "
          f"{sum(bool(r.get('skipped')) for r in rows)} skipped, {done['elapsed_s']:.0f} s")
    return done

if __name__ == "__main__":
    main()
