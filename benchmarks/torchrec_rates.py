"""Published rates that correct TorchRec's estimator, and the arithmetic that re-prices its
per-shard terms with them (issue 19). Pure Python: imported by ``torchrec_worker.py`` in
TorchRec's venv (which must not import gemc) and by ``torchrec_estimator_corrected.py`` and
its tests in gemc's.

Every rate below is bytes/ms (TorchRec's unit) and names its source in ``SOURCES``. Where a
rate enters TorchRec's formula through one of its own knobs (``Topology``'s ``hbm_mem_bw``,
``intra_host_bw``, ``inter_host_bw`` or a ``GeneralizedCommsBandwidth``), the worker sets
the knob and TorchRec computes; only the PXN correction, which depends on which host holds
each shard, is re-derived here (:func:`rank_times`), and the re-derivation without it
reproduces TorchRec's own figure (the tests).
"""

from __future__ import annotations

import math
from typing import Any

GB = 1e9
MS = 1e3  # TorchRec's bandwidths are bytes per millisecond


def per_ms(gb_per_s: float) -> float:
    """GB/s (10^9 B/s) as TorchRec's bytes/ms."""
    return gb_per_s * GB / MS


# What each correction cites (title, URL, the figure used); BENCHMARKS.md quotes these.
SOURCES: dict[str, dict[str, str]] = {
    "hbm": {
        "title": "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM)",
        "url": "https://www.nvidia.com/en-us/data-center/h200/",
        "figure": "141 GB HBM3e at 4.8 TB/s (TorchRec's HBM_MEM_BW is 897 GiB/s = 963 GB/s)",
    },
    "nic": {
        "title": "nccl-tests issue #290, NVIDIA's answer (H100, ConnectX-7 NDR 400 Gb/s)",
        "url": "https://github.com/NVIDIA/nccl-tests/issues/290",
        "figure": "46-48 GB/s per NIC measured across hosts (46 used; TorchRec's "
                  "CROSS_NODE_BANDWIDTH is 12.5 GiB/s = 13.4 GB/s, a 100 Gb/s NIC)",
    },
    "nvlink": {
        "title": "AutoParallel's H100 NVSwitch + 400G RoCE collective tables, fitted from "
                 "nccl-tests (meta-pytorch/autoparallel)",
        "url": "https://github.com/meta-pytorch/autoparallel/blob/"
               "331b7d9e7dd42abec4e47bb7826f1518e8ba9c05/autoparallel/cost_models/"
               "h100_nvswitch_roce_400g.py",
        "figure": "all_to_all (1 host, 8 GPUs): 374.4 GB/s per rank (reduce_scatter 392.0, "
                  "all_gather 386.1); TorchRec's INTRA_NODE_BANDWIDTH is 600 GiB/s = 644 GB/s",
    },
    "share": {
        "title": "the all-to-all's own definition (each rank's pooled output goes to every "
                 "rank's local batch) and the topology: 8 GPUs on NVLink per host",
        "url": "https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md",
        "figure": "of a shard's output 1/W stays on its GPU, (L-1)/W crosses NVLink, "
                  "(W-L)/W crosses hosts (W ranks, L per host)",
    },
    "pxn": {
        "title": "NVIDIA, \"Doubling all2all Performance with NVIDIA Collective Communication "
                 "Library 2.12\"",
        "url": "https://developer.nvidia.com/blog/doubling-all2all-performance-with-nvidia-"
               "collective-communication-library-2-12/",
        "figure": "PXN (on by default since NCCL 2.12) sends a GPU's cross-host messages "
                  "through the NVLink peer on the destination's rail, so a host's cross-host "
                  "bytes leave by all its NICs; the blog measures all2all up to 2x faster",
    },
    "measured": {
        "title": "AutoParallel's H100 NVSwitch + 400G RoCE collective tables, fitted from "
                 "nccl-tests (meta-pytorch/autoparallel)",
        "url": "https://github.com/meta-pytorch/autoparallel/blob/"
               "331b7d9e7dd42abec4e47bb7826f1518e8ba9c05/autoparallel/cost_models/"
               "h100_nvswitch_roce_400g.py",
        "figure": "peak bandwidth per rank (nccl-tests size / time): all_to_all 2x8 82.5 GB/s, "
                  "8x8 46.8, 32x8 43.1, one GPU per host 2x1 76.8, 8x1 46.0, 32x1 46.8; "
                  "all_reduce 2x8 193.1, 8x8 171.4, 32x8 129.8",
    },
}

