from gemc import ir
from gemc.api import load_model
from tests.conftest import TOY, check_golden
from tests.passes.helpers import dump_after, run_until


def test_collect_tables_golden_dump():
    check_golden("collect_tables.txt", dump_after("collect-tables"))


def test_table_facts_match_the_module_and_the_batch():
    gm = run_until("collect-tables")
    spec = load_model(f"{TOY}:build")
    facts = [n.meta[ir.TABLE] for n in gm.graph.nodes if ir.TABLE in n.meta]
    assert len(facts) == 1
    weight = spec.model.table.weight
    ids, offsets = spec.example_inputs[1], spec.example_inputs[2]
    assert facts[0] == {
        "fqn": "table.weight",
        "rows": weight.shape[0],
        "dim": weight.shape[1],
        "nnz": ids.numel(),
        "batch": offsets.numel() - 1,
        "mode": "sum",
        "weighted": False,
    }
