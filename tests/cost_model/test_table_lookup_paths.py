"""A table is priced by the code that will run it (gemc.table_lookup): inside the batched
kernel, or eager with a sparse or table-sized gradient and the sparse optimizer after it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from gemc.backends.torch.owner_lookup import owner_routes
from gemc.cost_model.calibration import default_calibration
from gemc.cost_model.step_model import predict_step, routed_tables, shard_compute_s
from gemc.cost_model.topology import parse_topology
from gemc.cost_model.types import RegionCost, StepOptions, TableCost

from gemc import ir
from gemc.table_lookup import (
    BATCHED,
    DENSE_GRAD,
    SPARSE,
    cheaper_route,
    lookup_paths,
    routed_as_sharded,
    sharded_route,
)

FP32 = {"a": "fp32", "b": "fp32", "c": "fp32"}


def test_rule_follows_the_runner() -> None:
    # module mode (no graph kernels): every table through the sharded tables
    assert lookup_paths(FP32, [{"a"}], world_size=1, graph_mode=False) == dict.fromkeys(
        FP32, SPARSE)
    # graph mode, one rank: the batched entry owns its tables, the others run as captured
    assert lookup_paths(FP32, [{"a", "b"}], world_size=1, graph_mode=True,
                        captured_sparse={"c"}) == {"a": BATCHED, "b": BATCHED, "c": SPARSE}
    assert lookup_paths(FP32, [{"a"}], world_size=1, graph_mode=True)["c"] == DENSE_GRAD
    # several ranks: no batched entry is applied; the owners look their shards up fused
    # (sharded_route), in module and graph mode alike
    for graph_mode in (False, True):
        assert set(lookup_paths(FP32, [{"a"}], world_size=2,
                                graph_mode=graph_mode).values()) == {BATCHED}
    paths = lookup_paths(FP32, [], world_size=2, graph_mode=False,
                         shardings={"a": "column_wise", "b": "data_parallel"},
                         lookups={"c": 2})
    # column shards under row-wise Adagrad run fused too (two phases: split_rows)
    assert paths == {"a": BATCHED, "b": SPARSE, "c": SPARSE}
    # a table the model holds in bf16 keeps the sparse route (the fused kernel's rows are
    # fp32, or bf16 / fp8 storage of fp32 rows): the runner, its plan facts and the cost
    # model read that from the model's dtype alike
    assert lookup_paths(FP32, [], world_size=2, graph_mode=False, not_fp32={"b"}) == {
        "a": BATCHED, "b": SPARSE, "c": BATCHED}
    assert owner_routes([{"fqn": "a", "sharding": "row_wise", "dtype": "float32"},
                         {"fqn": "b", "sharding": "row_wise", "dtype": "bfloat16"}],
                        world_size=2, optimizer="rowwise_adagrad") == {"a": BATCHED,
                                                                       "b": SPARSE}
    narrow = TableCost("b", 1000, 16, 64, 32, sharding="row_wise", ranks=(0, 1),
                       dtype_bytes=2)
    assert [t.lookup for t in routed_tables([narrow, replace(narrow, dtype_bytes=4)], 2,
                                             "rowwise_adagrad")] == [SPARSE, BATCHED]
    # a bf16 table outside any entry sends every lookup through the sharded tables
    low = {**FP32, "c": "bf16"}
    assert set(lookup_paths(low, [{"a"}], world_size=1, graph_mode=True).values()) == {SPARSE}
    # an entry of mixed precisions is not applied as one kernel, but does not block others
    mixed = {**FP32, "b": "bf16"}
    paths = lookup_paths(mixed, [{"a", "b"}], world_size=1, graph_mode=True)
    assert paths == {"a": SPARSE, "b": SPARSE, "c": SPARSE}


# DIN h200's tables (examples/zoo/din.py): the 1M-id history lookup into 4M goods (and its
# candidate lookup), the same into 100k categories, 16 weighted bags of 20 ids into 1M rows
DIN = [TableCost("goods", 4_000_000, 64, 1_050_624, 1_050_624, pooled=False, lookups=2),
       TableCost("cates", 100_000, 64, 1_050_624, 1_050_624, pooled=False, lookups=2)] + [
    TableCost(f"profile.{i}", 1_000_000, 64, 40_960, 2048, lookups=1) for i in range(16)]


def _sparse_ms(tables: list[TableCost], lookup: str, world: int = 1) -> float:
    calib = default_calibration("h200")
    topo = parse_topology(f"h200:1x{world}")
    return sum(1e3 * shard_compute_s(replace(t, lookup=lookup), t.rows, t.dim, world, topo.gpu,
                                     calib, "rowwise_adagrad") for t in tables)


def test_outside_the_batched_kernel_costs_more() -> None:
    batched = _sparse_ms(DIN, BATCHED)
    dense = _sparse_ms(DIN, DENSE_GRAD)
    sparse = _sparse_ms(DIN, SPARSE)
    assert dense > 2 * batched and sparse > batched
    # the table-sized gradient is what the dense path pays: more rows, same ids, more time
    big = [replace(t, rows=4 * t.rows) for t in DIN[2:]]
    assert _sparse_ms(big, DENSE_GRAD) > 2.5 * _sparse_ms(DIN[2:], DENSE_GRAD)
    assert _sparse_ms(big, SPARSE) < 1.2 * _sparse_ms(DIN[2:], SPARSE)


def test_din_tables_priced_toward_the_run() -> None:
    """DIN h200 measured 39.0 ms a step (benchmarks/results/zoo_h200_8e10b4c.json) where
    its plan predicted 18.6 ms with 2.5 ms for these tables priced as the fused kernel.
    By the path its run takes (graph mode, one rank: table-sized gradients and the
    sparse optimizer's step) they were priced 7-15 ms while that step scanned each
    gradient three times (``abs().sum(1)``: 7.5 ms of GPU time a step in the H200
    profile) before its row updates. The masked pass reads each gradient once and
    updates the used rows in it: 4-8 ms (a prediction, not measured yet)."""
    assert _sparse_ms(DIN, BATCHED) < 3.0
    assert 4.0 < _sparse_ms(DIN, DENSE_GRAD) < 8.0


def _route_ms(t: TableCost) -> dict[str, float]:
    return {path: _sparse_ms([t], path) for path in (SPARSE, DENSE_GRAD)}


def test_padded_ids_make_the_sparse_route_pay_their_duplicates() -> None:
    """DIN h200's history lookups read padded [B, L] grids whose padding is one id: the
    sparse coalesce sums that row's half a million duplicates in sequence. Measured:
    318 ms a step on the sparse route against 41 ms on the dense gradient."""
    goods, cates = DIN[0], DIN[1]
    padded = [replace(t, padded_nnz=1_048_576) for t in (goods, cates)]
    for plain, pad in zip((goods, cates), padded):
        assert _sparse_ms([pad], SPARSE) > _sparse_ms([plain], SPARSE) + 100.0
        # the dense gradient's atomic scatter adds them in sequence too, far faster (DIN's
        # e05fd50 profile: 2.6 ms a history table), and stays the cheaper route
        assert _sparse_ms([plain], DENSE_GRAD) + 2.0 < _sparse_ms([pad], DENSE_GRAD) \
            < _sparse_ms([plain], DENSE_GRAD) + 3.5
        assert cheaper_route(_route_ms(pad)) == DENSE_GRAD
    # the whole sparse route of DIN's 18 tables toward the run (318 ms, of which ~40 ms is
    # the rest of the step)
    assert 200.0 < _sparse_ms(padded + DIN[2:], SPARSE) < 350.0
    # without padding, a table far larger than its ids (16M rows, 1M ids) pays less for a
    # sparse gradient than for a 4 GB one
    assert cheaper_route(_route_ms(replace(goods, rows=16_000_000))) == SPARSE
    # a profile bag: one masked read of its 0.26 GB gradient costs less than the sparse
    # route's sort and row update, which called out of the compiled graph (graph mode)
    # also splits the graph
    bag = DIN[2]
    routed = replace(bag, routed=True)
    assert _sparse_ms([routed], SPARSE) > _sparse_ms([bag], SPARSE)
    assert _sparse_ms([routed], DENSE_GRAD) == _sparse_ms([bag], DENSE_GRAD)
    assert cheaper_route(_route_ms(routed)) == DENSE_GRAD


def test_route_follows_the_cheaper_price() -> None:
    """GEM's item table (1M x 128, 524k jagged ids: 1-D, no padding) measured faster on the
    sparse route (56.4 against 62.7 ms a step) while the dense route's optimizer scanned
    its gradient three times and synced; with the masked pass, one read of the gradient,
    it is priced cheaper on the dense route (to be measured again). HSTU's item table (1M
    rows, 66k ids over 3 lookups) stays sparse; a few rows looked up by many ids pay the
    duplicates' contended sum."""
    item = TableCost("item", 1_000_000, 128, 524_288, 524_288, pooled=False, routed=True)
    assert cheaper_route(_route_ms(item)) == DENSE_GRAD
    narrow = TableCost("pos", 256, 256, 524_288, 524_288, pooled=False, routed=True)
    assert narrow.hot_ids == pytest.approx(2048)
    assert cheaper_route(_route_ms(narrow)) == DENSE_GRAD
    hstu = TableCost("item", 1_000_001, 512, 66_560, 32_768, pooled=False, lookups=3,
                     routed=True)
    assert cheaper_route(_route_ms(hstu)) == SPARSE
    # a padding row: a local fp32 lookup keeps its ids in the gradient (no sync); on
    # several ranks the exchange masks them out, a host sync per lookup
    padded = _route_ms(replace(hstu, padding_row=True))
    assert padded == _route_ms(hstu)
    assert _sparse_ms([replace(hstu, padding_row=True)], SPARSE, world=2) == pytest.approx(
        _sparse_ms([hstu], SPARSE, world=2) + 3 * 1.3, rel=1e-6)
    assert cheaper_route({SPARSE: 1.0, DENSE_GRAD: 2.0}) == SPARSE
    assert cheaper_route({SPARSE: 2.0, DENSE_GRAD: 2.0}) == DENSE_GRAD  # a tie keeps it
    # the rule: a priced choice moves a DENSE_GRAD table only
    paths = lookup_paths(FP32, [{"a"}], world_size=1, graph_mode=True,
                         priced_sparse={"a", "c"})
    assert paths == {"a": BATCHED, "b": DENSE_GRAD, "c": SPARSE}