# TorchRec 1.8.0's defaults (planner/constants.py), for the reproduction checks.
TORCHREC_HBM = 897 * 1024**3 / MS
TORCHREC_INTRA = 600 * 1024**3 / MS
TORCHREC_INTER = 12.5 * 1024**3 / MS

H200_HBM = per_ms(4800.0)  # datasheet
# an assumption, for the verdict's sensitivity: that TorchRec's 963 GB/s is the share of an
# A100 80GB's 2,039 GB/s (its datasheet) that a lookup reaches, and an H200 reaches as much
H200_HBM_DERATED = H200_HBM * TORCHREC_HBM / per_ms(2039.0)
NDR_NIC = per_ms(46.0)  # NV290, lower end of 46-48
NVLINK_A2A = per_ms(374.401576)  # AP all_to_all (1, 8)

# AP's fitted all_to_all peak bandwidth, GB/s, by (hosts, GPUs per host); its latency and its
# size ramp are not applied (see BENCHMARKS.md). Shapes past 32 hosts take the 32-host
# figure: an assumption (AP measured no larger).
AP_ALL_TO_ALL_GBPS: dict[tuple[int, int], float] = {
    (1, 8): 374.401576, (2, 8): 82.508803, (4, 8): 55.765076, (8, 8): 46.789495,
    (16, 8): 43.551845, (32, 8): 43.056701,
    (2, 1): 76.829836, (4, 1): 61.11473, (8, 1): 45.992665, (16, 1): 47.264223,
    (32, 1): 46.781375,
}


# ... and its all_reduce (algorithm bandwidth, nccl-tests size / time), 8 GPUs a host
AP_ALL_REDUCE_GBPS: dict[tuple[int, int], float] = {
    (1, 8): 211.734617, (2, 8): 193.078468, (4, 8): 187.746513, (8, 8): 171.39765,
    (16, 8): 130.012097, (32, 8): 129.839793,
}


def _ap(table: dict[tuple[int, int], float], op: str, hosts: int, gpus: int) -> float:
    """AP's measured rate (bytes/ms) for ``hosts`` x ``gpus``: the nearest measured host
    count at or below (32 past 32)."""
    known = sorted(h for h, g in table if g == gpus)
    if not known:
        raise ValueError(f"AP measured no {op} with {gpus} GPUs per host; known shapes: "
                         f"{sorted(table)}; add the shape's row from SOURCES['measured']")
    at = max([h for h in known if h <= hosts] or [known[0]])
    return per_ms(table[(at, gpus)])


# ... and, for the all-to-all at 8 GPUs a host, its fitted latency (us) and size ramp: the
# share of the peak bandwidth reached with a per-peer chunk of 64 x 2^i bytes (AP's
# fit_profile.py: time = latency + bytes / (peak x ramp(log2(chunk / 64)))).
AP_ALL_TO_ALL_LATENCY_US: dict[int, float] = {2: 107.584, 8: 173.759997, 16: 323.663995,
                                              32: 636.143982}
