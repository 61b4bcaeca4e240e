"""Row shards' partial sums reduced inside each host (backends/torch/host_reduce.py).

Four gloo processes stand for 2 hosts x 2 GPUs. One launch runs every case twice, with
``GEMC_ROW_SHARD_HOST_REDUCE`` 1 and 0 (the direct path), from the same initial shards and
batches, and compares: the exchange's pooled outputs, the shards' gradients and the rows the
optimizer writes (two steps, the second's outputs read the updated rows), on the sparse
``F.embedding_bag`` route, the owners' fused route (optimizer in the lookup's backward) and
bf16 / fp8 storage with bf16 / fp8 wires; the float bytes that crossed hosts; and a whole
runner training run of the test model with row-wise, table-row-wise and grid tables.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import pytest

from tests.runner.harness import free_port, gloo_process, start_ranks, step_and_record, variant

ROWS, DIM, B, L, WORLD, GPH, STEPS = 24, 8, 4, 2, 4, 2, 2
PAD = 5

# name: (sharding, ranks, grid, kind, weighted)
TABLES: dict[str, tuple[str, list[int], list[int] | None, str, bool]] = {
    "rw": ("row_wise", [0, 1, 2, 3], None, "sum", False),
    "trw": ("table_row_wise", [2, 3], None, "mean", False),  # padding ids, mean
    "grid": ("grid", [0, 1, 2, 3], [2, 2], "sum", True),  # per-sample weights
    "seq": ("row_wise", [3, 2, 1, 0], None, "embedding", False),  # unpooled, ranks reversed
    "tw": ("table_wise", [1], None, "sum", False),  # never reduces, same exchange
}
# case: (route, {table: (storage precision, wire forward precision)})
CASES: dict[str, tuple[str, dict[str, tuple[str, str]]]] = {
    "sparse": ("sparse", {t: ("fp32", "fp32") for t in TABLES}),
    "fused": ("fused", {t: ("fp32", "fp32") for t in TABLES}),
    "lowp": ("sparse", {"rw": ("bf16", "bf16"), "trw": ("fp8", "fp32"),
                        "grid": ("fp32", "fp8"), "tw": ("fp32", "fp8")}),
}
RUN_STEPS = 3


def _shards(name: str) -> list[dict[str, Any]]:
    from gemc.sharding import make_shards

    sharding, ranks, grid, _, _ = TABLES[name]
    return make_shards(sharding, ranks, ROWS, DIM, grid)


def _table(name: str, rank: int, precision: str, wire: str, reduce_groups: bool):  # noqa: ANN202
    from gemc.backends.torch.embedding import ShardedEmbedding
    from torch import nn

    from gemc.exchange_precision import WirePrecision

    sharding, _, _, kind, _ = TABLES[name]
    source = (nn.Embedding(ROWS, DIM) if kind == "embedding"
              else nn.EmbeddingBag(ROWS, DIM, mode=kind, padding_idx=PAD if kind == "mean" else None))
    entry = {"fqn": f"{name}.weight", "rows": ROWS, "dim": DIM, "sharding": sharding,
             "shards": _shards(name), "precision": precision}
    m = ShardedEmbedding(source, entry, rank=rank, world_size=WORLD, seed=11,
                         exchange=WirePrecision.of(wire),
                         gpus_per_host=GPH if reduce_groups else None)
    m.to_empty(device="cpu")
    m.reset_parameters()
    return m


def _batch(name: str, step: int, rank: int):  # noqa: ANN202
    """(ids, offsets or None, per-sample weights or None, output gradient) of one rank."""
    import torch

    _, _, _, kind, weighted = TABLES[name]
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}/{rank}".encode()))
    if kind == "embedding":
        return (torch.randint(0, ROWS, (B, L), generator=g), None, None,
                torch.randn(B, L, DIM, generator=g))
    ids = torch.randint(0, ROWS, (9,), generator=g)
    if kind == "mean":
        ids[:2] = PAD  # a bag of padding only
    offsets = torch.tensor([0, 2, 2, 6])  # an empty bag
    weights = torch.rand(9, generator=g) if weighted else None
    return ids, offsets, weights, torch.randn(B, DIM, generator=g)


@contextmanager
def _cross_host(rank: int, cross: list[int]) -> Iterator[None]:
    """Count the float elements this rank's ``all_to_all_single`` calls send to and receive
    from ranks of the other host inside the block (appended to ``cross``)."""
    import torch.distributed as dist
    from gemc.backends.torch.comm import count_calls

    elements = [0]

    def on_call(output, data, out_splits, in_splits, **_: Any) -> None:  # noqa: ANN001
        if data.dtype.is_floating_point:
            elements[0] += sum(out_splits[d] + in_splits[d] for d in range(WORLD)
                               if d // GPH != rank // GPH)

    inner = dist.all_to_all_single
    count_calls("all_to_all_single", on_call)
    try:
        yield
    finally:
        dist.all_to_all_single = inner
        cross.append(elements[0])


def _train(case: str, rank: int, reduce: bool, cross: list[int]) -> dict[str, Any]:
    """Two steps of CASES[case] with the host reduce on or off: outputs, gradients and
    updated rows of this rank's shards, and the float elements this rank exchanged with
    ranks of the other host in step 1 (appended to ``cross``)."""
    from gemc.backends.torch.embedding_exchange import exchange_lookups
    from gemc.backends.torch.host_reduce import ENV
    from gemc.backends.torch.owner_lookup import OwnerLookup
    from gemc.backends.torch.sparse_optim import EmbeddingOptimConfig, EmbeddingOptimizer

    os.environ[ENV] = "1" if reduce else "0"
    route, specs = CASES[case]
    tables = {f"{n}.weight": _table(n, rank, *specs[n], reduce_groups=True) for n in specs}
    opt = EmbeddingOptimizer(tables, EmbeddingOptimConfig(kind="adam", lr=0.05),
                             world_size=WORLD)
    if route == "fused":
        owned = [f for f, m in tables.items() if m.local is not None]
        if owned:
            OwnerLookup(tables, owned, opt, world_size=WORLD, seed=11)
    out: dict[str, Any] = {"outputs": [], "grads": {}, "weights": {}}
    for step in range(STEPS):
        bags, grads, shapes = [], [], []
        for fqn, m in tables.items():
            ids, offsets, weights, grad = _batch(fqn.split(".")[0], step, rank)
            got = m.as_bags(ids, offsets, weights)
            bags.append(m.routed_bags(*got[:3]))
            shapes.append(got[3])
            grads.append(grad)
        with _cross_host(rank, cross) if step == 0 else nullcontext():
            outs = exchange_lookups(list(tables.values()), bags, world=WORLD)
            loss = sum((o.view(s) * g).sum() for o, s, g in zip(outs, shapes, grads))
            loss.backward()
        step_and_record(out, outs, tables, opt, with_grads=route != "fused")
    return out


def _max_rel(a: Any, b: Any) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) if b.numel() else 0.0


def _compare(case: str, on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """Per output / gradient / weight: whether reduce on equals off (fp32: to summation
    order; an fp8 / bf16 wire forward: to the wire's rounding), and the largest error."""
    import torch

    wires = [w for _, w in CASES[case][1].values()]
    report: dict[str, Any] = {"outputs": [], "grads": [], "weights": []}
    for step in range(STEPS):
        for t, (a, b) in enumerate(zip(on["outputs"][step], off["outputs"][step])):
            # a rounded wire rounds the sum on one path, each partial on the other
            tol = {"fp32": 1e-5, "bf16": 1e-2, "fp8": 0.08}[wires[t]]
            # step 2 reads rows updated from step 1's gradients, which a rounded wire's
            # forward does not change (the backward wire rounds the same values)
            report["outputs"].append((step, t, _max_rel(a, b), tol))
    for key in ("grads", "weights"):
        for fqn, steps in on[key].items():
            for step, (a, b) in enumerate(zip(steps, off[key][fqn])):
                tol = 1e-5
                storage = CASES[case][1][fqn.split(".")[0]][0]
                if key == "weights" and storage != "fp32":
                    tol = 2e-2  # stochastic rounding of a value differing in its last bits
                report[key].append((fqn, step, _max_rel(a, b), tol,
                                    bool(torch.isfinite(a).all())))
    return report


def _worker(rank: int, port: int, path: str, plans: list[str]) -> None:
    with gloo_process(rank, WORLD, port, per_host=GPH):
        out: dict[str, Any] = {}
        try:
            for case in CASES:
                cross: list[int] = []
                on = _train(case, rank, True, cross)
                off = _train(case, rank, False, cross)
                out[case] = {**_compare(case, on, off), "cross_host": cross}
            from gemc.backends.torch.host_reduce import ENV
            from gemc.backends.torch.runner import RunOptions, run

            losses = {}
            for reduce in ("1", "0"):
                os.environ[ENV] = reduce
                res = run(plans[0], RunOptions(steps=RUN_STEPS, device="cpu", progress=False))
                losses[reduce] = [loss for _, loss in res.losses]
            out["run"] = losses
        finally:
            Path(f"{path}.{rank}").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, base_plans) -> dict[int, dict]:
    from gemc.plan import write_plan

    where = tmp_path_factory.mktemp("host_reduce")
    r = [0, 1, 2, 3]
    plan = variant(base_plans[4], {
        "t0.weight": ("row_wise", r), "t1.weight": ("table_wise", [0]),
        "t2.weight": ("grid", r, [2, 2]), "t3.weight": ("row_wise", [3, 1, 2, 0]),
        "t4.weight": ("table_row_wise", [2, 3]), "t5.weight": ("data_parallel", r)},
        {"": "ddp", "bottom": "ddp", "top": "ddp"},
        optimizer={"embedding": {"kind": "rowwise_adagrad", "lr": 0.05}})
    assert plan["topology"]["hosts"] == 2 and plan["topology"]["gpus_per_host"] == GPH
    write_plan(where / "plan.json", plan)
    path = str(where / "out.json")
    start_ranks(_worker, (free_port(), path, [str(where / "plan.json")]), WORLD)
    return {rank: json.loads(Path(f"{path}.{rank}").read_text()) for rank in range(WORLD)}


