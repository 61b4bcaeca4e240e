"""TorchRec's side of ``vs_torchrec.py``: run in TorchRec's own venv (no gemc import).

    benchmarks/.venv_torchrec/bin/python benchmarks/torchrec_worker.py REQUEST.json RESULT.json

The request names the tables (name, rows, dim, pooling factor), the topology (world,
local world, HBM per GPU), the local batch, and gemc's plan (per table: sharding type and
the rank of each shard). The worker

1. plans the tables with ``EmbeddingShardingPlanner`` (TorchRec's defaults: greedy
   proposer, its perf and storage estimators, 15% heuristic storage reservation) and times it;
2. prices a plan the way TorchRec's planner does (its ``NoopPerfModel``: the largest sum,
   over ranks, of the estimated perf of the shards a rank holds; storage likewise) for its
   own plan and for gemc's. Shard estimates come from TorchRec's enumerator (perf and
   storage per shard, rank-independent), one enumeration per distinct table and shard
   count (repeated tables share it).

The optimizer is row-wise Adagrad (fused, ``EXACT_ROWWISE_ADAGRAD``), DLRMv2's, on both sides.
``priced_with`` (name -> TorchRec bandwidths in bytes/ms) prices both plans again with other
link rates than TorchRec's defaults (12.5 GiB/s across hosts: one 100 Gb/s NIC).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.constants import CROSS_NODE_BANDWIDTH, INTRA_NODE_BANDWIDTH
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import (
    EmbeddingPerfEstimator,
    EmbeddingStorageEstimator,
)
from torchrec.distributed.planner.types import (
    BasicCommsBandwidths,
    CollectiveType,
    GeneralizedCommsBandwidth,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

try:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
except ImportError:  # older layouts
    from torchrec.optim.rowwise_adagrad import EmbOptimType  # type: ignore

# the published rates and their arithmetic, shared with gemc's side (no gemc import)
from torchrec_rates import ap_all_reduce_knob, ap_all_to_all, share_bw  # noqa: E402

FUSED = EmbeddingComputeKernel.FUSED.value
# gemc's sharding names -> TorchRec's
TO_TORCHREC = {"table_wise": "table_wise", "row_wise": "row_wise", "column_wise": "column_wise",
               "table_row_wise": "table_row_wise", "data_parallel": "data_parallel",
               "grid": "grid_shard"}


def sharder() -> EmbeddingBagCollectionSharder:
    return EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD})


class CorrectedComms(GeneralizedCommsBandwidth):
    """TorchRec's own knob for link rates (``Topology(generalized_comms_bandwidths=)``)
    with the all-to-all rate corrected; every other collective as ``BasicCommsBandwidths``.

    ``kind`` "share": an all-to-all's bytes split as the collective sends them (NVLink's
    share at ``intra``, the cross-host share at ``inter``, ``torchrec_rates.share_bw``)
    instead of all of them at ``inter``; "ap": AutoParallel's measured per-rank all-to-all
    rate for the shape (``torchrec_rates.ap_all_to_all``) and its measured all-reduce for
    the data-parallel tables' gradients (``torchrec_rates.ap_all_reduce_knob``)."""

    def __init__(self, kind: str, intra: float, inter: float) -> None:
        if kind not in ("share", "ap"):
            raise ValueError(f"comms kind {kind!r} in the request: use 'share' or 'ap'")
        self.kind = kind
        self.basic = BasicCommsBandwidths(inter_host_bw=inter, intra_host_bw=intra)

    @property
    def intra_host_bw(self) -> float:
        return self.basic.intra_host_bw

    @property
    def inter_host_bw(self) -> float:
        return self.basic.inter_host_bw

    def get_bw(self, local_world_size: int, world_size: int,
               collective_type: CollectiveType) -> float:
        if self.kind == "ap" and collective_type == CollectiveType.ALL_REDUCE:
            return ap_all_reduce_knob(world_size, local_world_size)
        if collective_type != CollectiveType.ALL_TO_ALL:
            return self.basic.get_bw(local_world_size=local_world_size, world_size=world_size,
                                     collective_type=collective_type)
        if self.kind == "share":
            return share_bw(world_size, local_world_size, self.intra_host_bw,
                            self.inter_host_bw)
        gpus = min(local_world_size, world_size)
        return ap_all_to_all(max(1, world_size // gpus), gpus)

    def __hash__(self) -> int:
        return hash((self.kind, hash(self.basic)))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, CorrectedComms) and self.kind == other.kind
                and self.basic == other.basic)


