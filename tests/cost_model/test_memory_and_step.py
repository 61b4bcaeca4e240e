"""Memory breakdowns add up; the step model behaves as its formula says."""

from __future__ import annotations

import pytest
from gemc.cost_model.activations import saved_activation_bytes
from gemc.cost_model.memory import (
    MemoryBreakdown,
    eager_peak_bytes,
    optimizer_state_bytes,
    rank_memory,
    region_memory,
)
from gemc.cost_model.step_model import predict_step
from gemc.cost_model.topology import parse_topology
from gemc.cost_model.types import RegionCost, StepOptions, TableCost
from hypothesis import given, settings
from hypothesis import strategies as st

strategies = st.sampled_from(["ddp", "fsdp", "hsdp", "tp"])
regions_st = st.lists(st.builds(
    RegionCost,
    name=st.sampled_from(["a", "b", "c"]), params=st.integers(0, 10**9),
    fwd_flops=st.floats(0, 1e13), compute_s=st.floats(0, 1.0), strategy=strategies,
    shard_group=st.sampled_from([0, 2, 4, 8]), activation_bytes=st.integers(0, 10**10),
    boundary_bytes=st.integers(0, 10**8), checkpoint=st.booleans()), max_size=5)
tables_st = st.lists(st.builds(
    TableCost, fqn=st.just("t"), rows=st.integers(1, 10**8), dim=st.sampled_from([16, 64, 128]),
    nnz=st.integers(0, 10**6), batch=st.integers(1, 8192),
    sharding=st.sampled_from(["data_parallel", "table_wise", "row_wise", "column_wise",
                              "table_row_wise", "grid"]),
    ranks=st.sampled_from([(0,), (3,), (0, 1, 2, 3), tuple(range(16))])), max_size=6)


@settings(max_examples=40, deadline=None)
@given(regions_st, tables_st, st.sampled_from(["adamw", "sgd", "adagrad", "rowwise_adagrad"]))
def test_breakdown_sums_to_total(regions, tables, optimizer) -> None:
    opts = StepOptions(optimizer=optimizer if optimizer != "rowwise_adagrad" else "adamw",
                       table_optimizer=optimizer)
    mem = rank_memory(regions, tables, 0, 16, opts)
    d = mem.to_dict()
    parts = d["params"] + d["grads"] + d["optimizer"] + d["activations"] + d["workspace"]
    assert d["total"] == pytest.approx(parts)
    assert all(v >= 0 for v in d.values())
    expected = MemoryBreakdown(workspace=opts.workspace_bytes)
    assert mem.total >= expected.total


def test_strategies_shard_what_zero_says() -> None:
    opts = StepOptions(optimizer="adamw", workspace_bytes=0)
    p = 10**9
    ddp = region_memory(RegionCost("r", p, 0, 0, "ddp"), 8, opts)
    fsdp = region_memory(RegionCost("r", p, 0, 0, "fsdp"), 8, opts)
    hsdp = region_memory(RegionCost("r", p, 0, 0, "hsdp", shard_group=4), 8, opts)
    assert ddp.params == 4 * p and ddp.optimizer == 8 * p and ddp.grads == 8 * p
    assert fsdp.params == pytest.approx(ddp.params / 8)
    assert hsdp.optimizer == pytest.approx(ddp.optimizer / 4)
    # one rank: the runner wraps nothing, so no bucket copy of the gradients
    assert region_memory(RegionCost("r", p, 0, 0, "ddp"), 1, opts).grads == 4 * p
    assert optimizer_state_bytes("rowwise_adagrad", 1000, rows=10) == 40
    with pytest.raises(ValueError):
        optimizer_state_bytes("lion", 1)


def test_checkpointing_keeps_only_boundaries() -> None:
    opts = StepOptions(workspace_bytes=0)
    full = RegionCost("r", 0, 0, 0, activation_bytes=10**9, boundary_bytes=10**6)
    ckpt = RegionCost("r", 0, 0, 0, activation_bytes=10**9, boundary_bytes=10**6,
                      checkpoint=True)
    assert rank_memory([full] * 4, [], 0, 1, opts).activations == 4 * 10**9
    assert rank_memory([ckpt] * 4, [], 0, 1, opts).activations == 4 * 10**6 + 10**9


