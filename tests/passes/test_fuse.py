"""fuse, intent on small graphs: a Linear with its bias and activation is one GEMM-epilogue
kernel; a reduction takes the pointwise ops producing its input but stops at itself (its
consumers are another group, even one of its input's shape); a sum over the last dim is no reduction root; ``max_outputs``
bounds what a group may write.

Other fuse tests: cycles, residuals, views ending a group and the fused graph against eager
(forward and backward) in tests/fusion/test_fuse.py; the generated kernels in
tests/fusion/test_codegen.py; the whole-graph golden tests/golden/fuse.txt."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gemc.passes.fuse import Fuse
from torch import nn

from tests.passes.filecheck import check_graph
from tests.passes.helpers import annotated, graph_of


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x)).sum()


def test_linear_bias_gelu_is_one_gemm_epilogue_kernel():
    gm, _ = graph_of(_Mlp(), (torch.randn(4, 8),), annotated(Fuse()))
    # the bias is the linear's operand, not a separate add; the gelu is its epilogue, and
    # the kernel facts sit on the group's last node
    check_graph(gm, """
        CHECK: = aten.linear.default(%x, %p_fc_weight, %p_fc_bias)
        CHECK-SAME: group=gemm_epilogue_0
        CHECK-NEXT: = aten.gelu.default(
        CHECK-SAME: group=gemm_epilogue_0
        CHECK-SAME: kernel={id:gemm_epilogue_0,kind:gemm_epilogue,nodes:2,
        CHECK-NEXT: aten.sum.default
        CHECK-NOT: group=
    """)


def test_a_linear_alone_is_no_kernel():
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).sum()

    gm, _ = graph_of(Plain(), (torch.randn(4, 8),), annotated(Fuse()))
    check_graph(gm, "CHECK-NOT: group=\nCHECK: aten.linear.default")
    check_graph(gm, "CHECK: aten.linear.default\nCHECK-NOT: group=")


class _Reduce(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = (x * 2.0 + 1.0).sum(self.dim)
        return (r.relu() * 3.0).sum()


def test_a_reduction_takes_its_producers_and_stops_at_itself():
    gm, _ = graph_of(_Reduce(1), (torch.randn(2, 4, 8),), annotated(Fuse()))
    check_graph(gm, """
        CHECK: aten.mul.Tensor(%x, 2.0)
        CHECK-SAME: group=reduction_0
        CHECK-NEXT: aten.add.Tensor
        CHECK-SAME: group=reduction_0
        CHECK-NEXT: aten.sum.dim_IntList({{%\\w+}}, [1])
        CHECK-SAME: kernel={id:reduction_0,kind:reduction,nodes:3,
        CHECK-NEXT: aten.relu.default
        CHECK-NOT: reduction_0
        CHECK-SAME: group=pointwise_1
        CHECK-NEXT: aten.mul.Tensor
        CHECK-SAME: group=pointwise_1
    """)


class _Center(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2.0
        return ((y - y.mean(1, keepdim=True)) * 3.0).sum()


def test_a_consumer_of_the_reduction_is_not_fused_into_it():
    """``y - mean(y)``: the sub has the reduction's input shape and reads a group member, but
    needs the finished mean: it is no part of the reduction kernel (a pointwise group of its
    own with the multiply after it)."""
    gm, _ = graph_of(_Center(), (torch.randn(2, 4, 8),), annotated(Fuse()))
    check_graph(gm, """
        CHECK: aten.mul.Tensor(%x, 2.0)
        CHECK-SAME: group=reduction_0
        CHECK-NEXT: aten.mean.dim(%mul, [1], True)
        CHECK-SAME: kernel={id:reduction_0,kind:reduction,nodes:2,
        CHECK-NEXT: aten.sub.Tensor(%mul, %mean)
        CHECK-NOT: reduction_0
        CHECK-SAME: group=pointwise_1
    """)


def test_a_sum_over_the_last_dim_is_no_reduction_root():
    """Only dim -2 is a reduction kernel's axis: over the last dim the pointwise producers
    are a pointwise group of their own and the sum is left to ATen."""
    gm, _ = graph_of(_Reduce(2), (torch.randn(2, 4, 8),), annotated(Fuse()))
    check_graph(gm, """
        CHECK-NOT: reduction_
        CHECK: aten.add.Tensor
        CHECK-SAME: group=pointwise_0
        CHECK-NEXT: aten.sum.dim_IntList({{%\\w+}}, [2])
        CHECK-NOT: group=
        CHECK-SAME: kind=reduction
        CHECK-NEXT: aten.relu.default
    """)


class _TwoReads(nn.Module):
    """A chain whose middle value is read outside it as well: fused whole it writes two
    outputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.sigmoid(x * 2.0)
        b = torch.tanh(a) + 1.0
        return a.logsumexp(-1).sum() + b.logsumexp(-1).sum()


def test_max_outputs_bounds_what_a_group_writes():
    gm, _ = graph_of(_TwoReads(), (torch.randn(4, 8),), annotated(Fuse()))
    check_graph(gm, """
        CHECK: aten.tanh.default
        CHECK-SAME: group=pointwise_0
        CHECK: aten.add.Tensor
        CHECK-SAME: outputs:['sigmoid', 'add']
    """)
    gm, _ = graph_of(_TwoReads(), (torch.randn(4, 8),), annotated(Fuse(max_outputs=1)))
    check_graph(gm, """
        CHECK: aten.sigmoid.default
        CHECK-SAME: outputs:['sigmoid']
        CHECK-NEXT: aten.tanh.default
        CHECK-SAME: group=pointwise_1
        CHECK-NEXT: aten.add.Tensor
        CHECK-SAME: outputs:['add']
    """)
