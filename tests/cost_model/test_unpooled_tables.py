"""A plain lookup (nn.Embedding over a sequence) sharded by rows returns each id's row to
the asking rank alone; a pooled bag's row shard returns a partial sum for every bag."""

from dataclasses import replace

import pytest
from gemc.cost_model import step_model
from gemc.cost_model.memory import shard_shape, table_memory
from gemc.cost_model.op_cost import batched_embedding_time
from gemc.cost_model.step_model import a2a_sends, host_reduce_s, predict_step, shard_compute_s
from gemc.cost_model.topology import parse_topology
from gemc.cost_model.types import StepOptions, TableCost
from hypothesis import given
from hypothesis import strategies as st

from gemc.solver.candidates import table_option
from gemc.solver.problem import Problem


@given(world=st.integers(2, 64), batch=st.integers(1, 4096), dim=st.sampled_from([16, 64, 256]))
def test_row_sharded_lookup_returns_only_its_share(world, batch, dim):
    ranks = tuple(range(world))
    pooled = TableCost(
        "t", rows=10**6, dim=dim, nnz=batch, batch=batch, sharding="row_wise", ranks=ranks
    )
    plain = TableCost(
        "t",
        rows=10**6,
        dim=dim,
        nnz=batch,
        batch=batch,
        sharding="row_wise",
        ranks=ranks,
        pooled=False,
    )
    opts = StepOptions()
    act_pooled = table_memory(pooled, 0, world, opts).activations
    act_plain = table_memory(plain, 0, world, opts).activations
    assert abs(act_plain * world - act_pooled) <= 1e-6 * act_pooled


def test_table_wise_lookup_is_priced_like_a_bag():
    a = TableCost("t", rows=1000, dim=64, nnz=100, batch=100)
    b = TableCost("t", rows=1000, dim=64, nnz=100, batch=100, pooled=False)
    assert table_memory(a, 0, 8, StepOptions()).total == table_memory(b, 0, 8, StepOptions()).total


# ---- compute: a row shard of a plain lookup only looks up (and writes) its own ids ---------
@pytest.fixture(autouse=True)
def _no_kernel_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests compare shards' lookup work: the floor of a rank's batched kernel
    (step_model.batched_floor_s, tested in tests/solver/test_narrow_shards.py) would
    hide it, every shard here being priced under it."""
    monkeypatch.setattr(step_model, "SHARD_STEP_FLOOR_S", 0.0)


def _sparse_per_rank(table: TableCost, spec: str, calibration=None) -> list[float]:
    p = predict_step([], [table], parse_topology(spec), calibration=calibration)
    return [r.sparse_compute_s for r in p.per_rank]


@pytest.mark.parametrize("spec", ["h200:1x8", "h200:8x8"])
def test_row_sharded_lookup_computes_its_share(spec):
    world = parse_topology(spec).world_size
    nnz = 65_536  # one rank's sequence ids; each is its own output row
    one = TableCost("seq", rows=10**7, dim=128, nnz=nnz, batch=nnz, pooled=False)
    rows = replace(one, sharding="row_wise", ranks=tuple(range(world)))
    whole = _sparse_per_rank(one, spec)[0]  # one rank looks up the world's ids
    shard = _sparse_per_rank(rows, spec)
    assert shard == [shard[0]] * world
    # 1/N of the work, give or take the kernel launches and the touched-row count
    assert shard[0] * world == pytest.approx(whole, rel=0.08)
    # and 1/N of the all-to-all: each id's row still travels once
    sends_one, _ = a2a_sends([one], world)
    sends_rows, _ = a2a_sends([rows], world)
    assert sends_rows.sum() == pytest.approx(sends_one.sum())
    assert sends_rows.max() == pytest.approx(sends_one.max() / world)


def test_row_sharded_bag_still_writes_a_partial_sum_per_bag():
    world = 64
    spec, gpu = "h200:8x8", parse_topology("h200:8x8").gpu
    nnz, batch = 81_920, 4096
    bag = TableCost("bag", rows=10**7, dim=128, nnz=nnz, batch=batch, sharding="row_wise",
                    ranks=tuple(range(world)))
    plain = replace(bag, pooled=False)
    # the shard's share of the rank's batched lookup kernel (rowwise Adagrad: the runner's)
    t = batched_embedding_time(10**7 // world, 128, world * nnz // world, world * batch,
                               "fp32", gpu, None, "rowwise_adagrad")
    # plus the in-host all-to-all that sums the 8 partials a host holds of every bag
    summed = host_reduce_s(bag, 10**7 / world, 128, world, parse_topology(spec), None)
    assert summed > 0
    assert _sparse_per_rank(bag, spec)[0] == pytest.approx(t + summed, rel=1e-12)
    # and each partial crosses hosts summed: 1/8 of the bytes of sending every partial
    direct, _ = a2a_sends([bag], world)
    summed_sends, _ = a2a_sends([bag], world, gpus_per_host=8)
    assert summed_sends == pytest.approx(direct / 8)
    t = batched_embedding_time(10**7 // world, 128, world * nnz // world, world * batch // world,
                               "fp32", gpu, None, "rowwise_adagrad")
    assert _sparse_per_rank(plain, spec)[0] == pytest.approx(t, rel=1e-12)


@pytest.mark.parametrize("calibrated", [False, True])
def test_solver_prices_row_sharded_lookups_as_predict_step(calibration, calibrated):
    topo = parse_topology("h200:2x8")
    cal = calibration if calibrated else None
    t = TableCost("seq", rows=10**6, dim=256, nnz=131_072, batch=131_072, pooled=False)
    problem = Problem(regions=(), tables=(t,), topology=topo, calibration=cal)
    for sharding, ranks in (("row_wise", 16), ("table_row_wise", 8), ("grid", 16)):
        o = table_option(problem, t, sharding, ranks, (2, 8) if sharding == "grid" else None)
        placed = replace(t, sharding=sharding, ranks=tuple(range(ranks)))
        assert o.compute_s == _sparse_per_rank(placed, "h200:2x8", cal)[0]


def test_gem_xl_position_table_row_wise_is_cheap():
    """gem-xl's pos_emb (1024 positions x 1024, 131072 ids per rank) row-wise over 4096
    ranks: each rank looks up 1/4096 of the world's ids, not the world's batch (was 6.4 s)."""
    gpu = parse_topology("h200:512x8").gpu
    world = 4096
    pos = TableCost("pos_emb.weight", rows=1024, dim=1024, nnz=131_072, batch=131_072,
                    sharding="row_wise", ranks=tuple(range(world)), pooled=False)
    whole = shard_compute_s(replace(pos, sharding="table_wise", ranks=(0,)), 1024, 1024, world,
                            gpu, None, "adamw")
    shard = shard_compute_s(pos, *shard_shape(pos), world, gpu, None, "adamw")
    assert shard < 5e-3 and whole > 1.0  # ~1 ms: the local batch's worth of ids
