"""Data-parallel replicas are priced as the runner steps them (issue 19): each replica's
lookup and its bucketed step (its rows added into the step's bucket, one masked pass over
its table: ``kernels.replica_update_bytes``), and ONE all-reduce a step of every replica's
gradient and used-row flags (``step_model.replica_all_reduce_s``): a replica adds its bytes
to that collective, not another latency. The planners price the same (``evaluate`` held
equal to ``predict_step``) and are offered data parallel for DLRMv2's small tables."""

from __future__ import annotations

from dataclasses import replace

import pytest
from gemc.cost_model.calibration import default_calibration
from gemc.cost_model.kernels import replica_bucket_bytes
from gemc.cost_model.step_model import (
    predict_step,
    replica_all_reduce_s,
    shard_compute_s,
)
from gemc.cost_model.topology import parse_topology
from gemc.cost_model.types import RegionCost, StepOptions, TableCost

from gemc.table_lookup import SPARSE

TOPO = parse_topology("h200:2x8")
WORLD = TOPO.world_size
DENSE = RegionCost("top", params=10**6, fwd_flops=1e12, compute_s=2e-3,
                   activation_bytes=10**8, boundary_bytes=10**6)


def _replica(i: int, rows: int = 20_000, dim: int = 128, **kw) -> TableCost:
    """A DLRMv2-sized small table, data parallel on every rank, on the sparse route (the
    route rule's choice for a replica on several ranks)."""
    return TableCost(f"t{i}", rows=rows, dim=dim, nnz=4096, batch=4096,
                     sharding="data_parallel", ranks=tuple(range(WORLD)), lookup=SPARSE, **kw)


def _predict(tables: list[TableCost], optimizer: str = "rowwise_adagrad"):
    cal = default_calibration(TOPO.gpu.name)
    return predict_step([DENSE], tables, TOPO, calibration=cal,
                        options=StepOptions(table_optimizer=optimizer))


def test_replicas_share_one_all_reduce_latency() -> None:
    """N replicas: one collective of N buckets' bytes. A second replica adds its bytes'
    time (the all-reduce's slope), well under a second collective's latency."""
    cal = default_calibration(TOPO.gpu.name)
    one = _predict([_replica(0)])
    bucket = replica_bucket_bytes(20_000, 128)
    assert bucket == 20_000 * 129 * 4  # fp32 gradient rows + one fp32 flag a row
    for n in (1, 2, 5):
        p = _predict([_replica(i) for i in range(n)])
        assert p.breakdown["replica_all_reduce"] == pytest.approx(
            replica_all_reduce_s(n * bucket, TOPO, cal), rel=1e-12)
    two = _predict([_replica(0), _replica(1)])
    added = two.breakdown["replica_all_reduce"] - one.breakdown["replica_all_reduce"]
    latency = replica_all_reduce_s(1.0, TOPO, cal)  # alpha: what one more collective costs
    slope = replica_all_reduce_s(2 * bucket, TOPO, cal) - replica_all_reduce_s(bucket, TOPO, cal)
    assert added == pytest.approx(slope, rel=1e-9)
    assert added < one.breakdown["replica_all_reduce"] - 0.5 * latency
    # exposed after the backward (the bucket is reduced in the embedding optimizer's step)
    assert two.step_s - one.step_s >= added
    # a bf16-stored replica's bucket is fp32 all the same
    bf16 = _predict([_replica(0, precision="bf16"), _replica(1)])
    assert bf16.breakdown["replica_all_reduce"] == pytest.approx(
        two.breakdown["replica_all_reduce"], rel=1e-12)


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_a_small_replica_costs_its_few_kernels_not_a_per_table_collective(optimizer) -> None:
    """A 20k-row replica's step is three kernels issued (add into the bucket, flags, the
    masked pass): a few tens of us at 16 ranks, where the per-table densify, two
    all-reduces and ``nonzero`` cost >= 0.23 ms. Its update is a pass over its table, so a
    3M-row replica costs more, and bf16 storage (the ATen row update over every row)
    more than fp32."""
    gpu, cal = TOPO.gpu, default_calibration(TOPO.gpu.name)
    small = _replica(0)
    s = shard_compute_s(small, small.rows, small.dim, WORLD, gpu, cal, optimizer)
    assert 0 < s < 0.08e-3
    big = _replica(1, rows=3_000_000)
    assert shard_compute_s(big, big.rows, big.dim, WORLD, gpu, cal, optimizer) > 5 * s
    narrow = replace(small, precision="bf16")
    assert shard_compute_s(narrow, narrow.rows, narrow.dim, WORLD, gpu, cal, optimizer) > s


def test_the_planners_price_replicas_as_predict_step_and_offer_them() -> None:
    """``evaluate`` (the planners' sums) equals ``predict_step`` on a plan with replicas
    and sharded tables, Adam as the table optimizer (the replicas' optimizer included);
    data parallel is among a small table's options."""
    from gemc.solver.candidates import table_options
    from gemc.solver.evaluate import evaluate
    from gemc.solver.problem import Assignment, DenseChoice, Problem, SolverSettings, TableChoice

    opts = StepOptions(table_optimizer="adam")
    cal = default_calibration(TOPO.gpu.name)
    sharded = TableCost("big", rows=4_000_000, dim=128, nnz=4096 * 16, batch=4096,
                        lookup=SPARSE)
    tables = (_replica(0), _replica(1, rows=300), sharded)
    problem = Problem((DENSE,), tables, TOPO, calibration=cal, options=opts,
                      settings=SolverSettings(time_limit_s=5))
    assert "data_parallel" in {o.sharding for o in table_options(problem, tables[1])}
    choice = {"t0": TableChoice("data_parallel", tuple(range(WORLD))),
              "t1": TableChoice("data_parallel", tuple(range(WORLD))),
              "big": TableChoice("table_wise", (3,))}
    ev = evaluate(problem, Assignment(dense={"top": DenseChoice("ddp")}, tables=choice))
    placed = [tables[0], tables[1], replace(sharded, sharding="table_wise", ranks=(3,))]
    p = predict_step([replace(DENSE, strategy="ddp")], placed, TOPO, calibration=cal,
                     options=problem.options)
    assert ev.step_s == pytest.approx(p.step_s, rel=1e-9)
    assert ev.breakdown["replica_all_reduce"] == pytest.approx(
        p.breakdown["replica_all_reduce"], rel=1e-12)
    assert [float(m) for m in ev.memory] == pytest.approx(
        [r.memory_bytes for r in p.per_rank], rel=1e-9)
