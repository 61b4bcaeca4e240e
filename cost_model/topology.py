"""The cluster a plan runs on, as a graph of GPUs, switches and NICs.

Built from a short spec (``h200:2x8`` = 2 hosts of 8 H200s, each host with the reference
board's NICs) or from a topology file (JSON or YAML, format below and in
``examples/topologies/``). The graph is what collective costs are derived from:

    gpu:H:L ── nvswitch:H              NVLink, per GPU per direction
    gpu:H:L ── nic:H:I                 PCIe (GPU L is closest to NIC I = L * nics / gpus)
    nic:H:I ── leaf:U:R                one leaf per rail R and scalable unit U (rail-optimized,
                                       as in NVIDIA's DGX SuperPOD reference) or one leaf per U
    leaf:U:R ── spine                  leaf uplinks = downlinks / oversubscription

Rank r sits on host r // gpus_per_host at local index r % gpus_per_host (torchrun's order).
Every edge has ``bandwidth`` (B/s, one direction) and ``latency`` (s) and a ``tier``.

File format (all keys but gpu, hosts, gpus_per_host optional; defaults from the GPU's
reference host, see hardware.py)::

    {"gpu": "h100", "hosts": 64, "gpus_per_host": 8,
     "nvlink_gbyte_s": 450,
     "network": {"nics_per_host": 8, "nic_gbit_s": 400, "rail_optimized": true,
                 "hosts_per_leaf": 32, "oversubscription": 1.0},
     "latency_us": {"nvlink": 0.5, "pcie": 0.5, "nic": 1.0, "spine": 1.0}}
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import networkx as nx

from gemc.errors import TopologyError

from .hardware import GB, GPUSpec, get_gpu

FORMAT_VERSION = 1
_SPEC_RE = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_-]*)\s*:\s*(\d+)\s*x\s*(\d+)\s*$")
_SPEC_FIX = (
    "write GPU:HOSTSxGPUS_PER_HOST (e.g. h200:1x8, h100:512x8) or give the path of a "
    ".json/.yaml topology file (see examples/topologies/)"
)

# One-way latencies of a hop, typical of NVSwitch Hopper systems and NDR InfiniBand: a GPU
# to NVSwitch port ~0.5 us, PCIe to the NIC ~0.5 us, NIC + cable + leaf port ~1 us, leaf to
# spine ~1 us. They give ~1 us GPU-GPU inside a host and ~3 us (5 us through the spine)
# between hosts, in line with the hardware latencies in NCCL's tuning model (src/graph/
# tuning.cc: hwLat NVLink ~0.6-1.9 us, NET ~2.7-5 us for LL/LL128).
DEFAULT_LATENCY_US = {"nvlink": 0.5, "pcie": 0.5, "nic": 1.0, "spine": 1.0}


@dataclass(frozen=True)
class NetworkSpec:
    """The scale-out fabric: NICs per host and how they are switched."""

    nics_per_host: int
    nic_gbit_s: float
    rail_optimized: bool = True
    hosts_per_leaf: int = 32      # hosts under one leaf (a SuperPOD scalable unit)
    oversubscription: float = 1.0  # leaf downlink / uplink bandwidth; 1.0 = non-blocking

    @property
    def nic_bandwidth(self) -> float:
        """One NIC, B/s per direction."""
        return self.nic_gbit_s * 1e9 / 8


@dataclass(frozen=True)
class Placement:
    """Where a group of ranks sits: how many on each host, how many scalable units."""

    ranks: tuple[int, ...]
    per_host: tuple[tuple[int, int], ...]  # (host, ranks of the group on it), host order
    units: int                             # scalable units (leaf groups) spanned

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def hosts(self) -> int:
        return len(self.per_host)

    @property
    def max_local(self) -> int:
        return max(n for _, n in self.per_host)

    @property
    def min_local(self) -> int:
        return min(n for _, n in self.per_host)


@dataclass(frozen=True)
class TierBandwidth:
    """Per-rank bandwidth (B/s, one direction) a group gets on each tier, and hop latency."""

    nvlink: float        # a rank to the NVSwitch
    network: float       # what one rank's share of its host's NICs (reachable) gives
    host_network: float  # all NICs the group can use on one host
    nvlink_latency: float
    network_latency: float


class Topology:
    """GPUs on hosts, wired as a networkx graph; see the module docstring."""

    def __init__(
        self,
        gpu: GPUSpec,
        hosts: int,
        gpus_per_host: int,
        *,
        nvlink_bandwidth: float | None = None,
        network: NetworkSpec | None = None,
        latency_us: Mapping[str, float] | None = None,
        source: str = "topology",
    ) -> None:
        self.gpu = gpu
        self.hosts = int(hosts)
        self.gpus_per_host = int(gpus_per_host)
        self.world_size = self.hosts * self.gpus_per_host
        self.nvlink_bandwidth = float(nvlink_bandwidth or gpu.nvlink_bandwidth)
        self.network = network or NetworkSpec(gpu.nics_per_host, gpu.nic_gbps)
        self.latency_us = {**DEFAULT_LATENCY_US, **dict(latency_us or {})}
        _validate(self, source)
        self._placements: dict[tuple[int, ...], Placement] = {}
        self._tiers: dict[Placement, TierBandwidth] = {}

    # ---- identity -------------------------------------------------------------------
    def __repr__(self) -> str:
        return f"Topology({self.gpu.name}:{self.hosts}x{self.gpus_per_host})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    @property
    def spec(self) -> str:
        return f"{self.gpu.name}:{self.hosts}x{self.gpus_per_host}"

    def to_dict(self) -> dict[str, Any]:
        """Canonical, JSON-serializable form (goes into the plan); from_dict inverts it."""
        net = self.network
        return {
            "version": FORMAT_VERSION,
            "gpu": self.gpu.name,
            "hosts": self.hosts,
            "gpus_per_host": self.gpus_per_host,
            "world_size": self.world_size,
            "nvlink_gbyte_s": self.nvlink_bandwidth / GB,
            "network": {
                "nics_per_host": net.nics_per_host,
                "nic_gbit_s": float(net.nic_gbit_s),
                "rail_optimized": bool(net.rail_optimized),
                "hosts_per_leaf": net.hosts_per_leaf,
                "oversubscription": float(net.oversubscription),
            },
            "latency_us": {k: float(self.latency_us[k]) for k in sorted(self.latency_us)},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "topology") -> Topology:
        return _from_mapping(d, source)

    # ---- ranks ----------------------------------------------------------------------
    def host_of(self, rank: int) -> int:
        return rank // self.gpus_per_host

    def local_of(self, rank: int) -> int:
        return rank % self.gpus_per_host

    def unit_of_host(self, host: int) -> int:
        return host // self.network.hosts_per_leaf

    def gpu_node(self, rank: int) -> str:
        return f"gpu:{self.host_of(rank)}:{self.local_of(rank)}"

    def nic_of_local(self, local: int) -> int:
        """The NIC closest to a GPU (its rail)."""
        return local * self.network.nics_per_host // self.gpus_per_host

    def placement(self, ranks: Iterable[int]) -> Placement:
        key = ranks if isinstance(ranks, tuple) else tuple(ranks)
        p = self._placements.get(key)
        if p is None:
            p = _placement(self, tuple(sorted(set(int(r) for r in key))))
            if len(self._placements) < 65536:
                self._placements[key] = p
        return p

    # ---- graph ----------------------------------------------------------------------
    @cached_property
    def graph(self) -> nx.Graph:
        """Built on first use (a 4096-GPU cluster takes ~0.1 s)."""
        return _build_graph(self)

    @cached_property
    def tier_latency(self) -> dict[str, float]:
        """One-way GPU-to-GPU latency (s) inside a host, across hosts under one leaf, and
        across the spine, read off the graph's shortest paths."""
        g = self.graph
        out = {"intra_host": 0.0, "inter_host": 0.0, "inter_unit": 0.0}
        if self.gpus_per_host > 1:
            out["intra_host"] = nx.shortest_path_length(g, "gpu:0:0", "gpu:0:1", weight="latency")
        else:
            out["intra_host"] = 2 * self.latency_us["nvlink"] * 1e-6
        same_unit = min(self.hosts, self.network.hosts_per_leaf)
        out["inter_host"] = (
            nx.shortest_path_length(g, "gpu:0:0", f"gpu:{same_unit - 1}:0", weight="latency")
            if same_unit > 1 else 2 * (self.latency_us["pcie"] + self.latency_us["nic"]) * 1e-6
        )
        if self.hosts > self.network.hosts_per_leaf:
            out["inter_unit"] = nx.shortest_path_length(
                g, "gpu:0:0", f"gpu:{self.hosts - 1}:0", weight="latency")
        else:
            out["inter_unit"] = out["inter_host"] + 2 * self.latency_us["spine"] * 1e-6
        return out

    @cached_property
    def _edge_bw(self) -> dict[str, float]:
        g = self.graph
        nic_bw = sum(g.edges[f"nic:0:{i}", _leaf_name(self, 0, i)]["bandwidth"]
                     for i in range(self.network.nics_per_host))
        leaf = _leaf_name(self, 0, 0)
        spine_bw = g.edges[leaf, "spine"]["bandwidth"]
        leaf_down = sum(d["bandwidth"] for _, n, d in g.edges(leaf, data=True) if n != "spine")
        return {
            "nvlink": g.edges["gpu:0:0", "nvswitch:0"]["bandwidth"],
            "pcie": g.edges["gpu:0:0", "nic:0:0"]["bandwidth"],
            "host_nics": nic_bw,
            "spine_ratio": min(1.0, spine_bw / leaf_down) if leaf_down else 1.0,
        }

    def link_bandwidth(self, ranks: Iterable[int]) -> TierBandwidth:
        """Per-rank bandwidth a group gets on each tier (cached per placement)."""
        p = self.placement(ranks)
        tb = self._tiers.get(p)
        if tb is None:
            tb = self._tiers[p] = _tier_bandwidth(self, p)
        return tb

    def bottleneck(self, ranks: Iterable[int]) -> tuple[float, float]:
        """(bandwidth B/s, latency s) of the slowest hop of a ring over the group."""
        tb = self.link_bandwidth(ranks)
        p = self.placement(ranks)
        if p.hosts == 1:
            return tb.nvlink, tb.nvlink_latency
        return min(tb.nvlink, tb.host_network) if p.max_local > 1 else tb.network, \
            tb.network_latency


