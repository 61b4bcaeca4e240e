"""Pricing fixed from the seventh session's H200 profiles (issue 18): each fix moves a tiny
model's prediction the way the measured kernel says.

- fp32 GEMMs run on TF32 where the plan says so (the zoo's DLRM: +59% priced at CUDA-core
  fp32); the runner sets TF32 from the plan.
- a small-table gather the runner sends through ``gemc::gather_rows`` pays that kernel's
  measured backward (HSTU: 1.26 ms each, priced as ~0.1 ms of bytes).
- an unpooled dense-gradient lookup pays its pad row's serialised adds (DIN: 2.6 ms a
  history table); the sync-free dense-gradient route launches fewer kernels than the
  sparse one.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gemc.backends.torch import precision as runner_precision
from gemc.backends.torch.contended_gathers import route_contended_gathers
from gemc.cost_model import kernels
from gemc.cost_model.calibration import default_calibration
from gemc.cost_model.launches import DENSE_GRAD_TABLE_LAUNCHES, EAGER_TABLE_LAUNCHES, graph_launches
from gemc.cost_model.op_cost import gemm_time, node_cost
from gemc.cost_model.step_model import shard_compute_s
from gemc.cost_model.topology import parse_topology
from gemc.cost_model.types import TableCost
from torch import fx, nn

from gemc.api import annotate_model
from gemc.config import CompileConfig
from gemc.contended_gather import MIN_IDS_PER_ROW, contended_gather
from gemc.errors import GemcUserError, PlanError
from gemc.spec import ModelSpec
from gemc.table_lookup import DENSE_GRAD, SPARSE

CALIB = default_calibration("h200")


# ---- TF32 ---------------------------------------------------------------------------------
def test_fp32_gemm_priced_at_tf32_only_where_the_plan_runs_tf32() -> None:
    gpu = parse_topology("h200:1x1").gpu
    tf32 = replace(gpu, fp32_matmul="tf32")
    m = n = k = 8192
    ieee_s, _ = gemm_time(1, m, n, k, "fp32", gpu, CALIB)
    tf32_s, _ = gemm_time(1, m, n, k, "fp32", tf32, CALIB)
    # the calibration's own TF32 sweep: several times faster, not bf16's price
    assert tf32_s < ieee_s / 3
    assert tf32_s == pytest.approx(gemm_time(1, m, n, k, "tf32", gpu, CALIB)[0])
    # low-precision GEMMs do not move
    assert gemm_time(1, m, n, k, "bf16", tf32, CALIB) == gemm_time(1, m, n, k, "bf16", gpu, CALIB)


def test_fp32_matmul_option_is_checked() -> None:
    with pytest.raises(GemcUserError, match="fp32 matmul"):
        CompileConfig(fp32_matmul="fast").validate()


def test_runner_sets_tf32_from_the_plan() -> None:
    model = nn.Linear(4, 4)
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        for mode, flag in (("tf32", True), ("ieee", False)):
            plan = runner_precision.resolve(
                [{"target": "*", "dtype": "bf16", "fp32_matmul": mode}], model)
            assert plan.fp32_matmul == mode
            torch.backends.cuda.matmul.allow_tf32 = not flag
            runner_precision.install(model, plan, "cpu")
            assert torch.backends.cuda.matmul.allow_tf32 is flag
        # an older plan says nothing: the process keeps its own setting
        torch.backends.cuda.matmul.allow_tf32 = True
        old = runner_precision.resolve([{"target": "*", "dtype": "bf16"}], model)
        runner_precision.install(model, old, "cpu")
        assert old.fp32_matmul is None and torch.backends.cuda.matmul.allow_tf32 is True
        with pytest.raises(PlanError, match="fp32_matmul"):
            runner_precision.resolve([{"target": "*", "dtype": "bf16", "fp32_matmul": "x"}],
                                     model)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


# ---- gather_rows' backward ----------------------------------------------------------------
class _Bias(nn.Module):
    """A learned bias per bucket, gathered by one id per (row, column) pair: HSTU's
    relative time bias in small."""

    def __init__(self, buckets: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(buckets))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.w, 0, ids.view(-1)).sum()


def _gather_node(buckets: int, ids: int) -> tuple[fx.Node, fx.GraphModule]:
    spec = ModelSpec(_Bias(buckets), (torch.randint(0, buckets, (ids,)),),
                     lambda step, device: (torch.randint(0, buckets, (ids,), device=device),))
    gm = annotate_model(spec, parse_topology("h200:1x1"))
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.index_select.default)
    return node, gm


def test_contended_gather_backward_priced_at_the_kernel_and_dearer_with_fewer_rows() -> None:
    gpu = parse_topology("h200:1x1").gpu
    ids = 1 << 22
    few, few_gm = _gather_node(129, ids)  # 32k ids a row: the runner's gather_rows
    many, _ = _gather_node(8192, ids)  # more rows than gather_rows takes: plain atomics
    assert contended_gather(few) is not None and contended_gather(many) is None
    few_cost = node_cost(few, gpu, CALIB)
    many_cost = node_cost(many, gpu, CALIB)
    assert few_cost.bwd_s == pytest.approx(ids * kernels.ROW_SUMS_S_PER_ID + 2 * CALIB.kernel_s)
    # same ids, same bytes moved: the contended gather's backward is the dearer one
    assert few_cost.bwd_s > 2 * many_cost.bwd_s
    assert few_cost.fwd_s == pytest.approx(many_cost.fwd_s, rel=0.05)
    # the runner takes the very node the cost model priced as gather_rows
    taken = route_contended_gathers(few_gm, tables=())
    assert [t["node"] for t in taken] == [few.name]


def test_too_few_ids_a_row_is_not_the_contended_route() -> None:
    node, _ = _gather_node(1000, MIN_IDS_PER_ROW * 1000 - 1)
    assert contended_gather(node) is None


# ---- the dense-gradient route -------------------------------------------------------------
def _ms(t: TableCost) -> float:
    gpu = parse_topology("h200:1x1").gpu
    return 1e3 * shard_compute_s(t, t.rows, t.dim, 1, gpu, CALIB, "rowwise_adagrad")


def test_unpooled_dense_gradient_pays_its_pad_rows_adds() -> None:
    """DIN's history lookups: half of a padded [B, L] grid is one pad id."""
    history = TableCost("goods", 4_000_000, 64, 1_050_624, 1_050_624, pooled=False,
                        lookups=2, lookup=DENSE_GRAD)
    padded = replace(history, padded_nnz=1_048_576)
    chain_ms = 1e3 * 524_288 * kernels.DENSE_GRAD_HOT_ADD_S
    # the scatter takes the longer of its bytes (~0.4 ms here) and the pad row's chain
    assert 0.75 * chain_ms < _ms(padded) - _ms(history) <= chain_ms
    # a pooled lookup's backward (ATen's bag backward) sorts its ids: no chain
    pooled = replace(padded, pooled=True)
    assert _ms(pooled) == pytest.approx(_ms(replace(history, pooled=True)))
    assert _ms(pooled) < _ms(padded) - 0.75 * chain_ms


