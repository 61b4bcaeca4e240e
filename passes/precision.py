"""choose-precision: fp32, bf16 or fp8 for every GEMM of a training step.

Every GEMM site (a GEMM node of the forward graph) stands for three GEMMs -- forward,
input gradient (dgrad), weight gradient (wgrad) -- and each gets its own choice. The rule,
per GEMM, in ``--precision auto`` (the default):

1. **fp8** (e4m3; row-wise scaling, tensor-wise where no outliers) only if all hold:
   a. structurally allowed (:func:`~gemc.passes.precision_sites.structural_reason`: an
      ``nn.Linear``, not attention scores, not the logits, not an embedding table, every
      dim divisible by 16) on a GPU with fp8 tensor cores;
   b. it pays: the cost model's fp8 time at the real M, N, K *plus the quantization the
      runner launches* (amax, scale, cast, layout copy per operand) beats bf16 by at least
      ``min_gain`` (5%) -- so small and skinny GEMMs stay bf16. ``quantisation`` says which
      runner path is priced: ``eager`` (the default: separate kernels, 9-17 bytes an
      element) or ``compiled`` (torch.compile fuses them: one pass per operand at most);
      ``compiled`` stays opt-in until the H200 measures that path (issue 21);
   c. it is accurate: the probe (:mod:`gemc.probe`, a measured input the driver hands
      the pass as ``ctx.precision_probe``, like calibration) measured SQNR >= ``min_sqnr_db``
      (25 dB) on this model's own activations and gradients. Tensor-wise scaling is taken
      only when no operand shows outliers (max slice amax <= ``max_outlier_ratio`` x the
      median) and it is within ``tensorwise_margin_db`` of row-wise; otherwise row-wise.
2. else **bf16**, if its measured SQNR >= ``min_sqnr_db`` (or it could not be measured:
   bf16 is the baseline every GEM model trains in);
3. else **fp32**.

Then per module (the runner's unit: a linear layer is swapped whole, other GEMMs follow
their module's autocast scope): a layer shared by several call sites takes the widest
choice per GEMM; a non-fp8 module whose GEMMs disagree between bf16 and fp32 runs fp32.
Then per **block** (region): run alone on recorded inputs with the assignment applied as
the runner applies it, its outputs and input and parameter gradients must keep SQNR >=
``min_block_sqnr_db`` (23 dB) -- else its least accurate fp8 GEMM goes back to bf16 (then
its least accurate bf16 module to fp32) until it holds. Blocks without fp8 are checked
when a GEMM in them is within ``block_margin_db`` of the bound (or with
``check_all_blocks``).

The probe runs the model on the CPU at a reduced batch; when the model cannot be
materialised there (gem-xl), every GEMM stays bf16 with a loud warning -- fp8 is never
chosen unmeasured. ``--precision bf16`` / ``fp32`` skip the probe and choose uniformly.

Writes ``gemc.precision`` on every GEMM node (choice, SQNR, predicted times and gain, why
the others were rejected) and the graph-level facts (baseline, rule, probe, blocks) on the
output node; updates ``gemc.predicted_ms`` of GEMM nodes to the chosen precisions when
predict-time ran. The plan builder turns these into ``plan["precision"]``.

Options are the pass's ``options`` field (:class:`PrecisionOptions`): ``gemc compile
--precision`` and ``gemc.compile(precision=...)`` set them through
``gemc.config.CompileConfig.precision``, from which the driver builds the pipeline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from gemc.passes.precision_sites import (
    Prices,
    Site,
    collect_sites,
    drop_displaced_kernels,
    module_scopes,
    price,
    scoped_nodes,
    structural_reason,
)
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import fp8_recipe, ir
from gemc.context import PassContext
from gemc.errors import GemcUserError
from gemc.fp8_recipe import GemmChoice
from gemc.probe_types import BlockResult, PrecisionProbe, ProbeConfig, ProbeSkipped, SiteStats

MODES = ("auto", "bf16", "fp32")
_WIDTH = {"fp8-tensor": 0, "fp8-row": 1, "bf16": 2, "fp32": 3}
_BY_LABEL = {"fp32": fp8_recipe.FP32, "bf16": fp8_recipe.BF16, "fp8-row": fp8_recipe.FP8_ROW,
             "fp8-tensor": fp8_recipe.FP8_TENSOR}
MAX_DB = 200.0  # "exact" (plans are JSON: no infinities)


@dataclass(frozen=True)
class PrecisionOptions:
    """The rule's knobs (see the module doc)."""

    mode: str = "auto"
    min_sqnr_db: float = fp8_recipe.MIN_SQNR_DB
    min_block_sqnr_db: float = 23.0
    min_gain: float = 0.05
    require_gain: bool = True  # False: fp8 wherever allowed and accurate (numerics studies)
    quantisation: str = fp8_recipe.EAGER_QUANT  # the fp8 quantisation priced (QUANT_PATHS)
    max_outlier_ratio: float = 8.0
    tensorwise_margin_db: float = 0.5
    block_margin_db: float = 10.0
    check_all_blocks: bool = False
    probe: ProbeConfig | None = field(default_factory=ProbeConfig)  # None: do not probe

    def validate(self) -> None:
        if self.mode not in MODES:
            raise GemcUserError(f"unknown precision mode {self.mode!r}", where="--precision",
                                fix=f"use one of {', '.join(MODES)}")
        if self.quantisation not in fp8_recipe.QUANT_PATHS:
            raise GemcUserError(f"unknown fp8 quantisation {self.quantisation!r}",
                                where="PrecisionOptions.quantisation",
                                fix=f"use one of {', '.join(fp8_recipe.QUANT_PATHS)}")
        for name in ("min_sqnr_db", "min_block_sqnr_db"):
            if not math.isfinite(getattr(self, name)):
                raise GemcUserError(f"{name} must be a finite number of dB",
                                    where=f"--{name.replace('_', '-')}", fix="e.g. 25")

    def rule(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "probe"}
        out["probe"] = None if self.probe is None else {
            f.name: getattr(self.probe, f.name) for f in fields(self.probe)}
        return out


