from gemc import ir
from gemc.api import load_model
from tests.conftest import TOY, check_golden
from tests.passes.filecheck import check_graph
from tests.passes.helpers import annotated, dump_after, graph_of, run_until
from tests.passes.recsys_model import Recsys, inputs


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


def test_bag_and_plain_lookups_on_a_small_model():
    """A pooled bag's batch is its bags; a plain embedding's every id is a row of output."""
    gm, _ = graph_of(Recsys(), inputs(), annotated())
    check_graph(gm, """
        CHECK-NOT: table=
        CHECK: aten.embedding_bag.padding_idx(%p_bag_weight
        CHECK-SAME: table={fqn:bag.weight,rows:50,dim:8,nnz:10,batch:3,mode:mean,weighted:False}
        CHECK-NOT: table=
        CHECK: aten.embedding.default(%p_emb_weight
        CHECK-SAME: table={fqn:emb.weight,rows:30,dim:8,nnz:15,batch:15,mode:none,weighted:False}
        CHECK-NOT: table=
    """)
