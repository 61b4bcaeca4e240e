"""The rule's exclusions hold on the example models, even with fp8 forced wherever legal.

``require_gain=False`` makes the pass take fp8 at every site that is allowed and accurate
(the tiny presets never pay for fp8 on an H200), so what stays out of fp8 here stays out
because the rule forbids it: norms, softmax and attention scores, the loss and the logits,
embedding tables, residual adds, einsum/bmm interactions, dims not divisible by 16.
"""

from __future__ import annotations

import pytest
import torch
from gemc.backends.torch import fp8
from gemc.backends.torch import precision as runner_precision
from gemc.passes.classify_ops import op_name
from gemc.passes.precision import PrecisionOptions
from torch import fx, nn

from gemc import ir
from gemc.api import load_model
from gemc.ir import OpKind
from gemc.plan_builder import precision_entries
from gemc.probe import ProbeConfig
from tests.precision.test_pass import run_pass

GEMMS = ("fwd", "dgrad", "wgrad")
OPTIONS = PrecisionOptions(require_gain=False, probe=ProbeConfig(steps=1))
EXAMPLES = {"gem": "examples/gem/model.py:build", "dlrm": "examples/dlrm/model.py:build"}


@pytest.fixture(scope="module", params=sorted(EXAMPLES))
def compiled(request) -> tuple[str, fx.GraphModule]:
    gm, _ = run_pass(OPTIONS, EXAMPLES[request.param], {"preset": "tiny"})
    return request.param, gm


def _fp8(record: dict) -> bool:
    return any(record["gemms"][g]["dtype"] == "fp8" for g in GEMMS)


def test_fp8_only_on_aligned_linear_layers(compiled) -> None:
    name, gm = compiled
    model = load_model(EXAMPLES[name], {"preset": "tiny"}).model
    fp8_nodes = []
    for node in gm.graph.nodes:
        record = node.meta.get(ir.PRECISION)
        if node.op != "call_function" or record is None:
            continue
        assert ir.kind_of(node) is OpKind.GEMM, f"{node.name} ({node.target}) got a precision"
        if not _fp8(record):
            continue
        fp8_nodes.append(node)
        assert op_name(node) == "linear"
        module = model.get_submodule(record["module"])
        assert isinstance(module, nn.Linear) and not isinstance(module, nn.EmbeddingBag)
        b, m, n, k = (record["shape"][x] for x in ("batch", "m", "n", "k"))
        assert all(d % 16 == 0 for d in (m, n, k)), record["shape"]
        for g in GEMMS:
            d = record["gemms"][g]
            if d["dtype"] == "fp8":
                assert d["sqnr_db"] >= OPTIONS.min_sqnr_db
    assert fp8_nodes, "nothing went fp8: the test would prove nothing"


def test_never_fp8_where_the_rule_forbids(compiled) -> None:
    _, gm = compiled
    for node in gm.graph.nodes:
        record = node.meta.get(ir.PRECISION)
        kind = ir.kind_of(node)
        if kind in (OpKind.NORM, OpKind.ATTENTION, OpKind.EMBEDDING, OpKind.LOSS,
                    OpKind.POINTWISE, OpKind.REDUCTION, OpKind.INDEX):
            assert record is None, f"{kind} node {node.name} has a precision"
        if record is None or node.op != "call_function":
            continue
        reasons = {record["gemms"][g]["rejected"].get("fp8", "") for g in GEMMS}
        if op_name(node) in ("bmm", "einsum", "matmul"):
            assert not _fp8(record) and any("only nn.Linear" in r or "activation x" in r
                                            or "attention" in r for r in reasons)
        if any(ir.kind_of(u) is OpKind.LOSS for u in node.users) or record["shape"]["n"] == 1:
            assert not _fp8(record)  # the logits


def test_blocks_hold_their_bound_and_the_runner_takes_the_plan(compiled) -> None:
    name, gm = compiled
    facts = next(n for n in gm.graph.nodes if n.op == "output").meta[ir.PRECISION]
    for block in facts["blocks"]:
        if block["checked"]:
            assert block["sqnr_db"] >= OPTIONS.min_block_sqnr_db, block
    entries = precision_entries(gm)
    spec = load_model(EXAMPLES[name], {"preset": "tiny"}, device="cpu")
    resolved = runner_precision.resolve(entries, spec.model)
    assert resolved.fp8_linears
    runner_precision.install(spec.model, resolved, "cpu")
    tables = [m for m in spec.model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    assert tables and not any(isinstance(t, fp8.Fp8Linear) for t in tables)
    with resolved.autocast("cpu"):
        loss = spec.model(*spec.make_batch(0, "cpu"))
    loss.backward()
    assert torch.isfinite(loss)