def test_dense_gradient_route_launches_fewer_kernels_than_the_sparse_one() -> None:
    gm = fx.symbolic_trace(nn.Identity())
    tables = [TableCost(f"t{i}", 1000, 16, 64, 64, lookup=DENSE_GRAD) for i in range(18)]
    dense = graph_launches(gm, tables)["tables"]
    sparse = graph_launches(gm, [replace(t, lookup=SPARSE) for t in tables])["tables"]
    assert dense == 18 * DENSE_GRAD_TABLE_LAUNCHES < sparse == 18 * EAGER_TABLE_LAUNCHES
    # DIN's sync-free profile: 549 kernels for its 18 tables
    assert abs(dense - 549) < 0.05 * 549


def test_plan_records_the_fp32_matmul_it_was_priced_with() -> None:
    from gemc.api import compile as gemc_compile

    plans = {mode: gemc_compile("examples/dlrm/model.py:build", {"preset": "tiny"},
                                topology="h200:1x1", planner="default", fp32_matmul=mode)
             for mode in ("ieee", "tf32")}
    for mode, plan in plans.items():
        star = [e for e in plan["precision"] if e["target"] == "*"]
        assert star and star[-1]["fp32_matmul"] == mode
        # what the runner applies is what was priced
        assert runner_precision.resolve(star, _Bias(4)).fp32_matmul == mode
    assert plans["tf32"]["predicted"]["step_ms"] <= plans["ieee"]["predicted"]["step_ms"]


def test_cli_flag_reaches_the_plan(tmp_path) -> None:
    import json

    from gemc.cli import main

    out = tmp_path / "p.json"
    assert main(["compile", "examples/dlrm/model.py:build", "--set", "preset=tiny",
                 "--topology", "h200:1x1", "--fp32-matmul", "tf32", "--out", str(out)]) == 0
    star = [e for e in json.loads(out.read_text())["precision"] if e["target"] == "*"]
    assert star[-1]["fp32_matmul"] == "tf32"
    with pytest.raises(SystemExit):
        main(["compile", "m.py:build", "--out", str(out), "--fp32-matmul", "x"])
