"""Plan emission: aggregate the annotated graph into the plan document."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import torch
from torch import fx

import gemc
from gemc import ir
from gemc.capture import Captured
from gemc.context import PassContext
from gemc.ir import OpKind
from gemc.plan import SCHEMA_VERSION
from gemc.sharding import make_shards

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


def table_summaries(gm: fx.GraphModule, captured: Captured) -> list[dict[str, Any]]:
    """One entry per table FQN: size, lookups per batch, pooling, and its placement."""
    by_fqn: dict[str, dict[str, Any]] = {}
    for node in gm.graph.nodes:
        facts = node.meta.get(ir.TABLE)
        if facts is None:
            continue
        fqn = facts["fqn"]
        entry = by_fqn.setdefault(
            fqn,
            {
                "fqn": fqn,
                "rows": facts["rows"],
                "dim": facts["dim"],
                "nnz": 0,
                "batch": facts["batch"],
                "pooling": facts["mode"],
                "weighted": facts["weighted"],
                "dtype": captured.param_dtypes.get(fqn, "float32"),
                "lookups": 0,
                "placement": node.meta.get(ir.PLACEMENT),
                "predicted_ms": 0.0,
            },
        )
        entry["nnz"] += facts["nnz"]
        entry["lookups"] += 1
        entry["predicted_ms"] += float(node.meta.get(ir.PREDICTED_MS, 0.0))
    tables = []
    for fqn in sorted(by_fqn):
        entry = by_fqn[fqn]
        placement = entry.pop("placement") or {"sharding": "table_wise", "ranks": [0]}
        entry["sharding"] = placement["sharding"]
        if "cost" in placement:  # the parallelize pass's per-shard estimate
            entry["cost"] = placement["cost"]
        if "precision" in placement:  # the storage precision chosen with the sharding
            entry["precision"] = placement["precision"]
            entry["precision_reason"] = placement.get("precision_reason", "")
        entry["shards"] = make_shards(
            placement["sharding"],
            list(placement["ranks"]),
            entry["rows"],
            entry["dim"],
            placement.get("grid"),
        )
        entry["predicted_ms"] = round(entry["predicted_ms"], 6) if entry["predicted_ms"] else None
        tables.append(entry)
    return tables


def kernel_adjusted_ms(gm: fx.GraphModule) -> dict[fx.Node, float]:
    """Each node's forward+backward ms as the plan runs it (``gemc.predicted_ms`` is the node
    run alone, as ATen would): a kernel group's members scaled by its after/before,
    and, inside a packed token region, by the region's fill (the token-wise work shrinks
    with the real tokens; the jagged attention is already priced over them). Why: the step
    the plan predicts, and the placement the solver picks, are for the plan's kernels, not
    for the graph without them (the GEM h200 plan predicted 175 ms where its run measured
    82 ms before this).

    Attention runs under the plan's autocast: an fp32-captured attention is repriced at
    the autocast dtype (SDPA and the jagged kernel both run bf16 there), the jagged one on
    its real tokens (``fill``; inside a packed region it reads q/k/v in place). Why: at
    the captured fp32 the GEM h200 plan priced its two jagged attentions at 23.2 ms each
    and the cross attentions at 9.3 ms, where the profile of the run
    (benchmarks/results/e2e_h200_de5d649_gemc_alone.gemc.kernels.txt) shows ~3 ms and
    ~2 ms. Autocast also casts every fp32 operand of a GEMM or attention to bf16 in the
    forward and the gradient back in the backward (the run's profile: 130 bf16 casts,
    2.8 ms): each such node carries those copies. A packed region carries its boundary
    gathers and scatters (its after_ms less before_ms x fill) on its source node. (The
    backward's gradient additions are not a node's: gradient_accumulation_ms.)"""
    from gemc.cost_model.activations import plan_autocast, runtime_itemsize
    from gemc.passes.pack_jagged_tokens import PACKED, PACKED_REGION
    from gemc.passes.predict_time import PRICING

    pricing = gm.meta.get(PRICING)
    autocast = plan_autocast(gm) if pricing else None
    itemsize = runtime_itemsize(gm, autocast) if autocast else {}
    convert: dict[fx.Node, float] = {}
    ratio: dict[str, float] = {}
    attention: set[str] = set()
    fill: dict[str, float] = {}
    for node in gm.graph.nodes:
        facts = node.meta.get(ir.KERNEL)
        # a ratio, not after_ms itself: the precision pass reprices the nodes after the
        # kernel passes priced their groups (at the captured dtype). A transposed linear's
        # own time is already the GEMM alone (its before adds the copy it saves).
        if facts and facts.get("before_ms") and facts.get("after_ms") is not None \
                and facts.get("kind") != "transposed_linear":
            ratio[facts["id"]] = float(facts["after_ms"]) / float(facts["before_ms"])
        if facts and facts.get("kind") == "jagged_attention":
            attention.add(facts["id"])
        region = node.meta.get(PACKED_REGION)
        if region is not None:
            fill[region["id"]] = float(region["fill"])
            if region.get("after_ms") is not None and region.get("before_ms") is not None:
                convert[node] = convert.get(node, 0.0) + max(
                    0.0, float(region["after_ms"])
                    - float(region["before_ms"]) * float(region["fill"]))
    out: dict[fx.Node, float] = {}
    for node in gm.graph.nodes:
        ms = float(node.meta.get(ir.PREDICTED_MS, 0.0) or 0.0)
        gid = node.meta.get(ir.GROUP)
        packed = node.meta.get(PACKED)
        node_fill = fill.get(packed["id"], 1.0) if packed is not None else 1.0
        casts = _autocast_casts_ms(node, itemsize, pricing) * node_fill if autocast else 0.0
        repriced = _attention_at_autocast(node, autocast, pricing) if autocast else None
        if repriced is not None:
            out[node] = repriced + casts + convert.get(node, 0.0)
            continue
        ms *= ratio.get(gid, 1.0)
        if packed is not None and gid not in attention:
            ms *= node_fill
        out[node] = ms + casts + convert.get(node, 0.0)
    return out


def gradient_accumulation_ms(gm: fx.GraphModule) -> dict[fx.Node, float]:
    """ms of the backward's gradient additions, keyed by the last reader of each tensor
    (or dense weight) that several ops read: a tensor read by k ops gets k gradients,
    added up by k-1 kernels of its size (read 2, write 1), at its runtime element size
    and, inside a packed region, its fill. Table weights are left to the lookup kernel.
    Why: GEM h200 has 26 such adds, priced 5.1 ms, where the run's profile shows 28 add
    kernels taking 4.4 ms; they were priced as free. Empty before predict-time ran."""
    from gemc.cost_model import op_cost
    from gemc.cost_model.activations import _base, packed_fill, plan_autocast, runtime_itemsize
    from gemc.passes.predict_time import PRICING

    pricing = gm.meta.get(PRICING)
    if not pricing:
        return {}
    itemsize = runtime_itemsize(gm, plan_autocast(gm))
    fill = packed_fill(gm)
    readers: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op != "call_function" or ir.kind_of(node) is OpKind.VIEW:
            continue
        for arg in node.all_input_nodes:
            base = _base(arg)
            if node not in readers[base]:
                readers[base].append(node)
    out: dict[fx.Node, float] = defaultdict(float)
    for base, users in readers.items():
        dt = ir.dtype_of(base)
        val = base.meta.get("val")
        if len(users) < 2 or dt is None or not dt.is_floating_point \
                or not isinstance(val, torch.Tensor) \
                or any(u.meta.get(ir.TABLE) or ir.kind_of(u) is OpKind.EMBEDDING
                       for u in users):
            continue
        nbytes = 3.0 * val.numel() * (itemsize.get(base) or dt.itemsize) * fill.get(base, 1.0)
        t, _ = op_cost.memory_time(nbytes, pricing["gpu"], pricing["calibration"], "pointwise")
        out[users[-1]] += 1e3 * (len(users) - 1) * t
    return dict(out)


def _autocast_casts_ms(node: fx.Node, itemsize: dict[fx.Node, int],
                       pricing: dict[str, Any]) -> float:
    """Forward+backward ms of autocast's casts around a GEMM/attention node: each fp32
    floating operand read (4 B) and written bf16 (2 B), and its gradient back (2 + 4 B).
    Weights are counted too (autocast's cache casts each once a step)."""
    from gemc.cost_model import op_cost

    if ir.kind_of(node) not in (OpKind.GEMM, OpKind.ATTENTION):
        return 0.0
    total = 0.0
    for arg in node.all_input_nodes:
        dt = ir.dtype_of(arg)
        if dt is None or not dt.is_floating_point or itemsize.get(arg, 0) <= 2:
            continue
        val = arg.meta.get("val")
        numel = int(val.numel()) if isinstance(val, torch.Tensor) else 0
        if numel:
            t, _ = op_cost.memory_time(6.0 * numel, pricing["gpu"], pricing["calibration"],
                                       "copy")
            total += 2 * t
    return 1e3 * total


def _attention_at_autocast(node: fx.Node, autocast: str,
                           pricing: dict[str, Any]) -> float | None:
    """Forward+backward ms of an fp32-captured attention node run under ``autocast``
    (the jagged kernel over its real tokens), or None for any other node."""
    from gemc.cost_model import op_cost

    if ir.kind_of(node) is not OpKind.ATTENTION or ir.dtype_of(node) != torch.float32:
        return None
    gpu, calib = pricing["gpu"], pricing["calibration"]
    facts = node.meta.get(ir.KERNEL) or {}
    if facts.get("kind") == "jagged_attention":
        a = node.meta.get(ir.ATTENTION) or {}
        fwd, bwd, _ = op_cost.attention_time(a.get("batch", 1), facts["heads"],
                                             facts["max_len"], facts["max_len"],
                                             facts["head_dim"], bool(facts.get("causal")),
                                             autocast, gpu, calib)
        return 1e3 * (fwd + bwd) * float(facts["fill"])
    return op_cost.node_cost(node, gpu, calib, dtype=autocast).total_ms


def region_summaries(
    gm: fx.GraphModule, captured: Captured, table_fqns: set[str]
) -> list[dict[str, Any]]:
    """One entry per dense region: its weights (tables excluded), FLOPs, op mix, strategy."""
    flops: dict[str, int] = defaultdict(int)
    nbytes: dict[str, int] = defaultdict(int)
    kinds: dict[str, Counter] = defaultdict(Counter)
    params: dict[str, int] = defaultdict(int)
    param_bytes: dict[str, int] = defaultdict(int)
    strategy: dict[str, str] = {}
    extra: dict[str, dict[str, Any]] = {}  # the solver's shard_group / checkpoint, if any
    predicted: dict[str, float] = defaultdict(float)
    node_ms = kernel_adjusted_ms(gm)
    for node, ms in gradient_accumulation_ms(gm).items():
        predicted[node.meta.get(ir.REGION, "")] += ms
    for node in gm.graph.nodes:
        region = node.meta.get(ir.REGION, "")
        kind = ir.kind_of(node)
        fqn = node.meta.get(ir.PARAM)
        if fqn is not None:
            if fqn in table_fqns:
                continue
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                params[region] += int(val.numel())
                param_bytes[region] += ir.nbytes(val)
            kinds[region]["param"] += 1
            continue
        if (
            node.op != "call_function"
            or kind in (OpKind.VIEW, OpKind.EMBEDDING)
            or node.meta.get(ir.TABLE)
        ):
            continue
        flops[region] += int(node.meta.get(ir.FLOPS, 0))
        nbytes[region] += int(node.meta.get(ir.BYTES, 0))
        kinds[region][kind.value if kind else "other"] += 1
        predicted[region] += node_ms[node]
        placement = node.meta.get(ir.PLACEMENT) or {}
        strategy.setdefault(region, placement.get("strategy", "ddp"))
        extra.setdefault(
            region, {k: placement[k] for k in ("shard_group", "checkpoint") if k in placement}
        )
    names = sorted(set(flops) | set(params))
    return [
        {
            "name": name,
            "params": params[name],
            "param_bytes": param_bytes[name],
            "fwd_flops": flops[name],
            "fwd_bytes": nbytes[name],
            "ops": dict(sorted(kinds[name].items())),
            "strategy": strategy.get(name, "ddp"),
            "predicted_ms": round(predicted[name], 6) if predicted[name] else None,
            **extra.get(name, {}),
        }
        for name in names
    ]


_GEMMS = ("fwd", "dgrad", "wgrad")


def _module_dtype(sites: list[dict[str, Any]]) -> str:
    dtypes = {s["gemms"][g]["dtype"] for s in sites for g in _GEMMS}
    return "fp8" if "fp8" in dtypes else "fp32" if "fp32" in dtypes else "bf16"


def precision_entries(gm: fx.GraphModule) -> list[dict[str, Any]]:
    """``plan["precision"]`` from the choose-precision annotations (empty without the pass).

    Entries are what the runner applies (backends/torch/precision.py): first ``"*"`` with
    the baseline dtype (and the rule, the probe and the block checks); then one entry per
    module whose choice differs from what it would inherit -- ``"fp8"`` (an ``nn.Linear``
    swapped for an fp8 linear running ``recipe``), ``"fp32"`` or ``"bf16"`` (an autocast
    scope). Every GEMM site's record (per GEMM: choice, SQNR, predicted times and gain, why
    the others were rejected) sits on the entry whose scope it runs in: sites running at
    the baseline on the ``"*"`` entry.
    """
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    facts = out_node.meta.get(ir.PRECISION)
    if not isinstance(facts, dict):
        return []
    baseline = facts["baseline"]
    modules: dict[str, list[dict[str, Any]]] = {}
    for node in gm.graph.nodes:
        record = node.meta.get(ir.PRECISION) if node.op == "call_function" else None
        if isinstance(record, dict) and "gemms" in record:
            modules.setdefault(record["module"], []).append({"node": node.name, **record})
    dtype = {name: _module_dtype(sites) for name, sites in modules.items()}
    applied: set[str] = set()
    owner: dict[str, str] = {}  # module -> the entry whose scope it runs in
    for name in sorted(modules, key=lambda n: n.count(".")):  # parents before children
        scopes = [a for a in applied if name.startswith(a + ".") and dtype[a] != "fp8"]
        scope = max(scopes, key=len) if scopes else "*"
        if name and dtype[name] != (dtype[scope] if scopes else baseline):
            applied.add(name)  # e.g. an fp8 layer, or a bf16 layer inside an fp32 module
            scope = name
        owner[name] = scope
    star: dict[str, Any] = {
        "target": "*",
        "dtype": baseline,
        "source": "choose-precision",
        "mode": facts["mode"],
        "rule": facts["rule"],
        "probe": facts["probe"],
        "blocks": facts["blocks"],
        "sites": [s for name, sites in modules.items() if owner[name] == "*" for s in sites],
    }
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
    Recommendation kernels name their library module and the graph facts they need.
    """
    from gemc.backends.triton.codegen import generated, source_file_name
    from gemc.passes import fusion_spec
    from gemc.passes.group_embeddings import lookup_facts

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
        entry: dict[str, Any] = {
            "name": gid,
            "kind": kind,
            "nodes": [n.name for n in nodes],
            "replaces": _modules(nodes),
            "region": nodes[-1].meta.get(ir.REGION, ""),
            "predicted": {"before_ms": f.get("before_ms"), "after_ms": f.get("after_ms")},
        }
        if kind == "jagged_attention":
            q, k, v = (a.name for a in nodes[0].args[:3])
            keep = ("offsets", "clamp_min", "max_len", "heads", "head_dim", "scale", "causal",
                    "fill", "padded_from")
            entry.update(library="gemc.backends.triton.jagged_attention", q=q, k=k, v=v,
                         **{key: f[key] for key in keep})
        elif kind == "key_padding_attention":
            # an SDPA node (q, k, v its arguments), or a written-out formula (named in facts)
            q, k, v = (f["q"], f["k"], f["v"]) if "q" in f else \
                (a.name for a in nodes[0].args[:3])
            keep = ("mask", "additive", "causal", "zero_padding_queries", "queries",
                    "max_len", "heads", "head_dim", "scale", "fill")
            entry.update(library="gemc.backends.triton.key_padding_attention", q=q, k=k, v=v,
                         output=f.get("output", nodes[0].name),
                         merged_heads=bool(f.get("merged_heads", False)),
                         nan_if_empty=bool(f.get("nan_if_empty", False)),
                         **{key: f[key] for key in keep})
        elif kind == "jagged_silu_attention":
            keep = ("q", "k", "v", "output", "mask", "bias", "norm", "scale", "causal",
                    "query_mask", "max_len", "heads", "head_dim", "fill")
            entry.update(library="gemc.backends.triton.key_padding_attention",
                         **{key: f[key] for key in keep})
        elif kind == "transposed_linear":
            node = nodes[0]
            bias = node.args[2] if len(node.args) > 2 else None
            entry.update(library="gemc.backends.triton.transposed_linear",
                         input=node.args[0].name, weight=node.args[1].name,
                         bias=bias.name if isinstance(bias, fx.Node) else None)
        elif kind == "batched_embedding_bag":
            tables = [t for t in (lookup_facts(n) for n in nodes) if t is not None]
            entry.update(library="gemc.backends.triton.embedding_bag", batch=f["batch"],
                         tables=tables,
                         optimizer={key: f[key] for key in ("optimizer", "lr", "eps",
                                                            "weight_decay")})
        else:
            inside = set(nodes)
            outputs = [n for n in nodes if any(u not in inside for u in n.users)]
            structure, binding = fusion_spec.build(kind, nodes, outputs)
            source, digest = generated(structure)
            entry.update(structure=structure, binding=binding, sha256=digest,
                         file=source_file_name(digest))
            if digest not in with_code:
                entry["code"] = source
                with_code.add(digest)
        entries.append(entry)
    return entries + packed_entries(gm)


def packed_entries(gm: fx.GraphModule) -> list[dict[str, Any]]:
    """One ``packed_tokens`` entry per region ``pack-jagged-tokens`` found: not a kernel of
    its own but a layout the runner keeps the region's values in (its nodes overlap the
    fused groups and the jagged attention that run inside it)."""
    from gemc.passes.pack_jagged_tokens import PACKED, PACKED_REGION

    out = []
    for node in gm.graph.nodes:
        f = node.meta.get(PACKED_REGION)
        if f is None:
            continue
        members = [n for n in gm.graph.nodes if (n.meta.get(PACKED) or {}).get("id") == f["id"]]
        facts = {k: v for k, v in f.items() if k not in ("id", "before_ms", "after_ms")}
        out.append({"name": f["id"], "replaces": [], "region": node.meta.get(ir.REGION, ""),
                    "library": "gemc.backends.triton.packed_tokens",
                    "nodes": [n.name for n in members],
                    "dims": {n.name: n.meta[PACKED]["dims"] for n in members},
                    "zeroed": [n.name for n in members if n.meta[PACKED]["zeroed"]],
                    "predicted": {"before_ms": f["before_ms"], "after_ms": f["after_ms"]},
                    **facts})
    return out


def build_plan(
    gm: fx.GraphModule,
    ctx: PassContext,
    captured: Captured,
    *,
    planner: str = "default",
    predicted: dict[str, Any] | None = None,
) -> dict[str, Any]:
    tables = table_summaries(gm, captured)
    table_fqns = {t["fqn"] for t in tables}
    regions = region_summaries(gm, captured, table_fqns)
    topo = ctx.topology
    fwd_flops = sum(int(n.meta.get(ir.FLOPS, 0)) for n in gm.graph.nodes)
    embedding_params = sum(t["rows"] * t["dim"] for t in tables)
    dense_params = sum(r["params"] for r in regions)
    plan = {
        "schema_version": SCHEMA_VERSION,
        "gemc_version": gemc.__version__,
        "model": {
            "entrypoint": ctx.entrypoint,
            "args": _json_safe(ctx.args),  # only user values can be non-JSON types
            "fingerprint": captured.fingerprint,
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
        "regions": regions,
        "tables": tables,
        "kernels": kernel_entries(gm, ctx),
        "precision": precision_entries(gm),
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
    solver = gm.meta.get("gemc.solver")  # the parallelize pass's report, if it ran
    if solver is not None and solver.get("kept") in ("greedy", "naive"):
        # CP-SAT was tried (solver.planner says so) but another planner's plan won: the
        # plan names the planner whose plan it is, not the one that was asked for
        plan["planner"] = solver["kept"]
    if solver is not None:
        plan["solver"] = _json_safe(solver)
    return plan
