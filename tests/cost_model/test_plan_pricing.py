"""The plan's prediction prices what the runner executes (issue 18): attention at the
plan's autocast dtype, activations as the allocator holds them, the host's exposed time."""

from __future__ import annotations

from pathlib import Path

import pytest
from gemc.cost_model.activations import activation_profile, plan_autocast, saved_activation_bytes
from gemc.cost_model.topology import parse_topology
from gemc.cost_model.types import StepOptions, TableCost

from gemc import ir
from gemc.api import load_model, pass_context, resolve_calibration
from gemc.capture import capture
from gemc.costing import host_s, kernel_launches
from gemc.graph_summary import kernel_adjusted_ms
from gemc.pass_manager import PassManager
from gemc.pipeline import default_pipeline

GEM = str(Path(__file__).resolve().parents[2] / "examples" / "gem" / "model.py") + ":build"


@pytest.fixture(scope="module")
def gem_plan_graph():
    """The tiny GEM through the default pipeline for h200:1x1 (greedy), as compile runs it."""
    topo = parse_topology("h200:1x1")
    spec = load_model(GEM, {"preset": "tiny"})
    cap = capture(spec, entrypoint=GEM)
    ctx = pass_context(GEM, {"preset": "tiny"}, cap, topo)
    ctx.calibration = resolve_calibration("auto", "h200")
    ctx.options["solver"] = {}
    return PassManager(default_pipeline("greedy")).run(cap.gm, ctx, capture_seconds=0)


def test_attention_is_priced_at_the_autocast_dtype(gem_plan_graph):
    gm = gem_plan_graph
    assert plan_autocast(gm) == "bf16"
    ms = kernel_adjusted_ms(gm)
    attention = [n for n in gm.graph.nodes if ir.kind_of(n) is ir.OpKind.ATTENTION]
    assert attention
    for node in attention:  # bf16 (and, jagged, over the real tokens) is below fp32 alone
        assert 0 < ms[node] < node.meta[ir.PREDICTED_MS]


def test_activations_at_runtime_dtypes_and_liveness(gem_plan_graph):
    gm = gem_plan_graph
    runtime = activation_profile(gm)
    captured = activation_profile(gm, runtime=False)
    old = saved_activation_bytes(gm, runtime=False)
    # one walk: the per-region sums (the solver's) are the profile's, eager's the captured
    assert captured.saved_total == sum(v for k, v in old.items() if k != "inputs")
    solver = saved_activation_bytes(gm)
    assert {k: v for k, v in solver.items() if k != "inputs"} == runtime.saved
    assert 0 < runtime.saved_total < captured.saved_total
    # the walk's peak holds at least everything saved, and something transient on top
    assert runtime.peak >= runtime.saved_total and runtime.transient == \
        runtime.peak - runtime.saved_total
    assert runtime.inputs == old["inputs"] > 0


def test_host_time_syncs_and_launch_bound():
    topo1, topo8 = parse_topology("h200:1x1"), parse_topology("h200:1x8")
    opts = StepOptions()
    syncs = opts.host_syncs * opts.host_sync_s
    assert host_s([], topo1, opts, None) == pytest.approx(syncs)
    sharded = [TableCost("t", 1000, 8, 64, 32, sharding="row_wise", ranks=tuple(range(8)))]
    assert host_s(sharded, topo8, opts, None) == pytest.approx(
        syncs + opts.exchange_host_syncs * opts.host_sync_s)
    # launch-bound: issuing 10,000 kernels at 8 us takes 80 ms, the GPU needs 10
    assert host_s([], topo1, opts, None, launches=10_000, device_s=0.010) == pytest.approx(
        syncs + 0.070)
    assert host_s([], topo1, opts, None, launches=100, device_s=0.010) == pytest.approx(syncs)


def test_launch_count_counts_groups_once(gem_plan_graph):
    gm = gem_plan_graph
    groups = {n.meta[ir.GROUP] for n in gm.graph.nodes if n.meta.get(ir.GROUP) is not None}
    assert groups and kernel_launches(gm) >= 2 * len(groups)


def test_gradient_additions_are_priced_in_their_regions(gem_plan_graph):
    """A tensor read by several ops costs the backward's adds; the regions carry them."""
    from types import SimpleNamespace

    from gemc.graph_summary import gradient_accumulation_ms, region_summaries, table_summaries

    gm = gem_plan_graph
    adds = gradient_accumulation_ms(gm)
    assert adds and all(ms > 0 for ms in adds.values())
    shim = SimpleNamespace(param_dtypes={})
    tables = {t["fqn"] for t in table_summaries(gm, shim)}
    regions = region_summaries(gm, shim, tables)
    counted = {n for n in gm.graph.nodes if n.op == "call_function"
               and ir.kind_of(n) not in (ir.OpKind.VIEW, ir.OpKind.EMBEDDING)
               and not n.meta.get(ir.TABLE)}
    ms = kernel_adjusted_ms(gm)
    expected = sum(ms[n] for n in counted) + sum(adds.values())
    assert sum(r["predicted_ms"] or 0.0 for r in regions) == pytest.approx(expected, rel=1e-4)
