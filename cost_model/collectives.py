"""Time of NCCL collectives for a group of ranks placed on a topology (α-β model).

Sizes follow nccl-tests (doc/PERFORMANCE.md in NVIDIA/nccl-tests): ``nbytes`` is the
per-rank buffer NCCL reports as "size" — the buffer for all-reduce, the *full* (gathered)
output for all-gather, the full input for reduce-scatter, the whole send buffer for
all-to-all. A collective moving ``nbytes`` at bus bandwidth ``B`` takes

    t = α_launch + steps · α_hop + nbytes · F(n) / B

with NCCL's bus factors F: all-reduce 2(n-1)/n, reduce-scatter / all-gather / all-to-all
(n-1)/n. ``B`` is the bottleneck link of the placement (Topology.bottleneck): NVLink inside
a host, the NICs on the group's rails across hosts, thinned by spine oversubscription
across scalable units, times the fraction of link rate NCCL reaches.

Algorithms (the tuner picks the fastest when ``algorithm`` is None, like NCCL's):
- ``ring``: steps 2(n-1) (all-reduce) or n-1; bandwidth-optimal, latency linear in n.
- ``tree`` (all-reduce only, like NCCL): double binary tree across hosts, chain inside;
  ~2·(log2 H + L-1) hops; NCCL's tree reaches ~90% of ring bandwidth.
- ``hierarchical`` (group spans hosts with the same number of ranks on each): inside each
  host reduce-scatter over NVLink, across hosts the op on 1/L of the data per rail, then
  all-gather inside (as in Horovod/BytePS hierarchical all-reduce and NCCL's CollNet chain).
- ``direct`` (all-to-all): every pair exchanges at once; time is the most loaded rank on
  NVLink or the most loaded host on its NICs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .topology import Placement, Topology

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
ALGORITHMS = ("ring", "tree", "hierarchical", "direct")


@dataclass(frozen=True)
class CommEfficiency:
    """Fraction of link rate NCCL reaches, and fixed costs, when nothing is calibrated.

    nvlink 0.80: nccl-tests ring all-reduce on 8x H100 SXM reaches ~360 GB/s bus bandwidth
    of the 450 GB/s link (NVLS excluded). network 0.92: ~370 of 400 GB/s across DGX H100
    hosts with 8x400G NDR. launch 8 us: NCCL's base latency for Simple/LL128 (baseLat in
    src/graph/tuning.cc, 6.6-8.4 us) plus the kernel launch.
    """

    nvlink: float = 0.80
    network: float = 0.92
    tree_bandwidth: float = 0.90
    launch_s: float = 8e-6
    per_peer_s: float = 0.2e-6   # all-to-all: one send/recv pair issued per peer
    # All-to-all is NCCL point-to-point (every pair at once, no ring pipelining): it
    # reaches less of the link than the ring collectives. Fitted to AutoParallel's
    # nccl-tests tables for H100 NVSwitch + 400G (benchmarks/collectives_vs_published.py):
    # inside a host 374 GB/s algbw at 1 GiB = 0.73 x 450 GB/s of NVLink over the 7/8 that
    # leaves each GPU; across hosts 47 (8x8) and 43 GB/s (32x8) = ~0.82 x 50 GB/s per NIC
    # on the remote share. The ring figures (0.80, 0.92) were 10-12% fast on every row.
    all_to_all_nvlink: float = 0.73
    all_to_all_network: float = 0.82


DEFAULT_EFFICIENCY = CommEfficiency()


class CollectiveCalibration(Protocol):
    """What collectives need of a Calibration (see calibration.py)."""

    def collective_bus_bandwidth(self, op: str, nbytes: float, ranks: int) -> float | None: ...


def bus_factor(op: str, n: int) -> float:
    """NCCL's bus bandwidth factor (nccl-tests PERFORMANCE.md)."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")


def collective_time(
    op: str,
    nbytes: float,
    ranks: Iterable[int] | int,
    topo: Topology,
    *,
    algorithm: str | None = None,
    send_bytes: Sequence[float] | Sequence[Sequence[float]] | np.ndarray | None = None,
    calibration: CollectiveCalibration | None = None,
    efficiency: CommEfficiency = DEFAULT_EFFICIENCY,
) -> float:
    """Seconds for one collective; ``ranks`` is the group (or an int n for ranks 0..n-1).

    For an uneven all-to-all pass ``send_bytes``: an n x n matrix (row = sender, in the
    order of ``ranks``) or a per-rank list of bytes each rank sends, spread evenly over the
    others; ``nbytes`` is then ignored.
    """
    t = best_algorithm(op, nbytes, ranks, topo, algorithm=algorithm, send_bytes=send_bytes,
                       calibration=calibration, efficiency=efficiency)[1]
    factor = getattr(calibration, "factor", None)  # a run-fitted multiplier, if any
    return t * factor("comm") if factor is not None else t


