import pytest
import torch

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


class _TiedOutput(torch.nn.Module):
    """A bag table whose weight the output layer shares (weight tying), tied either way."""

    def __init__(self, table_owns: bool) -> None:
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(64, 8, mode="sum")
        self.out = torch.nn.Linear(8, 64, bias=False)
        if table_owns:
            self.out.weight = self.emb.weight
        else:
            self.emb.weight = self.out.weight

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids, offsets)).logsumexp(-1).sum()


@pytest.mark.parametrize("table_owns", [True, False])
def test_a_tied_table_stays_a_dense_parameter(table_owns: bool) -> None:
    """The runner shards a table by swapping its module: the other name of a tied weight
    would keep the old tensor. Whichever name export keeps, the weight is no table."""
    gm, ctx = graph_of(_TiedOutput(table_owns), (torch.randint(0, 64, (12,)),
                                                 torch.arange(0, 12, 3)), annotated())
    assert not any(ir.TABLE in n.meta for n in gm.graph.nodes)
    assert any("is tied to" in w and "stays a dense parameter" in w for w in ctx.warnings)


class _Penalised(torch.nn.Module):
    """A table looked up by its module and also read whole (an L2 penalty on it)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(20, 4)
        self.free = torch.nn.Embedding(20, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        loss = (self.emb(ids) * self.free(ids)).sum()
        return loss + 1e-3 * self.emb.weight.square().sum()


def test_a_table_read_outside_its_lookups_is_marked_replicated() -> None:
    gm, ctx = graph_of(_Penalised(), (torch.randint(0, 20, (6,)),), annotated())
    facts = {n.meta[ir.TABLE]["fqn"]: n.meta[ir.TABLE] for n in gm.graph.nodes
             if ir.TABLE in n.meta}
    assert set(facts) == {"emb.weight", "free.weight"}
    assert facts["emb.weight"]["replicated"][0].startswith("read at ")
    assert "test_collect_tables.py:" in facts["emb.weight"]["replicated"][0]
    assert "replicated" not in facts["free.weight"]
    assert any("'emb.weight' is also read outside its lookups" in w for w in ctx.warnings)
