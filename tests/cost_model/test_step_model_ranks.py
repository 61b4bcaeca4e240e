"""predict_step prices each table once and adds it to its holders: the same numbers as a
per-rank loop over every rank, in time linear in the ranks (not quadratic)."""

from __future__ import annotations

from collections import Counter

import pytest
from gemc.cost_model.memory import (
    MemoryBreakdown,
    lookup_gradient_extra,
    rank_memory,
    table_grad_bytes,
    table_memory,
    table_shard,
)
from gemc.cost_model.step_model import (
    a2a_sends,
    batched_kernel_floor_s,
    column_squares_s,
    host_reduce_s,
    in_batched_kernel,
    predict_step,
    routed_tables,
    shard_compute_s,
)
from gemc.cost_model.topology import parse_topology
from gemc.cost_model.types import RegionCost, StepOptions, TableCost
from hypothesis import given, settings
from hypothesis import strategies as st

from gemc.sharding import SHARDINGS


def small_case() -> tuple[list[RegionCost], list[TableCost]]:
    """Every sharding, a rank listed twice, a rank past the world, unpooled lookups."""
    T = TableCost
    tables = [
        T("pooled_rw", rows=1_000_000, dim=64, nnz=40_960, batch=2048, sharding="row_wise",
          ranks=tuple(range(8))),
        T("pooled_trw", rows=500_000, dim=128, nnz=20_480, batch=2048,
          sharding="table_row_wise", ranks=(4, 5, 6, 7)),
        T("grid", rows=2_000_000, dim=128, nnz=8192, batch=2048, sharding="grid",
          ranks=tuple(range(8)), dtype_bytes=2),
        T("cw", rows=300_000, dim=256, nnz=4096, batch=2048, sharding="column_wise",
          ranks=(1, 3)),
        T("cw_twice_on_2", rows=300_000, dim=64, nnz=4096, batch=2048,
          sharding="column_wise", ranks=(2, 2)),
        T("tw", rows=50_000, dim=64, nnz=2048, batch=2048, sharding="table_wise", ranks=(5,)),
        T("rw_past_world", rows=100_000, dim=32, nnz=2048, batch=2048, sharding="row_wise",
          ranks=(0, 1, 9)),
        T("dp", rows=1000, dim=16, nnz=2048, batch=2048, sharding="data_parallel",
          ranks=tuple(range(8))),
        T("seq_tw", rows=200_000, dim=128, nnz=65_536, batch=65_536, sharding="table_wise",
          ranks=(2,), pooled=False),
        T("seq_cw", rows=200_000, dim=128, nnz=65_536, batch=65_536, sharding="column_wise",
          ranks=(6, 7), pooled=False),
    ]
    regions = [RegionCost("mlp", 50_000_000, 2e11, 0.004, "fsdp", activation_bytes=10**9),
               RegionCost("head", 1_000_000, 1e10, 0.001, "ddp")]
    return regions, tables


