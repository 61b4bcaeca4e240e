"""One object per dense strategy (gemc.sharding.DenseStrategy): the choices the solver
offers, the memory and communication the cost model prices and what the runner accepts
follow the object's fields, not the strategy's name."""

from __future__ import annotations

import dataclasses

import pytest
from gemc.backends.torch.dense import TensorParallelNotSupported, check_strategies
from gemc.backends.torch.graph_mode import check_graph_mode
from gemc.cost_model.memory import region_memory, shard_degree
from gemc.cost_model.step_model import dense_comm
from gemc.cost_model.topology import parse_topology
from gemc.cost_model.types import RegionCost, StepOptions

from gemc.errors import PlanError
from gemc.sharding import (
    DENSE,
    DENSE_DECLARED,
    DENSE_STRATEGIES,
    DenseStrategy,
    dense_strategy,
    runner_executes,
)
from gemc.solver.candidates import dense_choices
from gemc.solver.problem import DenseChoice, Problem, SolverSettings

MLP = RegionCost("mlp", 10**6, 1e12, 5e-3, activation_bytes=10**9, boundary_bytes=10**7)


def _choices(topology: str, graph_mode: bool = False, **settings: bool
             ) -> list[tuple[str, int]]:
    problem = Problem((MLP,), (), parse_topology(topology), graph_mode=graph_mode,
                      settings=SolverSettings(allow_checkpoint=False, **settings))
    return [(c.strategy, c.shard_group) for c in dense_choices(problem, MLP)]


def test_the_solver_offers_each_strategys_shard_groups_in_declaration_order() -> None:
    # by default only what the runner executes (tensor parallel it refuses)
    assert _choices("h200:2x8") == [("ddp", 0), ("fsdp", 0), ("hsdp", 8)]
    assert _choices("h200:1x4") == [("ddp", 0), ("fsdp", 0)]
    assert _choices("h200:1x1") == [("ddp", 0)]
    # the rest only where the settings admit it
    assert _choices("h200:2x8", runner_only=False) == [
        ("ddp", 0), ("fsdp", 0), ("hsdp", 8), ("tp", 2), ("tp", 4), ("tp", 8)]
    assert _choices("h200:1x4", runner_only=False) == [("ddp", 0), ("fsdp", 0), ("tp", 2),
                                                       ("tp", 4)]


def test_next_to_graph_mode_kernels_the_solver_offers_what_the_runner_executes() -> None:
    """On several ranks the runner's graph mode runs replicated regions only (it refuses
    the rest: check_graph_mode); the solver offers the same, from the same rule."""
    assert _choices("h200:2x8", graph_mode=True) == [("ddp", 0)]
    assert _choices("h200:1x1", graph_mode=True) == [("ddp", 0)]
    for s in DENSE_DECLARED:
        offered = any(c[0] == s.name for c in _choices("h200:2x8", graph_mode=True))
        regions = [{"name": "mlp", "strategy": s.name}]
        kernel = [{"name": "k", "kind": "pointwise"}]
        if offered:
            check_graph_mode(kernel, world_size=16, regions=regions)
        else:
            with pytest.raises(PlanError, match="region\\(s\\) mlp are not ddp"):
                check_graph_mode(kernel, world_size=16, regions=regions)
        assert offered == runner_executes(s, world_size=16, graph_mode=True)
    # without graph-mode kernels the runner runs every strategy it runs at all
    assert all(runner_executes(s, world_size=16, graph_mode=False) == s.runner
               for s in DENSE_DECLARED)


@pytest.mark.parametrize("name", DENSE_STRATEGIES)
def test_memory_and_comm_follow_the_objects_fields(name: str) -> None:
    s = dense_strategy(name)
    topo = parse_topology("h200:2x8")
    group = max(s.shard_groups(16, 2, 8))
    region = dataclasses.replace(MLP, strategy=name, shard_group=group)
    degree = shard_degree(region, 16)
    assert degree == (1 if s.replicated else 16 if s.group == "world" else group)
    mem = region_memory(region, 16, StepOptions())
    assert mem.params == pytest.approx(MLP.params * MLP.param_bytes / degree)
    assert mem.grads == pytest.approx(MLP.params * MLP.grad_bytes / degree
                                      * (2 if s.replicated else 1))
    assert mem.activations == pytest.approx(
        MLP.activation_bytes / (group if s.splits_activations else 1))
    comm = dense_comm(region, topo, None, StepOptions())
    assert (comm["tp"] > 0) == (s.comm == "sequence_parallel")
    assert (comm["fwd"] > 0) == (s.comm == "gather_scatter")
    assert comm["bwd"] > 0


def test_the_runner_refuses_exactly_the_strategies_it_does_not_run() -> None:
    for s in DENSE_DECLARED:
        regions = [{"name": "mlp", "strategy": s.name}]
        if s.runner:
            check_strategies(regions)
        else:
            with pytest.raises(TensorParallelNotSupported, match="region\\(s\\) mlp"):
                check_strategies(regions)


def test_names_and_declarations_agree_and_bad_ones_are_refused() -> None:
    assert DENSE_STRATEGIES == tuple(DENSE) == tuple(d.name for d in DENSE_DECLARED)
    assert DENSE_DECLARED[0].replicated
    with pytest.raises(ValueError, match="unknown dense strategy 'zero3'"):
        dense_strategy("zero3")
    with pytest.raises(ValueError, match="group 'pod'"):
        DenseStrategy("x", "pod", "all_reduce")
    with pytest.raises(ValueError, match="comm 'ring'"):
        DenseStrategy("x", "none", "ring")
    with pytest.raises(ValueError, match="strategy 'zero3'"):
        RegionCost("r", 1, 1.0, 1.0, strategy="zero3")
    assert DenseChoice().strategy == DENSE_DECLARED[0].name