def _leaf_name(topo: Topology, host: int, nic: int) -> str:
    unit = topo.unit_of_host(host)
    return f"leaf:{unit}:{nic if topo.network.rail_optimized else 0}"


def _build_graph(topo: Topology) -> nx.Graph:
    g = nx.Graph(name=topo.spec)
    lat = {k: v * 1e-6 for k, v in topo.latency_us.items()}
    net = topo.network
    nic_bw = net.nic_bandwidth
    g.add_node("spine", kind="spine")
    for h in range(topo.hosts):
        sw = f"nvswitch:{h}"
        g.add_node(sw, kind="nvswitch", host=h)
        for i in range(net.nics_per_host):
            nic = f"nic:{h}:{i}"
            leaf = _leaf_name(topo, h, i)
            g.add_node(nic, kind="nic", host=h, rail=i)
            if leaf not in g:
                g.add_node(leaf, kind="leaf", unit=topo.unit_of_host(h))
            g.add_edge(nic, leaf, bandwidth=nic_bw, latency=lat["nic"], tier="nic")
        for local in range(topo.gpus_per_host):
            gpu = f"gpu:{h}:{local}"
            g.add_node(gpu, kind="gpu", host=h, local=local, rank=h * topo.gpus_per_host + local)
            g.add_edge(gpu, sw, bandwidth=topo.nvlink_bandwidth, latency=lat["nvlink"],
                       tier="nvlink")
            g.add_edge(gpu, f"nic:{h}:{topo.nic_of_local(local)}",
                       bandwidth=topo.gpu.pcie_bandwidth, latency=lat["pcie"], tier="pcie")
    for leaf in [n for n, d in g.nodes(data=True) if d["kind"] == "leaf"]:
        down = sum(d["bandwidth"] for _, _, d in g.edges(leaf, data=True))
        g.add_edge(leaf, "spine", bandwidth=down / net.oversubscription,
                   latency=lat["spine"], tier="spine")
    return g


