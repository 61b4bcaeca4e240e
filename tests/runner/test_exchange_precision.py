"""Pooled rows exchanged bf16 / fp8 by the runner on 2 CPU processes (gloo).

The test model's tables (bags sum / mean, per-sample weights, padding_idx, and a plain
nn.Embedding whose rows travel one per id) are sharded table-wise, row-wise and
column-wise, and the same plan trains 6 steps with the pooled exchange at fp32, bf16
(both ways) and fp8 forward / bf16 backward (10 before: each step costs ~0.4 s a run, the
owners' update interpreted, and the bound below is per step, not grown by the steps).

Tolerance from the wire's SQNR (gemc.exchange_codec.representative_sqnr_db, measured
at the widest test table's width): a cast with SQNR ``s`` dB adds noise of relative RMS
``10**(-s/20)`` to every pooled row and gradient: bf16 about 56 dB (0.16%), fp8 about
34 dB (2%). The loss is a smooth function of the pooled rows through the dense layers, so
its relative change is of that order; the test allows three times the noise amplitude
(measured over 10 steps: 0.05% and 0.5% at worst), and asks each run to differ from
fp32 (the cast is in effect).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from gemc.exchange_codec import representative_sqnr_db
from gemc.exchange_precision import WirePrecision
from gemc.plan import write_plan
from tests.runner.harness import run_scenarios, variant

STEPS = 6
DIM = 8  # the widest of the test model's tables (tests/runner/models.py): the lowest SQNR
RTOL = {p: 3 * 10 ** (-representative_sqnr_db(p, DIM) / 20) for p in ("bf16", "fp8")}


@pytest.fixture(scope="module")
def plan_w2(base_plans) -> dict:
    r = [0, 1]
    return variant(base_plans[2], {"t0.weight": ("table_wise", [1]),
                                   "t1.weight": ("row_wise", r),
                                   "t2.weight": ("column_wise", r),
                                   "t3.weight": ("row_wise", [1, 0]),
                                   "t4.weight": ("row_wise", [1, 0]),
                                   "t5.weight": ("table_wise", [0])},
                   optimizer={"embedding": {"kind": "rowwise_adagrad", "lr": 0.05}})


def _with_exchange(plan: dict, forward: str) -> dict:
    out = copy.deepcopy(plan)
    wire = WirePrecision.of(forward)
    out["exchange"] = {"forward": wire.forward, "backward": wire.backward,
                       "reason": "set by the test"}
    return out


def _floats(sent: list) -> list[tuple[str, int]]:
    """The exchanged calls that carry pooled rows or gradients (ids and sizes are int64)."""
    return [(d, n) for d, n in sent if d != "int64"]


def test_low_precision_exchange_trains_near_fp32_and_sends_narrow(plan_w2, tmp_path: Path):
    scenarios = []
    for forward in ("fp32", "bf16", "fp8"):
        path = tmp_path / f"{forward}.json"
        write_plan(path, _with_exchange(plan_w2, forward))
        scenarios.append({"name": forward, "plan": str(path), "phases": [{"steps": STEPS}]})
    got = run_scenarios(2, scenarios, tmp_path / "losses.json")
    fp32 = [v for _, v in got["fp32"][0]]
    assert len(fp32) == STEPS
    for forward in ("bf16", "fp8"):
        losses = [v for _, v in got[forward][0]]
        off = [abs(a - b) / abs(b) for a, b in zip(losses, fp32)]
        assert max(off) < RTOL[forward], f"{forward}: loss off fp32's by {max(off):.3%}"
        assert max(off) > 0, f"{forward}: identical to fp32: the cast is not in effect"

    # on the wire: fp32 sends float32 rows and gradients; bf16 the same elements as
    # bfloat16; fp8 each forward row as its bytes and a 4-byte scale (uint8), and the
    # gradients back as bfloat16. Calls pair up in order (the same batches every run).
    meta = {f: got["_meta"][f][0] for f in ("fp32", "bf16", "fp8")}
    ref = _floats(meta["fp32"]["all_to_all_sent"])
    assert ref and {d for d, _ in ref} == {"float32"}
    bf16 = _floats(meta["bf16"]["all_to_all_sent"])
    assert bf16 == [("bfloat16", n) for _, n in ref]
    fp8 = _floats(meta["fp8"]["all_to_all_sent"])
    assert len(fp8) == len(ref) and {d for d, _ in fp8} == {"uint8", "bfloat16"}
    forward_calls = 0
    for (dtype, n), (_, n32) in zip(fp8, ref):
        if dtype == "bfloat16":  # a backward: the same elements
            assert n == n32
        else:  # a forward: one byte an element plus 4 per row (rows are >= 4 wide)
            forward_calls += 1
            assert n == n32 == 0 or (n32 < n <= 2 * n32 and (n - n32) % 4 == 0)
    assert forward_calls == len(ref) // 2
    for f in ("bf16", "fp8"):
        assert meta[f]["exchange_precision"] == {"forward": f, "backward": "bf16"}
