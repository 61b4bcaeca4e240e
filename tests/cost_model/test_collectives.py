"""Collectives: α-β model properties over random groups and sizes."""

from __future__ import annotations

import numpy as np
import pytest
from gemc.cost_model.collectives import OPS, best_algorithm, bus_factor, collective_time
from gemc.cost_model.topology import parse_topology
from hypothesis import assume, given, settings
from hypothesis import strategies as st

TOPOS = {name: parse_topology(name) for name in ("h200:8x8", "h100:64x8", "a100:4x8", "b200:4x8")}
sizes = st.floats(min_value=1.0, max_value=4e9, allow_nan=False)


def _spread(topo, size: int, per_host: int) -> list[int]:
    """`size` ranks, `per_host` on each host from host 0 on."""
    hosts = size // per_host
    return [h * topo.gpus_per_host + i for h in range(hosts) for i in range(per_host)]


def test_bus_factors_are_nccls() -> None:
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert bus_factor("all_to_all", 1) == 0.0


def test_single_rank_is_free_and_unknown_op_fails() -> None:
    topo = TOPOS["h200:8x8"]
    assert collective_time("all_reduce", 1e9, [3], topo) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time("broadcast", 1e6, 8, topo)
    with pytest.raises(ValueError, match="does not apply"):
        collective_time("all_to_all", 1e6, 8, topo, algorithm="ring")


def test_large_all_reduce_on_one_h200_host_is_near_nccl_tests() -> None:
    # nccl-tests on 8x H100/H200 SXM (ring, no NVLS): ~360 GB/s bus bandwidth at 1 GiB+.
    t = collective_time("all_reduce", 2**30, 8, TOPOS["h200:8x8"])
    busbw = 2**30 * bus_factor("all_reduce", 8) / t
    assert 300e9 < busbw < 400e9


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(TOPOS)), st.sampled_from(OPS), sizes, sizes,
       st.sampled_from([2, 4, 8, 16, 32]))
def test_time_grows_with_bytes(name: str, op: str, a: float, b: float, n: int) -> None:
    topo = TOPOS[name]
    lo, hi = sorted((a, b))
    assert collective_time(op, lo, n, topo) <= collective_time(op, hi, n, topo)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(TOPOS)), st.sampled_from(OPS), sizes,
       st.sampled_from([2, 4, 8]))
def test_time_grows_with_the_span_of_the_group(name: str, op: str, nbytes: float,
                                                size: int) -> None:
    """The same number of ranks spread over more hosts is never faster."""
    topo = TOPOS[name]
    times = []
    per_host = size
    while per_host >= 1:
        if size // per_host <= topo.hosts:
            times.append(collective_time(op, nbytes, _spread(topo, size, per_host), topo))
        per_host //= 2
    assert all(a <= b * (1 + 1e-9) for a, b in zip(times, times[1:], strict=False)), times


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(TOPOS)), st.sampled_from(OPS), sizes, st.integers(2, 8),
       st.data())
def test_group_inside_a_host_is_never_slower_than_across_hosts(
        name: str, op: str, nbytes: float, size: int, data: st.DataObject) -> None:
    topo = TOPOS[name]
    inside = list(range(size))
    across = sorted(data.draw(st.sets(st.integers(0, topo.world_size - 1), min_size=size,
                                      max_size=size)))
    assume(len({topo.host_of(r) for r in across}) > 1)
    assert collective_time(op, nbytes, inside, topo) <= collective_time(op, nbytes, across, topo)


def test_spine_oversubscription_slows_groups_across_units() -> None:
    flat = parse_topology("h100:64x8")
    from gemc.cost_model.topology import Topology
    d = flat.to_dict()
    d["network"]["oversubscription"] = 2.0
    thin = Topology.from_dict(d)
    group = list(range(0, 512, 8))  # one rank per host, 2 scalable units
    assert collective_time("all_reduce", 1e9, group, thin) > collective_time(
        "all_reduce", 1e9, group, flat) * 1.5
    inside_unit = list(range(0, 256, 8))
    assert collective_time("all_reduce", 1e9, inside_unit, thin) == pytest.approx(
        collective_time("all_reduce", 1e9, inside_unit, flat))


def test_best_algorithm_prefers_latency_lean_ones_for_small_messages() -> None:
    topo = TOPOS["h100:64x8"]
    algo_small, _ = best_algorithm("all_reduce", 1e3, 512, topo)
    algo_large, _ = best_algorithm("all_reduce", 4e9, 8, topo)
    assert algo_small in ("tree", "hierarchical")
    assert algo_large == "ring"


def test_uneven_all_to_all_is_bounded_by_the_most_loaded_rank() -> None:
    topo = TOPOS["h200:8x8"]
    n = 16
    even = np.full((n, n), 1e6)
    skewed = even.copy()
    skewed[3, :] *= 10  # rank 3 sends 10x
    t_even = collective_time("all_to_all", 0, range(n), topo, send_bytes=even)
    t_skew = collective_time("all_to_all", 0, range(n), topo, send_bytes=skewed)
    assert t_skew > t_even
    assert t_even == pytest.approx(collective_time("all_to_all", n * 1e6, range(n), topo),
                                   rel=1e-6)
    per_rank = [15e6] * n
    assert collective_time("all_to_all", 0, range(n), topo, send_bytes=per_rank) == \
        pytest.approx(t_even, rel=1e-6)
    with pytest.raises(ValueError):
        collective_time("all_to_all", 0, range(n), topo, send_bytes=[1.0, 2.0])


def test_one_hot_sender_across_hosts_pays_the_pxn_hop_on_its_nvlink() -> None:
    """PXN: a rank's bytes to another host reach the NIC on the destination's rail through
    the local GPU on that rail, so 7/8 of them also leave over its NVLink. One rank of two
    H200 hosts sending B evenly: NVLink out 7/15 B (its host) + 7/8 x 8/15 B (PXN) = 14/15 B,
    which binds before the host's eight NICs (8/15 B over 8 x 50 GB/s)."""
    from gemc.cost_model.collectives import DEFAULT_EFFICIENCY as eff

    topo = parse_topology("h200:2x8")
    n, b = 16, 1e9
    sends = np.zeros(n)
    sends[0] = b
    t = collective_time("all_to_all", 0, range(n), topo, send_bytes=sends)
    tb = topo.link_bandwidth(tuple(range(n)))
    fixed = eff.launch_s + tb.network_latency + (n - 1) * eff.per_peer_s
    nvl = tb.nvlink * eff.all_to_all_nvlink
    assert t - fixed == pytest.approx((14 / 15) * b / nvl, rel=1e-9)
    assert (14 / 15) * b / nvl > (8 / 15) * b / (tb.host_network * eff.all_to_all_network)
