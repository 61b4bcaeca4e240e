"""The plan's prediction prices what the runner executes (issue 18): attention at the
plan's autocast dtype, activations as the allocator holds them, the host's exposed time."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from gemc.cost_model.activations import activation_profile, plan_autocast, saved_activation_bytes
from gemc.cost_model.launches import (
    EAGER_TABLE_LAUNCHES,
    GRAPH_LAUNCH_HOST_S,
    REPLICA_GROUP_LAUNCHES,
    REPLICA_GROUPED_TABLE_LAUNCHES,
    REPLICA_IN_GRAPH_MEMBER_LAUNCHES,
    REPLICA_TABLE_LAUNCHES,
    graph_launches,
)
from gemc.cost_model.topology import parse_topology
from gemc.cost_model.types import StepOptions, TableCost

from gemc import ir
from gemc.api import load_model, pass_context, resolve_calibration
from gemc.capture import capture
from gemc.costing import host_s, kernel_launches, step_launches
from gemc.graph_summary import kernel_adjusted_ms
from gemc.pass_manager import PassManager
from gemc.pipeline import default_pipeline

GEM = str(Path(__file__).resolve().parents[2] / "examples" / "gem" / "model.py") + ":build"


def _tiny_plan_graph(entry: str):
    """``entry``'s tiny preset through the default pipeline for h200:1x1 (greedy), as
    compile runs it."""
    topo = parse_topology("h200:1x1")
    spec = load_model(entry, {"preset": "tiny"})
    cap = capture(spec, entrypoint=entry)
    ctx = pass_context(entry, {"preset": "tiny"}, cap, topo)
    ctx.calibration = resolve_calibration("auto", "h200")
    return PassManager(default_pipeline("greedy")).run(cap.gm, ctx, capture_seconds=0)


@pytest.fixture(scope="module")
def gem_plan_graph():
    return _tiny_plan_graph(GEM)


def test_attention_is_priced_at_the_autocast_dtype(gem_plan_graph):
    gm = gem_plan_graph
    assert plan_autocast(gm) == "bf16"
    ms = kernel_adjusted_ms(gm)
    attention = [n for n in gm.graph.nodes if ir.kind_of(n) is ir.OpKind.ATTENTION]
    assert attention
    launches = 4e3 * gm.meta[ir.PRICING]["calibration"].kernel_s
    for node in attention:  # bf16 (and, jagged, over the real tokens) is below fp32 alone,
        # up to its four launches: the tiny preset is launch-bound, and since the jagged
        # kernel is priced by cost_model.attention_fit its launches no longer shrink with
        # the fill
        assert 0 < ms[node] < node.meta[ir.PREDICTED_MS] + launches


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


def test_host_term_rises_with_launches_and_bounds_the_step():
    """A compiled step's host time: issuing more kernels costs more once the host is the
    longer of the two, and the step (device + exposed host) never undercuts issuing."""
    topo = parse_topology("h200:1x1")
    opts = StepOptions()
    device = 0.010
    host = [host_s([], topo, opts, None, launches=n, device_s=device,
                   per_launch_s=GRAPH_LAUNCH_HOST_S) for n in (0, 100, 400, 1000, 2000)]
    assert host == sorted(host) and host[-1] > host[0]
    assert host[-1] - host[-2] == pytest.approx(1000 * GRAPH_LAUNCH_HOST_S)
    for n, h in zip((0, 100, 400, 1000, 2000), host, strict=True):
        assert device + h >= n * GRAPH_LAUNCH_HOST_S


def test_compiled_plan_counts_launches_by_source(gem_plan_graph):
    """The graph-mode count: Inductor's kernels, cuBLAS calls, the batched lookup's and
    the optimizer's; more than one a fused group (the backward launches its own)."""
    gm = gem_plan_graph
    tables = [TableCost(f"t{i}", 1000, 16, 64, 64, lookup="batched") for i in range(3)]
    counts, per = step_launches(gm, tables, resolve_calibration("auto", "h200"))
    assert per == pytest.approx(GRAPH_LAUNCH_HOST_S)
    assert counts == graph_launches(gm, tables)
    assert counts["total"] == sum(v for k, v in counts.items() if k != "total")
    assert counts["gemm"] > 0 and counts["inductor"] > 0 and counts["tables"] > 0
    assert graph_launches(gm, tables * 2)["total"] > counts["total"]
    # a table off the batched kernel: the sparse route's eager step, but a data-parallel
    # replica on several ranks only its lookup and its share of the step's one bucket
    eager = TableCost("e", 1000, 16, 64, 64, lookup="sparse")
    replica = TableCost("r", 1000, 16, 64, 64, lookup="sparse", sharding="data_parallel",
                        ranks=(0, 1))
    base = graph_launches(gm, tables, 2)["tables"]
    assert graph_launches(gm, [*tables, eager], 2)["tables"] - base == EAGER_TABLE_LAUNCHES
    assert graph_launches(gm, [*tables, replica], 2)["tables"] - base == \
        REPLICA_TABLE_LAUNCHES < EAGER_TABLE_LAUNCHES
    assert graph_launches(gm, [*tables, replica], 1)["tables"] - base == EAGER_TABLE_LAUNCHES
    # replicas that share a storage (backends/torch/replica_groups): one group's launches
    # and none a member (looked up by the group, in graph mode ahead of the graph); a
    # padding row or another width keeps a replica on its own
    two = [replica, replace(replica, fqn="r2")]
    assert graph_launches(gm, [*tables, *two], 2)["tables"] - base == \
        REPLICA_GROUP_LAUNCHES + 2 * REPLICA_GROUPED_TABLE_LAUNCHES
    many = [replace(replica, fqn=f"r{i}") for i in range(18)]
    assert graph_launches(gm, [*tables, *many], 2)["tables"] - base == \
        REPLICA_GROUP_LAUNCHES + 18 * REPLICA_GROUPED_TABLE_LAUNCHES < 18 * REPLICA_TABLE_LAUNCHES
    # the twenty-fifth session's count (replica_step.py --compare --cpu-proxy [--graph]):
    # 24 ops a group at 8.5 launches per 19 ops, no op a member looked up ahead of the
    # graph, 7 (3 launches) one whose ids the model computes (looked up inside it)
    assert (REPLICA_GROUP_LAUNCHES, REPLICA_GROUPED_TABLE_LAUNCHES,
            REPLICA_IN_GRAPH_MEMBER_LAUNCHES) == (11, 0, 3)
    assert graph_launches(gm, [*tables, *many], 2)["tables"] == \
        graph_launches(gm, [*tables, *two], 2)["tables"]
    computed = [replica, replace(replica, fqn="r2", batch_fed=False)]
    assert graph_launches(gm, [*tables, *computed], 2)["tables"] - base == \
        REPLICA_GROUP_LAUNCHES + REPLICA_IN_GRAPH_MEMBER_LAUNCHES
    apart = [replica, replace(replica, fqn="p", padding_row=True),
             replace(replica, fqn="w", dim=32)]
    assert graph_launches(gm, [*tables, *apart], 2)["tables"] - base == \
        3 * REPLICA_TABLE_LAUNCHES


