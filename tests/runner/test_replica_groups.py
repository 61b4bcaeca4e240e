"""Data-parallel replicas batched by group (:mod:`gemc.backends.torch.replica_groups`).

The grouped path (one storage, one lookup and one masked update a group) against the
per-table path (``batched_replicas=False``, today's): forward outputs, weights and optimizer
state equal bit for bit after a few steps, with no op that syncs with the host, on one process told it is one of two ranks and
on two gloo processes; a checkpoint sees each table by its own name and rows and loads back
into the group's storage; the switch refuses what it cannot read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gemc.backends.torch.embedding import ShardedEmbedding
from gemc.backends.torch.replica_groups import (
    BATCHED_REPLICAS_ENV,
    ReplicaLookups,
    batched_replicas_from_env,
)
from gemc.backends.torch.sparse_optim import EmbeddingOptimConfig, EmbeddingOptimizer
from torch import nn

from gemc.sharding import make_shards
from tests.runner.test_sync_free_tables import SyncOps

B = 4  # bags a rank and step


def _sources() -> dict[str, nn.Module]:
    """Every call form a group takes (width 8: a sum group and a mean group) and three
    replicas that stay alone (another width, a padding row, max pooling)."""
    return {
        "a": nn.EmbeddingBag(30, 8, mode="sum", include_last_offset=True),
        "b": nn.EmbeddingBag(20, 8, mode="sum"),  # offsets without the last; weights
        "c": nn.Embedding(25, 8),  # [B, L] ids, one row each
        "d": nn.EmbeddingBag(15, 8, mode="mean"),  # 2-D ids
        "e": nn.EmbeddingBag(12, 8, mode="mean", include_last_offset=True),
        "f": nn.EmbeddingBag(10, 4, mode="sum", include_last_offset=True),
        "g": nn.EmbeddingBag(10, 8, mode="sum", include_last_offset=True, padding_idx=0),
        "h": nn.EmbeddingBag(10, 8, mode="max", include_last_offset=True),
    }


def _tables(world: int, rank: int) -> dict[str, ShardedEmbedding]:
    out = {}
    for i, (name, src) in enumerate(_sources().items()):
        rows, dim = src.weight.shape
        plan = {"fqn": f"{name}.weight", "rows": rows, "dim": dim, "sharding": "data_parallel",
                "shards": make_shards("data_parallel", list(range(world)), rows, dim)}
        t = ShardedEmbedding(src, plan, rank=rank, world_size=world, seed=0)
        t.to_empty(device="cpu")
        with torch.no_grad():
            t.weight.copy_(torch.randn(rows, dim, generator=torch.Generator().manual_seed(i)))
        out[plan["fqn"]] = t
    return out


def _batch(step: int, rank: int) -> tuple[torch.Tensor, ...]:
    """One rank's step: ids, offsets (and weights) per table in a flat tuple (the runner's
    batch: the entries the first step records), then the probes of the loss."""
    g = torch.Generator().manual_seed(100 * step + rank)

    def bags(rows: int, n: int, last: bool) -> tuple[torch.Tensor, torch.Tensor]:
        cuts = torch.sort(torch.randint(0, n + 1, (B - 1,), generator=g)).values
        offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([n])])
        return torch.randint(0, rows, (n,), generator=g), offsets if last else offsets[:-1]

    a, b, e, f = bags(30, 9, True), bags(20, 7, False), bags(12, 6, True), bags(10, 5, True)
    g_ids, g_off = bags(10, 8, True)
    g_ids[:2] = 0  # the padding row
    h = bags(10, 6, True)
    return (*a, *b, torch.rand(7, generator=g), torch.randint(0, 25, (B, 3), generator=g),
            torch.randint(0, 15, (B, 2), generator=g), *e, *f, g_ids, g_off, *h,
            torch.randn(B, 6 * 8 + 4 + 3 * 8, generator=g))  # the outputs' widths


def _forward(tables: dict[str, ShardedEmbedding], batch: tuple, skip: str | None = None
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    (a_ids, a_off, b_ids, b_off, b_w, c_ids, d_ids, e_ids, e_off, f_ids, f_off, g_ids, g_off,
     h_ids, h_off, probe) = batch
    t = {k.removesuffix(".weight"): v for k, v in tables.items()}
    outs = [t["a"](a_ids, a_off), t["b"](b_ids, b_off, per_sample_weights=b_w),
            t["c"](c_ids).reshape(B, -1),
            t["d"](d_ids) if skip != "d" else torch.zeros(B, 8),
            t["e"](e_ids, e_off), t["f"](f_ids, f_off), t["g"](g_ids, g_off), t["h"](h_ids, h_off)]
    return (torch.cat(outs, 1) * probe).sum(), outs


class LookupCount(SyncOps):
    """The lookups (embedding bags and embeddings) run under it, and the ops that would
    make the host wait for the device (:class:`SyncOps`)."""

    def __init__(self) -> None:
        super().__init__()
        self.bags = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func.__name__.startswith(("_embedding_bag.", "embedding.")):
            self.bags += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def _train(world: int, rank: int, grouped: bool, optimizer: str, steps: int = 3,
           skip_at: int | None = None) -> tuple[dict[str, Any], list, list[int]]:
    """``steps`` steps of the eight replicas; (tables, their optimizer, the hook), each
    step's outputs and its lookup ops (forward)."""
    tables = _tables(world, rank)
    opt = EmbeddingOptimizer(tables, EmbeddingOptimConfig(kind=optimizer, lr=0.05,
                                                          weight_decay=0.01),
                             world_size=world, batched_replicas=grouped)
    hook = ReplicaLookups(opt.groups, opt.not_grouped)
    outs, lookups = [], []
    for step in range(1, steps + 1):
        batch = _batch(step, rank)
        count = LookupCount()
        with count:
            hook.begin_step(batch)
            loss, out = _forward(tables, batch, skip="d" if step == skip_at else None)
            lookups.append(count.bags)
            loss.backward()
            hook.end_step()
            opt.step()
        assert not count.found, count.found  # no host sync, grouped or not
        opt.zero_grad()
        outs.append([o.detach() for o in out])
    return {"tables": tables, "opt": opt, "hook": hook}, outs, lookups