def test_eager_gradient_joins_the_peak_only_past_the_activations() -> None:
    topo = parse_topology("h200:1x1")
    table = TableCost("t", 1_000_000, 64, 40_960, 2048, lookup=DENSE_GRAD)
    grad = 1_000_000 * 64 * 4

    def peak(t: TableCost, activations: int) -> float:
        region = RegionCost("r", 1000, 1e9, 1e-3, activation_bytes=activations)
        return predict_step([region], [t], topo, options=StepOptions()).max_memory_bytes

    batched = replace(table, lookup=BATCHED)
    # no dense activations to take their room: the gradient adds to the peak (the
    # optimizer's masked pass reads it in place, no copy), less the room of the lookup's
    # own outputs and their gradients
    outputs = 2 * 2048 * 64 * 4
    assert peak(table, 0) - peak(batched, 0) == pytest.approx(grad - outputs, rel=1e-6)
    # activations larger than both: the gradient lives where they were
    assert peak(table, 4 * grad) == pytest.approx(peak(batched, 4 * grad), rel=1e-9)
    # a sparse gradient holds one row and index per looked-up id; the optimizer's step
    # adds, at its largest, row-wise Adagrad's row update: five fp32 rows and two int64s
    # a used row (one per id at most), as counted on the runner
    # (benchmarks/lookup_gradient_memory.py): a quarter of the table (41k ids, 1M rows)
    sparse = replace(table, lookup=SPARSE)
    extra = peak(sparse, 0) - peak(batched, 0)
    held, update = 40_960 * (64 * 4 + 8), 40_960 * (5 * 64 * 4 + 2 * 8)
    assert extra == pytest.approx(held + update - outputs, rel=1e-6)
    assert extra < 0.25 * grad


