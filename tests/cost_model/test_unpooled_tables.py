"""A plain lookup (nn.Embedding over a sequence) sharded by rows returns each id's row to
the asking rank alone; a pooled bag's row shard returns a partial sum for every bag."""

from gemc.cost_model.memory import table_memory
from gemc.cost_model.types import StepOptions, TableCost
from hypothesis import given
from hypothesis import strategies as st


@given(world=st.integers(2, 64), batch=st.integers(1, 4096), dim=st.sampled_from([16, 64, 256]))
def test_row_sharded_lookup_returns_only_its_share(world, batch, dim):
    ranks = tuple(range(world))
    pooled = TableCost(
        "t", rows=10**6, dim=dim, nnz=batch, batch=batch, sharding="row_wise", ranks=ranks
    )
    plain = TableCost(
        "t",
        rows=10**6,
        dim=dim,
        nnz=batch,
        batch=batch,
        sharding="row_wise",
        ranks=ranks,
        pooled=False,
    )
    opts = StepOptions()
    act_pooled = table_memory(pooled, 0, world, opts).activations
    act_plain = table_memory(plain, 0, world, opts).activations
    assert abs(act_plain * world - act_pooled) <= 1e-6 * act_pooled


def test_table_wise_lookup_is_priced_like_a_bag():
    a = TableCost("t", rows=1000, dim=64, nnz=100, batch=100)
    b = TableCost("t", rows=1000, dim=64, nnz=100, batch=100, pooled=False)
    assert table_memory(a, 0, 8, StepOptions()).total == table_memory(b, 0, 8, StepOptions()).total