def _placement(topo: Topology, ranks: tuple[int, ...]) -> Placement:
    if not ranks:
        raise ValueError("a group needs at least one rank")
    if ranks[0] < 0 or ranks[-1] >= topo.world_size:
        raise ValueError(f"ranks {ranks[0]}..{ranks[-1]} outside world of {topo.world_size}")
    counts = Counter(topo.host_of(r) for r in ranks)
    units = len({topo.unit_of_host(h) for h in counts})
    return Placement(ranks, tuple(sorted(counts.items())), units)


def _tier_bandwidth(topo: Topology, p: Placement) -> TierBandwidth:
    bw = topo._edge_bw
    lat = topo.tier_latency
    net = topo.network
    # NICs whose rail a group member sits on: rings and trees use the NIC next to the GPU
    # (NCCL's default), so a host's group reaches only its members' NICs -- one GPU per
    # host drives one NIC (NVIDIA: 46-48 GB/s per NDR NIC, nccl-tests issue #290), not the
    # whole host's (a 2x1 topology used to get 8 NICs, capped by PCIe: 64 GB/s).
    host_min = min(p.per_host, key=lambda hc: hc[1])[0]
    usable = max(1, len({topo.nic_of_local(r % topo.gpus_per_host) for r in p.ranks
                         if topo.host_of(r) == host_min}))
    host_network = min(usable, net.nics_per_host) * bw["host_nics"] / net.nics_per_host
    host_network = min(host_network, p.min_local * bw["pcie"])
    if p.units > 1:
        host_network *= bw["spine_ratio"]
    per_rank = host_network / p.min_local
    return TierBandwidth(
        nvlink=bw["nvlink"],
        network=per_rank,
        host_network=host_network,
        nvlink_latency=lat["intra_host"],
        network_latency=lat["inter_unit"] if p.units > 1 else lat["inter_host"],
    )