def test_a_gradient_made_at_the_loss_lands_on_the_saved_activations() -> None:
    """HSTU reads its item table at the start (the history) and at the loss (targets,
    negatives): the loss-side lookups' table-sized gradients come while every activation
    is still saved and live on to the end of the backward (measured 17.3 GB against
    8.2 GB priced as if they all came at the end)."""
    topo = parse_topology("h200:1x1")
    acts = 4 * 10**9
    table = TableCost("item", 1_000_001, 512, 66_560, 32_768, pooled=False, lookups=3,
                      lookup=DENSE_GRAD)
    grad = 1_000_001 * 512 * 4

    def peak(alive: tuple[int, ...]) -> float:
        region = RegionCost("r", 1000, 1e9, 1e-3, activation_bytes=acts)
        return predict_step([region], [replace(table, lookup_alive=alive)], topo,
                            options=StepOptions()).max_memory_bytes

    early = peak((0, 0, 0))  # the three partial gradients meet at the end, alone
    late = peak((0, acts, acts))  # two lookups at the loss
    # two gradients on every saved activation, against three gradients alone
    assert late - early == pytest.approx(acts + 2 * grad - 3 * grad, rel=1e-6)
    assert peak((0, acts, 0)) < late  # one at the loss: one gradient on top
    assert peak(()) <= early  # no liveness known: the room the activations leave