def test_launch_bound_plan_is_priced_at_its_host_time():
    """The tiny GEM plan's GPU work is ~1 ms: its prediction is the host's issuing time
    plus the syncs, not the device step: the runner's three and one a call of each guarded
    attention kernel (its two cross-attentions, outside the packed region: gemc.costing.
    per_call_syncs)."""
    from gemc.api import compile as gemc_compile

    plan = gemc_compile(GEM, {"preset": "tiny"}, topology="h200:1x1", planner="greedy",
                        calibration="auto")
    pred = plan["predicted"]
    issue_ms = pred["host"]["launches"] * pred["host"]["per_launch_us"] / 1e3
    opts = StepOptions()
    assert issue_ms > pred["device_step_ms"]
    assert pred["step_ms"] >= issue_ms
    guarded = [k for k in plan["kernels"] if k["kind"] == "key_padding_attention"]
    assert len(guarded) == 2
    assert pred["step_ms"] == pytest.approx(
        issue_ms + 1e3 * (opts.host_syncs + len(guarded)) * opts.host_sync_s)


def test_launch_count_counts_groups_once(gem_plan_graph):
    gm = gem_plan_graph
    groups = {n.meta[ir.GROUP] for n in gm.graph.nodes if n.meta.get(ir.GROUP) is not None}
    assert groups and kernel_launches(gm) >= 2 * len(groups)