# ----------------------------------------------------------------------------- decisions


@dataclass
class GemmDecision:
    """One GEMM's choice and the evidence for it."""

    choice: GemmChoice
    prices: Prices | None
    sqnr: dict[str, float | None]
    outlier_ratio: float | None
    rejected: dict[str, str] = field(default_factory=dict)
    note: str | None = None

    @property
    def label(self) -> str:
        return self.choice.label

    def set(self, label: str, reason_for_old: str) -> None:
        """Change the choice, recording why the old one was dropped."""
        old = self.choice
        self.choice = _BY_LABEL[label]
        if old.dtype == self.choice.dtype:  # fp8 scaling only
            self.note = f"{self.choice.scaling}: {reason_for_old}"
            return
        self.rejected.pop(self.choice.dtype, None)
        self.rejected[old.dtype] = reason_for_old

    def to_json(self) -> dict[str, Any]:
        p = self.prices
        chosen_sqnr = self.sqnr.get(self.label)
        return {
            "dtype": self.choice.dtype,
            "scaling": self.choice.scaling,
            "sqnr_db": _db(chosen_sqnr) if self.choice.dtype != "fp32" else MAX_DB,
            "sqnr_db_by": {k: _db(v) for k, v in self.sqnr.items() if v is not None},
            "outlier_ratio": None if self.outlier_ratio is None else round(
                min(self.outlier_ratio, 1e6), 2),
            "pred_ms": None if p is None else {d: _ms(p.of(d)) for d in ("fp32", "bf16", "fp8")},
            "quant_ms": None if p is None else _ms(p.fp8_quant),
            "gain_ms": None if p is None else _ms(p.bf16 - p.of(self.choice.dtype)),
            "rejected": dict(sorted(self.rejected.items())),
            **({"note": self.note} if self.note else {}),
        }


def _db(v: float | None) -> float | None:
    return None if v is None else round(max(min(v, MAX_DB), -MAX_DB), 1)


def _ms(seconds: float) -> float:
    return round(1e3 * seconds, 4)


def _pct(gain: float, base: float) -> str:
    return f"{100 * gain / base:.0f}%" if base > 0 else "-"


