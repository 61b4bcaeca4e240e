"""The local searches' fast paths (issue 19's planning time) compute what the general
paths do, to the bit: a table on a few ranks added by scalar adds, one-rank pieces in the
packer, the id all-to-all remembered, the options shared between searches. A plan that
changed with one of them would be a plan that changed for speed alone."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gemc.solver import evaluate as evaluate_mod
from gemc.solver.evaluate import Pricer, add_table, table_loads
from gemc.solver.expand import Packer
from gemc.solver.greedy import greedy
from gemc.solver.local_search import (
    balance,
    cap_memory,
    improve,
    shared_options,
    spread_sends,
)
from gemc.solver.problem import TableChoice
from tests.solver.synth import make_problem


def _loads_after(p, pricer, ops):
    loads = table_loads(p, {t.fqn: TableChoice("table_wise", (0,)) for t in p.tables}, pricer)
    for o, ranks, sign in ops:
        add_table(loads, o, ranks, sign)
    return loads


def test_scalar_adds_equal_add_at_to_the_bit(monkeypatch):
    """Random adds and takes, a rank listed twice among them: the scalar path (up to
    ``SCALAR_RANKS`` ranks) leaves exactly the arrays ``np.add.at`` leaves."""
    p = make_problem("h200:2x4", n_tables=6, seed=4)
    pricer = Pricer(p)
    rng = random.Random(0)
    ops = []
    for _ in range(200):
        t = rng.choice(p.tables)
        ranks = tuple(rng.randrange(p.world) for _ in range(rng.randint(1, 4)))
        o = pricer.table(t, TableChoice("column_wise", ranks))
        ops.append((o, ranks, rng.choice((1, -1))))
    fast = _loads_after(p, pricer, ops)
    monkeypatch.setattr(evaluate_mod, "SCALAR_RANKS", 0)
    slow = _loads_after(p, pricer, ops)
    for name in ("sparse", "out", "mem", "shards", "kernel_s", "kernel_shards"):
        assert np.array_equal(getattr(fast, name), getattr(slow, name)), name
    assert (fast.dp_grad, fast.dp_numel, fast.ids) == (slow.dp_grad, slow.dp_numel, slow.ids)


@pytest.mark.parametrize("topology,seed", [("h200:2x4", 1), ("h200:4x8", 2)])
def test_searches_plan_the_same_without_the_scalar_adds(monkeypatch, topology, seed):
    """The step, balance, cap and sends searches end in the same tables whether a table's
    few ranks are added by scalars or by ``np.add.at``."""
    p = make_problem(topology, n_tables=12, seed=seed)

    def plans():
        pricer = Pricer(p)
        a = improve(p, pricer, greedy(p, pricer))
        return [a.tables, balance(p, pricer, a, 0.1).tables,
                cap_memory(p, pricer, a, 1.1, penalty=0.05).tables,
                spread_sends(p, pricer, a).tables]

    fast = plans()
    monkeypatch.setattr(evaluate_mod, "SCALAR_RANKS", 0)
    assert plans() == fast


def test_one_rank_piece_adds_what_a_wider_one_adds_per_rank():
    """A one-rank piece (the scalar path) and the same piece's bytes on a two-rank
    window (the slice path) add the same per rank and per host, and taking it away undoes it."""
    p = make_problem("h200:2x4", n_tables=3, seed=5)
    pricer = Pricer(p)
    t = p.tables[0]
    one = pricer.table(t, TableChoice("table_wise", (5,)))
    pack = Packer(p, pricer, 0.0)
    pack.add(one, 5)
    assert pack.comp[5] == one.compute_s and pack.mem[5] == one.memory
    assert pack.out[5] == one.out_bytes and pack.host[1] == one.out_bytes
    assert pack.kshards[5] == int(one.in_kernel) and pack.kern[5] == one.kernel_s
    assert np.count_nonzero(pack.mem) == 1 and np.count_nonzero(pack.host) == 1
    pack.add(one, 5, -1)
    assert not pack.mem.any() and not pack.host.any() and not pack.kshards.any()


def test_id_exchange_remembered_is_the_all_to_all_price():
    p = make_problem("h200:2x4", n_tables=3, seed=6)
    pricer = Pricer(p)
    for b in (0.0, 1.0, 3e5, 7.25e7):
        assert pricer.id_exchange_s(b) == pricer.a2a.even(b)
        assert pricer.id_exchange_s(b) == pricer.a2a.even(b)  # from the memo now
    assert len(pricer._ids) == 4


def test_searches_share_the_pricers_options_and_plan_as_with_a_fresh_one():
    """The cap search run with options the step search already priced plans exactly as
    one with a fresh pricer; a pricer of another problem lends none."""
    p = make_problem("h200:2x4", n_tables=10, seed=7)
    shared = Pricer(p)
    a = improve(p, shared, greedy(p, shared))
    assert shared.option_lists
    priced = dict(shared.option_lists)
    b = cap_memory(p, shared, a, 1.1)
    assert shared.option_lists == priced  # nothing priced twice
    assert b.tables == cap_memory(p, Pricer(p), a, 1.1).tables
    other = make_problem("h200:1x8", n_tables=10, seed=7)
    assert shared_options(other, shared) is not shared.option_lists


def test_taking_a_zero_buffer_leaves_the_moments_without_a_rescan(monkeypatch):
    """A shard with no optimizer buffer (the owners' fused lookup: ``grad_moment`` 0) taken
    off rescans no rank (a rank's largest buffer cannot fall below 0), and leaves every
    rank's largest buffer what a fresh count of the remaining shards gives."""
    p = make_problem("h200:2x4", n_tables=6, seed=5)
    pricer = Pricer(p)
    opts = [pricer.table(t, TableChoice(s, r)) for t in p.tables
            for s, r in (("table_wise", (1,)), ("row_wise", tuple(range(p.world))))]
    zero = [o for o in opts if o.grad_moment == 0]
    assert zero, "the synthetic tables should run fused on several ranks"
    ops = [(o, r, 1) for o, r in zip(opts, [(1,), None] * len(p.tables), strict=True)]
    loads = _loads_after(p, pricer, ops)
    refreshed = []
    monkeypatch.setattr(evaluate_mod, "_refresh_moment",
                        lambda loads, r: refreshed.append(r))
    for o, r, _ in ops:
        if o.grad_moment == 0:
            add_table(loads, o, r, -1)
    assert refreshed == []
    monkeypatch.undo()
    left = [(o, r, 1) for o, r, _ in ops if o.grad_moment != 0]
    assert np.array_equal(loads.moment, _loads_after(p, pricer, left).moment)
