"""A table's row shards on ranks of several hosts, in any order (not a host's block as the
planners place them): the plan validator takes it, and the runner's exchange, with the
partials summed by each host's owners (backends/torch/host_reduce.py), trains it exactly.

Four gloo processes stand for 2 hosts x 2 GPUs; each runs two steps of the exchange and
row-wise Adagrad on three tables whose row shards straddle the hosts: interleaved over
both (2 owners a host, each host summing), uneven (a lone owner on one host, a summing
pair on the other) and one owner a host. Their pooled outputs, the shards' gradients and
the rows the optimizer writes equal a single-process eager reference (``F.embedding_bag``
over the whole table, every rank's bags, the same update), to fp32 summation order.
"""

from __future__ import annotations

import copy
import json
import zlib
from pathlib import Path
from typing import Any

import pytest

from tests.runner.harness import free_port, gloo_process, start_ranks, step_and_record

ROWS, DIM, WORLD, GPH, STEPS, SEED, LR = 24, 8, 4, 2, 2, 11, 0.05

# name: (sharding, ranks in shard order, pooling mode, per-sample weights)
TABLES: dict[str, tuple[str, list[int], str, bool]] = {
    "spread": ("table_row_wise", [0, 2, 1, 3], "sum", False),  # 2 a host, interleaved
    "uneven": ("table_row_wise", [3, 1, 2], "mean", False),    # 1 on host 0, 2 on host 1
    "apart": ("row_wise", [3, 0], "sum", True),                # 1 a host: nothing summed
}


def _shards(name: str) -> list[dict[str, Any]]:
    from gemc.sharding import make_shards

    sharding, ranks, _, _ = TABLES[name]
    return make_shards(sharding, ranks, ROWS, DIM)


def _batch(name: str, step: int, rank: int):  # noqa: ANN202
    """(ids, offsets, per-sample weights or None, output gradient) of one rank's step."""
    import torch

    weighted = TABLES[name][3]
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}/{rank}".encode()))
    ids = torch.randint(0, ROWS, (9,), generator=g)
    offsets = torch.tensor([0, 2, 2, 6])  # an empty bag
    weights = torch.rand(9, generator=g) if weighted else None
    return ids, offsets, weights, torch.randn(4, DIM, generator=g)


def _train(rank: int) -> dict[str, Any]:
    """Two steps of every table on this rank: outputs, its shards' gradients and rows."""
    from gemc.backends.torch.embedding import ShardedEmbedding
    from gemc.backends.torch.embedding_exchange import exchange_lookups
    from gemc.backends.torch.sparse_optim import EmbeddingOptimConfig, EmbeddingOptimizer
    from torch import nn

    tables = {}
    for name, (sharding, _, mode, _) in TABLES.items():
        entry = {"fqn": f"{name}.weight", "rows": ROWS, "dim": DIM, "sharding": sharding,
                 "shards": _shards(name), "precision": "fp32"}
        m = ShardedEmbedding(nn.EmbeddingBag(ROWS, DIM, mode=mode), entry, rank=rank,
                             world_size=WORLD, seed=SEED, gpus_per_host=GPH)
        m.to_empty(device="cpu")
        m.reset_parameters()
        tables[entry["fqn"]] = m
    assert all(m.host_groups is not None for f, m in tables.items() if f != "apart.weight")
    assert tables["apart.weight"].host_groups is None
    opt = EmbeddingOptimizer(tables, EmbeddingOptimConfig(kind="rowwise_adagrad", lr=LR),
                             world_size=WORLD)
    out: dict[str, Any] = {"outputs": [], "grads": {}, "weights": {}}
    for step in range(STEPS):
        bags, grads = [], []
        for fqn, m in tables.items():
            ids, offsets, weights, grad = _batch(fqn.split(".")[0], step, rank)
            bags.append(m.routed_bags(*m.as_bags(ids, offsets, weights)[:3]))
            grads.append(grad)
        outs = exchange_lookups(list(tables.values()), bags, world=WORLD)
        sum((o * g).sum() for o, g in zip(outs, grads)).backward()
        step_and_record(out, outs, tables, opt, with_grads=True)
    return {"outputs": [[o.tolist() for o in step] for step in out["outputs"]],
            **{key: {f: [v.tolist() for v in steps] for f, steps in out[key].items()}
               for key in ("grads", "weights")}}


