"""The compiled graph the runner trains is one Dynamo frame where gemc has no eager island
left: MMoE's task attention over the padded history (a key-padding cross-attention, mask
from the batch) is decided by the check ahead of the graph and compiled inside it, so the
run has no graph break and trains as eager does."""

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


def test_mmoe_trains_as_one_compiled_frame(tmp_path) -> None:
    plan = gemc_compile(MMOE, {"preset": "tiny"}, topology="h200:1x1", planner="default")
    assert any(k["kind"] == "key_padding_attention" for k in plan["kernels"])
    path = tmp_path / "mmoe.plan.json"
    write_plan(path, plan)
    torch._dynamo.reset()
    counters.clear()
    kpa.STATS.reset()
    result = run(str(path), RunOptions(steps=3, device="cpu", progress=False))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    graph = result.report["graph_executor"]
    variants = graph["compiled_variants"]
    assert variants and all(v["checked_attentions"] for v in variants), variants
    # the check ahead of the graph counts each step's decision as the op would: MMoE's
    # batches always hold an empty history, whose finite additive row (-1e4 everywhere) is
    # no key mask, so the exact padded attention runs, inside the graph
    assert kpa.STATS.calls == 3 and kpa.STATS.fallback == 3
    assert all(v["checked_attentions"] == {"key_padding_attention_0": "padded"}
               for v in variants)
    ref = reference_losses(load_model(MMOE, {"preset": "tiny"}), steps=3, world_size=1)
    torch.testing.assert_close([loss for _, loss in result.losses], ref, rtol=1e-4, atol=1e-5)