def best_algorithm(
    op: str,
    nbytes: float,
    ranks: Iterable[int] | int,
    topo: Topology,
    *,
    algorithm: str | None = None,
    send_bytes: Any = None,
    calibration: CollectiveCalibration | None = None,
    efficiency: CommEfficiency = DEFAULT_EFFICIENCY,
) -> tuple[str, float]:
    """(algorithm, seconds) of the fastest applicable algorithm, or of the one asked for."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")
    group = tuple(range(ranks)) if isinstance(ranks, int) else tuple(ranks)
    p = topo.placement(group)
    if p.size <= 1:
        return (algorithm or "none"), 0.0
    if send_bytes is None and nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    candidates = _algorithms(op, p)
    if algorithm is not None:
        if algorithm not in candidates:
            raise ValueError(f"algorithm {algorithm!r} does not apply to {op} on this group; "
                             f"applicable: {', '.join(candidates)}")
        candidates = (algorithm,)
    best = ("", math.inf)
    for algo in candidates:
        if algo == "direct":
            t = _all_to_all(nbytes, p, topo, send_bytes, calibration, efficiency)
        else:
            t = _reducing(op, algo, nbytes, p, topo, calibration, efficiency)
        if t < best[1]:
            best = (algo, t)
    return best


def _algorithms(op: str, p: Placement) -> tuple[str, ...]:
    if op == "all_to_all":
        return ("direct",)
    algos = ["ring"]
    if op == "all_reduce":
        algos.append("tree")
    if p.hosts > 1 and p.max_local > 1 and p.max_local == p.min_local:
        algos.append("hierarchical")
    return tuple(algos)


def _eff_bw(topo: Topology, p: Placement, eff: CommEfficiency) -> tuple[float, float]:
    """(bus bandwidth B/s, hop latency s) of a ring over the placement, efficiency applied.

    A path leaving the host is never modeled faster than NVLink inside it."""
    tb = topo.link_bandwidth(p.ranks)
    nvl = tb.nvlink * eff.nvlink
    if p.hosts == 1:
        return nvl, tb.nvlink_latency
    net = (tb.host_network if p.max_local > 1 else tb.network) * eff.network
    return min(nvl, net), tb.network_latency


def _measured(calibration: CollectiveCalibration | None, op: str, nbytes: float,
              p: Placement) -> float | None:
    if calibration is None or p.hosts != 1:
        return None
    return calibration.collective_bus_bandwidth(op, nbytes, p.size)


def _reducing(op: str, algo: str, nbytes: float, p: Placement, topo: Topology,
              calibration: CollectiveCalibration | None, eff: CommEfficiency) -> float:
    n = p.size
    measured = _measured(calibration, op, nbytes, p)
    if measured and algo == "ring":
        return nbytes * bus_factor(op, n) / measured if nbytes > 0 else eff.launch_s
    if algo == "hierarchical":
        return _hierarchical(op, nbytes, p, topo, calibration, eff)
    bw, hop = _eff_bw(topo, p, eff)
    if algo == "ring":
        steps = 2 * (n - 1) if op == "all_reduce" else n - 1
        return eff.launch_s + steps * hop + nbytes * bus_factor(op, n) / bw
    # tree: chain of the host's ranks, binary tree across hosts, up then down.
    tb = topo.link_bandwidth(p.ranks)
    depth = (p.max_local - 1) * tb.nvlink_latency
    if p.hosts > 1:
        depth += math.ceil(math.log2(p.hosts)) * tb.network_latency
    else:
        depth = math.ceil(math.log2(n)) * tb.nvlink_latency
    return eff.launch_s + 2 * depth + nbytes * bus_factor(op, n) / (bw * eff.tree_bandwidth)


def _hierarchical(op: str, nbytes: float, p: Placement, topo: Topology,
                  calibration: CollectiveCalibration | None, eff: CommEfficiency) -> float:
    local = p.max_local
    first_host = tuple(r for r in p.ranks if topo.host_of(r) == p.per_host[0][0])
    intra = topo.placement(first_host)
    # Across hosts each of the `local` rails carries 1/local of the data at once, so the
    # per-rail bandwidth is the per-rank share of the host's NICs, not one NIC alone.
    tb = topo.link_bandwidth(p.ranks)
    net_bw = min(tb.network * eff.network, tb.nvlink * eff.nvlink)
    inter_steps = 2 * (p.hosts - 1) if op == "all_reduce" else p.hosts - 1
    inter_t = inter_steps * tb.network_latency + nbytes / local * bus_factor(op, p.hosts) / net_bw
    if op == "all_reduce":
        intra_t = (_reducing("reduce_scatter", "ring", nbytes, intra, topo, calibration, eff)
                   + _reducing("all_gather", "ring", nbytes, intra, topo, calibration, eff))
    else:
        intra_t = _reducing(op, "ring", nbytes, intra, topo, calibration, eff)
    return intra_t + eff.launch_s + inter_t


def _send_matrix(send_bytes: Any, n: int) -> np.ndarray:
    arr = np.asarray(send_bytes, dtype=np.float64)
    if arr.ndim == 1:
        if arr.shape[0] != n:
            raise ValueError(f"send_bytes has {arr.shape[0]} entries for a group of {n}")
        if n == 1:
            return arr.reshape(1, 1) * 0.0
        m = np.repeat((arr / (n - 1))[:, None], n, axis=1)
        np.fill_diagonal(m, 0.0)
        return m
    if arr.shape != (n, n):
        raise ValueError(f"send_bytes matrix is {arr.shape}, expected ({n}, {n})")
    if (arr < 0).any():
        raise ValueError("send_bytes must be >= 0")
    m = arr.copy()
    np.fill_diagonal(m, 0.0)  # a rank's chunk for itself never leaves it
    return m


def _all_to_all(nbytes: float, p: Placement, topo: Topology, send_bytes: Any,
                calibration: CollectiveCalibration | None, eff: CommEfficiency) -> float:
    n = p.size
    if send_bytes is None:
        measured = _measured(calibration, "all_to_all", nbytes, p)
        if measured:
            return nbytes * bus_factor("all_to_all", n) / measured if nbytes > 0 else eff.launch_s
        m = None
    else:
        m = _send_matrix(send_bytes, n)
    hosts = np.array([topo.host_of(r) for r in p.ranks])
    same = hosts[:, None] == hosts[None, :]
    if m is None:  # even: nbytes/n to every peer
        chunk = nbytes / n
        local_peers = same.sum(axis=1) - 1
        intra_out = intra_in = local_peers * chunk
        inter_out = inter_in = (n - 1 - local_peers) * chunk
    else:
        intra = np.where(same, m, 0.0)
        inter = m - intra
        intra_out, intra_in = intra.sum(axis=1), intra.sum(axis=0)
        inter_out, inter_in = inter.sum(axis=1), inter.sum(axis=0)
    tb = topo.link_bandwidth(p.ranks)
    nvl = tb.nvlink * eff.all_to_all_nvlink
    if p.hosts > 1:
        host_out = np.bincount(hosts, weights=inter_out)
        host_in = np.bincount(hosts, weights=inter_in)
        # PXN (NCCL >= 2.12, on by default): a send to another host leaves by the NIC on
        # the destination's rail, reached over NVLink through the local GPU on that rail
        # (the sender's own NIC for 1 rail in L). So (L-1)/L of a rank's cross-host bytes
        # also leave over its NVLink, and each host peer takes 1/L of them in.
        per_host = np.bincount(hosts)[hosts].astype(float)
        intra_out = intra_out + inter_out * (per_host - 1) / per_host
        intra_in = intra_in + (host_out[hosts] - inter_out) / per_host
    t_bw = float(max(np.max(intra_out), np.max(intra_in))) / nvl
    if p.hosts > 1:
        host_bw = min(tb.host_network * eff.all_to_all_network, p.min_local * nvl)
        t_bw = max(t_bw, float(max(host_out.max(), host_in.max())) / host_bw)
        hop = tb.network_latency
    else:
        hop = tb.nvlink_latency
    return eff.launch_s + hop + (n - 1) * eff.per_peer_s + t_bw