def test_data_parallel_replica_is_stepped_by_the_sparse_optimizer() -> None:
    """On several ranks a data-parallel table is a local sparse lookup whose gradient the
    sparse optimizer's replica bucket reduces: priced so, and not in the dense AdamW."""
    topo = parse_topology("h200:1x8")
    calib = default_calibration("h200")
    t = TableCost("t", 1_000_000, 64, 40_960, 2048, sharding="data_parallel",
                  ranks=tuple(range(8)), lookup=SPARSE)
    region = RegionCost("r", 1000, 1e9, 1e-3)
    eager = predict_step([region], [t], topo, calibration=calib)
    # handed in as batched (no rule gives a replica that on several ranks), it is priced
    # on the route the runner runs it on (gemc.table_lookup.sharded_route): the same
    legacy = predict_step([region], [replace(t, lookup=BATCHED)], topo, calibration=calib)
    assert eager.breakdown == legacy.breakdown
    dense_only = predict_step([region], [], topo, calibration=calib)
    assert eager.breakdown["optimizer"] == dense_only.breakdown["optimizer"]
    one = shard_compute_s(t, t.rows, t.dim, 8, topo.gpu, calib, "rowwise_adagrad")
    assert eager.breakdown["sparse_compute"] == pytest.approx(one)
    # the replica's bucketed step (its segment's fill and division, the masked pass over
    # the table) is paid;
    # one rank has no replica to agree with
    alone = shard_compute_s(replace(t, ranks=(0,)), t.rows, t.dim, 1, topo.gpu, calib,
                            "rowwise_adagrad")
    assert one > alone + 1e-5


@pytest.fixture(scope="module")
def annotated():
    """DIN tiny and DLRM tiny annotated for one H200 (every pass before the placement)."""
    from gemc.api import load_model
    from gemc.capture import capture
    from gemc.replan import annotate
    from tests.conftest import REPO

    out = {}
    for name, entry in (("din", f"{REPO}/examples/zoo/din.py:build"),
                        ("dlrm", f"{REPO}/examples/dlrm/model.py:build")):
        spec = load_model(entry, {"preset": "tiny"})
        captured = capture(spec, entrypoint=entry)
        gm, _ = annotate(captured, parse_topology("h200:1x1"), entrypoint=entry,
                         args={"preset": "tiny"})
        out[name] = gm
    return out