def topology(req: dict[str, Any]) -> Topology:
    """TorchRec's topology; its bandwidths (bytes/ms) are its defaults unless the request
    names them (``bandwidths``: intra_host_bw, inter_host_bw, hbm_mem_bw), its all-to-all
    rate TorchRec's unless ``comms`` names a :class:`CorrectedComms` kind."""
    bw = dict(req.get("bandwidths", {}))
    if req.get("comms"):
        bw["generalized_comms_bandwidths"] = CorrectedComms(
            req["comms"], bw.get("intra_host_bw", INTRA_NODE_BANDWIDTH),
            bw.get("inter_host_bw", CROSS_NODE_BANDWIDTH))
    return Topology(world_size=req["world"], compute_device="cuda",
                    local_world_size=req["local"], hbm_cap=int(req["hbm_bytes"]),
                    pod_size=req.get("pod_size"), **bw)


def a2a_rate(req: dict[str, Any]) -> float:
    """The rate (bytes/ms) the pricing charges the world-wide all-to-all at."""
    return topology(req).comms_bandwidths.get_bw(
        local_world_size=req["local"], world_size=req["world"],
        collective_type=CollectiveType.ALL_TO_ALL)


def ebc(tables: list[dict[str, Any]]) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=t["name"], feature_names=[t["name"]],
                           num_embeddings=t["rows"], embedding_dim=t["dim"])
        for t in tables], device=torch.device("meta"))


def constraints(tables: list[dict[str, Any]], **extra: Any) -> dict[str, ParameterConstraints]:
    return {t["name"]: ParameterConstraints(pooling_factors=[float(t["pooling"])], **extra)
            for t in tables}


def enumerator(req: dict[str, Any], cons: dict[str, ParameterConstraints]
               ) -> EmbeddingEnumerator:
    """TorchRec's enumerator with its perf and storage estimators on the request's
    topology; ``lookup_hooks`` (name -> bool) set TorchRec's own per-config hooks
    (estimator/annotations.py: use_block_usage_penalty, use_min_dim_for_lookup) on its
    perf estimator's config."""
    topo = topology(req)
    perf = EmbeddingPerfEstimator(topology=topo, constraints=cons)
    for hook, on in (req.get("lookup_hooks") or {}).items():
        setattr(perf._estimator.config, f"_{hook}", bool(on))
    return EmbeddingEnumerator(
        topology=topo, batch_size=req["batch"], constraints=cons,
        estimator=[perf, EmbeddingStorageEstimator(topology=topo, constraints=cons)])


def plan_with_torchrec(req: dict[str, Any]) -> dict[str, Any]:
    """TorchRec's plan of the tables; under the request's knobs when it names any (its
    enumerator passed only when lookup hooks are set, so the default path is TorchRec's
    own)."""
    tables = req["tables"]
    cons = constraints(tables)
    extra = {"enumerator": enumerator(req, cons)} if req.get("lookup_hooks") else {}
    planner = EmbeddingShardingPlanner(topology=topology(req), batch_size=req["batch"],
                                       constraints=cons, **extra)
    start = time.perf_counter()
    plan = planner.plan(ebc(tables), [sharder()])
    seconds = time.perf_counter() - start
    out = {}
    for _, module_plan in plan.plan.items():
        for name, ps in module_plan.items():
            shards = []
            spec = ps.sharding_spec
            if spec is not None:
                for s in spec.shards:
                    rank = s.placement.rank()
                    shards.append({"rank": rank, "offsets": list(s.shard_offsets),
                                   "sizes": list(s.shard_sizes)})
            else:  # data parallel: every rank
                shards = [{"rank": r} for r in (ps.ranks or range(req["world"]))]
            out[name] = {"sharding": ps.sharding_type, "kernel": ps.compute_kernel,
                         "ranks": list(ps.ranks or []), "shards": shards}
    return {"seconds": seconds, "plan": out}


