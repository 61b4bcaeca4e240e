from collections import defaultdict

from gemc import ir
from gemc.api import load_model
from tests.conftest import TOY, check_golden
from tests.passes.filecheck import check_graph
from tests.passes.helpers import annotated, dump_after, graph_of, run_until
from tests.passes.recsys_model import Recsys, inputs


def test_assign_regions_golden_dump():
    check_golden("assign_regions.txt", dump_after("assign-regions"))


def test_parameters_per_region_match_the_module_tree():
    for func in ("build", "build_attention"):
        gm = run_until("assign-regions", func)
        spec = load_model(f"{TOY}:{func}")
        by_region = defaultdict(int)
        for node in gm.graph.nodes:
            if ir.PARAM in node.meta:
                by_region[node.meta[ir.REGION]] += node.meta["val"].numel()
        expected = {
            name: sum(p.numel() for p in child.parameters())
            for name, child in spec.model.named_children()
        }
        assert dict(by_region) == expected
        compute = [n for n in gm.graph.nodes if n.op == "call_function"]
        assert all(n.meta[ir.REGION] in {*expected, ""} for n in compute)


def test_a_node_belongs_to_its_outermost_module_on_a_small_model():
    """``tower.up`` and ``tower.norm`` are one region, ``tower``; what the root's forward
    does itself (the add of the lookups, the view, the loss) is the root region ""."""
    gm, _ = graph_of(Recsys(), inputs(), annotated())
    check_graph(gm, """
        CHECK: %p_tower_up_weight = input
        CHECK-SAME: region=tower}
        CHECK: aten.embedding_bag.padding_idx(
        CHECK-SAME: region=bag table=
        CHECK: aten.add.Tensor(
        CHECK-SAME: region=}
        CHECK-NEXT: aten.linear.default(
        CHECK-SAME: region=tower}
        CHECK-NEXT: aten.gelu.default(
        CHECK-SAME: region=tower}
        CHECK-NEXT: aten.layer_norm.default(
        CHECK-SAME: region=tower}
        CHECK-NEXT: aten.linear.default(
        CHECK-SAME: region=head}
        CHECK-NEXT: aten.view.default(
        CHECK-SAME: region=}
    """)
