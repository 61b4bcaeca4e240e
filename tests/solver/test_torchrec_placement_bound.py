"""The placement bound under TorchRec's corrected estimator (issue 19,
``benchmarks/torchrec_placement_bound.py``): CP-SAT's optimum of the "all" max-rank over
every placement of a plan's shards is the brute-force optimum, re-prices to itself through
``torchrec_rates.rank_times`` (the figure BENCHMARKS.md reports), and obeys its caps."""

from __future__ import annotations

import itertools

import pytest

from tests.benchmark_module import load_benchmark

bound = load_benchmark("torchrec_placement_bound")
rates = bound.rates
BATCH = 65536
W, L = 4, 2  # two hosts of two
INTRA, INTER = 374e6, 46e6
BW = rates.share_bw(W, L, INTRA, INTER)
SPEC = {"a2a_bw": BW, "intra": INTRA, "inter": INTER, "share": True}


def record(table: str, cols: int, compute_ms: float, sharding: str = "table_wise") -> dict:
    """One shard's TorchRec terms as the worker records them (no ranks): its all-to-all
    charged at the pricing's rate, so rank_times' byte check holds."""
    comms = 2 * BATCH * cols * 4 / BW
    return {"table": table, "sharding": sharding, "rows": 1000, "cols": cols,
            "fwd_compute": compute_ms / 3, "bwd_compute": 2 * compute_ms / 3,
            "fwd_comms": comms / 2, "bwd_comms": comms / 2, "prefetch_compute": 0.0}


PIECES = [
    {"table": "t0", "record": record("t0", 32, 0.9, "column_wise"), "shards": 4,
     "load": {"mem": 5}},
    {"table": "t1", "record": record("t1", 128, 0.05), "shards": 1, "load": {"mem": 1}},
    {"table": "t2", "record": record("t2", 128, 0.30), "shards": 1, "load": {"mem": 4}},
    {"table": "t3", "record": record("t3", 64, 0.20, "column_wise"), "shards": 2,
     "load": {"mem": 3}},
    {"table": "t4", "record": record("t4", 128, 0.02), "shards": 1, "load": {"mem": 1}},
]
DP = {"table": "d", "sharding": "data_parallel", "ranks": "all", "rows": 10, "cols": 128,
      "fwd_compute": 0.01, "bwd_compute": 0.02, "fwd_comms": 0.0, "bwd_comms": 0.005}


def brute(caps: list[int] | None = None) -> float:
    """The least "all" max-rank over every placement (distinct ranks a table), each
    priced by rank_times; ``caps``: per-rank "mem"."""
    best = float("inf")
    choices = [list(itertools.combinations(range(W), p["shards"])) for p in PIECES]
    for pick in itertools.product(*choices):
        ranks = {p["table"]: list(c) for p, c in zip(PIECES, pick, strict=True)}
        if caps is not None:
            mem = [sum(p["load"]["mem"] for p in PIECES if r in ranks[p["table"]])
                   for r in range(W)]
            if any(m > c for m, c in zip(mem, caps, strict=True)):
                continue
        recs = bound.place_records(PIECES, [DP], ranks)
        best = min(best, rates.rank_times(recs, W, L, BATCH, SPEC)["max_ms"])
    return best


def fixed_ms() -> float:
    """What the data-parallel shard costs every rank (best_placement's ``fixed_ms``)."""
    return rates.rank_times([{**DP, "ranks": [0]}], 1, 1, BATCH)["max_ms"]


@pytest.mark.parametrize("caps", [None, [8, 8, 10, 10], [9, 9, 9, 9]])
def test_best_placement_is_the_brute_force_optimum(caps: list[int] | None) -> None:
    got = bound.best_placement(PIECES, W, L, SPEC, fixed_ms=fixed_ms(),
                               caps=None if caps is None else {"mem": caps}, seconds=20)
    assert got["status"] == "OPTIMAL"
    want = brute(caps)
    assert got["max_ms"] == pytest.approx(want, abs=1e-5)
    # the placement it returns prices to its objective under rank_times (the reported figure)
    recs = bound.place_records(PIECES, [DP], got["ranks"])
    assert rates.rank_times(recs, W, L, BATCH, SPEC)["max_ms"] == pytest.approx(want, abs=1e-5)
    for p in PIECES:  # distinct ranks, the table's shard count
        assert len(set(got["ranks"][p["table"]])) == p["shards"]
    if caps is not None:
        mem = [sum(p["load"]["mem"] for p in PIECES if r in got["ranks"][p["table"]])
               for r in range(W)]
        assert all(m <= c for m, c in zip(mem, caps, strict=True))


def test_the_memory_cap_binds() -> None:
    """The caps are not decoration: the capped optimum is dearer than the free one here."""
    assert brute([8, 8, 10, 10]) > brute() + 1e-4


def test_host_cap_holds_each_hosts_load() -> None:
    pieces = [{**p, "host_load": {"sends": p["record"]["cols"]}} for p in PIECES]
    # every host may carry at most 330 columns of sends of the 640 (4 x 32 + 128 + 128 + 2 x 64 + 128)
    got = bound.best_placement(pieces, W, L, SPEC, caps={"host:sends": [330, 330]},
                               seconds=20)
    assert got["status"] == "OPTIMAL"
    for h in range(W // L):
        cols = sum(p["record"]["cols"] for p in pieces for r in got["ranks"][p["table"]]
                   if r // L == h)
        assert cols <= 330


def test_pieces_of_refuses_a_table_of_unlike_shards() -> None:
    a = {**record("t0", 64, 0.1, "column_wise"), "ranks": [0]}
    b = {**record("t0", 32, 0.1, "column_wise"), "ranks": [1]}
    pieces, fixed = bound.pieces_of([a, {**a, "ranks": [2]}, {**DP}])
    assert pieces[0]["shards"] == 2 and pieces[0]["was"] == [0, 2] and fixed == [DP]
    with pytest.raises(ValueError, match="t0: shards .* differ"):
        bound.pieces_of([a, b])
