"""The pooled exchange of row-split tables as the runner runs it: each host's owners of a
column block sum their partials before they cross hosts (step_model.host_reduce_owners),
so a table in 8 row shards on a host crosses once, not 8 times, and pays an in-host
all-to-all for it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from gemc.cost_model.collectives import collective_time
from gemc.cost_model.step_model import (
    a2a_sends,
    host_reduce_owners,
    host_reduce_s,
    pooled_send_bytes,
    predict_step,
)
from gemc.cost_model.topology import parse_topology
from gemc.cost_model.types import RegionCost, TableCost

from gemc.exchange_precision import FP32_WIRE

BAG = TableCost("bag", rows=4_000_000, dim=128, nnz=40_960, batch=4096)


@pytest.mark.parametrize(("sharding", "ranks", "local", "owners"), [
    ("table_row_wise", tuple(range(8, 16)), 8, 8),  # a host's row shards
    ("row_wise", tuple(range(16)), 8, 8),           # every rank: 8 a host
    ("grid", tuple(range(64)), 8, 8),               # 8 column blocks of a host's 8 rows
    ("row_wise", tuple(range(16)), 1, 1),           # one GPU a host: nothing to sum
    ("row_wise", (0, 8), 8, 1),                     # one owner on each host
    ("row_wise", (0, 1, 2, 8), 8, 1),               # the fewest a host has
    ("column_wise", tuple(range(8)), 8, 1),         # disjoint columns: no partials
    ("table_wise", (3,), 8, 1),
    ("data_parallel", tuple(range(16)), 8, 1),
])
def test_owners_that_sum_a_partial(sharding, ranks, local, owners) -> None:
    table = replace(BAG, sharding=sharding, ranks=ranks)
    assert host_reduce_owners(table, local, 64) == owners
    assert host_reduce_owners(table, local, local) == 1  # one host: nothing crosses


def test_unpooled_shards_send_only_their_rows() -> None:
    seq = replace(BAG, sharding="row_wise", ranks=tuple(range(16)), pooled=False)
    assert host_reduce_owners(seq, 8, 16) == 1


def test_a_hosts_row_shards_cross_hosts_once() -> None:
    """8 row shards on a host send, summed, what one whole-table shard sends, split
    over the 8; each pays the in-host exchange, forward and backward."""
    topo = parse_topology("h200:2x8")
    whole = replace(BAG, sharding="table_wise", ranks=(0,))
    rows = replace(BAG, sharding="table_row_wise", ranks=tuple(range(8)))
    one = pooled_send_bytes(whole, BAG.rows, 128, 16, FP32_WIRE, 8)
    assert pooled_send_bytes(rows, BAG.rows / 8, 128, 16, FP32_WIRE, 8) == \
        pytest.approx(one / 8)
    assert a2a_sends([rows], 16, gpus_per_host=8)[0].sum() == \
        pytest.approx(a2a_sends([whole], 16, gpus_per_host=8)[0].sum())
    assert host_reduce_s(whole, BAG.rows, 128, 16, topo, None) == 0.0
    summed = host_reduce_s(rows, BAG.rows / 8, 128, 16, topo, None)
    # 7/8 of the world's bags' partial rows, fp32, each way over NVLink
    nvlink_s = 7 / 8 * 16 * 4096 * 128 * 4 / topo.gpu.nvlink_bandwidth
    assert 2 * nvlink_s < summed < 4 * nvlink_s


def test_the_step_prices_the_sum_and_the_smaller_exchange() -> None:
    """On two hosts the summed exchange beats sending every partial: the all-to-all
    falls by more than the in-host exchange adds."""
    topo = parse_topology("h200:2x8")
    regions = [RegionCost("mlp", 10**7, 1e11, 0.002, "ddp")]
    rows = replace(BAG, sharding="table_row_wise", ranks=tuple(range(8)))
    p = predict_step(regions, [rows], topo)
    direct_sends = a2a_sends([rows], 16)[0]
    summed_sends = a2a_sends([rows], 16, gpus_per_host=8)[0]
    assert summed_sends.sum() == pytest.approx(direct_sends.sum() / 8)
    # the step's all-to-all is the summed one, and with the in-host exchange added it is
    # still under what sending every partial would take
    summed_a2a = 2 * collective_time("all_to_all", 0, range(16), topo, send_bytes=summed_sends)
    direct_a2a = 2 * collective_time("all_to_all", 0, range(16), topo, send_bytes=direct_sends)
    assert p.breakdown["all_to_all"] == pytest.approx(summed_a2a)
    in_host = host_reduce_s(rows, BAG.rows / 8, 128, 16, topo, None)
    assert summed_a2a + in_host < direct_a2a