def _assert_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    for fqn, t in got["tables"].items():
        assert torch.equal(t.weight.data, want["tables"][fqn].weight.data), fqn
        for k, v in got["opt"].state[fqn].tensors.items():
            assert torch.equal(v, want["opt"].state[fqn].tensors[k]), (fqn, k)


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_grouped_replicas_step_as_the_per_table_path_bit_for_bit(optimizer: str,
                                                                 one_process_group) -> None:  # noqa: ANN001
    """Two groups (sum: a bag with the last offset, one without and per-sample weights, an
    nn.Embedding over 2-D ids; mean: 2-D and 1-D bags), three replicas alone; after the
    recording step each group is ONE lookup, and every output, row and state equals the
    per-table path's exactly, a step where the model skips a member (its rows untouched,
    as when it is not looked up: lazy Adam and weight decay would move them) included."""
    got, got_out, got_lookups = _train(2, 0, True, optimizer, skip_at=3)
    want, want_out, want_lookups = _train(2, 0, False, optimizer, skip_at=3)
    assert [len(g.members) for g in got["opt"].groups] == [3, 2]
    assert got["opt"].not_grouped == {"f.weight": "no other replica of its width and pooling",
                                      "g.weight": "a padding row",
                                      "h.weight": "max pooling (a dense gradient)"}
    assert want["opt"].groups == []
    assert want_lookups == [8, 8, 7]  # step 3 skips d
    assert got_lookups == [8, 2 + 3, 2 + 3]  # the groups' two, then the three alone
    for a, b in zip(got_out, want_out):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    _assert_equal(got, want)
    d = got["tables"]["d.weight"].weight
    assert d.data.data_ptr() == got["opt"].groups[1].weight.data[
        got["opt"].groups[1].base["d.weight"]].data_ptr()  # a view of the group's rows
    report = got["hook"].report()
    assert report["groups"] == {"replica-group-0": ["a.weight", "b.weight", "c.weight"],
                                "replica-group-1": ["d.weight", "e.weight"]}
    assert report["batched_lookup"] == ["a.weight", "b.weight", "c.weight", "d.weight",
                                        "e.weight"]