AP_ALL_TO_ALL_RAMP: dict[int, tuple[float, ...]] = {
    2: (0.03043, 0.01805, 0.01, 0.01, 0.01, 0.01, 0.052269, 0.136005, 0.250046, 0.386247,
        0.509604, 0.585114, 0.63155, 0.667687, 0.771885, 0.869944, 0.943457, 0.925582,
        0.968346, 0.967401, 0.999668, 1.0, 1.0, 1.0),
    8: (0.01, 0.01, 0.01, 0.01, 0.11495, 0.363726, 0.648272, 0.886742, 0.997293, 0.898079,
        0.777973, 0.825848, 0.625731, 0.731843, 0.836931, 0.919436, 0.954716, 0.988598, 1.0,
        1.0, 1.0, 1.0, 1.0, 1.0),
    16: (0.01, 0.347972, 0.656088, 0.886504, 1.0, 1.0, 1.0, 1.0, 1.0, 0.9984, 0.935775,
         0.938098, 0.912835, 0.865016, 0.952429, 0.990285, 0.999979, 0.994526, 0.989072,
         0.983619, 0.978166, 0.972713, 0.96726, 0.961807),
    32: (0.066816, 0.074591, 0.097428, 0.150386, 0.248529, 0.406916, 0.593547, 0.776421,
         0.923536, 1.0, 0.98249, 0.916307, 0.976105, 0.945287, 0.968074, 0.999239, 0.996528,
         0.993816, 0.991105, 0.988394, 0.985683, 0.982972, 0.98026, 0.977549),
}