def test_eager_peak_is_the_larger_phase() -> None:
    small_act = eager_peak_bytes(1e9, 1e8)
    assert small_act["peak"] == pytest.approx(1e9 * 5)  # p + g + 2 states + foreach temp
    big_act = eager_peak_bytes(1e9, 1e11)
    assert big_act["peak"] == pytest.approx(1e9 * 3 + 1e11)


def test_saved_activations_of_a_tiny_graph() -> None:
    from tests.cost_model.test_predict_time import _annotated
    saved = saved_activation_bytes(_annotated())
    assert saved["inputs"] > 0
    assert sum(v for k, v in saved.items() if k != "inputs") > 0


def _model(sharding: str, ranks: tuple[int, ...], world_spec: str = "h200:2x8"):
    topo = parse_topology(world_spec)
    regions = [RegionCost(f"mlp{i}", params=20_000_000, fwd_flops=2 * 20e6 * 2048,
                          compute_s=3 * 2 * 20e6 * 2048 / 600e12, activation_bytes=2048 * 4096 * 4)
               for i in range(4)]
    tables = [TableCost(f"t{i}", rows=1_000_000, dim=128, nnz=2048 * 10, batch=2048,
                        sharding=sharding, ranks=ranks) for i in range(8)]
    return regions, tables, topo


def test_step_prediction_shape_and_mfu() -> None:
    regions, tables, topo = _model("table_wise", (0,))
    pred = predict_step(regions, tables, topo)
    d = pred.to_dict()
    assert d["cost_model"] == "roofline" and len(d["per_rank"]) == 16
    assert d["step_ms"] == pytest.approx(sum(d["breakdown_ms"].values()))
    assert 0 < d["mfu"] < 1
    assert {"rank", "memory_gb", "compute_ms", "comm_ms"} <= set(d["per_rank"][0])
    # all tables on rank 0: it is the slowest and the fullest
    assert d["per_rank"][0]["memory_gb"] > d["per_rank"][1]["memory_gb"]
    assert d["per_rank"][0]["sparse_compute_ms"] > d["per_rank"][1]["sparse_compute_ms"]


def test_spreading_tables_beats_piling_them_on_one_rank() -> None:
    piled = predict_step(*_model("table_wise", (0,))[:2], _model("table_wise", (0,))[2])
    regions, _, topo = _model("table_wise", (0,))
    spread_tables = [TableCost(f"t{i}", rows=1_000_000, dim=128, nnz=2048 * 10, batch=2048,
                               sharding="table_wise", ranks=(2 * i,)) for i in range(8)]
    spread = predict_step(regions, spread_tables, topo)
    assert spread.step_s < piled.step_s
    assert spread.max_memory_bytes < piled.max_memory_bytes


def test_fsdp_saves_memory_and_comm_shows_up() -> None:
    regions, tables, topo = _model("row_wise", tuple(range(16)))
    ddp = predict_step(regions, tables, topo)
    fsdp = predict_step([RegionCost(**{**r.__dict__, "strategy": "fsdp"}) for r in regions],
                        tables, topo)
    assert fsdp.max_memory_bytes < ddp.max_memory_bytes
    assert all(r.comm_s > 0 for r in ddp.per_rank)


def test_single_gpu_has_no_comm() -> None:
    regions, tables, topo = _model("data_parallel", (0,), "h200:1x1")
    pred = predict_step(regions, tables, topo)
    assert pred.per_rank[0].comm_s == 0.0
    assert pred.breakdown["all_to_all"] == 0.0


def test_types_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="strategy"):
        RegionCost("r", 1, 1, 1, strategy="zero3")
    with pytest.raises(ValueError, match="sharding"):
        TableCost("t", 10, 4, 1, 1, sharding="hash")