def _decide(site: Site, gemm: str, prices: Prices | None, structural: str | None,
            hw_reason: str | None, stats: SiteStats | None, probe_note: str | None,
            opts: PrecisionOptions) -> GemmDecision:
    sq = {label: (stats.sqnr(gemm, label) if stats else None)
          for label in ("bf16", "fp8-row", "fp8-tensor")}
    ratio = stats.outliers.get(gemm) if stats else None
    d = GemmDecision(fp8_recipe.BF16, prices, sq, ratio)
    lo = opts.min_sqnr_db
    gain = prices.bf16 - prices.fp8 if prices else 0.0
    pays = prices is not None and gain > 0 and gain >= opts.min_gain * prices.bf16
    fp8_label = None
    if structural:
        d.rejected["fp8"] = structural
    elif hw_reason:
        d.rejected["fp8"] = hw_reason
    elif opts.require_gain and not pays:
        d.rejected["fp8"] = (
            "no gain: " + (f"fp8 {_ms(prices.fp8)} ms (quantization {_ms(prices.fp8_quant)}) "
                           f"vs bf16 {_ms(prices.bf16)} ms" if prices else "no cost model")
        )
    elif sq["fp8-row"] is None:
        d.rejected["fp8"] = f"error not measured ({probe_note or 'no probe'})"
    else:
        row, ten = sq["fp8-row"], sq["fp8-tensor"]
        clean = ratio is not None and ratio <= opts.max_outlier_ratio
        if ten is not None and clean and ten >= lo and ten >= row - opts.tensorwise_margin_db:
            fp8_label = "fp8-tensor"
            d.note = f"tensor-wise: no outliers (ratio {ratio:.1f} <= {opts.max_outlier_ratio:g})"
        elif row >= lo:
            fp8_label = "fp8-row"
            d.note = ("row-wise: outliers (ratio " + (f"{ratio:.1f}" if ratio else "?")
                      + f" > {opts.max_outlier_ratio:g})") if not clean else "row-wise"
        else:
            d.rejected["fp8"] = f"SQNR {row:.1f} dB < {lo:g} dB"
    bf16_db = sq["bf16"]
    if fp8_label is not None:
        d.choice = _BY_LABEL[fp8_label]
        base = prices.bf16 if prices else 0.0
        saving = (f"fp8 saves {_ms(gain)} ms ({_pct(gain, base)})" if pays else
                  f"fp8 forced (require_gain off; it costs {_ms(-gain)} ms more)")
        d.rejected["bf16"] = f"{saving} at {sq[fp8_label]:.1f} dB >= {lo:g} dB"
    elif bf16_db is None or bf16_db >= lo:
        d.choice = fp8_recipe.BF16
    else:
        d.choice = fp8_recipe.FP32
        d.rejected["bf16"] = f"SQNR {bf16_db:.1f} dB < {lo:g} dB"
    if d.choice.dtype != "fp32":
        faster = prices.fp32 - prices.bf16 if prices else 0.0
        extra = f", {_ms(faster)} ms faster" if _ms(faster) > 0 else ""
        measured = f"measures {bf16_db:.1f} dB" if bf16_db is not None else "not measured"
        d.rejected["fp32"] = f"not needed: bf16 (the baseline{extra}) {measured}, bound {lo:g} dB"
    return d


# ----------------------------------------------------------------------------- modules


@dataclass
class Target:
    """A module the runner applies one choice to, and the sites it governs."""

    name: str
    linear: bool
    sites: list[Site] = field(default_factory=list)

    def dtype(self, decisions: dict[fx.Node, dict[str, GemmDecision]]) -> str:
        labels = {decisions[s.node][g].label for s in self.sites for g in fp8_recipe.GEMMS}
        if any(label.startswith("fp8") for label in labels):
            return "fp8"
        return "fp32" if "fp32" in labels else "bf16"


def _consolidate(target: Target, decisions: dict[fx.Node, dict[str, GemmDecision]],
                 root_warn: list[str]) -> None:
    """One choice per GEMM role for a shared layer; one dtype for a non-fp8 module."""
    for g in fp8_recipe.GEMMS:
        ds = [decisions[s.node][g] for s in target.sites]
        widest = max((d.label for d in ds), key=_WIDTH.__getitem__)
        for d in ds:
            if d.label != widest:
                d.set(widest, f"layer {target.name} is shared: another call needs {widest}")
    if target.dtype(decisions) == "fp8":
        return
    ds = [decisions[s.node][g] for s in target.sites for g in fp8_recipe.GEMMS]
    if any(d.label == "fp32" for d in ds):
        if not target.name:
            root_warn.append(", ".join(s.node.name for s in target.sites))
            for d in ds:
                if d.label == "fp32":
                    d.set("bf16", "runs in the model's own forward: no module scope for fp32")
            return
        for d in ds:
            if d.label != "fp32":
                d.set("fp32", f"module {target.name} runs fp32 (autocast scopes a module, "
                              "not one GEMM)")


