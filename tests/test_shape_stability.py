"""Which batch inputs may change shape by step in graph mode (gemc.shape_stability): the
compile captures the model again on a later batch of other shapes and compares the graphs.

Probes: ``tests/models/probes/nested_jagged.py``'s (values, offsets) histories whose total
varies by step, pooled three ways: through ``nn.EmbeddingBag`` (no size of the batch in
the graph: the values may vary), divided by ``values.numel()`` (a constant of the graph),
padded by ``repeat_interleave(..., output_size=n)`` (likewise)."""

from __future__ import annotations

import pytest
from gemc.backends.torch.reference import reference_losses
from gemc.backends.torch.runner import RunOptions, run

from gemc.api import compile as gemc_compile
from gemc.api import load_model
from gemc.errors import PlanError
from tests.runner.harness import REPO, variant

ENTRY = f"{REPO / 'tests' / 'models' / 'probes' / 'nested_jagged.py'}:build"
STEPS = 4  # the probe's totals: 15, 15, 14, ... ids


@pytest.mark.parametrize("form,held", [
    ("bag", None), ("numel", "node div (aten.div.Tensor) holds a size of the batch"),
    ("index_put", "aten.repeat_interleave.self_Tensor) holds a size of the batch")])
def test_the_plan_says_which_inputs_may_vary(form: str, held: str | None) -> None:
    model = gemc_compile(ENTRY, {"form": form}, topology="h200:1x1")["model"]
    if held is None:
        assert model["varying_inputs"] == ["batch_hist_values"]
        assert "fixed_shapes" not in model
    else:
        assert "varying_inputs" not in model
        assert held in model["fixed_shapes"] and "nested_jagged.py" in model["fixed_shapes"]


def test_a_varying_input_runs_in_graph_mode_as_eager() -> None:
    """The EmbeddingBag form in graph mode (the plan's kernels) over batches of 15, 15, 14
    and more ids: trained as eager (before, the runner refused every batch of another
    shape, whatever the graph held)."""
    plan = variant(gemc_compile(ENTRY, {"form": "bag"}, topology="h200:1x1"), kernels=True)
    assert {k["kind"] for k in plan["kernels"]} >= {"batched_embedding_bag", "gemm_epilogue"}
    res = run(plan, RunOptions(steps=STEPS, device="cpu", progress=False))
    ref = reference_losses(load_model(ENTRY, {"form": "bag"}), steps=STEPS, world_size=1)
    got = [loss for _, loss in res.losses]
    assert got == pytest.approx(ref, rel=1e-4)


def test_a_held_size_is_refused_with_the_node_that_holds_it() -> None:
    plan = variant(gemc_compile(ENTRY, {"form": "numel"}, topology="h200:1x1"), kernels=True)
    with pytest.raises(PlanError, match="holds a size of the batch"):
        run(plan, RunOptions(steps=STEPS, device="cpu", progress=False))
