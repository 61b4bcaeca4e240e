"""A packed region that starts at a row lookup of a padded ``[B, L]`` id grid looks up its
tokens' ids only (``gemc.packed_rules.gathered_lookup``): the runners gather the ids to the
region's layout and look those up, so the lookup reads and its backward scatters ``T`` rows
(the real tokens, plus each row's padding representative where the region has them), not
``B * L``, and the padding ids' serial adds into one gradient row shrink to one per row.

Checked here on the zoo's DIN (padding representatives: ``T = sum(len) + rows with
padding``) and SASRec/BST (a guarded attention region over its item and category history,
the target appended: ``T = sum(len) + B``) at ``tiny``: the ids each lookup and its backward see, recorded at the dispatcher, and
loss and every gradient (the tables' included) against eager, in the interpreter and in
the compiled graph, on fresh batches with an empty and a full row; a call the check
refuses (the padded run: DIN's padded ids unequal within a row) looks up all ``B * L``
ids, as the model does, and equals eager too (BST's region packs every batch: each row keeps
its target). A table module's call that does not take gathered ids keeps the padded lookup with a
warning naming the table. The price moves with it: the same plan's history tables cost
less with their lookups inside the region, the dense gradient's hot-row chain at the
representatives' count instead of half of ``B * L``."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from gemc.backends.torch.graph_mode import lookup_call
from gemc.backends.triton import ops as _ops  # noqa: F401  (registers gemc's custom ops)
from gemc.backends.triton import packed_tokens as pt
from gemc.backends.triton.graph_runner import GraphRunner
from gemc.cost_model import kernels
from gemc.cost_model.hardware import get_gpu
from gemc.cost_model.op_cost import eager_table_time
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from examples.zoo import din, sasrec_bst
from gemc.costing import table_costs
from gemc.graph_summary import table_facts
from gemc.table_lookup import DENSE_GRAD
from tests.fusion.helpers import (
    compiled,
    cpu_graph_executor,
    eager_step,
    entries_of,
    fresh_seed,
    params_of,
    train_against_eager,
)

aten = torch.ops.aten
DIN = "examples.zoo.din:build"
BST = "examples.zoo.sasrec_bst:build"


class _Ids(TorchDispatchMode):
    """The id shapes every ``aten.embedding`` and its dense backward receive on real tensors
    (a record at the dispatcher: what ran, not what a runner says it ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in (aten.embedding.default, aten.embedding_dense_backward.default) \
                and not isinstance(args[1], FakeTensor):  # a capture's tracing: not a run
            self.seen.append((func.__name__.split(".")[0], tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


@functools.cache
def _graph(entry: str) -> tuple[Any, list[dict[str, Any]], Any]:
    gm, ctx, spec = compiled(entry)
    return gm, entries_of(gm, ctx), spec


def _region(entries: list[dict[str, Any]]) -> dict[str, Any]:
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    return region


def _interpreted(entry: str, batch: tuple[torch.Tensor, ...],
                 calls: dict[str, Any] | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """One interpreter step against eager (loss and every gradient); the lookups' ids."""
    gm, entries, spec = _graph(entry)
    ref, grads = eager_step(spec.model, batch)
    runner = GraphRunner(gm, entries, params_of(spec.model), calls=calls)
    with _Ids() as ids:
        loss = runner(*batch)
        loss.backward()
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    for k, p in spec.model.named_parameters():
        torch.testing.assert_close(p.grad, grads[k], atol=1e-5, rtol=1e-4, msg=k)
    spec.model.zero_grad()
    return ids.seen


def _history_ids(seen: list[tuple[str, tuple[int, ...]]], history: set[tuple[int, ...]]
                 ) -> list[tuple[str, tuple[int, ...]]]:
    """The lookups of ``seen`` over a history (their ids of a shape in ``history``)."""
    return [s for s in seen if s[1] in history]


# ---- DIN: padding representatives ---------------------------------------------------------------


def _din_batches(count: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """DIN's tiny batches: lengths 0..L with an empty and a full row, padded ids 0."""
    batches = [din._batch(din.PRESETS["tiny"], step, seed, "cpu") for step in range(count)]
    for b in batches:
        assert int(b[2].min()) == 0 and int(b[2].max()) == b[0].shape[1]
    return batches


def _din_tokens(batch: tuple[torch.Tensor, ...]) -> int:
    lengths, length = batch[2], batch[0].shape[1]
    return int(lengths.sum()) + int((lengths < length).sum())


def _unequal(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """One padded id of the empty row changed: the check refuses the representatives."""
    goods = batch[0].clone()
    goods[int(batch[2].argmin()), -1] = 7
    return (goods, *batch[1:])


def test_din_region_lists_its_history_lookups():
    gm, entries, _ = _graph(DIN)
    region = _region(entries)
    assert region["pad_rep"] and region["lookups"] == ["embedding", "embedding_1"]
    lookups = {n.name: n for n in gm.graph.nodes if n.name in region["lookups"]}
    # the goods and category tables' lookups of the [B, L] history ids
    assert [tuple(n.args[1].meta["val"].shape) for n in lookups.values()] == [(8, 8)] * 2


def test_din_interpreter_looks_up_the_tokens_ids_and_matches_eager():
    stats = pt.GUARD_STATS
    stats.reset()
    for batch in _din_batches(2, fresh_seed()):
        t = _din_tokens(batch)
        seen = _interpreted(DIN, batch)
        # both tables, forward and backward, at the region's tokens only: [1, T]
        assert _history_ids(seen, {(1, t), tuple(batch[0].shape)}) == \
            [("embedding", (1, t))] * 2 + [("embedding_dense_backward", (1, t))] * 2, seen
    assert stats.as_dict()["packed"] == 2


def test_din_padded_call_looks_up_every_id_and_matches_eager():
    batch = _unequal(_din_batches(1, fresh_seed())[0])
    pt.GUARD_STATS.reset()
    seen = _interpreted(DIN, batch)
    assert pt.GUARD_STATS.as_dict()["unequal_padding"] == 1
    full = tuple(batch[0].shape)
    assert [s for s in seen if s[1] == full] == \
        [("embedding", full)] * 2 + [("embedding_dense_backward", full)] * 2


def _lookup_inputs(module: torch.fx.GraphModule) -> dict[str, str]:
    """In a built (Inductor) graph: each ``aten.embedding``'s id operand's producer."""
    return {n.name: str(getattr(n.args[1].target, "__name__", n.args[1].target))
            for n in module.graph.nodes if n.target is aten.embedding.default}


def test_din_compiled_graph_looks_up_gathered_ids_and_trains_as_eager():
    gm, entries, spec = _graph(DIN)
    executor = cpu_graph_executor(gm, spec.model, entries)
    good = _din_batches(2, fresh_seed())
    pt.GUARD_STATS.reset()
    train_against_eager(executor, spec.model, [good[0]])
    # the packed graph: both history lookups read ids gathered to the tokens
    assert list(_lookup_inputs(executor.module).values()).count("_p_gather") == 2
    train_against_eager(executor, spec.model, [_unequal(good[1])])
    # the padded graph: every lookup reads the batch's ids as they are
    assert "_p_gather" not in _lookup_inputs(executor.module).values()
    train_against_eager(executor, spec.model, [good[1]])
    assert pt.GUARD_STATS.as_dict()["packed"] == 2


# ---- SASRec/BST: a guarded attention region over an item and a category history ---------------


def _bst_batch(seed: int) -> tuple[torch.Tensor, ...]:
    """BST's tiny batch (row 0's history empty, row 1's full), the target appended to the
    history by the model: the region's tokens are the kept history and one per row."""
    batch = sasrec_bst._batch(sasrec_bst.PRESETS["tiny"], 0, seed, "cpu")
    lengths = batch[2].sum(1)
    assert int(lengths[0]) == 0 and int(lengths[1]) == batch[2].shape[1]
    return batch


def _bst_tokens(batch: tuple[torch.Tensor, ...]) -> int:
    return int(batch[2].sum()) + batch[2].shape[0]


def test_bst_region_looks_up_its_tokens_ids_in_the_interpreter():
    gm, entries, _ = _graph(BST)
    region = _region(entries)
    assert region["guard"] and region["compact"]
    assert region["lookups"] == ["embedding", "embedding_1"]
    # the item and category tables' lookups of the history with the target appended
    b, length = sasrec_bst.PRESETS["tiny"].batch_size, sasrec_bst.PRESETS["tiny"].max_len
    assert [tuple(n.args[1].meta["val"].shape) for n in gm.graph.nodes
            if n.name in region["lookups"]] == [(b, length + 1)] * 2
    pt.GUARD_STATS.reset()
    for seed in (fresh_seed(), fresh_seed()):
        batch = _bst_batch(seed)
        t = _bst_tokens(batch)
        seen = _interpreted(BST, batch)
        assert _history_ids(seen, {(1, t), (b, length + 1)}) == \
            [("embedding", (1, t))] * 2 + [("embedding_dense_backward", (1, t))] * 2, seen
    assert pt.GUARD_STATS.as_dict()["packed"] == 2


def test_bst_compiled_graph_looks_up_gathered_ids_and_trains_as_eager():
    gm, entries, spec = _graph(BST)
    executor = cpu_graph_executor(gm, spec.model, entries)
    seed = fresh_seed()
    train_against_eager(executor, spec.model, [_bst_batch(seed)])
    # the packed graph: the item and category lookups read ids gathered to the tokens
    assert list(_lookup_inputs(executor.module).values()).count("_p_gather") == 2
    train_against_eager(executor, spec.model, [_bst_batch(seed + 1), _bst_batch(seed + 2)])


# ---- a call that cannot take gathered ids ---------------------------------------------------------


def test_a_lookup_call_that_does_not_take_gathered_ids_stays_padded_and_says_so():
    """A table module's call that does not declare it takes ids of another shape: the
    region still packs, its lookup reads every padded id (then gathered), with a warning
    naming the table; == eager. Declared (``padded_ids_why`` None), it takes them."""
    def lookup(weight: torch.Tensor, ids: torch.Tensor, *rest: Any) -> torch.Tensor:
        return torch.embedding(weight, ids, *rest)

    batch = _bst_batch(fresh_seed())
    full, t = (batch[0].shape[0], batch[0].shape[1] + 1), _bst_tokens(batch)
    with pytest.warns(UserWarning, match="the lookup embedding of table 'item_emb.weight' "
                      "keeps looking up every padded id"):
        seen = _interpreted(BST, batch, calls={"embedding": lookup})
    assert _history_ids(seen, {(1, t), full}) == [
        ("embedding", full), ("embedding", (1, t)),
        ("embedding_dense_backward", (1, t)), ("embedding_dense_backward", full)], seen
    lookup.padded_ids_why = None  # type: ignore[attr-defined]
    seen = _interpreted(BST, batch, calls={"embedding": lookup})
    assert _history_ids(seen, {(1, t), full}) == \
        [("embedding", (1, t))] * 2 + [("embedding_dense_backward", (1, t))] * 2, seen


def test_a_table_answered_by_its_module_looks_up_the_tokens_ids():
    """The graph-mode runner on one rank, a history table stored bf16 (so answered by its
    table module through ``gemc::table_lookup``: the sparse route) in a guarded region: its
    lookups (forward and the replayed sparse backward) see the region's ``[1, T]`` ids,
    never the ``[B, L]`` grid, and the losses are eager's to the bf16 rows' rounding."""
    import json
    from pathlib import Path

    from gemc.backends.torch.reference import reference_losses
    from gemc.backends.torch.runner import RunOptions, run

    from gemc.api import compile as gemc_compile
    from gemc.api import load_model

    entry = str(Path(__file__).resolve().parents[2] / "benchmarks" / "masked_tower.py") \
        + ":build"
    plan = gemc_compile(entry, {"preset": "tiny"}, topology="h200:1x1")
    plan["precision"] = []
    (region,) = [k for k in plan["kernels"] if k["kind"] == "packed_tokens"]
    assert region["guard"] and region["lookups"] == ["embedding"]
    plan = json.loads(json.dumps(plan))
    for t in plan["tables"]:
        t["precision"] = "bf16"
    ref = reference_losses(load_model(entry, {"preset": "tiny"}), steps=2, world_size=1)
    pt.GUARD_STATS.reset()
    with _Ids() as ids:
        res = run(plan, RunOptions(steps=2, device="cpu", progress=False,
                                   graph_executor="interpreter"))
    assert set(res.report["graph_executor"]["table_lookups"].values()) == {"sparse"}
    assert pt.GUARD_STATS.as_dict()["packed"] == 2
    shapes = {shape for name, shape in ids.seen if name == "embedding"}
    assert shapes and all(len(s) == 2 and s[0] == 1 for s in shapes), ids.seen
    torch.testing.assert_close([v for _, v in res.losses], ref, rtol=2e-2, atol=1e-5)


def test_graph_mode_lookup_calls_take_gathered_ids_on_one_rank_only():
    from tests.kernels.test_table_lookup_op import _table

    table = _table(torch.nn.Embedding(12, 4))
    assert lookup_call(table, aten.embedding.default, 1).padded_ids_why is None
    why = lookup_call(table, aten.embedding.default, 2).padded_ids_why
    assert "on 2 ranks" in why and "gathered ids" in why


# ---- the price --------------------------------------------------------------------------------------


def test_the_history_tables_are_priced_at_the_regions_tokens():
    """DIN's plan priced with its history lookups inside the region (ids gathered), and the
    same plan with them outside (every padded id looked up): fewer ids, and the dense
    gradient's serial adds on the padding row at the representatives' count."""
    gm, entries, _ = _graph(DIN)
    region = _region(entries)
    (head,) = [n for n in gm.graph.nodes if n.name == region["padded_from"]]
    facts = head.meta["gemc.packed_region"]
    inside = {t.fqn: t for t in table_costs(table_facts(gm, {}))}
    saved, facts["lookups"] = facts["lookups"], []
    try:
        outside = {t.fqn: t for t in table_costs(table_facts(gm, {}))}
    finally:
        facts["lookups"] = saved
    b, length = 8, 8
    for fqn in ("goods_emb.weight", "cate_emb.weight"):
        a, p = inside[fqn], outside[fqn]
        # the region's tokens (bucketed, representatives included) + the 8 candidates
        assert a.nnz == round(b * length * region["fill"]) + b and p.nnz == b * length + b
        assert a.hot_ids == region["sample_reps"] < p.hot_ids == kernels.PADDED_SHARE * b * \
            length

        def backward(t):  # noqa: ANN001, ANN202
            return eager_table_time(DENSE_GRAD, t.rows, t.dim, t.nnz, t.batch, t.lookups,
                                    "fp32", get_gpu("h200"), None, None, None, 1,
                                    t.hot_ids)[1]

        assert backward(a) < backward(p)
