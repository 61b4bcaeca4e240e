"""benchmarks/attention_price_check.py reads a kernels.py --cases zoo run and prices each
timed attention; on the session-25 H100 run its rows hold what BENCHMARKS.md quotes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_module import BENCHMARKS, load_benchmark

RUN = BENCHMARKS / "results" / "session25" / "kernels_zoo.json"


def test_each_timed_softmax_or_silu_attention_gets_both_prices_and_both_times() -> None:
    check = load_benchmark("attention_price_check")
    run = json.loads(Path(RUN).read_text())
    rows = {r["model"]: r for r in check.rows(run, "h200")}
    # transact's attention is kernels.transact_case's (the run's mean kept keys)
    assert set(rows) == {"hstu", "sasrec_bst", "mmoe", "transact"}
    assert rows["transact"]["shape"]["guarded"] and 0.4 < rows["transact"]["fill"] < 0.5
    for r in rows.values():
        assert r["priced_sdpa_ms"] > 0 and r["priced_gemc_ms"] >= r["priced_gemc_gpu_ms"] > 0
        assert r["measured_ratio"] == r["measured_sdpa_ms"] / r["measured_gemc_ms"]
    # the run's figures as read (the prices move with the cost model; these do not)
    assert 3.9 < rows["sasrec_bst"]["measured_ratio"] < 4.0
    assert rows["mmoe"]["measured_gemc_ms"] == 1.6848959922790527
    assert rows["transact"]["measured_gemc_ms"] == 2.5980000495910645


def test_refit_reproduces_the_constants_in_attention_fit() -> None:
    """``--fit`` on the stored run gives the constants the module holds (to their digits)."""
    from gemc.cost_model import attention_fit as fit
    check = load_benchmark("attention_price_check")
    run = json.loads(Path(RUN).read_text())
    got = check.refit(run, RUN.parent / "attention_gpu_time.log")
    for name, value in got.items():
        assert getattr(fit, name) == pytest.approx(value, rel=0.01), name
