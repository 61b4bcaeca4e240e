"""Graph mode on one rank: a table no batched kernel owns takes gemc.table_lookup's path —
the captured op's table-sized gradient for an fp32 table captured ``sparse=False``
(measured faster on the H200), its sharded table (a sparse gradient, the sparse optimizer's
row update; compiled as ``gemc::table_lookup``, no graph break) for one captured
``sparse=True`` or stored narrower — and trains exactly like eager either way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gemc.backends.torch.reference import ReferenceTrainer
from gemc.backends.torch.runner import RunOptions, run
from gemc.backends.torch.sparse_optim import EmbeddingOptimizer
from torch import nn
from torch._dynamo.utils import counters

from gemc.errors import PlanError
from tests.runner.harness import MODEL, variant

STEPS = 3


def _checkpoint_tables(root) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """The tables of the run's last checkpoint (DCP), read back into one process."""
    from gemc.backends.torch import checkpoint as ckpt
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _, path = ckpt.require_latest(root)
    flat = root / "flat.pt"
    dcp_to_torch_save(path, flat)
    return torch.load(flat, weights_only=True)["tables"]


def test_tables_outside_the_batched_kernel_train_exactly_on_their_paths(
        base_plans, tmp_path, monkeypatch) -> None:
    """The test model's plan keeps its batched lookup (which owns some tables) and leaves
    others outside it: the plain nn.Embedding over a sequence, the per-sample-weighted
    bag, the padding_idx bag. Each table outside reaches the sparse optimizer with the
    gradient its path makes (dense for ``dense_grad``, sparse for ``sparse``), as the
    report says; losses and every table's rows after 3 steps equal eager training's."""
    from gemc.api import load_model

    plan = variant(base_plans[1], kernels=True)
    owned = {t["fqn"] for k in plan["kernels"] if k["kind"] == "batched_embedding_bag"
             for t in k["tables"]}
    outside = {t["fqn"] for t in plan["tables"]} - owned
    assert owned and {"t2.weight", "t3.weight"} <= outside
    # the plan's route choice by price (gemc.table_lookup.cheaper_route): the runner
    # follows a table the plan sends SPARSE though it was captured sparse=False
    dense = sorted(t["fqn"] for t in plan["tables"] if t.get("lookup") == "dense_grad")
    assert len(dense) >= 2
    chosen = dense[0]
    plan = {**plan, "tables": [{**t, "lookup": "sparse"} if t["fqn"] == chosen else t
                               for t in plan["tables"]]}

    layouts: dict[str, set[torch.layout]] = {}
    step = EmbeddingOptimizer.step

    def spy(self: EmbeddingOptimizer) -> None:
        for fqn, m in self.tables.items():
            m.replay_deferred()  # a compiled sparse lookup's gradient, as step() makes it
            if m.weight is not None and m.weight.grad is not None:
                layouts.setdefault(fqn, set()).add(m.weight.grad.layout)
        step(self)

    monkeypatch.setattr(EmbeddingOptimizer, "step", spy)
    ck = tmp_path / "ck"
    torch._dynamo.reset()
    counters.clear()
    got = run(plan, RunOptions(steps=STEPS, device="cpu", progress=False,
                               checkpoint_dir=str(ck)))
    # the sparse tables' lookups compile inside the graph (gemc::table_lookup): no island
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert got.report["execution"].startswith("graph") and got.report["kernels_applied"]
    paths = got.report["graph_executor"]["table_lookups"]
    assert {f: p for f, p in paths.items() if f in owned} == dict.fromkeys(owned, "batched")
    assert {paths[f] for f in outside} <= {"sparse", "dense_grad"} and "dense_grad" in {
        paths[f] for f in outside}
    assert paths[chosen] == "sparse"
    assert got.report["graph_executor"]["table_route_ms"] == {
        t["fqn"]: t["route_ms"] for t in plan["tables"] if "route_ms" in t}
    assert layouts == {f: {torch.sparse_coo if paths[f] == "sparse" else torch.strided}
                       for f in outside}

    ref = ReferenceTrainer(load_model(MODEL, {}), world_size=1)
    losses = [ref.step(s) for s in range(STEPS)]
    torch.testing.assert_close([v for _, v in got.losses], losses, rtol=1e-5, atol=0)
    tables = _checkpoint_tables(ck)
    for name, module in ref.tables.items():
        torch.testing.assert_close(tables[f"{name}.weight"], module.weight.detach(),
                                   rtol=1e-5, atol=1e-7)


class _TiedTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode="sum", sparse=True)  # routed: SPARSE

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return (self.bag(ids, offsets) @ self.bag.weight.t()).sum()


class _OtherPooling(_TiedTable):
    """A functional lookup of the table with another pooling than its module's."""

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        mean = nn.functional.embedding_bag(ids, self.bag.weight, offsets, mode="mean",
                                           sparse=True)
        return (self.bag(ids, offsets) * mean).sum()


