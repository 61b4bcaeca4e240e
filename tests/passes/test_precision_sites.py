"""precision-sites (not a pass: the GEMM sites choose-precision decides on), intent on a
small graph: a layer called twice is two sites of one module, told apart by call index (the
probe's key); a Linear whose weight is an embedding table (tied weights) may never run fp8;
an aligned Linear may; a GEMM reading a LayerNorm's output reads fp32 activations (autocast
runs the norm in fp32), one reading a pointwise op bf16.

The sites' exclusions on the zoo models: tests/precision/test_exclusions.py; the pass that
reads them: tests/passes/test_precision.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gemc.passes.precision_sites import activation_bytes, collect_sites, structural_reason
from torch import nn

from gemc import ir
from tests.passes.helpers import annotated, graph_of


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(64, 32, mode="sum")
        self.norm = nn.LayerNorm(32)
        self.shared = nn.Linear(32, 32)
        self.out = nn.Linear(32, 64, bias=False)
        self.out.weight = self.emb.weight  # tied: the output layer reads the table

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor
                ) -> torch.Tensor:
        h = self.shared(self.norm(self.emb(ids, offsets) + x))
        h = self.shared(F.relu(h))
        return self.out(h).logsumexp(-1).sum()


def test_sites_keys_tied_weights_and_activation_widths():
    gm, _ = graph_of(_Tied(), (torch.randint(0, 64, (32,)), torch.arange(0, 32, 2),
                               torch.randn(16, 32)), annotated())
    # a tied table stays a dense parameter (collect-tables: the runner's table swap would
    # untie it); a site whose weight is a table is refused by that fact alone
    assert not any(ir.TABLE in n.meta for n in gm.graph.nodes)
    tables = {"out.weight"}
    sites = collect_sites(gm)
    assert [s.key for s in sites] == [("shared", "linear", 0), ("shared", "linear", 1),
                                      ("out", "linear", 0)]
    assert [s.problem for s in sites] == [{"batch": 1, "m": 16, "n": 32, "k": 32}] * 2 + [
        {"batch": 1, "m": 16, "n": 64, "k": 32}]
    first, second, out = sites
    assert structural_reason(first, tables, True) is None
    assert structural_reason(out, tables, True) == "its weight is an embedding table"
    assert structural_reason(out, set(), True) is None  # the same layer, not tied
    assert (activation_bytes(first), activation_bytes(second)) == (4, 2)