def test_small_case_is_pinned() -> None:
    """Values of predict_step on a fixed case: first computed by the per-rank (quadratic)
    version before it went linear; re-pinned (issue 18) when the defaults became what the
    runner does -- rowwise Adagrad tables in one batched lookup kernel, the id exchange
    inside the step -- and all-to-all took its fitted NVLink/NIC efficiencies; and
    (issue 19) rank 2, which holds both shards of ``cw_twice_on_2``, pays for two; and
    (issue 19) weight rows move in whole 32-byte sectors: the 8-rank grid's shards of
    ``grid`` are 128/3 columns wide (171 bytes, priced as 192); and (issue 19) a rank's
    batched kernel costs at least ``kernels.SHARD_STEP_FLOOR_S`` (its step unchanged:
    rank 2 is past it); and (issue 19) the id all-to-all carries what the runner sends
    (step_model.id_send_bytes): each id once per column piece or grid column block, the
    int64 per-bag counts once per holder (input dist 0.0403 -> 0.0659 ms, nothing else
    moved); and (issue 19) the data-parallel table's gradient goes in the step's one
    replica bucket with a used-row flag a row, reduced after the backward, exposed
    (``replica_all_reduce``); and (issue 21) each table is priced on the route the runner
    runs it on (gemc.table_lookup.sharded_route): the column-split tables (``grid``,
    ``cw``, ``cw_twice_on_2``, ``seq_cw``) under row-wise Adagrad on the sparse route, the
    others in their owners' batched kernel, the data-parallel table on the sparse route;
    and (issues 19, 21) the column-split tables joined their owners' batched kernel (the
    two-phase row-wise Adagrad update, ``split_rows``): the kernels at their floor (rank 2
    above it by its two shards' second pass), the column groups' all-reduce of the
    squares on top for ranks 1, 3, 6 and 7 (rank 2 holds both pieces of its table: no
    group; step 11.22 -> 10.34 ms); and (issue 19) the batched kernel's price refitted to
    its measured steps (op_cost's BATCHED_* constants: a per-id term, bytes at the HBM rate;
    benchmarks/fit_lookup_price.py): this case's small tables cost less, rank 2's two
    second passes now fall under the floor (step 10.34 -> 10.30 ms); and (issue 19) the
    row-split pooled tables' partials are summed inside each host before they cross
    (step_model.host_reduce_owners: ``pooled_rw`` and ``pooled_trw`` by 4 owners a host,
    ``grid`` by 2): all-to-all 2.028 -> 1.858 ms, their holders' sparse time up by the
    in-host all-to-all (ranks 0-3 +0.061 ms, 4-7 +0.118), step 10.30 -> 10.25 ms."""
    regions, tables = small_case()
    p = predict_step(regions, tables, parse_topology("h200:2x4"))
    assert p.step_s == pytest.approx(0.010251849869442008, rel=1e-12)
    assert p.breakdown["replica_all_reduce"] == pytest.approx(2.5718599033816424e-05, rel=1e-12)
    assert p.breakdown["input_dist"] == pytest.approx(6.594770731707317e-05, rel=1e-12)
    assert p.breakdown["all_to_all"] == pytest.approx(0.0018576767479674798, rel=1e-12)
    # the batched kernels at their floor, plus the column groups' squares (``cw``,
    # ``seq_cw``) and the in-host sums of the row shards' partials
    sparse = [0.0012383088892947741, 0.0012486729781836631, 0.0012383088892947741,
              0.0012486729781836631, 0.0012958130354134957, 0.0012958130354134955,
              0.001311638457635718, 0.001311638457635718]
    memory = [2713419082.666667, 2884996298.6666665, 3432484298.6666665,
              2876401994.6666665, 2786101994.6666665, 2807490602.6666665,
              3106537450.666667, 3106537450.666667]
    assert [r.sparse_compute_s for r in p.per_rank] == pytest.approx(sparse, rel=1e-12)
    assert [r.memory_bytes for r in p.per_rank] == pytest.approx(memory, rel=1e-12)