# ---- validation and parsing -----------------------------------------------------------
def _validate(topo: Topology, source: str = "topology") -> None:
    def err(field: str, what: str, fix: str) -> TopologyError:
        return TopologyError(what, where=f"{source}: field '{field}'", fix=fix)

    if topo.hosts < 1:
        raise err("hosts", f"hosts must be at least 1, got {topo.hosts}", "use 1 or more hosts")
    if topo.gpus_per_host < 1:
        raise err("gpus_per_host", f"gpus_per_host must be at least 1, got "
                  f"{topo.gpus_per_host}", "use 1 or more GPUs per host")
    if topo.gpus_per_host > topo.gpu.max_gpus_per_host:
        raise err("gpus_per_host",
                  f"{topo.gpus_per_host} GPUs per host, but a {topo.gpu.name} host holds at "
                  f"most {topo.gpu.max_gpus_per_host}",
                  f"use at most {topo.gpu.max_gpus_per_host} GPUs per host and more hosts")
    if not topo.nvlink_bandwidth > 0:
        raise err("nvlink_gbyte_s", "NVLink bandwidth must be positive", "give GB/s > 0")
    net = topo.network
    if net.nics_per_host < 1:
        raise err("network.nics_per_host", f"nics_per_host must be at least 1, got "
                  f"{net.nics_per_host}", "give the host's compute-fabric NIC count")
    if not net.nic_gbit_s > 0:
        raise err("network.nic_gbit_s", f"NIC speed must be positive, got {net.nic_gbit_s}",
                  "give the NIC speed in Gb/s, e.g. 400")
    if net.hosts_per_leaf < 1:
        raise err("network.hosts_per_leaf", "hosts_per_leaf must be at least 1",
                  "give how many hosts one leaf switch serves, e.g. 32")
    if not net.oversubscription >= 1.0:
        raise err("network.oversubscription",
                  f"oversubscription must be >= 1 (1 = non-blocking), got {net.oversubscription}",
                  "give downlink/uplink bandwidth of a leaf, e.g. 1.0 or 2.0")
    for key, value in topo.latency_us.items():
        if key not in DEFAULT_LATENCY_US:
            raise err(f"latency_us.{key}", f"unknown latency tier {key!r}",
                      f"use the tiers {sorted(DEFAULT_LATENCY_US)}")
        if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
            raise err(f"latency_us.{key}", f"latency must be a non-negative number, got {value!r}",
                      "give microseconds >= 0")


_TOP_KEYS = {"version", "gpu", "hosts", "gpus_per_host", "world_size", "nvlink_gbyte_s",
             "network", "latency_us"}
_NET_KEYS = {"nics_per_host", "nic_gbit_s", "rail_optimized", "hosts_per_leaf",
             "oversubscription"}


def _number(d: Mapping[str, Any], key: str, field: str, source: str, *, integer: bool) -> Any:
    value = d[key]
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or (not integer and not math.isfinite(value)):
        kind = "an integer" if integer else "a number"
        raise TopologyError(f"{field} must be {kind}, got {value!r}",
                            where=f"{source}: field '{field}'", fix=f"write {field} as {kind}")
    if value <= 0:
        raise TopologyError(f"{field} must be positive, got {value!r}",
                            where=f"{source}: field '{field}'", fix=f"give {field} > 0")
    return value