def test_graph_summary_names_each_tables_path(annotated) -> None:
    from gemc.graph_summary import table_lookup_paths

    # DIN: per-sample weights, plain nn.Embedding read twice: no batched kernel takes them;
    # the plan has graph kernels, so they run as captured (sparse=False)
    din = table_lookup_paths(annotated["din"])
    assert din and set(din.values()) == {DENSE_GRAD}
    # DLRM: sum-pooled bags, all in the batched kernel
    dlrm = table_lookup_paths(annotated["dlrm"])
    assert dlrm and set(dlrm.values()) == {BATCHED}
    # on several ranks the runner applies no batched kernel: the owners' fused lookup
    # runs each table as placed (table-wise here)
    gm = annotated["dlrm"]
    saved = dict(gm.meta[ir.PRICING])
    try:
        gm.meta[ir.PRICING] = {**saved, "world_size": 8}
        assert set(table_lookup_paths(gm).values()) == {BATCHED}
        # every rank calls every lookup there: not priced on the holders as graph splits
        from gemc.graph_summary import table_facts
        assert not any(t.routed for t in table_facts(gm, {}))
    finally:
        gm.meta[ir.PRICING] = saved


def test_plan_records_both_route_prices_and_takes_the_cheaper(annotated) -> None:
    from gemc.graph_summary import table_facts, table_lookup_paths

    gm = annotated["din"]
    tables = {t.fqn: t for t in table_facts(gm, {})}
    paths = table_lookup_paths(gm)
    assert tables and all(t.route_ms is not None for t in tables.values())
    for fqn, t in tables.items():
        assert t.lookup == paths[fqn] == cheaper_route(t.route_ms)
        assert t.entry()["route_ms"] == t.route_ms  # what the plan records
    # the history lookups read their packed region's gathered ids (gemc.packed_rules.
    # gathered_lookup): no padded grid, one padding id per row with padding (the sample's
    # representatives); the profile bags read no padded grid either
    assert tables["goods_emb.weight"].padded_nnz == 0 < tables["goods_emb.weight"].pad_ids
    assert tables["profile.0.weight"].padded_nnz == 0
    assert not any(t.padding_row for t in tables.values())
    # a batched table has no choice to record
    assert all(t.route_ms is None and "route_ms" not in t.entry()
               for t in table_facts(annotated["dlrm"], {}))


def test_loss_side_lookups_see_the_saved_activations() -> None:
    """The liveness walk: HSTU tiny's history lookup runs first (nothing saved is live at
    its backward), its target and negative lookups at the loss (nearly all of it)."""
    from gemc.cost_model.activations import activation_profile

    from gemc.api import load_model
    from gemc.capture import capture
    from gemc.graph_summary import padding_row
    from gemc.replan import annotate
    from tests.conftest import REPO

    entry = f"{REPO}/examples/zoo/hstu.py:build"
    captured = capture(load_model(entry, {"preset": "tiny"}), entrypoint=entry)
    gm, _ = annotate(captured, parse_topology("h200:1x1"), entrypoint=entry,
                     args={"preset": "tiny"})
    profile = activation_profile(gm)
    lookups = [n for n in gm.graph.nodes if n.meta.get(ir.TABLE)]
    alive = [profile.alive_at_lookup[n.name] for n in lookups]
    assert all(padding_row(n) for n in lookups)  # nn.Embedding(..., padding_idx=0)
    assert len(alive) == 3 and alive[0] < 0.1 * profile.saved_total
    assert min(alive[1:]) > 0.8 * profile.saved_total


