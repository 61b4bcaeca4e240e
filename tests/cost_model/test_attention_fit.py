"""cost_model.attention_fit against the session-25 H100 run it was fitted to
(benchmarks/attention_price_check.py reads it): the fitted prices order the four zoo
attentions as measured (padded masked cuDNN over gemc's call: SASRec/BST > MMoE > HSTU >
TransAct) and put each on the measured side of 1; every price is within the errors the
BENCHMARKS table quotes; the terms behave as the module says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gemc.cost_model import attention_fit as fit
from gemc.cost_model import op_cost
from gemc.cost_model.hardware import get_gpu

from tests.benchmark_module import BENCHMARKS, load_benchmark

RUN = BENCHMARKS / "results" / "session25" / "kernels_zoo.json"


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    check = load_benchmark("attention_price_check")
    run = json.loads(Path(RUN).read_text())
    return {r["model"]: r for r in check.rows(run, "h100", log=RUN.parent
                                               / "attention_gpu_time.log")}


def test_fitted_prices_order_the_four_zoo_attentions_as_measured(rows) -> None:
    assert set(rows) == {"hstu", "sasrec_bst", "mmoe", "transact"}
    measured = sorted(rows, key=lambda m: rows[m]["measured_ratio"])
    priced = sorted(rows, key=lambda m: rows[m]["priced_ratio"])
    assert measured == ["transact", "hstu", "mmoe", "sasrec_bst"]
    assert priced == measured
    for r in rows.values():  # the same side of 1: which one a call timed alone prefers
        assert (r["priced_ratio"] > 1) == (r["measured_ratio"] > 1), r["model"]


def test_each_fitted_price_is_near_its_measurement(rows) -> None:
    for r in rows.values():
        assert r["priced_sdpa_ms"] == pytest.approx(r["measured_sdpa_ms"], rel=0.10)
        assert r["priced_gemc_ms"] == pytest.approx(r["measured_gemc_ms"], rel=0.12)
        if r["measured_gemc_gpu_ms"] is not None:  # graph replay: HSTU, MMoE
            assert r["priced_gemc_gpu_ms"] == pytest.approx(r["measured_gemc_gpu_ms"], rel=0.05)


def test_in_a_step_hstu_keeps_the_kernel_and_transact_does_not(rows) -> None:
    """HSTU's kernel loses timed alone (host-bound) but wins on the GPU, where a step whose
    host runs ahead pays it; TransAct's guarded call pays its sync's host either way."""
    assert rows["hstu"]["priced_gemc_step_ms"] < rows["hstu"]["priced_sdpa_ms"]
    assert rows["transact"]["priced_gemc_step_ms"] > rows["transact"]["priced_sdpa_ms"]


def test_terms() -> None:
    h100, h200 = get_gpu("h100"), get_gpu("h200")
    # masked SDPA: per padded tile element, whatever the fill; scales with bandwidth
    assert fit.masked_sdpa_s(8, 4, 100, 100, 64, h100) == \
        pytest.approx(fit.masked_sdpa_s(8, 4, 128, 128, 64, h100))
    assert fit.masked_sdpa_s(8, 4, 256, 256, 64, h200) < fit.masked_sdpa_s(8, 4, 256, 256, 64,
                                                                          h100)
    # gemc's work: the real rows' tiles; causal about half; full rows the padded tiles
    full = fit.jagged_tiles(8, 4, 256, 1.0, False)
    assert full == 8 * 4 * 256 * 256
    assert fit.jagged_tiles(8, 4, 256, 0.5, False) < 0.5 * full
    causal = fit.jagged_tiles(8, 4, 256, 0.5, True)
    assert 0.5 < causal / fit.jagged_tiles(8, 4, 256, 0.5, False) < 0.7  # + diagonal tiles
    # against the tiles counted row by row, lengths uniform in 1..L (the benchmarks')
    for length, is_causal in ((201, False), (256, True), (512, True)):
        counted = 0
        for n in range(1, length + 1):
            t = -(-n // fit.TILE)
            counted += (t * (t + 1) // 2 if is_causal else t * t) * fit.TILE ** 2
        model = fit.jagged_tiles(1, 1, length, (length + 1) / (2 * length), is_causal)
        assert model == pytest.approx(counted / length, rel=0.06), (length, is_causal)
    assert fit.score_share(0.5) == pytest.approx(1 / 3) and fit.score_share(1.0) == 1.0
    # a call timed alone: host and GPU overlap unless synced
    call = fit.GemcAttentionPrice(1e-3, 0.0, 2e-3, guarded=False)
    assert call.isolated_s == 2e-3 and call.in_step_s == 1e-3
    synced = fit.GemcAttentionPrice(1e-3, 0.0, 2e-3, guarded=True)
    assert synced.isolated_s == synced.in_step_s == 3e-3
    # op_cost prices bf16 masked SDPA and gemc's kernel by the law; fp32 as before
    fwd, bwd, source = op_cost.attention_time(8, 4, 256, 256, 64, False, "bf16", h100, None,
                                              masked=True)
    assert source == "fitted" and fwd + bwd == pytest.approx(
        fit.masked_sdpa_s(8, 4, 256, 256, 64, h100) + 4 * op_cost.DEFAULT_KERNEL_LAUNCH_S)
    assert op_cost.attention_time(8, 4, 256, 256, 64, False, "fp32", h100, None,
                                  masked=True)[2] == "roofline"
