import torch
from gemc.passes.classify_ops import ClassifyOps

from gemc import ir
from gemc.ir import OpKind
from tests.conftest import check_golden
from tests.passes.filecheck import check_graph
from tests.passes.helpers import dump_after, graph_of, run_until
from tests.passes.recsys_model import Recsys, inputs


def test_classify_ops_golden_dump():
    check_golden("classify_ops.txt", dump_after("classify-ops"))


def test_every_node_has_a_known_kind_and_gemm_shapes_match_operands():
    gm = run_until("classify-ops", "build_attention")
    kinds = [ir.kind_of(n) for n in gm.graph.nodes]
    assert None not in kinds
    assert OpKind.ATTENTION in kinds and OpKind.GEMM in kinds
    for node in gm.graph.nodes:
        if ir.kind_of(node) is OpKind.GEMM:
            p = node.meta[ir.GEMM]
            x, w = (a.meta["val"] for a in node.args[:2])
            assert p["k"] == x.shape[-1] == w.shape[1]
            assert p["m"] * p["n"] == node.meta["val"].numel()
        if ir.kind_of(node) is OpKind.ATTENTION:
            a = node.meta[ir.ATTENTION]
            assert (a["batch"], a["heads"], a["q_len"], a["kv_len"], a["head_dim"]) == (
                3,
                2,
                6,
                6,
                8,
            )
            assert a["masked"] and not a["causal"]


def test_unknown_op_is_kept_and_named_in_a_warning():
    from gemc.passes.classify_ops import ClassifyOps

    from gemc.context import PassContext

    class Odd(torch.nn.Module):
        def forward(self, x):
            return torch.linalg.det(x).sum()

    ep = torch.export.export(Odd(), (torch.randn(2, 3, 3),), strict=False)
    ctx = PassContext()
    gm, _ = ClassifyOps().run(ep.graph_module, ctx)
    det = [n for n in gm.graph.nodes if "det" in str(n.target)]
    assert det and ir.kind_of(det[0]) is OpKind.OTHER
    assert any("linalg_det" in w for w in ctx.warnings)


def test_losses_as_export_spells_them_are_losses():
    """``F.cross_entropy`` reaches the graph as ``aten.cross_entropy_loss`` (not decomposed
    at export): a loss, priced as one, with no unknown-op warning."""
    from gemc.passes.classify_ops import ClassifyOps

    from gemc.context import PassContext

    class NextItem(torch.nn.Module):
        def forward(self, logits, target):
            return torch.nn.functional.cross_entropy(logits, target)

    ep = torch.export.export(NextItem(), (torch.randn(4, 7), torch.randint(0, 7, (4,))),
                             strict=False)
    ctx = PassContext()
    gm, _ = ClassifyOps().run(ep.graph_module, ctx)
    losses = [n for n in gm.graph.nodes if ir.kind_of(n) is OpKind.LOSS]
    assert losses and not ctx.warnings, ([str(n.target) for n in gm.graph.nodes], ctx.warnings)


def test_an_activation_torch_leaves_untagged_is_still_pointwise(monkeypatch):
    """torch 2.11 exports ``leaky_relu`` without ATen's ``pointwise`` tag (2.13 has it): the
    op is still one element in, one element out, for classify-ops and for the padding
    follower; an untagged op outside the known activations stays unknown."""
    from gemc.passes.classify_ops import classify
    from torch import fx

    from gemc.fusion_spec import elementwise

    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    act = g.call_function(aten.leaky_relu.default, (x, 0.1))
    other = g.call_function(aten.cumsum.default, (x, 0))
    monkeypatch.setattr(aten.leaky_relu.default, "_tags", [])
    assert torch.Tag.pointwise not in aten.leaky_relu.default.tags
    assert classify(act) is OpKind.POINTWISE and elementwise(act)
    assert classify(other) is not OpKind.POINTWISE and not elementwise(other)