def _from_mapping(d: Mapping[str, Any], source: str) -> Topology:
    if not isinstance(d, Mapping):
        raise TopologyError("a topology file must hold a mapping (JSON object)",
                            where=source, fix="see examples/topologies/h100_2x8.json")
    for key in d:
        if key not in _TOP_KEYS:
            raise TopologyError(f"unknown field {key!r}", where=f"{source}: field '{key}'",
                                fix=f"use only {sorted(_TOP_KEYS - {'world_size'})}")
    for key in ("gpu", "hosts", "gpus_per_host"):
        if key not in d:
            raise TopologyError(f"missing field {key!r}", where=f"{source}: field '{key}'",
                                fix="a topology names gpu, hosts and gpus_per_host")
    if d.get("version", FORMAT_VERSION) != FORMAT_VERSION:
        raise TopologyError(f"topology format version {d['version']!r} is not supported",
                            where=f"{source}: field 'version'", fix=f"use version {FORMAT_VERSION}")
    try:
        gpu = get_gpu(d["gpu"])
    except TopologyError as exc:
        raise TopologyError(exc.what, where=f"{source}: field 'gpu'", fix=exc.fix) from None
    hosts = _number(d, "hosts", "hosts", source, integer=True)
    gph = _number(d, "gpus_per_host", "gpus_per_host", source, integer=True)
    nvlink = None
    if "nvlink_gbyte_s" in d:
        nvlink = _number(d, "nvlink_gbyte_s", "nvlink_gbyte_s", source, integer=False) * GB
    net_d = d.get("network", {})
    if not isinstance(net_d, Mapping):
        raise TopologyError("network must be a mapping", where=f"{source}: field 'network'",
                            fix="write network as an object of " + ", ".join(sorted(_NET_KEYS)))
    for key in net_d:
        if key not in _NET_KEYS:
            raise TopologyError(f"unknown field {key!r}",
                                where=f"{source}: field 'network.{key}'",
                                fix=f"use only {sorted(_NET_KEYS)}")
    net_args: dict[str, Any] = {}
    for key, integer in (("nics_per_host", True), ("nic_gbit_s", False),
                         ("hosts_per_leaf", True), ("oversubscription", False)):
        if key in net_d:
            net_args[key] = _number(net_d, key, f"network.{key}", source, integer=integer)
    if "rail_optimized" in net_d:
        if not isinstance(net_d["rail_optimized"], bool):
            raise TopologyError("network.rail_optimized must be true or false",
                                where=f"{source}: field 'network.rail_optimized'",
                                fix="write true or false")
        net_args["rail_optimized"] = net_d["rail_optimized"]
    network = NetworkSpec(
        nics_per_host=net_args.pop("nics_per_host", gpu.nics_per_host),
        nic_gbit_s=net_args.pop("nic_gbit_s", gpu.nic_gbps),
        **net_args,
    )
    lat = d.get("latency_us", {})
    if not isinstance(lat, Mapping):
        raise TopologyError("latency_us must be a mapping", where=f"{source}: field 'latency_us'",
                            fix=f"write latency_us as an object of {sorted(DEFAULT_LATENCY_US)}")
    topo = Topology(gpu, hosts, gph, nvlink_bandwidth=nvlink, network=network,
                    latency_us=lat, source=source)
    if "world_size" in d and d["world_size"] != topo.world_size:
        raise TopologyError(f"world_size {d['world_size']!r} is not hosts x gpus_per_host = "
                            f"{topo.world_size}", where=f"{source}: field 'world_size'",
                            fix="drop world_size (it is derived) or correct it")
    return topo


def _load_file(path: str) -> Mapping[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise TopologyError(f"cannot read topology file: {exc.strerror}", where=path,
                            fix="check the path") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml  # lazy: only YAML topology files need pyyaml
        except ImportError:
            raise TopologyError("reading a YAML topology file needs pyyaml", where=path,
                                fix="pip install pyyaml, or write the topology as JSON") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise TopologyError(f"invalid YAML: {exc}", where=path, fix="fix the syntax") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TopologyError(f"invalid JSON: {exc.msg}", where=f"{path}:{exc.lineno}",
                            fix="fix the syntax") from None


def parse_topology(spec: str) -> Topology:
    """``GPU:HOSTSxGPUS_PER_HOST`` (``h200:1x8``) or a .json/.yaml/.yml topology file."""
    if not isinstance(spec, str) or not spec.strip():
        raise TopologyError(f"empty topology spec {spec!r}", where="topology", fix=_SPEC_FIX)
    text = spec.strip()
    if text.endswith((".json", ".yaml", ".yml")) or os.path.isfile(text):
        return _from_mapping(_load_file(text), text)
    m = _SPEC_RE.match(text)
    if not m:
        raise TopologyError(f"malformed topology spec {spec!r}", where="topology", fix=_SPEC_FIX)
    name, hosts, gph = m.group(1), int(m.group(2)), int(m.group(3))
    return _from_mapping({"gpu": name, "hosts": hosts, "gpus_per_host": gph}, f"topology {text!r}")
