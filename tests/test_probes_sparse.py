"""Models written by others in their own idioms (tests/models/probes_b): sparse features,
interactions, multi-task heads. Each test pins a way gemc used to break on one of them.

* DeepCTR-Torch adds an L2 penalty over every embedding table's whole weight to the loss:
  sharded, each rank's penalty saw only its own rows (a silently wrong loss on 2 ranks).
* ``F.embedding`` on a raw ``nn.Parameter``: compiled as a table, then refused by the
  runner ("does not name a weight ... compile the plan again", which could not help).
* weight tying (``out.weight = item.weight``): untied by the runner's allocation.
* ``nn.EmbeddingBag(mode="max")``: compiled, then refused by the runner (any sharding).
* ``loss[label >= 0].mean()``, ``bag(ids[ids != 0], ...)``: a data-dependent size crashed
  the count-flops-bytes pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gemc.backends.torch.reference import reference_losses
from gemc.backends.torch.runner import RunOptions, run

from gemc import ir
from gemc.api import compile as gemc_compile
from gemc.api import load_model
from gemc.capture import capture
from gemc.errors import CaptureError
from gemc.plan import write_plan
from tests.runner.harness import REPO, run_scenarios, variant

PROBES = REPO / "tests" / "models" / "probes_b"
DEEPFM = (f"{PROBES / 'deepctr.py'}:build", {"arch": "deepfm", "use_bn": True, "dropout": 0.2})
RAW = (f"{PROBES / 'sparse_idioms.py'}:build", {"variant": "raw_param"})
MAX = (f"{PROBES / 'sparse_idioms.py'}:build", {"variant": "bag_max"})
UNPAD = (f"{PROBES / 'sparse_idioms.py'}:build", {"variant": "unpad"})
TIED = (f"{PROBES / 'tied.py'}:build", {"tie": "alias"})
MASKED = (f"{PROBES / 'multitask.py'}:build", {"arch": "ple", "mask": "index"})
STEPS = 3


def _compile(case: tuple[str, dict], topology: str) -> dict:
    return gemc_compile(case[0], case[1], topology=topology)


def _close(got: list[float], ref: list[float]) -> None:
    assert len(got) == len(ref) == STEPS
    assert got == pytest.approx(ref, rel=1e-4), (got, ref)


def _tables(plan: dict) -> list[str]:
    """The reference's tables: the plan's (a weight gemc keeps dense is dense there too)."""
    return [t["fqn"].removesuffix(".weight") for t in plan["tables"]]


def _one_rank(case: tuple[str, dict], kernels: bool) -> None:
    plan = variant(_compile(case, "h200:1x1"), kernels=kernels)
    res = run(plan, RunOptions(steps=STEPS, device="cpu", progress=False))
    _close([loss for _, loss in res.losses],
           reference_losses(load_model(*case), steps=STEPS, world_size=1,
                            table_modules=_tables(plan)))


@pytest.mark.parametrize("planner", ["default", "cpsat"])
def test_a_table_read_whole_is_only_replicated(planner: str) -> None:
    plan = gemc_compile(*DEEPFM, topology="h200:1x8", planner=planner)
    sharding = {t["fqn"]: t["sharding"] for t in plan["tables"]}
    penalised = {f for f in sharding if ".embedding_dict." in f}
    assert len(penalised) == 4
    assert {sharding[f] for f in penalised} == {"data_parallel"}, sharding
    warned = [w for w in plan["warnings"] if "read outside its lookups" in w]
    assert len(warned) == 4 and "deepctr.py:" in warned[0], warned
    # the linear part's tables are only looked up: still free to shard
    assert not any("linear_embedding_dict" in w for w in warned)


CASES = (("deepfm", DEEPFM), ("max", MAX), ("masked", MASKED), ("unpad", UNPAD),
         ("tied", TIED))


def test_two_gloo_ranks_match_eager(tmp_path: Path) -> None:
    """DeepFM with the tables' L2 penalty, BatchNorm and dropout, a max-pooled bag, PLE
    with a loss on the labelled samples only (``loss[mask].mean()``), a bag over
    ``ids[ids != 0]`` and a tied output layer, on two ranks; DeepFM and the tied model
    (``h @ item.weight.T``) in graph mode too, where reading a replicated table outside
    its lookups was refused ("on several ranks a table is sharded")."""
    runs = [(name, case, False) for name, case in CASES]
    runs += [("deepfm_graph", DEEPFM, True), ("tied_graph", (TIED[0], {"tie": "matmul"}), True)]
    scenarios, plans = [], {}
    for name, case, kernels in runs:
        plan = variant(_compile(case, "h200:1x2"), kernels=kernels)
        if kernels:  # graph mode on several ranks runs ddp regions (harness.variant's rule)
            plan["regions"] = [{**r, "strategy": "ddp"} for r in plan["regions"]]
        path = tmp_path / f"{name}.json"
        write_plan(path, plan)
        plans[name] = plan
        scenarios.append({"name": name, "plan": str(path),
                          "phases": [{"steps": STEPS, "kernels": kernels}]})
    results = run_scenarios(2, scenarios, tmp_path / "results.json")
    for name, case, _ in runs:
        ref = reference_losses(load_model(*case), steps=STEPS, world_size=2,
                               table_modules=_tables(plans[name]))
        _close([loss for _, loss in results[name][0]], ref)


def test_a_raw_parameter_looked_up_stays_dense() -> None:
    for topology in ("h200:1x1", "h200:1x8"):
        plan = _compile(RAW, topology)
        assert [t["fqn"] for t in plan["tables"]] == ["item.weight"]
        assert any("'table' is looked up" in w and "stays a dense parameter" in w
                   for w in plan["warnings"]), plan["warnings"]
    _one_rank(RAW, kernels=False)


def test_a_max_pooled_bag_is_replicated_and_trains() -> None:
    plan = _compile(MAX, "h200:1x8")
    assert {t["fqn"]: t["sharding"] for t in plan["tables"]}["table.weight"] == "data_parallel"
    assert any("max-pools" in w for w in plan["warnings"]), plan["warnings"]
    # graph mode: the probe's jagged ids change their total every step; its graph on
    # another batch is the same up to shapes (gemc.shape_stability), so they may
    assert "ids" in plan["model"]["varying_inputs"], plan["model"]
    _one_rank(MAX, kernels=True)


def test_a_sharded_max_pooled_bag_is_refused_by_name() -> None:
    """A plan from before (or edited to) a table-wise max table on 2 ranks: named."""
    from gemc.backends.torch.embedding import ShardedEmbedding

    from gemc.errors import GemcUserError
    from gemc.sharding import make_shards

    table = {"fqn": "table.weight", "rows": 50, "dim": 8, "sharding": "table_wise",
             "shards": make_shards("table_wise", [1], 50, 8)}
    with pytest.raises(GemcUserError, match="mode='max'.*shards it table_wise") as info:
        ShardedEmbedding(torch.nn.EmbeddingBag(50, 8, mode="max"), table, rank=0,
                         world_size=2, seed=0)
    assert "data_parallel" in info.value.fix


def test_tied_weights_stay_tied_when_the_runner_allocates_them() -> None:
    """``to_empty`` from meta made a Parameter per module: ``out.weight = item.weight``
    trained as two tensors in the runner and its reference alike, so they agreed."""
    from gemc.backends.torch.materialize import materialize_

    model = load_model(*TIED).model
    assert model.out.weight is model.item.weight
    materialize_(model, torch.device("cpu"), 0, [])
    assert model.out.weight is model.item.weight
    assert model.out.weight.device.type == "cpu"
    assert len(list(model.parameters())) == 4  # item (= out), history, proj weight and bias


def test_a_tied_model_trains_tied_in_graph_mode() -> None:
    """The graph has a placeholder per name of the tied weight: both get the one tensor."""
    _one_rank(TIED, kernels=True)


def test_a_data_dependent_loss_compiles_at_its_bound_and_trains() -> None:
    captured = capture(load_model(*MASKED))
    bounded = [n for n in captured.gm.graph.nodes if ir.BOUNDED in n.meta]
    assert len(bounded) == 2 and all(ir.shape_of(n) == (8,) for n in bounded)
    assert len(captured.bounded_sizes) == 2 and "multitask.py:" in captured.bounded_sizes[0]
    for topology in ("h200:1x1", "h200:1x8"):
        plan = _compile(MASKED, topology)
        assert sum("data-dependent size" in w for w in plan["warnings"]) == 2
    kernel_nodes = {n for k in plan["kernels"] for n in k.get("nodes", [])}
    assert not kernel_nodes & {n.name for n in bounded}
    _one_rank(MASKED, kernels=True)


def test_a_bag_over_data_dependent_ids_trains_with_the_batched_kernel() -> None:
    """``bag(ids[ids != 0], offsets)``: the lookup's output tuple (offset2bag is [u0]) used to
    crash count-flops-bytes; the batched kernel reads the ids' count at run time."""
    plan = _compile(UNPAD, "h200:1x8")
    assert [w for w in plan["warnings"] if "data-dependent size: embedding_bag" in w
            and "sparse_idioms.py:" in w]
    plan = _compile(UNPAD, "h200:1x1")
    assert "batched_embedding_bag" in {k["kind"] for k in plan["kernels"]}
    _one_rank(UNPAD, kernels=True)


