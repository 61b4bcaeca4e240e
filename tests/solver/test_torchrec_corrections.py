"""The re-pricing of TorchRec's estimator with published corrections (issue 19,
``benchmarks/torchrec_rates.py``), on the CPU and without TorchRec's venv: the arithmetic
on small hand-made plans, and the reproduction of TorchRec's recorded figures from the
per-shard terms ``benchmarks/torchrec_estimator_corrected.py`` recorded."""

from __future__ import annotations

import gzip
import json

import pytest

from tests.benchmark_module import BENCHMARKS, load_benchmark

rates = load_benchmark("torchrec_rates")
BATCH = 65536
W, L = 16, 8


def tw(table: str, rank: int, cols: int, comms_ms: float, compute_ms: float = 0.0,
       sharding: str = "table_wise") -> dict:
    """A table- or column-wise shard record as the worker writes it (forward and backward
    split evenly)."""
    return {"table": table, "sharding": sharding, "ranks": [rank], "rows": 1000, "cols": cols,
            "fwd_compute": compute_ms / 3, "bwd_compute": 2 * compute_ms / 3,
            "fwd_comms": comms_ms / 2, "bwd_comms": comms_ms / 2, "prefetch_compute": 0.0}


def a2a_ms(cols: int, bw: float) -> float:
    """TorchRec's all-to-all charge of a shard: its forward and backward bytes at ``bw``."""
    return 2 * BATCH * cols * 4 / bw


def test_shares_split_a_ranks_bytes() -> None:
    nvl, cross = rates.a2a_shares(16, 8)
    assert (nvl, cross) == (7 / 16, 8 / 16)
    assert rates.a2a_shares(8, 8) == (7 / 8, 0.0)
    # one rate for both links: the bytes that stay on the GPU (1/16) cost nothing
    assert rates.share_bw(16, 8, 100.0, 100.0) == pytest.approx(100.0 * 16 / 15)
    # NVLink 10x the NIC: 7/16 at 1000, 8/16 at 100
    assert rates.share_bw(16, 8, 1000.0, 100.0) == pytest.approx(1 / (7 / 16000 + 8 / 1600))


def test_plain_sum_is_torchrecs_noop_perf_model() -> None:
    dp = {"table": "d", "sharding": "data_parallel", "ranks": "all", "rows": 10, "cols": 128,
          "fwd_compute": 0.1, "bwd_compute": 0.2, "fwd_comms": 0.0, "bwd_comms": 0.3}
    shards = [tw("a", 3, 128, 2.0, 0.5), tw("b", 3, 64, 1.0, 0.25), tw("c", 9, 128, 2.5), dp]
    r = rates.rank_times(shards, W, L, BATCH)
    assert r["rank"] == 3
    assert r["compute_ms"] == pytest.approx(0.75 + 0.3)
    assert r["comms_ms"] == pytest.approx(3.0 + 0.3)
    assert r["max_ms"] == pytest.approx(4.35)


def test_pxn_charges_each_rank_its_hosts_mean() -> None:
    """Two 128-column shards on rank 0, one 64-column on rank 9: at TorchRec's rates (all
    bytes across hosts), PXN spreads host 0's bytes over its 8 NICs and adds the NVLink hop
    of the 7/8 not on the sender's rail."""
    inter, intra = rates.TORCHREC_INTER, rates.TORCHREC_INTRA
    shards = [tw("a", 0, 128, a2a_ms(128, inter)), tw("b", 0, 128, a2a_ms(128, inter)),
              tw("c", 9, 64, a2a_ms(64, inter), compute_ms=0.1, sharding="column_wise")]
    plain = rates.rank_times(shards, W, L, BATCH)
    assert plain["rank"] == 0 and plain["comms_ms"] == pytest.approx(2 * a2a_ms(128, inter))
    pxn = {"a2a_bw": inter, "intra": intra, "inter": inter, "share": False}
    r = rates.rank_times(shards, W, L, BATCH, pxn)
    host0 = 2 * 2 * BATCH * 128 * 4
    rank0 = host0 / 8 / inter + host0 * 7 / 8 / intra
    host1 = 2 * BATCH * 64 * 4
    rank9 = host1 / 8 / inter + host1 * 7 / 8 / intra + 0.1
    assert r["rank"] == 0
    assert r["max_ms"] == pytest.approx(rank0)
    assert rank0 < plain["max_ms"] / 4  # the host's 8 NICs, less the hop
    # every rank of a host pays the mean, holding shards or not
    assert rates.rank_times(shards[2:], W, L, BATCH, pxn)["max_ms"] == pytest.approx(rank9)


