"""Plan emission, the pipeline's last pass (``emit-plan``): aggregate the placed graph
into the plan document.

Why a pass: ``gemc.compile`` and ``gemc.replan`` end the same way, by running it (a
replanned plan is the plan a compile writes), and the pass manager times it and dumps
the graph it emitted from like any other step. Why here and not in ``passes/``: it calls
the Triton backend's kind implementations for the kernels' plan entries, which only the
driver layer may import (docs/architecture.md).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import ir
from gemc.context import PassContext
from gemc.exchange_precision import fixed_exchange, wire_of_plan
from gemc.graph_summary import GraphFacts, graph_facts
from gemc.passes.precision_sites import module_scopes
from gemc.plan import SCHEMA_VERSION
from gemc.version import __version__

# A training step runs the forward once and the backward (two GEMMs per forward GEMM).
TRAIN_FLOPS_FACTOR = 3


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and value != value:  # NaN is not JSON
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


_GEMMS = ("fwd", "dgrad", "wgrad")


def precision_entries(gm: fx.GraphModule, gpu: Any = None) -> list[dict[str, Any]]:
    """``plan["precision"]`` from the choose-precision annotations (empty without the pass).

    Entries are what the runner applies (backends/torch/precision.py): first ``"*"`` with
    the baseline dtype (and the rule, the probe and the block checks); then one entry per
    module whose choice differs from what it would inherit -- ``"fp8"`` (an ``nn.Linear``
    swapped for an fp8 linear running ``recipe``), ``"fp32"`` or ``"bf16"`` (an autocast
    scope). Every GEMM site's record (per GEMM: choice, SQNR, predicted times and gain, why
    the others were rejected) sits on the entry whose scope it runs in: sites running at
    the baseline on the ``"*"`` entry, with ``fp32_matmul`` (how fp32 GEMMs run, as
    priced: the runner sets TF32 from it), read off ``gpu`` (the compile's topology GPU;
    else the one predict-time priced with).
    """
    scopes = module_scopes(gm)
    if scopes is None:
        return []
    facts = next(n for n in gm.graph.nodes if n.op == "output").meta[ir.PRECISION]
    modules, dtype, owner = scopes.modules, scopes.dtype, scopes.owner
    applied = scopes.applied
    star: dict[str, Any] = {
        "target": "*",
        "dtype": scopes.baseline,
        "source": "choose-precision",
        "mode": facts["mode"],
        "rule": facts["rule"],
        "probe": facts["probe"],
        "blocks": facts["blocks"],
        "sites": [s for name, sites in modules.items() if owner[name] == "*" for s in sites],
    }
    gpu = gpu if gpu is not None else (gm.meta.get(ir.PRICING) or {}).get("gpu")
    star["fp32_matmul"] = getattr(gpu, "fp32_matmul", "ieee")  # what the prediction priced
    entries = [star]
    for name in modules:
        if name not in applied:
            continue
        sites = [s for m, ss in modules.items() if owner[m] == name for s in ss]
        gemms = [s["gemms"][g] for s in sites for g in _GEMMS]
        entry: dict[str, Any] = {
            "target": name,
            "dtype": dtype[name],
            "source": "choose-precision",
            "sqnr_db": min((g["sqnr_db"] for g in gemms if g["sqnr_db"] is not None),
                           default=None),
            "gain_ms": round(sum(g["gain_ms"] or 0.0 for g in gemms), 4),
        }
        if dtype[name] == "fp8":
            first = sites[0]["gemms"]
            entry["recipe"] = {
                g: {"dtype": first[g]["dtype"], "scaling": first[g]["scaling"]} for g in _GEMMS
            }
        entry["sites"] = sites
        entries.append(entry)
    return entries


def _modules(nodes: list[fx.Node]) -> list[str]:
    """Innermost module FQNs of the nodes (from torch.export's nn_module_stack)."""
    out = set()
    for node in nodes:
        stack = node.meta.get("nn_module_stack") or {}
        if stack:
            out.add(list(stack.values())[-1][0])
    return sorted(out)


def kernel_entries(gm: fx.GraphModule, ctx: PassContext) -> list[dict[str, Any]]:
    """``plan["kernels"]``: one entry per kernel group (``gemc.group``/``gemc.kernel``).

    Self-contained, as the runner needs nothing of the compiler: a fused group carries its
    spec (``structure``, and ``binding``: the nodes it reads and writes, shapes, dtypes),
    the sha256 of its generated source and, on the first entry with that hash, the source
    text (``code``); ``file`` is where ``--dump-dir`` puts it. The source is also a pure
    function of ``structure``, so it can be regenerated and checked against the hash.
    Recommendation kernels name their library module and the graph facts they need. Each
    kind's own fields come from its implementation's ``entry`` (``gemc.backends.triton.kinds``);
    layouts (``packed_tokens``) follow, from their ``layout_entries``.
    """
    # the kinds' implementations are the Triton backend's: imported when a plan is built,
    # not with the API (importing the backend imports Triton)
    from gemc.backends.triton import kinds

    members: dict[str, list[fx.Node]] = defaultdict(list)
    facts: dict[str, dict[str, Any]] = {}
    for node in gm.graph.nodes:
        gid = node.meta.get(ir.GROUP)
        if gid is not None:
            members[gid].append(node)
            if ir.KERNEL in node.meta:
                facts[gid] = node.meta[ir.KERNEL]
    entries: list[dict[str, Any]] = []
    with_code: set[str] = set()
    for gid, nodes in members.items():
        f = facts.get(gid)
        if f is None:
            continue
        kind = f["kind"]
        implementation = kinds.unit(kind)
        if implementation is None:
            raise ValueError(f"kernel group {gid} has kind {kind!r}, which no registered "
                             "implementation has (declare it in gemc/kernel_kinds.py and "
                             "register its implementation in gemc/backends/triton/kinds)")
        entry: dict[str, Any] = {
            "name": gid,
            "kind": kind,
            "nodes": [n.name for n in nodes],
            "replaces": _modules(nodes),
            "region": nodes[-1].meta.get(ir.REGION, ""),
            "predicted": {"before_ms": f.get("before_ms"), "after_ms": f.get("after_ms"),
                          # a matched attention's priced choice (passes/attention_choice)
                          **({"attention": f["attention_prices"]}
                             if f.get("attention_prices") else {})},
        }
        library = implementation.kind.library
        if library is not None:
            entry["library"] = library
        entry.update(implementation.entry(f, nodes))
        if "code" in entry:  # the source text once per hash
            if entry["sha256"] in with_code:
                del entry["code"]
            with_code.add(entry["sha256"])
        entries.append(entry)
    return entries + [e for layout in kinds.layouts() for e in layout.layout_entries(gm)]


def build_plan(
    gm: fx.GraphModule,
    ctx: PassContext,
    *,
    planner: str = "default",
    predicted: dict[str, Any] | None = None,
    facts: GraphFacts | None = None,
) -> dict[str, Any]:
    """The plan document of the placed graph ``gm`` (the model named by ``ctx``'s
    entrypoint, arguments and fingerprint): its ``facts`` (``graph_facts`` of ``gm`` when
    not given: the caller that prices them passes the same object) recorded as the
    plan's tables and regions, its kernels and precisions, the solver's report."""
    if facts is None:
        facts = graph_facts(gm, ctx.param_dtypes)
    topo = ctx.topology
    fwd_flops = sum(int(n.meta.get(ir.FLOPS, 0)) for n in gm.graph.nodes)
    embedding_params = sum(t.rows * t.dim for t in facts.tables)
    dense_params = sum(r.params for r in facts.regions)
    plan = {
        "schema_version": SCHEMA_VERSION,
        "gemc_version": __version__,
        "model": {
            "entrypoint": ctx.entrypoint,
            "args": _json_safe(ctx.args),  # only user values can be non-JSON types
            "fingerprint": ctx.fingerprint,
            "batch_size": ctx.batch_size,  # stated by the model; null when not
            "graph_nodes": len(gm.graph.nodes),
            "dense_params": dense_params,
            "embedding_params": embedding_params,
            "fwd_flops": fwd_flops,
            "train_flops_per_step": TRAIN_FLOPS_FACTOR * fwd_flops,
        },
        "topology": topo.to_dict(),
        "mesh": {
            "world_size": topo.world_size,
            "shape": [topo.hosts, topo.gpus_per_host],
            "dim_names": ["host", "local"],
        },
        "regions": [r.entry() for r in facts.regions],
        "tables": [t.entry() for t in facts.tables],
        "kernels": kernel_entries(gm, ctx),
        "precision": precision_entries(gm, topo.gpu if topo is not None else None),
        "predicted": predicted
        or {
            "step_ms": None,
            "mfu": None,
            "per_rank": None,
            "cost_model": None,
            "note": "no cost model in this pipeline: predictions are null, not invented",
        },
        "planner": planner,
        "warnings": list(ctx.warnings),
    }
    solver = gm.meta.get("gemc.solver")  # the parallelize pass's PlannerReport, if it ran
    kept = solver.cpsat.kept if solver is not None and solver.cpsat is not None else None
    if kept in ("greedy", "naive"):
        # CP-SAT was tried (solver.planner says so) but another planner's plan won: the
        # plan names the planner whose plan it is, not the one that was asked for
        plan["planner"] = kept
    if solver is not None:
        plan["solver"] = _json_safe(solver.to_dict())
    return plan


def emit_plan(gm: fx.GraphModule, ctx: PassContext, planner: str, *, predict: bool = True,
              table_optimizer: str | None = None,
              exchange_precision: str | None = None) -> dict[str, Any]:
    """The plan of a placed graph: the builder's plan, the table optimizer and the exchange
    precision the placement chose (or, where no planner chose them, the ones given here:
    the compile's options), and the prediction priced with them (``predict``: whether
    predict-time ran). The graph's facts are read once, recorded and priced."""
    from gemc.costing import predicted_block
    from gemc.passes.parallelize import EXCHANGE_META, TABLE_OPTIMIZER_META, step_options

    facts = graph_facts(gm, ctx.param_dtypes)
    plan = build_plan(gm, ctx, planner=planner, facts=facts)
    chosen = gm.meta.get(TABLE_OPTIMIZER_META) or (
        step_options(None).table_optimizer if table_optimizer in (None, "auto")
        else table_optimizer)
    plan["optimizer"] = {"embedding": {"kind": chosen}}
    plan["exchange"] = gm.meta.get(EXCHANGE_META) or fixed_exchange(exchange_precision)
    if predict:
        options = replace(step_options(chosen), exchange=wire_of_plan(plan))
        plan["predicted"] = predicted_block(gm, facts.regions, facts.tables,
                                            ctx.topology, ctx.calibration, options)
    return plan


@dataclass(frozen=True)
class EmitPlan:
    """The pipeline's last pass: builds the plan document of the placed graph
    (:func:`emit_plan`) into ``gm.meta[gemc.ir.PLAN]``, where the driver takes it; the
    graph itself is left as it is. Its fields are the compile's options the plan records:
    the planner's name, the table optimizer and exchange precision a plan without a
    planner states, and whether to price the step (False where predict-time is
    disabled: the ``predicted`` block then stays null, not invented)."""

    name: ClassVar[str] = "emit-plan"
    requires: ClassVar[tuple[str, ...]] = ("classify-ops", "collect-tables", "assign-regions")

    planner: str = "default"
    table_optimizer: str | None = None
    exchange_precision: str | None = None
    predict: bool = True

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        gm.meta[ir.PLAN] = emit_plan(gm, ctx, self.planner, predict=self.predict,
                                     table_optimizer=self.table_optimizer,
                                     exchange_precision=self.exchange_precision)
        return PassResult(gm, False)


def take_plan(gm: fx.GraphModule) -> dict[str, Any]:
    """The plan emit-plan left on ``gm`` (removed from it: a graph planned again emits its
    own). A pipeline that did not end with emit-plan is a bug of its driver."""
    plan = gm.meta.pop(ir.PLAN, None)
    if plan is None:
        raise RuntimeError("no plan on the graph: the pass list the driver ran did not end "
                           "with emit-plan; end it with gemc.plan_builder.EmitPlan (as "
                           "gemc.pipeline.default_pipeline and pipeline_from_spec do)")
    return plan