def _worker(rank: int, port: int, path: str) -> None:
    with gloo_process(rank, WORLD, port, per_host=GPH):
        Path(f"{path}.{rank}").write_text(json.dumps(_train(rank)))


def _reference(name: str) -> dict[str, Any]:
    """The whole table in one process: every rank's outputs and the table's gradient and
    rows after each step, row-wise Adagrad written out (a row no bag touched keeps its
    values: its gradient is zero)."""
    import torch
    import torch.nn.functional as F
    from gemc.backends.torch.init import fill_table_slice_

    mode = TABLES[name][2]
    w = fill_table_slice_(torch.empty(ROWS, DIM), fqn=f"{name}.weight", rows=ROWS, dim=DIM,
                          row_offset=0, col_offset=0, seed=SEED)
    acc = torch.zeros(ROWS)
    out: dict[str, Any] = {"outputs": [], "grads": [], "weights": []}
    for step in range(STEPS):
        w.requires_grad_(True)
        outs, loss = [], 0.0
        for rank in range(WORLD):
            ids, offsets, weights, grad = _batch(name, step, rank)
            o = F.embedding_bag(ids, w, offsets, mode=mode, per_sample_weights=weights)
            outs.append(o.detach())
            loss = loss + (o * grad).sum()
        loss.backward()
        g = w.grad
        with torch.no_grad():
            acc = acc + g.pow(2).sum(dim=1) / DIM
            w = w - LR * g / (acc.sqrt().unsqueeze(1) + 1e-8)
        out["outputs"].append(outs)
        out["grads"].append(g)
        out["weights"].append(w.detach().clone())
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    path = str(tmp_path_factory.mktemp("row_hosts") / "out.json")
    start_ranks(_worker, (free_port(), path), WORLD)
    return {rank: json.loads(Path(f"{path}.{rank}").read_text()) for rank in range(WORLD)}


@pytest.mark.parametrize("name", list(TABLES))
def test_row_shards_over_both_hosts_train_as_one_process(results, name: str) -> None:
    import torch
    from torch.testing import assert_close

    ref = _reference(name)
    t = list(TABLES).index(name)
    fqn = f"{name}.weight"
    for step in range(STEPS):
        for rank in range(WORLD):
            assert_close(torch.tensor(results[rank]["outputs"][step][t]),
                         ref["outputs"][step][rank], rtol=1e-6, atol=1e-6)
    held = {s["rank"]: s for s in _shards(name)}
    for rank in range(WORLD):
        s = held.get(rank)
        assert (fqn in results[rank]["grads"]) == (s is not None), (name, rank)
        if s is None:
            continue
        rows = slice(s["row_offset"], s["row_offset"] + s["rows"])
        for step in range(STEPS):
            assert_close(torch.tensor(results[rank]["grads"][fqn][step]),
                         ref["grads"][step][rows], rtol=1e-6, atol=1e-6)
            assert_close(torch.tensor(results[rank]["weights"][fqn][step]),
                         ref["weights"][step][rows], rtol=1e-6, atol=1e-6)
        assert ref["grads"][0][rows].abs().sum() > 0  # the shard had rows to update


def test_the_validator_takes_row_shards_on_any_distinct_ranks(base_plans) -> None:
    """Row shards on ranks of both hosts, in any order, make a valid plan; a rank given
    two shards of the table is still refused."""
    from gemc.errors import PlanError
    from gemc.plan import validate_plan
    from gemc.sharding import make_shards

    plan = copy.deepcopy(base_plans[4])
    t = plan["tables"][0]
    t["sharding"] = "table_row_wise"
    t["shards"] = make_shards("table_row_wise", [3, 0, 2], t["rows"], t["dim"])
    validate_plan(plan)
    t["shards"] = make_shards("table_row_wise", [3, 0, 3], t["rows"], t["dim"])
    with pytest.raises(PlanError, match=r"give rank 3 2 shards of one table"):
        validate_plan(plan)
