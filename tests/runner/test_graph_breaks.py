"""The compiled graph the runner trains is one Dynamo frame where gemc has no eager island
left: MMoE's task attention over the padded history (a key-padding cross-attention, mask
from the batch) is decided by the check ahead of the graph and compiled inside it; GEM's
batched lookup with its fused optimizer traces into the graph (its update owns the tables'
state, so AOTAutograd does not lose it). Each run has no graph break and trains as eager
does, step after step (a lost table update shows in the second step's loss)."""

from __future__ import annotations

import torch
from gemc.backends.torch.reference import reference_losses
from gemc.backends.torch.runner import RunOptions, run
from gemc.backends.triton import key_padding_attention as kpa
from torch._dynamo.utils import counters

from gemc.api import compile as gemc_compile
from gemc.api import load_model
from gemc.plan import write_plan

MMOE = "examples/zoo/mmoe.py:build"
GEM = "examples/gem/model.py:build"
DLRM = "examples/dlrm/model.py:build"


def _run(entry: str, tmp_path, steps: int = 2, **args: object):  # noqa: ANN202
    args = {"preset": "tiny", **args}
    plan = gemc_compile(entry, args, topology="h200:1x1", planner="default")
    plan["precision"] = []  # fp32 on both sides: eager's losses to 1e-4
    path = tmp_path / "plan.json"
    write_plan(path, plan)
    torch._dynamo.reset()
    counters.clear()
    kpa.STATS.reset()
    result = run(str(path), RunOptions(steps=steps, device="cpu", progress=False))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    ref = reference_losses(load_model(entry, args), steps=steps, world_size=1)
    torch.testing.assert_close([loss for _, loss in result.losses], ref, rtol=1e-4, atol=1e-5)
    return plan, result


def test_mmoe_trains_as_one_compiled_frame(tmp_path) -> None:
    plan, result = _run(MMOE, tmp_path)
    assert any(k["kind"] == "key_padding_attention" for k in plan["kernels"])
    variants = result.report["graph_executor"]["compiled_variants"]
    # the check ahead of the graph counts each step's decision as the op would: MMoE's
    # batches always hold an empty history, whose additive row is -1e4 everywhere (a
    # constant: every key kept), so the attention over each row's kept keys runs, inside
    # the graph
    assert kpa.STATS.calls == 2 and kpa.STATS.fallback == 0
    assert variants and all(v["checked_attentions"] == {"key_padding_attention_0": "prefix"}
                            for v in variants), variants


def test_gem_trains_as_one_compiled_frame_its_tables_updated_inside_it(tmp_path) -> None:
    plan, result = _run(GEM, tmp_path, batch_size=4)  # a small batch: kernels interpreted
    kinds = {k["kind"] for k in plan["kernels"]}
    assert {"batched_embedding_bag", "key_padding_attention"} <= kinds
    assert result.report["graph_executor"]["table_lookups"]  # the batched tables ran
    assert "batched" in result.report["graph_executor"]["table_lookups"].values()


def test_dlrm_compiles_one_frame_once_for_every_step(tmp_path) -> None:
    """DLRM (every table in the batched lookup, no guarded region) compiles one graph for
    every step: one Dynamo frame, no graph break, no recompile after the first step (a
    recompile is a whole second compile, first-step sized, at a later step)."""
    plan, result = _run(DLRM, tmp_path, steps=3, batch_size=8)  # kernels interpreted
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert len(result.report["graph_executor"]["compiled_variants"]) == 1
    assert set(result.report["graph_executor"]["table_lookups"].values()) == {"batched"}