def _executor_for(model: nn.Module, precision: str = "fp32"):  # noqa: ANN202
    from gemc.backends.torch.embedding import shard_tables
    from gemc.backends.torch.graph_mode import GraphExecutor
    from gemc.backends.torch.sparse_optim import EmbeddingOptimConfig

    from gemc.capture import capture
    from gemc.sharding import make_shards
    from gemc.spec import ModelSpec

    example = (torch.tensor([1, 2, 3]), torch.tensor([0, 1]))
    captured = capture(ModelSpec(model=model, example_inputs=example, make_batch=None))
    table = {"fqn": "bag.weight", "rows": 10, "dim": 4, "sharding": "table_wise",
             "shards": make_shards("table_wise", [0], 10, 4), "precision": precision}
    tables = shard_tables(model, [table], rank=0, world_size=1, seed=0)
    model.to_empty(device="cpu")  # the sharded table is made on meta, as in the runner
    tables["bag.weight"].reset_parameters()
    emb_opt = EmbeddingOptimizer(tables, EmbeddingOptimConfig(), world_size=1)
    executor = GraphExecutor(captured.gm, captured.param_fqns, model, [], tables=tables,
                             emb_opt=emb_opt, device=torch.device("cpu"))
    return executor, tables["bag.weight"], example


def test_a_table_also_read_outside_its_lookup_on_one_rank() -> None:
    """One rank, fp32: a tied read of the weight runs as captured on the whole table (as in
    module mode), loudly; the lookup itself still runs sparse, and the forward and the
    gradient are eager's. Stored bf16, the same read is refused (it would read the stored
    values)."""
    model = _TiedTable()
    with pytest.warns(UserWarning, match="reads table 'bag.weight'.*table-sized"):
        executor, table, example = _executor_for(model)
    ids, offsets = example
    weight = table.weight.detach().clone().requires_grad_()
    want = (nn.functional.embedding_bag(ids, weight, offsets, mode="sum") @ weight.t()).sum()
    want.backward()
    loss = executor(*example)
    loss.backward()
    table.replay_deferred()  # the compiled lookup's sparse part, as the optimizer makes it
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(table.weight.grad.to_dense(), weight.grad)
    with pytest.raises(PlanError, match="reads table 'bag.weight'.*stored bf16") as err:
        _executor_for(_TiedTable(), "bf16")
    assert "--no-kernels" in err.value.fix


def test_a_lookup_of_another_form_than_its_modules_runs_as_captured() -> None:
    """The sharded table answers only the lookups its module would make: a functional
    ``mean`` lookup of a ``sum`` table runs as captured (warned, naming the pooling), and
    the result is eager's."""
    with pytest.warns(UserWarning, match="with pooling mode 1 \\(its module's: sum\\)"):
        executor, table, (ids, offsets) = _executor_for(_OtherPooling())
    weight = table.weight.detach().clone().requires_grad_()
    want = (nn.functional.embedding_bag(ids, weight, offsets, mode="sum")
            * nn.functional.embedding_bag(ids, weight, offsets, mode="mean")).sum()
    want.backward()
    loss = executor(ids, offsets)
    loss.backward()
    table.replay_deferred()  # the compiled lookup's sparse part, as the optimizer makes it
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(table.weight.grad.to_dense(), weight.grad)


def test_a_packed_region_starting_at_a_table_lookup_matches_eager_on_both_paths() -> None:
    """A guarded packed region (a bool mask given as input) whose first node is the lookup
    of a table no batched kernel owns: run as captured (``dense_grad``), or answered padded
    by its table module (the table stored bf16: ``sparse``) with the region packing its
    tokens from there — compiled and interpreted, as eager computes (bf16 rows: to their
    rounding)."""
    from gemc.backends.torch.reference import reference_losses
    from gemc.backends.triton.packed_tokens import GUARD_STATS

    from gemc.api import compile as gemc_compile
    from gemc.api import load_model

    entry = str(Path(__file__).resolve().parents[2] / "benchmarks" / "masked_tower.py") + ":build"
    plan = gemc_compile(entry, {"preset": "tiny"}, topology="h200:1x1")
    plan["precision"] = []
    assert any(k["kind"] == "packed_tokens" and k.get("guard") for k in plan["kernels"])
    ref = reference_losses(load_model(entry, {"preset": "tiny"}), steps=2, world_size=1)
    bf16 = json.loads(json.dumps(plan))
    for t in bf16["tables"]:
        t["precision"] = "bf16"
    for p, path, tol in ((plan, "dense_grad", 1e-4), (bf16, "sparse", 2e-2)):
        for executor in ("inductor", "interpreter"):
            GUARD_STATS.reset()
            res = run(p, RunOptions(steps=2, device="cpu", progress=False,
                                    graph_executor=executor))
            graph = res.report["graph_executor"]
            assert set(graph["table_lookups"].values()) == {path}, graph["table_lookups"]
            regions = res.report["per_rank"][0]["guarded_regions"]
            assert regions["packed"] >= 2, regions  # every step ran packed
            torch.testing.assert_close([v for _, v in res.losses], ref, rtol=tol, atol=1e-5)