def test_a_member_called_with_computed_ids_is_looked_up_on_its_own(one_process_group) -> None:  # noqa: ANN001
    """A member whose ids are not the batch's own tensors stays on its own lookup, into
    its rows of the group's gradient: still equal to the per-table path, and reported."""
    results = []
    for grouped in (True, False):
        tables = _tables(2, 0)
        opt = EmbeddingOptimizer(tables, EmbeddingOptimConfig(lr=0.05), world_size=2,
                                 batched_replicas=grouped)
        hook = ReplicaLookups(opt.groups, opt.not_grouped)
        for step in (1, 2):
            batch = _batch(step, 0)
            hook.begin_step(batch)
            loss, _ = _forward(tables, (batch[0].clone(), *batch[1:]))  # a's ids computed
            loss.backward()
            hook.end_step()
            opt.step()
            opt.zero_grad()
        results.append({"tables": tables, "opt": opt, "hook": hook})
    _assert_equal(results[0], results[1])
    assert results[0]["hook"].report()["on_call"] == {
        "a.weight": "its ids are computed in the model"}


def test_checkpoint_sees_each_table_and_loads_into_the_group(one_process_group,  # noqa: ANN001
                                                             tmp_path: Path) -> None:
    """training_state names every member by its fqn with its own rows (and state); a load
    writes them back into the group's storage, where the next lookup reads them."""
    from gemc.backends.torch import checkpoint as ckpt
    from gemc.backends.torch.state import training_state

    trained, _, _ = _train(2, 0, True, "adam", steps=2)
    model = nn.Linear(1, 1)  # the dense part the state also holds
    dense = torch.optim.SGD(model.parameters(), lr=0.1)

    def state_of(run: dict[str, Any]) -> dict[str, Any]:
        return training_state(model, dense, run["tables"], run["opt"], step=2, rank=0,
                              device=torch.device("cpu"), local_world=1)

    saved = state_of(trained)
    assert saved["tables"]["d.weight"].shape == (15, 8)
    assert torch.equal(saved["table_optim"]["c.weight.exp_avg"],
                       trained["opt"].state["c.weight"].tensors["exp_avg"])
    path = ckpt.save(tmp_path / "ck", 2, saved, rank=0)
    fresh, _, _ = _train(2, 0, True, "adam", steps=0)
    ckpt.load(path, state_of(fresh))
    _assert_equal(fresh, trained)
    g = fresh["opt"].groups[0]
    first, rows = g.rows_of("b.weight")
    assert torch.equal(g.weight.data[first:first + rows], trained["tables"]["b.weight"].weight)


def test_the_switch_reads_one_and_zero_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BATCHED_REPLICAS_ENV, raising=False)
    assert batched_replicas_from_env()
    monkeypatch.setenv(BATCHED_REPLICAS_ENV, "0")
    assert not batched_replicas_from_env()
    monkeypatch.setenv(BATCHED_REPLICAS_ENV, "yes")
    with pytest.raises(ValueError, match="GEMC_BATCHED_REPLICAS='yes'"):
        batched_replicas_from_env()