class Pricer:
    """TorchRec's per-shard perf and storage, one enumeration per distinct table, sharding
    type and shape (repeated tables are priced once). The enumeration is held to the one
    sharding type asked for: a shard's estimate does not depend on the other options, and
    enumerating every type at 4,096 ranks takes minutes a table."""

    def __init__(self, req: dict[str, Any]) -> None:
        self.req = req
        self.cache: dict[tuple, list[Any]] = {}

    def options(self, t: dict[str, Any], kind: str, cw_shards: int | None = None,
                grid_cols: int | None = None, grid_rows: int | None = None) -> list[Any]:
        """TorchRec's ``kind`` options for a table; ``cw_shards``: that many column blocks
        (column-wise), ``grid_cols``: its grid_shard with that many column blocks of
        ``grid_rows`` row shards. TorchRec cuts a grid's column block over its table-row-wise
        group (``intra_group_size``: a host, or ``pod_size`` hosts), so a block of more row
        shards than a host has GPUs is priced with ``pod_size`` that many hosts: TorchRec's
        own pricing of a group across hosts (its reduce-scatter at the cross-host rate)."""
        local = self.req["local"]
        pod = grid_rows // local if grid_rows and grid_rows > local else None
        key = (t["rows"], t["dim"], t["pooling"], kind, cw_shards, grid_cols, pod)
        if key not in self.cache:
            one = [dict(t, name="t")]
            extra: dict[str, Any] = {"sharding_types": [kind]}
            if cw_shards:
                extra["min_partition"] = t["dim"] // cw_shards
            if grid_cols:
                extra["min_partition"] = t["dim"] // grid_cols
            req = {**self.req, "pod_size": pod} if pod else self.req
            enum = enumerator(req, constraints(one, **extra))
            self.cache[key] = enum.enumerate(ebc(one), [sharder()])
        return self.cache[key]

    def price(self, tables: list[dict[str, Any]], plan: dict[str, dict[str, Any]]
              ) -> dict[str, Any]:
        """(max over ranks of summed shard perf, ms; per-rank HBM, GB) of a plan, and every
        shard's terms as TorchRec reports them (``shards``: table, sharding, ranks -- a
        list, or "all" for data parallel --, rows, cols, its Perf's fields); tables
        TorchRec cannot price that way are listed in ``unpriced``."""
        world = self.req["world"]
        perf = [0.0] * world
        hbm = [0.0] * world
        comms = [0.0] * world  # of perf: the outputs' and gradients' communication
        held: list[list[str]] = [[] for _ in range(world)]
        records: list[dict[str, Any]] = []
        unpriced = []
        for t in tables:
            p = plan[t["name"]]
            kind = TO_TORCHREC.get(p["sharding"], p["sharding"])
            ranks = p["ranks"]
            if kind == "data_parallel":
                opts = self.options(t, kind)
            else:
                cw = len(ranks) if kind == "column_wise" else None
                # gemc's grid: round(sqrt(shards)) column blocks (its memory model's shape)
                cols = round(len(ranks) ** 0.5) if kind == "grid_shard" else None
                rows = len(ranks) // cols if cols else None
                opts = [o for o in self.options(t, kind, cw, cols, rows)
                        if o.compute_kernel == FUSED and len(o.shards) == len(ranks)]
            if not opts:
                unpriced.append(f"{t['name']} ({p['sharding']} x{len(ranks)})")
                continue
            o = opts[0]
            if kind == "data_parallel":
                placed = [(r, o.shards[0]) for r in range(world)]
                records.append(shard_record(t["name"], kind, "all", o.shards[0]))
            else:
                placed = list(zip(ranks, o.shards))
                records.extend(shard_record(t["name"], kind, [r], s) for r, s in placed)
            for rank, shard in placed:
                perf[rank] += shard.perf.total
                hbm[rank] += shard.storage.hbm
                sp = shard.perf
                comms[rank] += sp.fwd_comms + sp.bwd_comms
                if kind != "data_parallel":
                    held[rank].append(f"{t['name']} {kind} {shard.size[1]}c")
        top = max(range(world), key=perf.__getitem__)
        # where the figure comes from: the slowest rank's communication and compute, and
        # what it holds (data-parallel tables, on every rank, left out of the list)
        return {"max_perf_ms": max(perf), "max_hbm_gb": max(hbm) / 1e9,
                "mean_hbm_gb": sum(hbm) / world / 1e9, "unpriced": unpriced,
                "max_rank": top, "max_rank_comms_ms": comms[top],
                "max_rank_compute_ms": perf[top] - comms[top], "max_rank_shards": held[top],
                "shards": records}


