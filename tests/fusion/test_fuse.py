"""The fuse pass: golden dump, grouping rules, and the fused graph against eager."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gemc.passes.classify_ops import ClassifyOps
from gemc.passes.count_flops_bytes import CountFlopsBytes
from gemc.passes.fuse import Fuse
from torch import nn

from gemc import ir
from gemc.context import PassContext
from tests.conftest import check_golden
from tests.fusion.helpers import compiled, dump_after, entries_of, fresh_seed, run_against_eager

JAGGED = "tests/fusion/models.py:build_jagged"


def test_fuse_golden_dump():
    check_golden("fuse.txt", dump_after(JAGGED, "fuse"))


def _groups(fn, *inputs) -> dict[str, list[str]]:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, *xs):  # noqa: ANN002
            return fn(self, *xs)

    gm = torch.export.export(M(), inputs, strict=False).graph_module
    ctx = PassContext()
    for p in (ClassifyOps(), CountFlopsBytes(), Fuse()):
        gm, _ = p.run(gm, ctx)
    out: dict[str, list[str]] = {}
    for n in gm.graph.nodes:
        if ir.GROUP in n.meta:
            out.setdefault(n.meta[ir.GROUP], []).append(n.name)
    return out


def test_no_group_makes_a_cycle():
    """``z + b(gelu(z))``: the add cannot join z's group (its other operand depends on the
    group); it becomes the epilogue of the second GEMM instead, with z as its residual."""
    groups = _groups(lambda m, x: (lambda z: z + m.b(F.gelu(z)))(m.a(x)), torch.randn(4, 8))
    assert list(groups.values()) == [["linear", "gelu"], ["linear_1", "add"]]


def test_gemm_epilogue_takes_residual_scale_and_activation():
    groups = _groups(lambda m, x, r: F.silu(m.a(x)) * 0.5 + r, torch.randn(4, 8),
                     torch.randn(4, 8))
    assert list(groups.values()) == [["linear", "silu", "mul", "add"]]


def test_a_view_between_ops_ends_the_group():
    groups = _groups(lambda m, x: F.gelu(m.a(x).view(4, 2, 4)) * 2.0, torch.randn(4, 8))
    assert list(groups.values()) == [["gelu", "mul"]]  # a pointwise group after the view


def test_value_used_outside_becomes_an_output():
    gm, ctx, _ = compiled(JAGGED)
    norms = [e for e in entries_of(gm, ctx) if e["kind"] == "norm"]
    for e in entries_of(gm, ctx):
        if "binding" in e:
            inside = set(e["nodes"])
            for name in e["binding"]["outputs"]:
                node = next(n for n in gm.graph.nodes if n.name == name)
                assert any(u.name not in inside for u in node.users)
    assert norms, "the LayerNorm and its masked epilogue form a norm group"


def test_fused_graph_matches_eager_forward_and_backward():
    gm, ctx, spec = compiled(JAGGED)
    entries = entries_of(gm, ctx, ["gemm_epilogue", "norm", "pointwise", "reduction"])
    kinds = {e["kind"] for e in entries}
    assert {"gemm_epilogue", "norm"} <= kinds
    for e in entries:
        assert e["predicted"]["after_ms"] < e["predicted"]["before_ms"], e["name"]
    run_against_eager(gm, entries, spec.model, spec.make_batch(fresh_seed(), "cpu"))
