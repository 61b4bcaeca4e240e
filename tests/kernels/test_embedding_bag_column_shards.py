"""BatchedEmbeddingBag's two-phase row-wise Adagrad for column shards (``split_rows``):
shards of one table's columns, each in its own module beside other tables, updated with the
squares summed over the shards, must move exactly as the whole table does in one module."""

from __future__ import annotations

import pytest
import torch
from gemc.backends.triton.embedding_bag import BatchedEmbeddingBag
from kernel_helpers import fresh_generator, offsets_of, randn

TOL = {"atol": 1e-5, "rtol": 1e-5}
ROWS, DIM, SPLIT, OTHER = 13, 12, (4, 8), (7, 6)  # the split table; a whole table beside it


def _bags(rows: int, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    lengths = torch.randint(0, 5, (batch,), generator=gen).tolist()
    ids = torch.randint(0, rows, (sum(lengths),), generator=gen)  # duplicates: small table
    return ids, lengths


def _module(tables, weight_decay: float) -> BatchedEmbeddingBag:
    return BatchedEmbeddingBag(tables, optimizer="rowwise_adagrad", lr=0.3, eps=1e-6,
                               weight_decay=weight_decay)


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_column_shards_update_as_the_whole_table(weight_decay: float) -> None:
    gen = fresh_generator()
    batch = 6
    whole = _module([(ROWS, DIM)], weight_decay)
    full = torch.randn(ROWS, DIM, generator=gen)
    other = torch.randn(*OTHER, generator=gen)
    whole.load_weights([full])
    # shard 0 holds the split table second (after another table), shard 1 first: the heads'
    # slice of the split table sits at another offset of each launch's sorted ids
    shard0 = _module([OTHER, (ROWS, SPLIT[0])], weight_decay)
    shard1 = _module([(ROWS, SPLIT[1])], weight_decay)
    shard0.load_weights([other, full[:, :SPLIT[0]]])
    shard1.load_weights([full[:, SPLIT[0]:]])
    shard0.split_rows({1: DIM})
    shard1.split_rows({0: DIM})
    for _ in range(3):
        ids, lengths = _bags(ROWS, batch, gen)
        other_ids, other_lengths = _bags(OTHER[0], batch, gen)
        grad = torch.randn(batch, DIM, generator=gen)
        other_grad = torch.randn(batch, OTHER[1], generator=gen)

        out = whole(ids, offsets_of(lengths, torch.int64))
        out.backward(grad)
        expected = whole.split_weights()[0].clone()

        # shard 0's launch lists the split table first, as the owners' lookup may
        out0 = shard0(torch.cat([ids, other_ids]), offsets_of(lengths + other_lengths,
                                                              torch.int64),
                      tables=[1, 0], id_counts=[ids.numel(), other_ids.numel()])
        out0.backward(torch.cat([grad[:, :SPLIT[0]], other_grad], dim=1))
        out1 = shard1(ids, offsets_of(lengths, torch.int64), id_counts=[ids.numel()])
        out1.backward(grad[:, SPLIT[0]:])
        torch.testing.assert_close(torch.cat([out0[:, :SPLIT[0]], out1], 1), out.detach(),
                                   **TOL)
        # nothing moves before the squares are summed
        torch.testing.assert_close(shard1.split_weights()[0], full[:, SPLIT[0]:])
        (a,), (b,) = shard0.pending_squares(1), shard1.pending_squares(0)
        assert a.shape == b.shape == (ids.numel(),)
        total = a + b
        a.copy_(total)
        b.copy_(total)
        shard0.apply_pending()
        shard1.apply_pending()
        assert not shard0.pending and not shard1.pending
        got = torch.cat([shard0.split_weights()[1], shard1.split_weights()[0]], dim=1)
        torch.testing.assert_close(got, expected, **TOL)
        torch.testing.assert_close(shard0.split_optimizer_state()[1]["sum"],
                                   whole.split_optimizer_state()[0]["sum"], **TOL)
        torch.testing.assert_close(shard1.split_optimizer_state()[0]["sum"],
                                   whole.split_optimizer_state()[0]["sum"], **TOL)
        full = expected


def test_a_table_of_split_rows_needs_its_id_counts_and_row_wise_adagrad() -> None:
    m = _module([(ROWS, SPLIT[0])], 0.0)
    m.split_rows({0: DIM})
    ids = torch.tensor([1, 2, 2])
    with pytest.raises(ValueError, match="id_counts"):
        m(ids, offsets_of([3], torch.int64))
    with pytest.raises(ValueError, match="full width"):
        m.split_rows({0: SPLIT[0] - 1})
    adam = BatchedEmbeddingBag([(ROWS, SPLIT[0])], optimizer="adam")
    with pytest.raises(ValueError, match="row-wise Adagrad"):
        adam.split_rows({0: DIM})


def test_without_split_tables_the_update_is_one_pass_in_the_backward() -> None:
    m = _module([(ROWS, DIM)], 0.0)
    before = m.split_weights()[0].clone()
    m(torch.tensor([1, 2]), offsets_of([2], torch.int64)).sum().backward()
    assert not m.pending
    assert not torch.equal(before, m.split_weights()[0])


def test_each_split_tables_squares_come_from_the_launches_that_looked_it_up() -> None:
    """Two split tables looked up in two launches (different bag counts, as the owners'
    lookup groups them): each table's squares are the one view of its own launch."""
    m = _module([(ROWS, SPLIT[0]), (ROWS, SPLIT[1])], 0.0)
    m.split_rows({0: DIM, 1: DIM})
    a = m(torch.tensor([1, 2, 2]), offsets_of([3], torch.int64), tables=[0], id_counts=[3])
    b = m(torch.tensor([4, 5]), offsets_of([1, 1], torch.int64), tables=[1], id_counts=[2])
    (a.sum() + b.sum()).backward()
    assert len(m.pending) == 2
    (first,), (second,) = m.pending_squares(0), m.pending_squares(1)
    assert first.shape == (3,) and second.shape == (2,)
    assert first[0] > 0 and first[1] > 0 and first[2] == 0  # row 2's run head only
    m.apply_pending()
    assert not m.pending and m.pending_squares(0) == []


def test_a_whole_row_in_two_phases_moves_as_in_one_pass_and_as_eager() -> None:
    """A shard that is the whole row (``split_rows`` with its own width: the squares summed
    over that one shard) against the one-pass update of the same table and against eager
    PyTorch (``F.embedding_bag``'s gradient, the reference row-wise Adagrad), two steps,
    rows hit several times in one bag and across bags. Under ``GEMC_TEST_DEVICE=cuda`` the
    batch is one where the accumulator's read-after-write race showed on a GPU (0.3-1% of
    the rows off: test_embedding_bag_state_race)."""
    from gemc.backends.triton.embedding_bag_reference import (
        pooled_lookup_reference,
        rowwise_adagrad_step_,
        touched_rows,
    )

    gen = fresh_generator()
    device = torch.get_default_device()  # drawn on the CPU, moved there (kernel_helpers)
    cuda = device.type == "cuda"
    rows, dim, batch, pooling = (50_000, 128, 1024, 50) if cuda else (24, 128, 12, 4)
    one, two = _module([(rows, dim)], 0.0), _module([(rows, dim)], 0.0)
    ref = randn(rows, dim, gen=gen)
    one.load_weights([ref])
    two.load_weights([ref])
    two.split_rows({0: dim})
    state = torch.zeros(rows)
    for _ in range(2):
        ids = torch.randint(0, rows, (batch * pooling,), generator=gen, device="cpu").to(device)
        offsets = offsets_of([pooling] * batch, torch.int64)
        grad = randn(batch, dim, gen=gen)
        one(ids, offsets).backward(grad)
        two(ids, offsets, id_counts=[ids.numel()]).backward(grad)
        two.apply_pending()
        w = ref.clone().requires_grad_()
        pooled_lookup_reference([w], ids, offsets).backward(grad)
        rowwise_adagrad_step_(ref, w.grad, state, touched_rows(ids, offsets, 1)[0],
                              lr=one.lr, eps=one.eps)
        for m in (one, two):
            torch.testing.assert_close(m.split_weights()[0], ref, **TOL)
            torch.testing.assert_close(m.split_optimizer_state()[0]["sum"], state, **TOL)
