from collections import defaultdict

from gemc import ir
from gemc.api import load_model
from tests.conftest import TOY, check_golden
from tests.passes.helpers import dump_after, run_until


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