def ap_all_to_all_ms(nbytes: float, world: int, local: int = 8) -> float:
    """AP's fitted time (ms) of one all-to-all in which a rank sends ``nbytes`` in all to
    ``world`` ranks, ``local`` a host: its latency plus the bytes at its peak rate times the
    ramp at the per-peer chunk (the nearest measured host count at or below, 32 past 32)."""
    if local != 8:
        raise ValueError(f"AP's all-to-all ramps here are for 8 GPUs a host, not {local}; "
                         "add the shape's rows from SOURCES['measured']")
    if nbytes <= 0:
        return 0.0
    hosts = max(1, world // local)
    at = max([h for h in AP_ALL_TO_ALL_RAMP if h <= hosts] or [min(AP_ALL_TO_ALL_RAMP)])
    ramp = AP_ALL_TO_ALL_RAMP[at]
    x = min(max(math.log2(nbytes / world / 64.0), 0.0), len(ramp) - 1.0)
    lo = min(int(x), len(ramp) - 2)
    share = ramp[lo] + (ramp[lo + 1] - ramp[lo]) * (x - lo)
    return AP_ALL_TO_ALL_LATENCY_US[at] / 1e3 + nbytes / (ap_all_to_all(hosts, local) * share)


def ap_all_to_all(hosts: int, gpus: int) -> float:
    """AP's measured all-to-all rate per rank (bytes/ms) for ``hosts`` x ``gpus``."""
    return _ap(AP_ALL_TO_ALL_GBPS, "all_to_all", hosts, gpus)


def ap_all_reduce_knob(world: int, local: int) -> float:
    """The rate to hand TorchRec's data-parallel all-reduce so that its formula
    (``DataParallelEvaluator._default_bwd_comms``: table bytes x (2n-1)/n / rate, n =
    min(hosts, 2), doubled past two hosts) gives AP's measured time, bytes / algbw."""
    hosts = max(1, world // local)
    n = min(world / local, 2)
    factor = (2 * n - 1) / n * (2 if world > 2 * local else 1)
    return _ap(AP_ALL_REDUCE_GBPS, "all_reduce", hosts, min(local, world)) * factor


def a2a_shares(world: int, local: int) -> tuple[float, float]:
    """(NVLink share, cross-host share) of an all-to-all's bytes sent by one rank to all
    ``world`` ranks, ``local`` per host; the rest (1/world) stays on the GPU."""
    inside = min(local, world)
    return (inside - 1) / world, (world - inside) / world


def share_bw(world: int, local: int, intra: float, inter: float) -> float:
    """The one rate that charges an all-to-all's bytes as its shares would take them,
    one after the other: NVLink's share at ``intra``, the cross-host share at ``inter``."""
    nvl, cross = a2a_shares(world, local)
    seconds_per_byte = nvl / intra + cross / inter
    return math.inf if seconds_per_byte == 0 else 1.0 / seconds_per_byte


# TorchRec's sharding types whose forward and backward comms are the world-wide all-to-all
# of the pooled outputs (estimator.py: TableWiseEvaluator; ColumnWise and TableColumnWise
# inherit it) -- the only terms the PXN correction re-derives.
WORLD_A2A = ("table_wise", "column_wise", "table_column_wise")
FP32 = 4


def a2a_bytes(shard: dict[str, Any], global_batch: int) -> float:
    """Bytes a table- or column-wise shard sends in its forward and backward all-to-all by
    TorchRec's formula: batch_outputs x world x dim x 4, each way (fp32, pooling >= 1)."""
    return 2 * global_batch * shard["cols"] * FP32


def rank_times(shards: list[dict[str, Any]], world: int, local: int, global_batch: int,
               pxn: dict[str, Any] | None = None) -> dict[str, Any]:
    """TorchRec's figure of merit from its per-shard terms: per rank the sum of its shards'
    compute (fwd + bwd + prefetch) and comms (fwd + bwd), the plan's figure the largest
    rank's sum (its ``NoopPerfModel``). A record's ``ranks`` is a list or ``"all"``
    (data parallel: the same terms on every rank).

    ``pxn`` re-derives the world-wide all-to-all of table- and column-wise shards; with
    ``{"a2a_bw": ..., "sized": True}`` as AP measured it at the size it has: one exchange
    a direction per rank, its bytes the rank's shards' (half of TorchRec's forward +
    backward bytes each way), at :func:`ap_all_to_all_ms` (latency and size ramp).
    Otherwise as NCCL's PXN runs it: ``{"a2a_bw": rate the pricing charged those bytes at, "intra": NVLink rate,
    "inter": NIC rate, "share": bool}``. Each rank's bytes are recovered from its terms
    (``comms x a2a_bw``, checked against TorchRec's byte formula); the cross-host bytes
    (all of them as TorchRec counts, or the (W-L)/W share with ``share``) leave by the
    host's L NICs, so every rank of a host is charged its host's mean at ``inter``; the
    NVLink bytes (the (L-1)/W share with ``share``) and PXN's relay hop ((L-1)/L of the
    cross-host bytes go to the NVLink peer on the destination's rail first) at ``intra``.
    """
    compute = [0.0] * world
    comms = [0.0] * world
    sent = [0.0] * world  # world-wide all-to-all bytes per rank (pxn only)
    for s in shards:
        ranks = range(world) if s["ranks"] == "all" else s["ranks"]
        c = s["fwd_compute"] + s["bwd_compute"] + s.get("prefetch_compute", 0.0)
        m = s["fwd_comms"] + s["bwd_comms"]
        for r in ranks:
            compute[r] += c
            if pxn is not None and s["sharding"] in WORLD_A2A:
                got = m * pxn["a2a_bw"]
                want = a2a_bytes(s, global_batch)
                if abs(got - want) > 1e-6 * want:
                    raise ValueError(
                        f"{s['table']} ({s['sharding']}, {s['cols']} cols, rank {r}): TorchRec's "
                        f"comms x a2a_bw = {got:.0f} B, its formula {want:.0f} B; the pricing's "
                        "a2a_bw is not the rate it charged (pass the rate of its comms object)")
                sent[r] += got
            else:
                comms[r] += m
    if pxn is not None and pxn.get("sized"):
        for r in range(world):
            comms[r] += 2 * ap_all_to_all_ms(sent[r] / 2, world, local)
    elif pxn is not None:
        if pxn.get("share"):
            nvl_share, cross_share = a2a_shares(world, local)
        else:
            nvl_share, cross_share = 0.0, 1.0
        hop = (local - 1) / local if world > local else 0.0
        for h in range(0, world, local):
            members = range(h, min(h + local, world))
            host_cross = sum(sent[r] * cross_share for r in members) / len(members)
            for r in members:
                nvl = sent[r] * nvl_share + sent[r] * cross_share * hop
                comms[r] += nvl / pxn["intra"] + host_cross / pxn["inter"]
    total = [a + b for a, b in zip(compute, comms)]
    top = max(range(world), key=total.__getitem__)
    return {"max_ms": total[top], "rank": top, "compute_ms": compute[top],
            "comms_ms": comms[top]}


# TorchRec pricings the worker runs (its own knobs; bytes/ms): name -> Topology bandwidths
# and the all-to-all rate object (``torchrec_worker.CorrectedComms`` kind, or none).
_ALL_RATES = {"hbm_mem_bw": H200_HBM, "inter_host_bw": NDR_NIC, "intra_host_bw": NVLINK_A2A}
PRICINGS: dict[str, dict[str, Any]] = {
    "torchrec": {},
    "hbm": {"bandwidths": {"hbm_mem_bw": H200_HBM}},
    "nic": {"bandwidths": {"inter_host_bw": NDR_NIC}},
    "nvlink": {"bandwidths": {"intra_host_bw": NVLINK_A2A}},
    "share": {"comms": "share"},
    "measured": {"comms": "ap"},
    "all_links": {"bandwidths": _ALL_RATES, "comms": "share"},
    "all_measured": {"bandwidths": _ALL_RATES, "comms": "ap"},
    "all_links_derated": {"bandwidths": {**_ALL_RATES, "hbm_mem_bw": H200_HBM_DERATED},
                          "comms": "share"},
    # an assumption, not a published correction: gemc's lookup without FBGEMM's narrow-shard
    # terms (TorchRec's hooks: no block-usage penalty below 128 columns, rows read at their
    # own width rather than at least 32)
    "all_links_plain_lookup": {"bandwidths": _ALL_RATES, "comms": "share",
                               "lookup_hooks": {"use_block_usage_penalty": False,
                                                "use_min_dim_for_lookup": False}},
}
# The variants reported: name -> (pricing, PXN re-derived on top). One correction at a
# time, then all of them: "all" composes the links (NIC, NVLink, the shares, PXN) from
# their separate sources, "all_measured" takes the measured all-to-all rate (which has PXN,
# on by default in the NCCL that AP measured, and the shares in it) instead.
VARIANTS: dict[str, tuple[str, bool]] = {
    "torchrec": ("torchrec", False),
    "hbm": ("hbm", False),
    "nic": ("nic", False),
    "nvlink": ("nvlink", False),
    "share": ("share", False),
    "pxn": ("torchrec", True),
    "measured": ("measured", False),
    "all": ("all_links", True),
    "all_measured": ("all_measured", False),
    "all_hbm_derated": ("all_links_derated", True),
    "all_no_narrow_penalty": ("all_links_plain_lookup", True),
    "all_measured_sized": ("all_measured", True),
}
# variants whose re-derivation is AP's sized all-to-all rather than PXN
SIZED = ("all_measured_sized",)
# "all" with every shard's compute replaced by the measured price of the kernel that runs
# it in gemc's runner (kernel_fit_shards): not one of TorchRec's knobs, so not in VARIANTS
# (which reprice from TorchRec's own terms); added by reprice when it has the tables.
KERNEL_FIT = {"all_kernel_fit": "all"}


def kernel_fit_shards(shards: list[dict[str, Any]], tables: dict[str, dict[str, Any]],
                      world: int, global_batch: int, gpu: Any) -> list[dict[str, Any]]:
    """``shards`` with each one's compute (forward, backward, prefetch) replaced by what
    gemc's batched lookup kernel costs it on ``gpu`` (``op_cost.batched_embedding_time``,
    fitted to the kernel's measured steps: benchmarks/fit_lookup_price.py), row-wise
    Adagrad, fp32. A shard sees the ids of its rows' share of its table (all of them for a
    column piece) from the global batch, and writes a pooled row per bag of it (a
    data-parallel replica: its rank's batch); a piece narrower than the table is updated
    in two phases (its row's squares summed over the column group), as the runner does.
    Why: TorchRec prices a 16-column piece of a 40M-row table at pooling 100 at ~1 ms of
    compute, where the kernel measured 5.2 ms (one pass) and 9.1 ms (two phases) on an
    H100 at DLRMv2's global batch."""
    from gemc.cost_model.op_cost import batched_embedding_time

    out = []
    for s in shards:
        t = tables[s["table"]]
        replica = s["sharding"] == "data_parallel"
        bags = global_batch // world if replica else global_batch
        share = 1.0 if replica else s["rows"] / t["rows"]
        ids = int(round(bags * t["pooling"] * share))
        ms = 1e3 * batched_embedding_time(
            int(s["rows"]), int(s["cols"]), ids, bags, "fp32", gpu, None, "rowwise_adagrad",
            split_squares=int(s["cols"]) < t["dim"])
        out.append({**s, "fwd_compute": ms, "bwd_compute": 0.0, "prefetch_compute": 0.0})
    return out


def pricing_rates(pricing: str) -> tuple[float, float]:
    """(intra, inter) bytes/ms of a pricing: its knobs, else TorchRec's defaults."""
    bw = PRICINGS[pricing].get("bandwidths", {})
    return bw.get("intra_host_bw", TORCHREC_INTRA), bw.get("inter_host_bw", TORCHREC_INTER)


def reprice(terms: dict[str, Any], who: str, world: int, local: int,
            global_batch: int, tables: list[dict[str, Any]] | None = None,
            gpu: Any = None) -> dict[str, dict[str, Any]]:
    """Every variant of one plan (``who``: "gemc" or "torchrec") from the worker's
    ``terms`` (pricing -> {"a2a_bw", who: {"shards", "max_perf_ms", ...}}). A variant
    without PXN is TorchRec's own sum and must equal its recorded figure (checked here to
    0.001 ms, so a re-derivation never drifts from what TorchRec computed). With
    ``tables`` (name -> rows, dim, pooling records) and ``gpu`` the KERNEL_FIT variants
    too (:func:`kernel_fit_shards`)."""
    out = {}
    for name, (pricing, pxn) in VARIANTS.items():
        got = terms.get(pricing, {}).get(who)
        if not got:
            continue
        r = rank_times(got["shards"], world, local, global_batch,
                       _pxn_spec(terms, name) if pxn else None)
        if not pxn and abs(r["max_ms"] - got["max_perf_ms"]) > 1e-3:
            raise ValueError(f"{who} plan, pricing {pricing}: re-summed {r['max_ms']:.4f} ms "
                             f"against TorchRec's {got['max_perf_ms']:.4f} ms; the shard "
                             "records do not carry TorchRec's terms")
        out[name] = r
    if tables is not None and gpu is not None:
        by_name = {t["name"]: t for t in tables}
        for name, base in KERNEL_FIT.items():
            pricing, pxn = VARIANTS[base]
            got = terms.get(pricing, {}).get(who)
            if got:
                shards = kernel_fit_shards(got["shards"], by_name, world, global_batch, gpu)
                out[name] = rank_times(shards, world, local, global_batch,
                                       _pxn_spec(terms, base) if pxn else None)
    return out


def _pxn_spec(terms: dict[str, Any], variant: str) -> dict[str, Any]:
    """rank_times' ``pxn`` argument for ``variant`` (see :func:`rank_times`)."""
    pricing = VARIANTS[variant][0]
    intra, inter = pricing_rates(pricing)
    return {"a2a_bw": terms[pricing]["a2a_bw"], "intra": intra, "inter": inter,
            "share": PRICINGS[pricing].get("comms") == "share", "sized": variant in SIZED}


def verdict(gemc: dict[str, dict[str, Any]], torchrec: dict[str, dict[str, Any]]
            ) -> dict[str, bool]:
    """Per variant: is gemc's plan no worse than TorchRec's (max-rank ms, 0.005 ms slack
    for the sums' rounding)?"""
    return {v: gemc[v]["max_ms"] <= torchrec[v]["max_ms"] + 5e-3
            for v in gemc if v in torchrec}
