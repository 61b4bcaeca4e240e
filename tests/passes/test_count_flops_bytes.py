import torch
from torch.utils.flop_counter import FlopCounterMode

from gemc import ir
from gemc.api import load_model
from gemc.ir import OpKind
from tests.conftest import TOY, check_golden
from tests.passes.filecheck import check_graph
from tests.passes.helpers import annotated, dump_after, graph_of, run_until
from tests.passes.recsys_model import Recsys, inputs


def test_count_flops_bytes_golden_dump():
    check_golden("count_flops_bytes.txt", dump_after("count-flops-bytes"))


def _flops(gm, kind) -> int:
    return sum(n.meta[ir.FLOPS] for n in gm.graph.nodes if ir.kind_of(n) is kind)


def test_gemm_flops_match_torch_flop_counter():
    for func in ("build", "build_attention"):
        gm = run_until("count-flops-bytes", func)
        spec = load_model(f"{TOY}:{func}", device="cpu")
        batch = spec.make_batch(int(torch.randint(0, 1000, ())), "cpu")
        counter = FlopCounterMode(display=False)
        with counter:
            spec.model(*batch)
        counted = sum(
            v for op, v in counter.get_flop_counts()["Global"].items() if "bmm" not in str(op)
        )
        # torch counts a Linear's bias add nowhere, and neither do we.
        assert _flops(gm, OpKind.GEMM) == counted, func


def test_attention_flops_match_its_two_gemms_counted_by_torch():
    gm = run_until("count-flops-bytes", "build_attention")
    node = next(n for n in gm.graph.nodes if ir.kind_of(n) is OpKind.ATTENTION)
    q, k, v = (torch.randn(a.meta["val"].shape) for a in node.args[:3])
    counter = FlopCounterMode(display=False)
    with counter:
        torch.softmax(q @ k.transpose(-1, -2), -1) @ v
    assert node.meta[ir.FLOPS] == counter.get_total_flops()


def test_bytes_of_a_pointwise_op_are_inputs_plus_output():
    gm = run_until("count-flops-bytes")
    gelu = next(n for n in gm.graph.nodes if "gelu" in str(n.target))
    assert gelu.meta[ir.BYTES] == 2 * gelu.meta["val"].numel() * 4
    views = [n for n in gm.graph.nodes if ir.kind_of(n) is OpKind.VIEW]
    assert views and all(n.meta[ir.BYTES] == 0 and n.meta[ir.FLOPS] == 0 for n in views)


def test_a_gemm_and_a_view_on_a_small_model():
    """A Linear [3, 8] x [8, 16]: 2 m n k FLOPs; bytes: input, weight, bias and output in
    fp32. A view moves nothing."""
    gm, _ = graph_of(Recsys(), inputs(), annotated())
    check_graph(gm, f"""
        CHECK: aten.linear.default(%add, %p_tower_up_weight
        CHECK-SAME: bytes={4 * (3 * 8 + 16 * 8 + 16 + 3 * 16)} flops={2 * 3 * 16 * 8}
        CHECK: aten.view.default(
        CHECK-SAME: bytes=0 flops=0
    """)