def _assignment(targets: list[Target], decisions: dict[fx.Node, dict[str, GemmDecision]]
                ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for t in targets:
        if not t.name:
            continue
        dtype = t.dtype(decisions)
        if dtype == "fp8":
            d0 = decisions[t.sites[0].node]
            out[t.name] = fp8_recipe.Fp8Recipe(*(d0[g].choice for g in fp8_recipe.GEMMS))
        else:
            out[t.name] = dtype
    return out


def _in_region(name: str, region: str) -> bool:
    return name == region or name.startswith(region + ".")


# ----------------------------------------------------------------------------- the pass


@dataclass(frozen=True)
class ChoosePrecision:
    """Annotates ``gemc.precision`` on GEMM nodes (and the graph's facts on the output)."""

    name: ClassVar[str] = "choose-precision"
    requires: ClassVar[tuple[str, ...]] = ("classify-ops", "assign-regions")
    options: PrecisionOptions | None = None  # None: PrecisionOptions()

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        opts = self.options or PrecisionOptions()
        opts.validate()
        sites = collect_sites(gm)
        topo = ctx.topology
        gpu = topo.gpu if topo is not None else None
        calibration = ctx.calibration
        prices = {s.node: price(s, gpu, calibration, opts.quantisation) for s in sites} \
            if gpu else {}
        graph_facts: dict[str, Any] = {"mode": opts.mode, "baseline": "fp32" if opts.mode ==
                                       "fp32" else "bf16", "rule": opts.rule(), "probe": None,
                                       "blocks": []}
        if opts.mode == "auto":
            decisions = self._auto(gm, ctx, sites, prices, gpu, opts, graph_facts)
        else:
            choice = fp8_recipe.FP32 if opts.mode == "fp32" else fp8_recipe.BF16
            decisions = {}
            for s in sites:
                decisions[s.node] = {}
                for g in fp8_recipe.GEMMS:
                    d = GemmDecision(choice, prices.get(s.node, {}).get(g), {}, None)
                    for other in ("fp32", "bf16", "fp8"):
                        if other != choice.dtype:
                            d.rejected[other] = f"--precision {opts.mode} requested"
                    decisions[s.node][g] = d
        self._annotate(gm, sites, decisions, graph_facts)
        scopes = module_scopes(gm)
        dropped = drop_displaced_kernels(gm, scoped_nodes(gm, scopes)) if scopes else []
        if dropped:
            ctx.warn(f"choose-precision: {len(dropped)} kernel(s) left out of the plan: "
                     f"{', '.join(dropped[:6])}: their ops run in a module scoped to another "
                     "precision (or an fp8 site's linear), which the runner executes as the "
                     "model's own ops; priced that way")
        return PassResult(gm, True)

    # -- auto
    def _auto(self, gm: fx.GraphModule, ctx: PassContext, sites: list[Site],
              prices: dict[fx.Node, dict[str, Prices]], gpu: Any, opts: PrecisionOptions,
              facts: dict[str, Any]) -> dict[fx.Node, dict[str, GemmDecision]]:
        tables = {n.meta[ir.TABLE]["fqn"] for n in gm.graph.nodes if n.meta.get(ir.TABLE)}
        hw_reason = None
        if gpu is None:
            hw_reason = "no topology: no GPU to price fp8 on"
        elif gpu.fp8_flops <= 0:
            hw_reason = f"{gpu.name} has no fp8 tensor cores"
        # before the probe has the real modules, assume a linear op is an nn.Linear: the
        # probe measures fp8 only where it is, and the rule is re-checked after it
        structural = {s.node: structural_reason(s, tables, True if s.op == "linear" else None)
                      for s in sites}
        candidates = {s.key for s in sites if structural[s.node] is None and hw_reason is None
                      and (not opts.require_gain or any(
                          self._pays(p, opts) for p in prices[s.node].values()))}
        probe, note = self._probe(ctx, gm, sites, candidates, opts, facts)
        # the real module types settle "is it an nn.Linear" (without a probe: the graph's
        # module stack says which class ran the op)
        structural = {s.node: structural_reason(
            s, tables, probe.is_linear(s.module) if probe is not None and s.op == "linear"
            else None) for s in sites}
        decisions = {}
        for s in sites:
            stats = probe.sites.get(s.key) if probe is not None else None
            site_note = note if probe is None else (None if stats else "site not seen by the probe")
            decisions[s.node] = {
                g: _decide(s, g, prices.get(s.node, {}).get(g), structural[s.node], hw_reason,
                           stats, site_note, opts)
                for g in fp8_recipe.GEMMS
            }
        targets = self._targets(sites, probe)
        root_warn: list[str] = []
        for t in targets:
            _consolidate(t, decisions, root_warn)
        if root_warn:
            ctx.warn("choose-precision: GEMMs in the model's own forward measured below "
                     f"{opts.min_sqnr_db:g} dB in bf16 but cannot be scoped to fp32 alone "
                     f"({'; '.join(root_warn)}): kept bf16; move them into a submodule")
        if probe is not None:
            facts["blocks"] = self._check_blocks(ctx, probe, targets, decisions, opts)
        return decisions

    @staticmethod
    def _pays(p: Prices, opts: PrecisionOptions) -> bool:
        gain = p.bf16 - p.fp8
        return gain > 0 and gain >= opts.min_gain * p.bf16

    def _probe(self, ctx: PassContext, gm: fx.GraphModule, sites: list[Site],
               candidates: set[Any], opts: PrecisionOptions, facts: dict[str, Any]
               ) -> tuple[PrecisionProbe | None, str | None]:
        if opts.probe is None:
            facts["probe"] = {"skipped": "disabled"}
            return None, "probe disabled"
        regions = sorted({s.region for s in sites if s.region})
        flops = float(sum(int(n.meta.get(ir.FLOPS, 0)) for n in gm.graph.nodes))
        try:
            if ctx.precision_probe is None:
                raise ProbeSkipped("the driver gave the pass no probe "
                                   "(PassContext.precision_probe is None)")
            probe = ctx.precision_probe(regions, opts.probe, fwd_flops=flops,
                                        fp8_sites=candidates)
        except ProbeSkipped as exc:
            reason = str(exc)
        except GemcUserError as exc:  # e.g. an entrypoint that will not rebuild on the CPU
            reason = f"the model could not be rebuilt: {exc.what}"
        except Exception as exc:  # the model ran under capture; a probe crash is ours
            reason = f"the probe failed: {type(exc).__name__}: {exc}"
        else:
            facts["probe"] = {**probe.info, "steps": opts.probe.steps, "sites": len(probe.sites),
                              "fp8_candidates": len(candidates), "reference": "fp32"}
            return probe, None
        facts["probe"] = {"skipped": reason}
        ctx.warn(f"choose-precision: no precision probe ({reason}); every GEMM stays bf16 "
                 "(fp8 is never chosen unmeasured). Compile a smaller configuration to "
                 "measure, or pass --precision bf16 to make this explicit")
        return None, f"probe skipped: {reason}"

    @staticmethod
    def _targets(sites: list[Site], probe: PrecisionProbe | None) -> list[Target]:
        by_name: dict[str, Target] = {}
        for s in sites:
            t = by_name.setdefault(s.module, Target(s.module, False))
            t.sites.append(s)
            t.linear = s.op == "linear" and (probe.is_linear(s.module) if probe is not None
                                             else s.module_type == "Linear")
        return list(by_name.values())

    def _check_blocks(self, ctx: PassContext, probe: PrecisionProbe, targets: list[Target],
                      decisions: dict[fx.Node, dict[str, GemmDecision]],
                      opts: PrecisionOptions) -> list[dict[str, Any]]:
        results = []
        for region in sorted({s.region for t in targets for s in t.sites if s.region}):
            inside = [t for t in targets if t.name and _in_region(t.name, region)]
            ds = [(t, s, g, decisions[s.node][g]) for t in inside for s in t.sites
                  for g in fp8_recipe.GEMMS]
            near = any(d.sqnr.get("bf16") is not None
                       and d.sqnr["bf16"] < opts.min_sqnr_db + opts.block_margin_db
                       for *_, d in ds)
            has_fp8 = any(d.choice.dtype == "fp8" for *_, d in ds)
            if not (has_fp8 or near or opts.check_all_blocks):
                results.append({"region": region, "checked": False,
                                "why": "bf16 only, every GEMM well above the bound"})
                continue
            results.append(self._fix_block(ctx, probe, region, inside, ds, decisions, opts))
        return results

    def _fix_block(self, ctx: PassContext, probe: PrecisionProbe, region: str, inside: list[Target],
                   ds: list[Any], decisions: dict[fx.Node, dict[str, GemmDecision]],
                   opts: PrecisionOptions) -> dict[str, Any]:
        changes: list[str] = []
        res: BlockResult | None = None
        for _ in range(len(ds) + 1):
            try:
                res = probe.check_block(region, _assignment(inside, decisions))
            except Exception as exc:  # a block that cannot be re-run alone: no fp8 in it
                for *_, d in ds:
                    if d.choice.dtype == "fp8":
                        d.set("bf16", f"block {region} could not be checked")
                ctx.warn(f"choose-precision: block {region} could not be re-run alone "
                         f"({type(exc).__name__}: {exc}); its GEMMs stay bf16")
                return {"region": region, "checked": False, "why": f"error: {exc}"}
            if res is None or res.db >= opts.min_block_sqnr_db:
                break
            why = f"block {region} at {res.db:.1f} dB < {opts.min_block_sqnr_db:g} dB with it"
            fp8s = [x for x in ds if x[3].choice.dtype == "fp8"]
            if fp8s:
                t, s, g, d = min(fp8s, key=lambda x: x[3].sqnr.get(x[3].label) or 0.0)
                for other in t.sites:  # a layer's GEMM role changes for all its calls
                    decisions[other.node][g].set("bf16", why)
                changes.append(f"{t.name}.{g} fp8 -> bf16")
                continue
            bf16s = [x for x in ds if x[3].choice.dtype == "bf16"]
            if not bf16s:
                break
            t = min(bf16s, key=lambda x: x[3].sqnr.get("bf16") or 0.0)[0]
            for s in t.sites:
                for g in fp8_recipe.GEMMS:
                    if decisions[s.node][g].choice.dtype == "bf16":
                        decisions[s.node][g].set("fp32", why)
            changes.append(f"{t.name} bf16 -> fp32")
        if res is None:
            return {"region": region, "checked": False, "why": "not seen by the probe"}
        if res.db < opts.min_block_sqnr_db:
            ctx.warn(f"choose-precision: block {region} measures {res.db:.1f} dB even with "
                     f"its GEMMs in fp32 (bound {opts.min_block_sqnr_db:g} dB)")
        return {"region": region, "checked": True, "sqnr_db": _db(res.db),
                "outputs_db": _db(res.outputs_db), "input_grads_db": _db(res.input_grads_db),
                "param_grads_db": _db(res.param_grads_db), "changes": changes}

    # -- annotations
    @staticmethod
    def _annotate(gm: fx.GraphModule, sites: list[Site],
                  decisions: dict[fx.Node, dict[str, GemmDecision]],
                  facts: dict[str, Any]) -> None:
        blocks = {b["region"]: b for b in facts.get("blocks", [])}
        for s in sites:
            ds = decisions[s.node]
            record = {
                "module": s.module,
                "op": s.op,
                "region": s.region,
                "shape": {k: int(v) for k, v in s.problem.items()},
                **{g: ds[g].label for g in fp8_recipe.GEMMS},
                "block_sqnr_db": blocks.get(s.region, {}).get("sqnr_db"),
                "gemms": {g: ds[g].to_json() for g in fp8_recipe.GEMMS},
            }
            s.node.meta[ir.PRECISION] = record
            if ir.PREDICTED_MS in s.node.meta and all(d.prices for d in ds.values()):
                s.node.meta[ir.PREDICTED_MS] = sum(
                    1e3 * d.prices.of(d.choice.dtype) for d in ds.values())  # type: ignore[union-attr]
        out = next(n for n in gm.graph.nodes if n.op == "output")
        out.meta[ir.PRECISION] = facts