def test_gradient_additions_are_priced_in_their_regions(gem_plan_graph):
    """A tensor read by several ops costs the backward's adds; the regions carry them."""
    from gemc.graph_summary import gradient_accumulation_ms, graph_facts

    gm = gem_plan_graph
    adds = gradient_accumulation_ms(gm)
    assert adds and all(ms > 0 for ms in adds.values())
    regions = graph_facts(gm, {}).regions
    counted = {n for n in gm.graph.nodes if n.op == "call_function"
               and ir.kind_of(n) not in (ir.OpKind.VIEW, ir.OpKind.EMBEDDING)
               and not n.meta.get(ir.TABLE)}
    ms = kernel_adjusted_ms(gm)
    expected = sum(ms[n] for n in counted) + sum(adds.values())
    assert sum(r.predicted_ms or 0.0 for r in regions) == pytest.approx(expected, rel=1e-4)


def test_jagged_attention_kernel_time_adds_the_bias_traffic():
    """The jagged kernel in bf16 is its real tiles at the kernel family's fitted rate
    (``attention_fit``; it was the fused attention at the padded shape times the fill,
    which priced MMoE's kernel 0.38x its session-25 measurement); a score bias adds its
    traffic (read by each head in three kernels, an fp32 gradient), more for a broadcast
    bias (its gradient is summed down) and for a narrower one (cast back)."""
    from gemc.cost_model import attention_fit, op_cost
    from gemc.cost_model.hardware import get_gpu

    gpu, cal = get_gpu("h200"), resolve_calibration("auto", "h200")
    plain = op_cost.jagged_attention_time(8, 4, 256, 64, True, "bf16", 0.5, gpu, cal)
    work = attention_fit.gemc_kernel_s(attention_fit.jagged_tiles(8, 4, 256, 0.5, True), 64,
                                       "softmax", gpu)
    assert plain == pytest.approx(work + 4 * cal.kernel_s)
    assert op_cost.jagged_attention_time(8, 4, 256, 64, True, "bf16", 0.5, gpu, cal,
                                         kind="silu") < plain  # the SiLU kernel's rate
    full = 8 * 4 * 256 * 256
    own = op_cost.jagged_attention_time(8, 4, 256, 64, True, "bf16", 0.5, gpu, cal,
                                        bias_numel=full)
    shared = op_cost.jagged_attention_time(8, 4, 256, 64, True, "bf16", 0.5, gpu, cal,
                                           bias_numel=full // 4)
    narrow = op_cost.jagged_attention_time(8, 4, 256, 64, True, "bf16", 0.5, gpu, cal,
                                           bias_numel=full, bias_itemsize=2)
    moved = full * (3 * 4 * 0.5 + 4 + 4 * 0.5)  # reads over the real tokens, zero, write
    assert own - plain == pytest.approx(op_cost.memory_time(moved, gpu, cal, "copy")[0])
    assert shared > own and narrow > plain


@pytest.fixture(scope="module")
def hstu_plan_graph():
    return _tiny_plan_graph(
        str(Path(__file__).resolve().parents[2] / "examples" / "zoo" / "hstu.py") + ":build")


def test_silu_kernel_is_priced_as_it_runs(hstu_plan_graph):
    """HSTU's matched SiLU attention (tiny) is priced as the jagged kernel at the plan's
    autocast dtype (its members sum to ``jagged_silu_kernel_time`` in bf16, inside its
    packed region: no padded <-> jagged copies), below the padded formula op by op, which
    stores the [B, H, L, L] scores."""
    from gemc.cost_model import op_cost
    from gemc.cost_model.activations import runtime_itemsize
    from gemc.cost_model.inductor_fusion import island_groups

    from gemc.graph_summary import silu_kernel_ratios

    gm = hstu_plan_graph
    pricing = gm.meta[ir.PRICING]
    assert plan_autocast(gm) == "bf16"
    ms = kernel_adjusted_ms(gm)
    named = {n.name: n for n in gm.graph.nodes}
    sizes = runtime_itemsize(gm, "bf16")
    kernels = [n for n in gm.graph.nodes
               if (n.meta.get(ir.KERNEL) or {}).get("kind") == "jagged_silu_attention"]
    ratios = silu_kernel_ratios(gm, island_groups(gm), "bf16", sizes, gm.meta[ir.PRICING])
    assert len(kernels) == 2
    for node in kernels:
        facts = node.meta[ir.KERNEL]
        members = [n for n in gm.graph.nodes if n.meta.get(ir.GROUP) == facts["id"]]
        assert ir.PACKED in node.meta  # on a packed region's tokens: no copies priced
        expected = 1e3 * op_cost.jagged_silu_kernel_time(
            facts, node, named, "bf16", lambda n: sizes.get(n) or 4, pricing["gpu"],
            pricing["calibration"], in_region=True)
        assert expected < 1e3 * op_cost.jagged_silu_kernel_time(
            facts, node, named, "bf16", lambda n: sizes.get(n) or 4, pricing["gpu"],
            pricing["calibration"])
        own = sum(float(n.meta[ir.PREDICTED_MS]) for n in members)
        assert ratios[facts["id"]] * own == pytest.approx(expected, rel=1e-9)
        # plus autocast's casts of fp32 operands, nothing else
        assert expected <= sum(ms[n] for n in members) < 2 * expected
        assert 0 < facts["after_ms"] < facts["before_ms"]


def test_attention_kernel_saves_its_operands_bias_and_output(hstu_plan_graph, monkeypatch):
    """A matched attention kernel saves q, k, v, the score bias and its output for its
    backward (JaggedAttentionFunction.save_for_backward); the walk counts the output and
    the bias, which its members' own rules (matmul inputs, an add) left out."""
    from gemc.cost_model import activations

    gm = hstu_plan_graph
    operands = activations._attention_kernel_operands(gm)
    assert len(operands) == 2
    extra = 0
    for node, saved in operands.items():
        facts = node.meta[ir.KERNEL]
        assert [n.name for n in saved] == [facts["q"], facts["k"], facts["v"], node.name,
                                           facts["bias"]]
        extra += ir.nbytes(node) + ir.nbytes(saved[-1])
    with_operands = activation_profile(gm).saved_total
    monkeypatch.setattr(activations, "_attention_kernel_operands", lambda gm: {})
    without = activation_profile(gm).saved_total
    assert 0 < with_operands - without <= extra


def test_a_regions_causal_attention_run_on_its_tokens_is_priced_over_them():
    """MMoE's causal tower (SDPA is_causal=True, no mask, right-padded) inside its guarded
    packed region runs as the jagged causal kernel on the tokens (gemc.packed_rules): its
    time is the padded attention's at the autocast dtype times the region's score share
    (sum(len^2) / (B * L^2), the sample batch's ``attention_fill``), not the padded time."""
    from gemc import packed_rules
    from gemc.graph_summary import attention_at_autocast

    entry = str(Path(__file__).resolve().parents[2] / "examples" / "zoo" / "mmoe.py") + ":build"
    gm = _tiny_plan_graph(entry)
    causal = [n for n in gm.graph.nodes if packed_rules.causal_self_attention(n)
              and n.meta.get(ir.PACKED) is not None]
    assert causal  # the tower's self-attentions are region members
    (region,) = [n.meta[ir.PACKED_REGION] for n in gm.graph.nodes
                 if isinstance(n.meta.get(ir.PACKED_REGION), dict)]
    share = float(region["attention_fill"])
    assert 0 < share < 1
    ms = kernel_adjusted_ms(gm)
    autocast = plan_autocast(gm)
    for node in causal:
        padded = attention_at_autocast(node, autocast, gm.meta[ir.PRICING])
        assert padded is not None and padded > 0
        assert ms[node] == pytest.approx(padded * share, rel=1e-6)
