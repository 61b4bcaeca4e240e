"""choose-precision, intent on a small model measured by the real precision probe (on the
CPU, the model's own weights): fp8 only where the rule allows all three of its conditions,

- structurally (an aligned ``nn.Linear``: not the layer with dims not divisible by 16, not
  the attention scores' matmuls, not the logits feeding the loss),
- paying (``require_gain``: at these tiny shapes the quantization costs more than fp8
  saves, so nothing goes fp8 by default),
- accurate (the measured SQNR over ``min_sqnr_db``: a bound above what fp8 measures keeps
  the layer bf16, one above what bf16 measures moves the measured GEMMs to fp32);

every other GEMM bf16, each choice with the reason the others were rejected, and the
graph's facts (mode, rule, probe, blocks) on the output node.

The zoo models' exclusions and block checks: tests/precision/test_exclusions.py; the golden
dump, the plan entries, uniform modes, a model the probe cannot hold, explain:
tests/precision/test_pass.py; the probe: tests/precision/test_probe.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gemc.passes.precision import ChoosePrecision, PrecisionOptions
from gemc.passes.predict_time import PredictTime
from torch import nn

from gemc import ir
from gemc.probe import Probe
from gemc.spec import ModelSpec
from tests.passes.filecheck import check_graph
from tests.passes.helpers import annotated, graph_of

B = 32


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 128)  # every dim a multiple of 16: fp8 may run it
        self.odd = nn.Linear(128, 40)  # N = 40
        self.qk = nn.Linear(40, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.odd(F.gelu(self.up(x)))
        q = self.qk(h).view(B, 3, 16)
        return (torch.softmax(q @ q.transpose(1, 2), -1) @ q).reshape(B, 48)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()
        self.head = nn.Linear(48, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.head(self.block(x)).squeeze(1), y)


def _chosen(options: PrecisionOptions):
    torch.manual_seed(0)  # the measured SQNRs are of these weights and inputs
    model = _Model()
    inputs = (torch.randn(B, 64), torch.rand(B))
    spec = ModelSpec(model=model, example_inputs=inputs,
                     make_batch=lambda step, device: inputs, batch_size=B)

    def probe(regions, config, *, fwd_flops, fp8_sites):  # noqa: ANN001, ANN202
        return Probe(spec, {"batch": B, "probe_batch": B}, config, regions, fp8_sites)

    return graph_of(model, inputs, annotated(PredictTime(), ChoosePrecision(options)),
                    topology="h200:1x1", precision_probe=probe)


_EXCLUDED = """
    CHECK: %linear_1 = aten.linear.default(
    CHECK-SAME: precision={module:block.odd,op:linear,
    CHECK-SAME: fwd:bf16,dgrad:bf16,wgrad:bf16,
    CHECK-SAME: fp8:dims not divisible by 16 (fwd M=32 N=40 K=128)
    CHECK: %matmul = aten.matmul.default(
    CHECK-SAME: fwd:bf16,dgrad:bf16,wgrad:bf16,
    CHECK-SAME: fp8:attention scores/probabilities
    CHECK: %matmul_1 = aten.matmul.default(
    CHECK-SAME: fp8:attention scores/probabilities
    CHECK: %linear_3 = aten.linear.default(
    CHECK-SAME: precision={module:head,op:linear,
    CHECK-SAME: fwd:bf16,dgrad:bf16,wgrad:bf16,
    CHECK-SAME: fp8:feeds the loss directly (logits)
"""


def test_fp8_only_on_the_aligned_linear_when_gain_is_not_required():
    gm, ctx = _chosen(PrecisionOptions(require_gain=False))
    check_graph(gm, """
        CHECK: %linear = aten.linear.default(%x, %p_block_up_weight
        CHECK-SAME: precision={module:block.up,op:linear,
        CHECK-SAME: fwd:fp8-{{row|tensor}},dgrad:fp8-{{row|tensor}},wgrad:fp8-{{row|tensor}},
        CHECK-SAME: fp8 forced (require_gain off;
    """ + _EXCLUDED + """
        CHECK: return
        CHECK-SAME: precision={mode:auto,baseline:bf16,
        CHECK-SAME: probe:{batch:32,probe_batch:32,steps:2,sites:6,fp8_candidates:1,
        CHECK-SAME: blocks:[{'region': 'block', 'checked': True,
    """)
    assert not [w for w in ctx.warnings if w.startswith("choose-precision")]


def test_fp8_that_does_not_pay_is_not_taken():
    gm, _ = _chosen(PrecisionOptions())
    check_graph(gm, """
        CHECK: %linear = aten.linear.default(%x, %p_block_up_weight
        CHECK-SAME: fwd:bf16,dgrad:bf16,wgrad:bf16,
        CHECK-SAME: fp8:no gain: fp8
        CHECK-NOT: dtype:fp8
    """ + _EXCLUDED)


def test_fp8_the_probe_measures_below_the_bound_is_not_taken():
    """fp8 measures ~29 dB on this layer, bf16 ~50: a 40 dB bound keeps it bf16."""
    gm, _ = _chosen(PrecisionOptions(require_gain=False, min_sqnr_db=40.0))
    check_graph(gm, """
        CHECK: %linear = aten.linear.default(%x, %p_block_up_weight
        CHECK-SAME: fwd:bf16,dgrad:bf16,wgrad:bf16,
        CHECK-SAME: fp8:SQNR {{[0-9.]+}} dB < 40 dB
        CHECK-NOT: dtype:fp8
    """)


def test_a_bound_bf16_does_not_meet_moves_the_gemms_to_fp32():
    gm, _ = _chosen(PrecisionOptions(min_sqnr_db=150.0, min_block_sqnr_db=140.0))
    records = [n.meta[ir.PRECISION] for n in gm.graph.nodes
               if n.op == "call_function" and ir.PRECISION in n.meta]
    assert len(records) == 6
    for r in records:
        assert (r["fwd"], r["dgrad"], r["wgrad"]) == ("fp32", "fp32", "fp32"), r
        assert r["gemms"]["fwd"]["rejected"]["bf16"].endswith("dB < 150 dB"), r