def shard_record(table: str, kind: str, ranks: Any, shard: Any) -> dict[str, Any]:
    """One shard as priced: where it sits, its size, and TorchRec's Perf of it (ms)."""
    sp = shard.perf
    return {"table": table, "sharding": kind, "ranks": ranks, "rows": int(shard.size[0]),
            "cols": int(shard.size[1]), "row_offset": int(shard.offset[0]),
            "col_offset": int(shard.offset[1]), "fwd_compute": sp.fwd_compute,
            "bwd_compute": sp.bwd_compute, "fwd_comms": sp.fwd_comms,
            "bwd_comms": sp.bwd_comms, "prefetch_compute": sp.prefetch_compute,
            "input_dist_comms": sp.input_dist_comms}


def main(argv: list[str]) -> int:
    req = json.loads(open(argv[1]).read())
    result: dict[str, Any] = {"torch": torch.__version__}
    try:
        import torchrec

        result["torchrec"] = torchrec.__version__
    except Exception:  # a version string is a nicety
        result["torchrec"] = "?"
    pricer = Pricer(req)
    if req.get("gemc_plan"):
        result["gemc_under_torchrec"] = pricer.price(req["tables"], req["gemc_plan"])
    if req.get("plan", True):
        tr = plan_with_torchrec(req)
        result.update(torchrec_seconds=tr["seconds"], torchrec_plan=tr["plan"])
        own = {name: {"sharding": p["sharding"], "ranks": p["ranks"]}
               for name, p in tr["plan"].items()}
        result["torchrec_under_torchrec"] = pricer.price(req["tables"], own)
    # both plans' every shard under each pricing (``terms``: name -> {"bandwidths",
    # "comms"}), with the rate that pricing charges the world-wide all-to-all at
    if req.get("terms"):
        plans = {"gemc": req.get("gemc_plan"), "torchrec": own if "torchrec_plan" in result
                 else None}
        result["terms"] = {}
        for name, knobs in req["terms"].items():
            sub = {**req, "bandwidths": knobs.get("bandwidths", {}), "comms": knobs.get("comms"),
                   "lookup_hooks": knobs.get("lookup_hooks")}
            again = Pricer(sub)
            result["terms"][name] = {
                "a2a_bw": a2a_rate(sub),
                **{who: again.price(req["tables"], p) for who, p in plans.items() if p}}
    # the same plans under TorchRec's estimator told the hardware's link rates
    for name, bw in (req.get("priced_with") or {}).items():
        again = Pricer({**req, "bandwidths": bw})
        if req.get("gemc_plan"):
            result[f"gemc_under_torchrec_{name}"] = again.price(req["tables"], req["gemc_plan"])
        if "torchrec_plan" in result:
            result[f"torchrec_under_torchrec_{name}"] = again.price(req["tables"], own)
    with open(argv[2], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