def test_pxn_with_shares_charges_only_the_cross_host_share_at_the_nic() -> None:
    inter, intra = 46e6, 374e6
    bw = rates.share_bw(W, L, intra, inter)
    shards = [tw("a", 5, 128, a2a_ms(128, bw))]
    r = rates.rank_times(shards, W, L, BATCH,
                         {"a2a_bw": bw, "intra": intra, "inter": inter, "share": True})
    sent = 2 * BATCH * 128 * 4
    cross = sent * 8 / 16
    want = (sent * 7 / 16 + cross * 7 / 8) / intra + cross / 8 / inter
    assert r["rank"] == 5 and r["max_ms"] == pytest.approx(want)


def test_a_wrong_all_to_all_rate_is_refused() -> None:
    shards = [tw("a", 0, 128, a2a_ms(128, rates.TORCHREC_INTER))]
    pxn = {"a2a_bw": rates.NDR_NIC, "intra": rates.TORCHREC_INTRA,
           "inter": rates.TORCHREC_INTER, "share": False}
    with pytest.raises(ValueError, match="a2a_bw is not the rate it charged"):
        rates.rank_times(shards, W, L, BATCH, pxn)


def test_measured_all_reduce_knob_gives_aps_time_through_torchrecs_formula() -> None:
    """TorchRec's data-parallel all-reduce (DataParallelEvaluator._default_bwd_comms):
    bytes x (2n-1)/n / bw, n = min(hosts, 2), doubled past two hosts."""
    nbytes = 20e6
    for world, hosts_row in ((16, (2, 8)), (64, (8, 8)), (4096, (32, 8))):
        n = min(world / 8, 2)
        torchrec = nbytes * (2 * n - 1) / n / rates.ap_all_reduce_knob(world, 8)
        if world > 16:
            torchrec *= 2
        measured = nbytes / rates.per_ms(rates.AP_ALL_REDUCE_GBPS[hosts_row])
        assert torchrec == pytest.approx(measured)


def test_ap_rates_take_the_nearest_measured_shape_below() -> None:
    assert rates.ap_all_to_all(2, 8) == rates.per_ms(82.508803)
    assert rates.ap_all_to_all(64, 8) == rates.per_ms(43.056701)  # past AP's 32 hosts
    assert rates.ap_all_to_all(512, 1) == rates.per_ms(46.781375)
    with pytest.raises(ValueError, match="no all_to_all with 4 GPUs per host"):
        rates.ap_all_to_all(2, 4)


def small_terms() -> dict:
    """Worker-shaped terms of a two-plan case at 16 ranks under two pricings."""
    inter = rates.TORCHREC_INTER
    gemc = [tw("a", 0, 128, a2a_ms(128, inter), 0.4), tw("b", 1, 128, a2a_ms(128, inter))]
    torchrec = [{"table": "a", "sharding": "table_row_wise", "ranks": [r], "rows": 5,
                 "cols": 128, "fwd_compute": 0.1, "bwd_compute": 0.2, "fwd_comms": 0.3,
                 "bwd_comms": 0.4} for r in range(8)]
    out = {}
    for pricing in ("torchrec", "nic"):
        k = 1.0 if pricing == "torchrec" else inter / rates.NDR_NIC
        g = [dict(s, fwd_comms=s["fwd_comms"] * k, bwd_comms=s["bwd_comms"] * k) for s in gemc]
        out[pricing] = {
            "a2a_bw": inter / k,
            "gemc": {"shards": g, "max_perf_ms": rates.rank_times(g, W, L, BATCH)["max_ms"]},
            "torchrec": {"shards": torchrec, "max_perf_ms": 1.0}}
    return out