@pytest.mark.parametrize("returns,shape,fix", [
    ("dict", "a dict {'ctr', 'cvr'} of 2 value(s)", "sum(losses.values())"),
    ("tuple", "a tuple of 2 value(s): scalar torch.float32, 8x2", "model(...)[0]")])
def test_a_forward_returning_more_than_the_loss_is_named(returns: str, shape: str,
                                                         fix: str) -> None:
    with pytest.raises(CaptureError, match="must return the scalar training loss") as info:
        gemc_compile(f"{PROBES / 'multitask.py'}:build", {"returns": returns},
                     topology="h200:1x1")
    assert shape in info.value.what and fix in info.value.fix, str(info.value)


class _MaskedScale(torch.nn.Module):
    """Pointwise work on a masked selection, then a reduction over it: a fusion candidate
    whose size is the batch's (``u0``), not the bound's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)[keep]  # [u0, 4]
        return (torch.sigmoid(h) * 2.0 - 1.0).sum(0).mean()


def test_no_kernel_takes_a_data_dependent_size() -> None:
    from gemc.passes.fuse import Fuse

    from tests.passes.helpers import annotated, graph_of

    gm, _ = graph_of(_MaskedScale(), (torch.randn(6, 4), torch.tensor([1, 0, 1, 1, 0, 1]) > 0),
                     annotated(Fuse()))
    bounded = {n for n in gm.graph.nodes if ir.BOUNDED in n.meta}
    assert {ir.shape_of(n) for n in bounded} == {(6, 4)}
    assert not [n.name for n in bounded if ir.GROUP in n.meta]
    assert not [n.name for n in gm.graph.nodes if ir.GROUP in n.meta
                and any(a in bounded for a in n.all_input_nodes)]


def test_a_batch_read_on_meta_names_the_authors_line_and_the_cpu_fix() -> None:
    """``int(lengths.sum())`` in make_batch under gemc's meta default device: the error
    named torch/_meta_registrations.py as the place; now the author's line, and the fix."""
    from gemc.errors import EntrypointError

    with pytest.raises(EntrypointError) as info:
        load_model(RAW[0], {"variant": "bag_mean", "cpu_batch": False})
    assert "sparse_idioms.py:" in info.value.where, info.value.where
    assert "torch.device('cpu')" in info.value.fix, info.value.fix