@pytest.mark.parametrize("case", list(CASES))
def test_reduced_exchange_equals_the_direct_one(results, case: str) -> None:
    for rank in range(WORLD):
        got = results[rank][case]
        assert len(got["outputs"]) == STEPS * len(CASES[case][1])
        bad = [o for o in got["outputs"] if not o[2] <= o[3]]
        assert not bad, (case, rank, "outputs (step, table, error, tolerance)", bad)
        if CASES[case][0] != "fused":  # the fused route keeps no gradient
            assert got["grads"], (case, rank)
        assert got["weights"], (case, rank)
        for key in ("grads", "weights"):
            bad = [g for g in got[key] if not (g[2] <= g[3] and g[4])]
            assert not bad, (case, rank, key, bad)


def _cross_host_elements(reduce: bool, names: Iterable[str] = tuple(TABLES)) -> int:
    """The pooled rows (elements) the exchange sends across hosts in one step, forward and
    backward, counted from both ends (sent and received): per requester and table, one
    block per owner on the other host, or with the reduce one per (column range, host);
    the unpooled table's owners send only the rows of their own ids, reduce or not
    (backends/torch/owned_rows.py)."""
    total = 0
    for name in names:
        kind = TABLES[name][3]
        bags = B * L if kind == "embedding" else B
        for requester in range(WORLD):
            far = [s for s in _shards(name) if s["rank"] // GPH != requester // GPH]
            if kind == "embedding":
                ids = _batch(name, 0, requester)[0]
                total += sum(int(((ids >= s["row_offset"])
                                  & (ids < s["row_offset"] + s["rows"])).sum()) * s["cols"]
                             for s in far)
                continue
            if reduce:
                far = list({(s["col_offset"], s["cols"], s["rank"] // GPH): s
                            for s in far}.values())
            total += sum(bags * s["cols"] for s in far)
    return 4 * total  # forward and backward, each counted by sender and receiver


def test_fewer_bytes_cross_hosts(results) -> None:
    on = sum(results[rank]["sparse"]["cross_host"][0] for rank in range(WORLD))
    off = sum(results[rank]["sparse"]["cross_host"][1] for rank in range(WORLD))
    assert off == _cross_host_elements(False)
    assert on == _cross_host_elements(True)
    # the unpooled table sends its own ids' rows either way; the others, with two owners
    # a host, about half
    seq = _cross_host_elements(True, ["seq"])
    assert 0 < seq == _cross_host_elements(False, ["seq"])
    assert on - seq < 0.6 * (off - seq)


def test_runner_training_with_the_reduce_equals_the_direct_path(results) -> None:
    from tests.runner.harness import assert_losses_match

    losses = results[0]["run"]
    assert_losses_match("host reduce", losses["1"], losses["0"], RUN_STEPS, rtol=1e-5)
    assert len(set(losses["1"])) > 1  # it trains


def test_host_groups_are_rail_aligned_and_absent_on_one_host() -> None:
    from gemc.backends.torch.embedding import Shard
    from gemc.backends.torch.host_reduce import host_groups

    from gemc.sharding import make_shards

    shards = [Shard.from_plan(s) for s in make_shards("row_wise", list(range(8)), 64, 4)]
    hg = host_groups(shards, 4, 8)
    assert hg is not None
    assert hg.group_of[5] == (4, 5, 6, 7) and hg.group_of[0] == (0, 1, 2, 3)
    # requester 6 (local index 2) is summed on local index 2 of each host
    assert [hg.aggregator(hg.group_of[o], 6) for o in (0, 4)] == [2, 6]
    assert hg.sends(2, 6) and not hg.sends(3, 6)
    assert host_groups(shards, 8, 8) is None and host_groups(shards, None, 8) is None
    # one owner per host and column range (column-wise): nothing reduces
    cols = [Shard.from_plan(s) for s in make_shards("column_wise", list(range(8)), 64, 8)]
    assert host_groups(cols, 4, 8) is None
    # a grid of two column blocks, each cut in two row ranges on one host of 2
    grid = [Shard.from_plan(s) for s in make_shards("grid", [0, 1, 2, 3], 64, 8, [2, 2])]
    hg = host_groups(grid, 2, 4)
    assert hg is not None and hg.group_of == {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    # three owners on a host of 4: the requester's local index modulo 3
    odd = [Shard.from_plan(s) for s in make_shards("row_wise", [0, 1, 2, 4], 64, 4)]
    hg = host_groups(odd, 4, 8)
    assert hg is not None and hg.group_of == {0: (0, 1, 2), 1: (0, 1, 2), 2: (0, 1, 2)}
    assert [hg.aggregator((0, 1, 2), r) for r in (4, 5, 6, 7)] == [0, 1, 2, 0]
    assert hg.sends(4, 7)  # a lone owner sends its own partial


def test_a_bad_switch_value_is_refused_by_name(monkeypatch) -> None:
    from gemc.backends.torch.host_reduce import ENV, host_reduce_enabled

    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match=r"GEMC_ROW_SHARD_HOST_REDUCE='yes': use 1 .* or 0"):
        host_reduce_enabled()
    monkeypatch.setenv(ENV, "0")
    assert host_reduce_enabled() is False
    monkeypatch.delenv(ENV)
    assert host_reduce_enabled() is True
