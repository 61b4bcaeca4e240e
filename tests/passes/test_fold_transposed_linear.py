"""fold-transposed-linear, intent on small graphs: a Linear over the token axis (its input
``x.transpose(-1, -2)``) becomes a one-node ``transposed_linear`` kernel, priced as the
linear plus the copy it saves; a Linear over a transpose of other dims, or over ``x``
itself, is left alone.

Numerics (values and gradients under autocast, the runner against eager) and the GEM Wukong
layers: tests/fusion/test_fold_transposed_linear.py; golden tests/golden/fold_transposed_linear.txt."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gemc.passes.fold_transposed_linear import FoldTransposedLinear
from gemc.passes.fuse import Fuse
from gemc.passes.predict_time import PredictTime
from torch import nn

from gemc import ir
from tests.passes.filecheck import check_graph
from tests.passes.helpers import annotated, graph_of, node

aten = torch.ops.aten


class _TokenMix(nn.Module):
    """``x``: [B, n, d]; ``mix`` mixes the n tokens, ``feat`` the d features."""

    def __init__(self, n: int = 6, d: int = 4) -> None:
        super().__init__()
        self.mix = nn.Linear(n, 3)
        self.feat = nn.Linear(d, 5)
        self.batch = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.mix(x.transpose(1, 2))  # [B, d, 3]: over the token axis
        features = self.feat(x)  # no transpose
        across = self.batch(x.transpose(0, 2))  # [d, n, B=2]: a transpose of other dims
        return tokens.sum() + features.sum() + across.sum()


def test_a_linear_over_the_token_axis_is_folded_and_nothing_else():
    gm, _ = graph_of(_TokenMix(), (torch.randn(2, 6, 4),),
                     annotated(PredictTime(), FoldTransposedLinear()), topology="h200:1x1")
    check_graph(gm, """
        CHECK: %transpose = aten.transpose.int(%x, 1, 2)
        CHECK-NOT: group=
        CHECK-NEXT: = aten.linear.default(%transpose, %p_mix_weight
        CHECK-SAME: group=transposed_linear_0
        CHECK-SAME: kernel={id:transposed_linear_0,kind:transposed_linear,
        CHECK-NOT: transposed_linear_
    """)
    linear = node(gm, aten.linear.default, 0)
    folded = linear.meta[ir.KERNEL]
    # priced: the linear alone after, plus the saved copy of its transposed input before
    assert folded["after_ms"] == pytest.approx(linear.meta[ir.PREDICTED_MS], abs=1e-6)
    assert folded["before_ms"] > folded["after_ms"]
    assert ir.GROUP not in node(gm, aten.linear.default, 1).meta
    assert ir.GROUP not in node(gm, aten.linear.default, 2).meta


def test_a_linear_already_in_a_group_is_not_taken_again():
    """A kernel pass before it (here fuse, run first on purpose) keeps what it took."""

    class Activated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mix = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.gelu(self.mix(x.transpose(1, 2))).sum()

    gm, _ = graph_of(Activated(), (torch.randn(2, 6, 4),),
                     annotated(Fuse(), FoldTransposedLinear()))
    check_graph(gm, """
        CHECK: aten.linear.default(%transpose,
        CHECK-SAME: group=gemm_epilogue_0
        CHECK-NEXT: aten.gelu.default
        CHECK-SAME: kind:gemm_epilogue,
        CHECK-NOT: transposed_linear
    """)