@pytest.mark.parametrize("sharding,optimizer,lookups,route", [
    ("table_wise", "rowwise_adagrad", 1, BATCHED),
    ("row_wise", "rowwise_adagrad", 1, BATCHED),
    ("table_row_wise", "rowwise_adagrad", 1, BATCHED),
    # the row accumulator needs every column shard's squares: the fused kernel's two
    # phases (BatchedEmbeddingBag.split_rows) sum them before the update
    ("column_wise", "rowwise_adagrad", 1, BATCHED),
    ("grid", "rowwise_adagrad", 1, BATCHED),
    ("column_wise", "adam", 1, BATCHED),
    ("grid", "adam", 1, BATCHED),
    ("data_parallel", "adam", 1, SPARSE),  # a replica's gradient is all-reduced
    ("table_wise", "adam", 2, SPARSE),  # two updates a step where the reference makes one
])
def test_several_ranks_fuse_the_owners_lookup_by_sharding(sharding, optimizer, lookups,
                                                          route) -> None:
    assert sharded_route(sharding, world_size=4, optimizer=optimizer, lookups=lookups) == route
    # one rank keeps its own rule's path whatever the sharding
    assert routed_as_sharded(DENSE_GRAD, sharding, world_size=1, optimizer=optimizer,
                             lookups=lookups) == DENSE_GRAD


def test_cost_model_prices_each_sharding_on_the_route_the_runner_runs() -> None:
    """The solver's option and the plan's facts price a table on the route the runner's
    rule (owner_lookup.owner_routes, from the plan entry) gives it: time in the rank's
    batched kernel with one floor per rank, and no gradient of one row per id."""
    from gemc.backends.torch.owner_lookup import owner_routes
    from gemc.cost_model.memory import FUSED_UPDATE_BYTES_PER_ID, table_grad_bytes
    from gemc.cost_model.step_model import in_batched_kernel

    from gemc.solver.candidates import table_option
    from gemc.solver.problem import Problem

    topo = parse_topology("h200:1x4")
    calib = default_calibration("h200")
    t = TableCost("t.weight", 1_000_000, 64, 40_960, 2048, lookup=SPARSE)
    problem = Problem(regions=(), tables=(t,), topology=topo, calibration=calib,
                      options=StepOptions())
    for sharding in ("table_wise", "row_wise", "column_wise", "data_parallel"):
        ranks = 1 if sharding == "table_wise" else 4
        option = table_option(problem, t, sharding, ranks)
        entry = {"fqn": t.fqn, "sharding": sharding, "lookups": 1}
        runs = owner_routes([entry], world_size=4, optimizer="rowwise_adagrad")[t.fqn]
        assert option.in_kernel == (runs == BATCHED), sharding
        placed = replace(t, sharding=sharding, ranks=tuple(range(ranks)), lookup=runs)
        held, _ = table_grad_bytes(placed, t.rows / (4 if sharding == "row_wise" else 1),
                                   64 // (4 if sharding == "column_wise" else 1), 4)
        assert option.grad_held == pytest.approx(held)
        if runs == BATCHED:  # the fused update's sort buffers, no gradient rows
            ids = 4 * t.nnz / (4 if sharding == "row_wise" else 1)
            assert held == pytest.approx(ids * FUSED_UPDATE_BYTES_PER_ID)
            assert in_batched_kernel(placed, 4)
        # the plan's facts of that table placed so carry the same route, and the step
        # prediction prices it so whatever lookup it is handed
        paths = lookup_paths({t.fqn: "fp32"}, [], world_size=4, graph_mode=False,
                             shardings={t.fqn: sharding}, optimizer="rowwise_adagrad")
        assert paths[t.fqn] == runs
        for given in (SPARSE, BATCHED):
            pred = predict_step([RegionCost("r", 1000, 1e6, 1e-4)],
                                [replace(placed, lookup=given)], topo, calibration=calib)
            same = predict_step([RegionCost("r", 1000, 1e6, 1e-4)], [placed], topo,
                                calibration=calib)
            assert pred.step_s == pytest.approx(same.step_s)
            assert [r.memory_bytes for r in pred.per_rank] == pytest.approx(
                [r.memory_bytes for r in same.per_rank])
    # the sparse route's per-id gradient rows (64 fp32 columns and an index an id) dwarf
    # the fused update's sort buffers
    whole = replace(t, sharding="table_wise")
    sparse, _ = table_grad_bytes(whole, t.rows, t.dim, 4)
    fused, _ = table_grad_bytes(replace(whole, lookup=BATCHED), t.rows, t.dim, 4)
    assert sparse > 5 * fused > 0