def test_reprice_reproduces_recorded_figures_and_refuses_drift() -> None:
    terms = small_terms()
    got = rates.reprice(terms, "gemc", W, L, BATCH)
    assert set(got) == {"torchrec", "nic", "pxn"}  # the variants whose pricing is there
    assert got["torchrec"]["max_ms"] == pytest.approx(terms["torchrec"]["gemc"]["max_perf_ms"])
    assert got["pxn"]["max_ms"] < got["torchrec"]["max_ms"]
    theirs = rates.reprice(terms, "torchrec", W, L, BATCH)
    assert rates.verdict(got, theirs) == {"torchrec": False, "nic": False, "pxn": False}
    terms["nic"]["gemc"]["max_perf_ms"] += 0.01
    with pytest.raises(ValueError, match="pricing nic: re-summed"):
        rates.reprice(terms, "gemc", W, L, BATCH)


RECORDED = [BENCHMARKS / "results" / f"torchrec_estimator_corrected{tail}.json.gz"
            for tail in ("", "_4096", "_replanned")]


def recorded_rows() -> dict[tuple[str, int], dict]:
    """(file, world) -> a recorded size, from every recorded run."""
    out = {}
    for path in RECORDED:
        with gzip.open(path, "rt") as f:
            for row in json.load(f)["rows"]:
                if "terms" in row:
                    out[(path.name, row["world"])] = row
    return out


def test_recorded_run_reproduces_torchrecs_figures() -> None:
    """Every plan and pricing of the recorded runs: the re-summed shard terms give
    TorchRec's own figure (reprice checks it to 0.001 ms), the default one is what
    vs_torchrec.py recorded for TorchRec's plan (8.12 ms at 16 ranks, 3.88 at 64), the
    table-/column-wise comms are TorchRec's byte formula at the pricing's all-to-all rate,
    and at 4,096 ranks every table of both plans is priced (gemc's grids included)."""
    rows = recorded_rows()
    worlds = {w: row for (name, w), row in rows.items()
              if name == "torchrec_estimator_corrected.json.gz"}
    assert {16, 64, 512, 4096} <= set(worlds)
    assert rows[("torchrec_estimator_corrected_4096.json.gz", 4096)]["unpriced"] == {
        "gemc": [], "torchrec": []}
    for (_, world), row in rows.items():
        for who in row["variants"]:
            again = rates.reprice(row["terms"], who, world, 8, BATCH)
            for name, r in again.items():
                assert r["max_ms"] == pytest.approx(row["variants"][who][name]["max_ms"],
                                                    abs=1e-9)
            for t in row["terms"].values():
                for s in t[who]["shards"]:
                    if s["sharding"] in rates.WORLD_A2A:
                        m = (s["fwd_comms"] + s["bwd_comms"]) * t["a2a_bw"]
                        assert m == pytest.approx(rates.a2a_bytes(s, BATCH), rel=1e-9)
    assert worlds[16]["variants"]["torchrec"]["torchrec"]["max_ms"] == pytest.approx(8.12, abs=5e-3)
    assert worlds[64]["variants"]["torchrec"]["torchrec"]["max_ms"] == pytest.approx(3.88, abs=5e-3)


def test_aps_sized_all_to_all_reproduces_its_published_rows() -> None:
    """AP's formula at 1 GiB gives the rows of BENCHMARKS' collectives table (2x8: 13,121
    us; 8x8: 23,122 us) and is slower per byte at smaller messages (its ramp)."""
    gib = float(1 << 30)
    assert rates.ap_all_to_all_ms(gib, 16) == pytest.approx(13.1212, rel=1e-3)
    assert rates.ap_all_to_all_ms(gib, 64) == pytest.approx(23.1221, rel=1e-3)
    small, big = rates.ap_all_to_all_ms(10e6, 64), rates.ap_all_to_all_ms(100e6, 64)
    assert small / 10e6 > big / 100e6
    with pytest.raises(ValueError, match="8 GPUs a host, not 4"):
        rates.ap_all_to_all_ms(1e6, 16, local=4)


def test_sized_mode_charges_one_exchange_a_direction_per_rank() -> None:
    bw = rates.ap_all_to_all(2, 8)
    shards = [tw("a", 2, 128, a2a_ms(128, bw)), tw("b", 2, 64, a2a_ms(64, bw))]
    r = rates.rank_times(shards, W, L, BATCH, {"a2a_bw": bw, "sized": True})
    each_way = BATCH * (128 + 64) * 4
    assert r["rank"] == 2
    assert r["comms_ms"] == pytest.approx(2 * rates.ap_all_to_all_ms(each_way, W))
    assert r["comms_ms"] > 2 * each_way / bw  # latency and ramp on top of the peak rate