def _two_ranks(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        runs = {}
        for grouped in (True, False):
            run, _, _ = _train(world, rank, grouped, "adam")
            runs[grouped] = {f: (t.weight.data.clone(), dict(run["opt"].state[f].tensors))
                             for f, t in run["tables"].items()}
            graph = _graph_train(world, rank, grouped, "rowwise_adagrad", steps=2)
            runs["graph", grouped] = {
                f: (t.weight.data.clone(), dict(graph["opt"].state[f].tensors))
                for f, t in graph["tables"].items()}
        if rank == 0:
            torch.save(runs, out)
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_step_grouped_as_per_table(tmp_path: Path) -> None:
    """Two processes, each its own batches: the grouped replicas' one all-reduce (its
    layout by group) gives the per-table path's rows and state bit for bit, in module mode
    (Adam) and in graph mode (row-wise Adagrad; the groups looked up ahead of the graph)."""
    from tests.runner.harness import free_port, start_ranks

    out = tmp_path / "runs.pt"
    start_ranks(_two_ranks, (2, free_port(), str(out)), 2)
    runs = torch.load(out)
    for got, want in ((True, False), (("graph", True), ("graph", False))):
        for fqn, (weight, state) in runs[got].items():
            assert torch.equal(weight, runs[want][fqn][0]), (got, fqn)
            for k, v in state.items():
                assert torch.equal(v, runs[want][fqn][1][k]), (got, fqn, k)


def test_deferred_lookups_replay_as_one_lookup_a_group(one_process_group) -> None:  # noqa: ANN001
    """Graph mode's deferred gradients (gemc::table_lookup's backward): the optimizer's step
    replays a group's members as ONE lookup, with the per-table replays' result."""
    runs = []
    for grouped in (True, False):
        tables = _tables(2, 0)
        opt = EmbeddingOptimizer(tables, EmbeddingOptimConfig(kind="adam", lr=0.05),
                                 world_size=2, batched_replicas=grouped)
        for step in (1, 2):
            batch = _batch(step, 0)
            args = [(batch[0], batch[1], None), (batch[2], batch[3], batch[4]),
                    (batch[5], None, None), (batch[6], None, None), (batch[7], batch[8], None),
                    (batch[9], batch[10], None), (batch[11], batch[12], None),
                    (batch[13], batch[14], None)]
            gen = torch.Generator().manual_seed(step)
            for t, call in zip(tables.values(), args):
                with torch.no_grad():  # the op's forward
                    out = t(*call)
                t.defer_backward(torch.randn(out.shape, generator=gen), *call)
            count = LookupCount()
            with count:
                opt.step()
            opt.zero_grad()
        runs.append(({"tables": tables, "opt": opt}, count.bags))
    _assert_equal(runs[0][0], runs[1][0])
    assert (runs[0][1], runs[1][1]) == (2 + 3, 8)


# ---- graph mode: the groups looked up ahead of the compiled graph (replica_ahead) ----------


class _Replicas(nn.Module):
    """The eight replicas of :func:`_sources` and one more sum member the forward never
    calls (``k``: skipped at every step, so its rows must not move), looked up as
    :func:`_forward` does; ``computed``: ``a``'s ids computed in the model."""

    def __init__(self, computed: bool = False) -> None:
        super().__init__()
        for name, src in {**_sources(), "k": nn.EmbeddingBag(9, 8, mode="sum")}.items():
            self.add_module(name, src)
        self.computed = computed

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        (a_ids, a_off, b_ids, b_off, b_w, c_ids, d_ids, e_ids, e_off, f_ids, f_off, g_ids,
         g_off, h_ids, h_off, probe) = batch
        outs = [self.a(a_ids % 30 if self.computed else a_ids, a_off),
                self.b(b_ids, b_off, per_sample_weights=b_w), self.c(c_ids).reshape(B, -1),
                self.d(d_ids), self.e(e_ids, e_off), self.f(f_ids, f_off),
                self.g(g_ids, g_off), self.h(h_ids, h_off)]
        return (torch.cat(outs, 1) * probe).sum()


def _graph_train(world: int, rank: int, grouped: bool, optimizer: str, steps: int = 3,
                 computed: bool = False, weights_grad_at: int | None = None
                 ) -> dict[str, Any]:
    """``steps`` steps of :class:`_Replicas` in graph mode (the GraphExecutor, compiled
    with aot_eager on the CPU): the losses, the per-sample weights' gradients, the lookups
    the optimizer's step replays, and the tables, optimizer and executor."""
    from gemc.backends.torch.embedding import shard_tables
    from gemc.backends.torch.graph_mode import GraphExecutor

    from gemc.capture import capture
    from gemc.spec import ModelSpec

    model = _Replicas(computed)
    captured = capture(ModelSpec(model=model, example_inputs=_batch(0, 0), make_batch=None))
    plan = [{"fqn": f"{name}.weight", "rows": m.weight.shape[0], "dim": m.weight.shape[1],
             "sharding": "data_parallel",
             "shards": make_shards("data_parallel", list(range(world)), *m.weight.shape)}
            for name, m in model.named_children()]
    tables = shard_tables(model, plan, rank=rank, world_size=world, seed=0)
    model.to_empty(device="cpu")
    for i, t in enumerate(tables.values()):
        with torch.no_grad():
            t.weight.copy_(torch.randn(t.weight.shape, generator=torch.Generator().manual_seed(i)))
    opt = EmbeddingOptimizer(tables, EmbeddingOptimConfig(kind=optimizer, lr=0.05,
                                                          weight_decay=0.01),
                             world_size=world, batched_replicas=grouped)
    executor = GraphExecutor(captured.gm, captured.param_fqns, model, [], tables=tables,
                             emb_opt=opt, device=torch.device("cpu"), world_size=world)
    losses, weight_grads, replays = [], [], []
    for step in range(1, steps + 1):
        batch = _batch(step, rank)
        if step == weights_grad_at:
            batch[4].requires_grad_()
        loss = executor(*batch)
        loss.backward()
        count = LookupCount()
        with count:
            opt.step()
        assert not count.found, count.found
        opt.zero_grad()
        losses.append(loss.detach())
        weight_grads.append(batch[4].grad)
        replays.append(count.bags)
    return {"tables": tables, "opt": opt, "executor": executor, "losses": losses,
            "weight_grads": weight_grads, "replays": replays}


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_graph_mode_looks_groups_up_ahead_as_the_per_table_path(optimizer: str,
                                                                one_process_group) -> None:  # noqa: ANN001
    """Graph mode: the members the graph calls with batch inputs (a, b with its weights,
    c, e) are looked up ahead of the compiled graph, one lookup a group, their rows its
    inputs; d (2-D ids: offsets made in the graph) stays in the graph and is replayed by
    its group; k is never called. Losses, rows and state equal the per-table path's
    (``batched_replicas=False``: every lookup in the graph, replayed table by table) bit
    for bit, a step whose per-sample weights want a gradient (b runs in the graph that
    step, and the weights' gradient is the per-table path's) included."""
    got = _graph_train(2, 0, True, optimizer, weights_grad_at=3)
    want = _graph_train(2, 0, False, optimizer, weights_grad_at=3)
    assert [len(g.members) for g in got["opt"].groups] == [4, 2]
    for x, y in zip(got["losses"], want["losses"]):
        assert torch.equal(x, y)
    assert got["weight_grads"][:2] == [None, None]
    assert torch.equal(got["weight_grads"][2], want["weight_grads"][2])
    _assert_equal(got, want)
    k = got["tables"]["k.weight"].weight.data
    assert torch.equal(k, torch.randn(k.shape, generator=torch.Generator().manual_seed(8)))
    # replays at the step: d by its group, f g h alone (and b at step 3), against all eight
    assert got["replays"] == [4, 4, 5]
    assert want["replays"] == [8, 8, 8]
    assert got["executor"].replicas_ahead.report() == {
        "ahead": ["a.weight", "b.weight", "c.weight", "e.weight"],
        "in_graph": {"d.weight": "its ids and offsets are computed in the model"},
        "in_graph_steps": {"b.weight": 1}}
    assert want["executor"].replicas_ahead is None


def test_graph_mode_member_with_computed_ids_stays_in_the_graph(one_process_group) -> None:  # noqa: ANN001
    """``a``'s ids computed in the model: a stays in the graph (its gradient deferred and
    replayed by its group), the rest of its group is looked up ahead; still bit for bit."""
    got = _graph_train(2, 0, True, "adam", steps=2, computed=True)
    want = _graph_train(2, 0, False, "adam", steps=2, computed=True)
    for x, y in zip(got["losses"], want["losses"]):
        assert torch.equal(x, y)
    _assert_equal(got, want)
    report = got["executor"].replicas_ahead.report()
    assert report["ahead"] == ["b.weight", "c.weight", "e.weight"]
    assert report["in_graph"]["a.weight"] == "its ids are computed in the model"