# ---- a straightforward reference: ask every rank about every table ------------------------
def reference_per_rank(regions, tables, topo, calibration, opts):
    """(sparse seconds, memory dicts, all-to-all sends) per rank, by the obvious loops."""
    world, gpu = topo.world_size, topo.gpu
    sparse = [0.0] * world
    kernel = [0.0] * world  # the rank's batched kernel: its shards' seconds, their count
    kernel_shards = [0] * world
    sends = [0.0] * world
    table_mem: dict[int, MemoryBreakdown] = {}
    held = [0.0] * world  # the lookups' gradients (sparse) or sort buffers (batched)
    moment = [0.0] * world  # the largest sparse optimizer step's buffers
    dp_mem = MemoryBreakdown()
    for t in routed_tables(tables, world, opts.table_optimizer):  # as the runner runs them
        if t.sharding == "data_parallel":  # stepped by the sparse optimizer (sparse route)
            c = shard_compute_s(t, *table_shard(t, 0), world, gpu, calibration,
                                opts.table_optimizer)
            sparse = [s + c for s in sparse]
            dp_mem = dp_mem + table_memory(t, 0, world, opts)
            # every replica holds its local batch's gradient (and its step's buffers)
            grads = table_grad_bytes(t, *table_shard(t, 0), world, opts.table_optimizer)
            held = [h + grads[0] for h in held]
            moment = [max(m, grads[1]) for m in moment]
            continue
        for r in range(world):
            if r not in t.ranks:
                continue
            # a rank listed twice computes two shards (table_memory counts them too)
            c = t.ranks.count(r) * shard_compute_s(
                t, *table_shard(t, r), world, gpu, calibration, opts.table_optimizer)
            # and waits for its column group's squares once per shard (row-wise Adagrad)
            sparse[r] += c + t.ranks.count(r) * column_squares_s(
                t, world, topo, calibration, opts.table_optimizer)
            if in_batched_kernel(t, world):
                kernel[r] += c
                kernel_shards[r] += t.ranks.count(r)
            table_mem[r] = table_mem.get(r, MemoryBreakdown()) + table_memory(t, r, world,
                                                                             opts)
            grads = table_grad_bytes(t, *table_shard(t, r), world, opts.table_optimizer)
            held[r] += t.ranks.count(r) * grads[0]
            moment[r] = max(moment[r], grads[1])
        # a pooled row-split table's partials summed in each host first: the fewest
        # owners a column block (consecutive ranks) has on one host
        summed = 1
        if t.pooled and SHARDINGS[t.sharding].row_split \
                and 1 < topo.gpus_per_host < world:
            per = len(t.ranks) // SHARDINGS[t.sharding].column_blocks(len(t.ranks))
            if per > 1:
                summed = min(Counter(r // topo.gpus_per_host for r in t.ranks[i:i + per])
                             .most_common()[-1][1] for i in range(0, len(t.ranks), per))
        for r in t.ranks:  # a rank listed twice sends twice
            if r < world:
                rows, dim = table_shard(t, r)
                sends[r] += ((world - 1) * t.batch * dim * t.dtype_bytes * t.output_share(rows)
                             / summed)
                sparse[r] += host_reduce_s(t, rows, dim, world, topo, calibration)
    for r in range(world):  # the kernel costs at least its floor, once a rank
        if kernel_shards[r]:
            sparse[r] += max(0.0, batched_kernel_floor_s(world) - kernel[r])
    base = rank_memory(regions, (), 0, world, opts) + dp_mem
    memory = []
    for r in range(world):
        mem = base + table_mem[r] if r in table_mem else base
        # what the lookups' gradients (sparse) and sort buffers (batched) add beyond the
        # activations' room: the largest sparse step's moment, no table-sized gradient
        mem = mem + MemoryBreakdown(grads=float(lookup_gradient_extra(
            held[r], moment[r], 0.0, mem.activations)))
        memory.append(mem.to_dict())
    return sparse, memory, sends


rank_sets = st.sampled_from([(0,), (5,), (0, 1, 2, 3), tuple(range(8)), tuple(range(16)),
                             (1, 1, 3), (6, 7, 8, 9), (2, 20)])
tables_st = st.lists(st.builds(
    TableCost, fqn=st.just("t"), rows=st.integers(1, 10**8),
    dim=st.sampled_from([16, 64, 128]), nnz=st.integers(0, 10**6), batch=st.integers(1, 8192),
    sharding=st.sampled_from(["data_parallel", "table_wise", "row_wise", "column_wise",
                              "table_row_wise", "grid"]),
    ranks=rank_sets, dtype_bytes=st.sampled_from([2, 4]), pooled=st.booleans()), max_size=8)


@settings(max_examples=60, deadline=None)
@given(tables_st, st.sampled_from(["h200:2x4", "h200:2x8", "h100:1x8"]), st.booleans(),
       st.sampled_from(["adamw", "rowwise_adagrad"]))
def test_per_table_pricing_equals_per_rank_loop(calibration, tables, spec, calibrated,
                                                optimizer) -> None:
    topo = parse_topology(spec)
    calibration = calibration if calibrated else None
    opts = StepOptions(table_optimizer=optimizer)
    regions = [RegionCost("r", 10**7, 1e11, 0.002, "fsdp", activation_bytes=10**8)]
    p = predict_step(regions, tables, topo, calibration=calibration, options=opts)
    sparse, memory, sends = reference_per_rank(regions, tables, topo, calibration, opts)
    # approx, not ==: a rank listed twice adds its shard twice in one and multiplies by two
    # in the other, which round differently in the last bit
    assert [r.sparse_compute_s for r in p.per_rank] == pytest.approx(sparse, rel=1e-12)
    for got, want in zip([r.memory for r in p.per_rank], memory, strict=True):
        assert got == pytest.approx(want, rel=1e-12)
    assert list(a2a_sends(tables, topo.world_size, gpus_per_host=topo.gpus_per_host)[0]) \
        == pytest.approx(sends, rel=1e-12)


# ---- scaling: count how often rank lists are read, no clocks ------------------------------
class CountingRanks(tuple):
    """A rank tuple that counts the elements read from it (a membership test is a scan)."""

    reads = 0

    def __iter__(self):
        for r in super().__iter__():
            CountingRanks.reads += 1
            yield r

    def __contains__(self, rank: object) -> bool:
        CountingRanks.reads += len(self)
        return super().__contains__(rank)


def rank_reads(hosts: int, n_tables: int) -> int:
    topo = parse_topology(f"h200:{hosts}x8")
    world = topo.world_size
    tables = [TableCost(f"t{i}", rows=10**7 + i, dim=128, nnz=81_920, batch=4096,
                        sharding=sharding, ranks=CountingRanks(range(world)), pooled=i % 2 == 0)
              for i in range(n_tables)
              for sharding in ("row_wise", "grid", "table_row_wise")]
    CountingRanks.reads = 0
    predict_step([RegionCost("r", 10**8, 1e12, 0.01, "fsdp")], tables, topo)
    return CountingRanks.reads


def test_rank_list_reads_grow_linearly_with_ranks() -> None:
    small, large = rank_reads(4, 5), rank_reads(32, 5)  # 32 and 256 ranks, 15 tables
    tables = 15
    # a constant number of passes over each table's ranks, not one per rank
    assert large <= 8 * tables * 256
    assert large <= 8 * 1.5 * small  # 8x the ranks: ~8x the reads (was ~64x)
