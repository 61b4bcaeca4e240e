"""The solver's arithmetic is the step model's: evaluate == predict_step, and the CP-SAT
model's all-to-all forms reproduce collective_time."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from gemc.cost_model.collectives import collective_time
from gemc.cost_model.step_model import StepOptions

from gemc.solver.candidates import AllToAll, dense_choices, table_options
from gemc.solver.evaluate import evaluate
from gemc.solver.problem import Assignment, TableChoice, predict
from tests.solver.synth import make_problem


def random_assignment(p, rng: random.Random) -> Assignment:
    a = Assignment()
    for r in p.regions:
        a.dense[r.name] = rng.choice(dense_choices(p, r))
    for t in p.tables:
        o = rng.choice(table_options(p, t))
        if o.uniform:
            ranks = tuple(range(p.world))
        else:
            starts = sorted(rng.sample(range(0, p.world, o.width), o.pieces))
            ranks = tuple(r for s in starts for r in range(s, s + o.width))
        a.tables[t.fqn] = TableChoice(o.sharding, ranks, o.grid)
    return a


@pytest.mark.parametrize("topology", ["h200:1x1", "h200:1x4", "h200:2x8", "h200:8x8",
                                      "h100:3x4"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_evaluate_equals_predict_step(topology, seed):
    opts = StepOptions(pipeline_sparse=seed != 1)  # also the exposed id all-to-all
    p = make_problem(topology, n_tables=8, seed=seed, options=opts)
    # every other table a plain (unpooled) lookup, as a sequence's item table
    p = replace(p, tables=tuple(replace(t, pooled=i % 2 == 0) for i, t in enumerate(p.tables)))
    a = random_assignment(p, random.Random(seed))
    ev, ref = evaluate(p, a), predict(p, a)
    assert ev.step_s == pytest.approx(ref.step_s, rel=1e-9)
    for k, v in ref.breakdown.items():
        assert ev.breakdown[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    np.testing.assert_allclose(ev.memory, [r.memory_bytes for r in ref.per_rank], rtol=1e-9)


@pytest.mark.parametrize("topology", ["h200:1x8", "h200:4x8", "h100:3x4", "a100:2x8"])
def test_all_to_all_forms_match_collective_time(topology):
    p = make_problem(topology)
    a2a = AllToAll.of(p)
    rng = np.random.default_rng(0)
    for _ in range(5):
        out = rng.uniform(0, 1e9, p.world) * (rng.uniform(size=p.world) < 0.5)
        if not out.any():
            continue
        ref = collective_time("all_to_all", 0, range(p.world), p.topology, send_bytes=out)
        assert a2a.time(out) == pytest.approx(ref, rel=1e-12)