def test_each_op_kind_on_a_small_model():
    """Intent in a few dump lines (the golden above holds the whole graph)."""
    gm, ctx = graph_of(Recsys(), inputs(), [ClassifyOps()])
    check_graph(gm, """
        CHECK: %p_bag_weight = input
        CHECK-SAME: kind=param
        CHECK: %ids = input
        CHECK-SAME: kind=input
        CHECK: aten.embedding_bag.padding_idx(
        CHECK-SAME: kind=embedding
        CHECK-NEXT: getitem(
        CHECK-SAME: kind=view
        CHECK: aten.embedding.default(%p_emb_weight, %tokens)
        CHECK-SAME: kind=embedding
        CHECK-NEXT: aten.sum.dim_IntList(
        CHECK-SAME: kind=reduction
        CHECK-NEXT: aten.add.Tensor(
        CHECK-SAME: kind=pointwise
        CHECK-NEXT: aten.linear.default(
        CHECK-SAME: gemm={batch:1,m:3,n:16,k:8} kind=gemm
        CHECK-NEXT: aten.gelu.default(
        CHECK-SAME: kind=pointwise
        CHECK-NEXT: aten.layer_norm.default(
        CHECK-SAME: kind=norm
        CHECK-NEXT: aten.linear.default(
        CHECK-SAME: gemm={batch:1,m:3,n:1,k:16} kind=gemm
        CHECK-NEXT: aten.view.default(
        CHECK-SAME: kind=view
        CHECK-NEXT: aten.binary_cross_entropy_with_logits.default(
        CHECK-SAME: kind=loss
        CHECK-NEXT: return
        CHECK-SAME: kind=output
    """)
    assert not ctx.warnings


def test_python_mask_operators_are_pointwise_not_unknown():
    """``a & b`` on bool masks exports as ``aten.__and__`` (untagged on every torch here)."""
    from gemc.fusion_spec import pointwise_op

    aten = torch.ops.aten
    for op in (aten.__and__.Tensor, aten.__or__.Tensor, aten.__xor__.Tensor,
               aten.bitwise_and.Tensor):
        assert pointwise_op(op), op
    assert not pointwise_op(aten.mm.default)


class _ConvFeedForward(torch.nn.Module):
    """SASRec's point-wise feed-forward as its authors write it (channels first, kernel 1),
    a grouped 3-tap convolution, a transposed one and a 2-D one."""

    def __init__(self) -> None:
        super().__init__()
        self.ff = torch.nn.Sequential(torch.nn.Conv1d(8, 8, 1), torch.nn.ReLU(),
                                      torch.nn.Conv1d(8, 16, 3, padding=1, groups=2))
        self.up = torch.nn.ConvTranspose1d(16, 4, 2, groups=2)
        self.c2 = torch.nn.Conv2d(4, 6, (1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up(self.ff(x.transpose(1, 2)))
        return self.c2(y.unsqueeze(-1).expand(-1, -1, -1, 3)).sum()


def test_convolutions_are_implicit_gemms_with_their_problem_shape():
    """A convolution is no op of unknown kind (priced by bytes, no FLOPs): per group, batch
    x output positions rows, the group's output channels, in-channels x taps contracted."""
    gm, ctx = graph_of(_ConvFeedForward(), [torch.randn(2, 5, 8)], [ClassifyOps()])
    check_graph(gm, """
        CHECK: aten.conv1d.default(
        CHECK-SAME: gemm={batch:1,m:10,n:8,k:8} kind=gemm
        CHECK: aten.conv1d.default(
        CHECK-SAME: gemm={batch:2,m:10,n:8,k:12} kind=gemm
        CHECK: aten.conv_transpose1d.default(
        CHECK-SAME: gemm={batch:2,m:12,n:2,k:16} kind=gemm
        CHECK: aten.conv2d.default(
        CHECK-SAME: gemm={batch:1,m:24,n:6,k:8} kind=gemm
    """)
    assert not [w for w in ctx.warnings if "unknown kind" in w], ctx.warnings
