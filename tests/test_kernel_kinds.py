"""One declaration per kernel kind (gemc/kernel_kinds.py): every layer's table keyed by kind
covers exactly the declared kinds, so a kind without a runtime fails here, not at a run;
the plan validator requires each kind's fields."""

from __future__ import annotations

import copy

import pytest
from gemc.backends.torch import graph_mode
from gemc.backends.torch import kernels as module_kernels
from gemc.backends.triton import graph_runner, inductor_graph

from gemc import kernel_kinds
from gemc.errors import PlanError
from gemc.kernel_kinds import KINDS, KernelKind
from gemc.plan import validate_plan


def test_names_are_unique_and_the_kinds_partition() -> None:
    assert len(KINDS) == len(kernel_kinds.DECLARED)
    units, layouts = set(kernel_kinds.unit_kinds()), set(kernel_kinds.layout_kinds())
    assert not units & layouts
    assert units | layouts == set(kernel_kinds.graph_kinds())
    assert set(kernel_kinds.generated_kinds()) <= units


def test_every_declared_kind_has_a_plan_entry_and_a_runtime_in_each_backend() -> None:
    from gemc import plan_builder

    units, layouts = set(kernel_kinds.unit_kinds()), set(kernel_kinds.layout_kinds())
    tables = {
        "gemc.plan_builder.PLAN_ENTRIES": (set(plan_builder.PLAN_ENTRIES), units),
        "gemc.plan_builder.LAYOUT_ENTRIES": (set(plan_builder.LAYOUT_ENTRIES), layouts),
        "graph_runner.UNIT_RUNTIMES": (set(graph_runner.UNIT_RUNTIMES), units),
        "graph_runner.LAYOUT_SETUPS": (set(graph_runner.LAYOUT_SETUPS), layouts),
        "inductor_graph.EMITTERS": (set(inductor_graph.EMITTERS), units),
    }
    for table, (keys, declared) in tables.items():
        assert keys - declared == set(), f"{table} has undeclared kinds {keys - declared}"
        assert declared - keys == set(), f"{table} lacks declared kinds {declared - keys}"
    # the runner hands the graph kinds to graph mode, the rest to the module-mode registry,
    # where every declared module-mode kind must find its applier
    assert graph_mode.GRAPH_KINDS == kernel_kinds.graph_kinds()
    module = {k.name for k in KINDS.values() if k.mode == "module"}
    assert module <= set(module_kernels.registered())


def test_the_kind_decides_the_default_choice(monkeypatch) -> None:
    monkeypatch.delenv(inductor_graph.CHOICE_ENV, raising=False)
    for kind in KINDS.values():
        entry = {"name": "x", "kind": kind.name}
        assert inductor_graph.default_choice(entry) == kind.default_choice
        won = inductor_graph.default_choice(entry, {"x": {"choice": "gemc"}})
        lost = inductor_graph.default_choice(entry, {"x": {"choice": "inductor"}})
        # a measurement decides only where gemc's kernel competes with Inductor's code
        assert (won, lost) == (("gemc", "inductor") if kind.generated else ("gemc", "gemc"))
    assert set(inductor_graph.GENERATED) == {k.name for k in KINDS.values() if k.generated}


def test_a_declaration_that_contradicts_itself_is_refused() -> None:
    with pytest.raises(ValueError, match="only a generated kind competes"):
        KernelKind("k", ("a",), default_choice="inductor")
    with pytest.raises(ValueError, match="mode 'eager'"):
        KernelKind("k", ("a",), mode="eager")
    with pytest.raises(ValueError, match="a layout is a graph-mode kind"):
        KernelKind("k", ("a",), mode="module", layout=True)


def _plan(kernels: list) -> dict:
    return {
        "schema_version": 1, "gemc_version": "0", "planner": "default", "warnings": [],
        "model": {"entrypoint": "m.py:f", "args": {}, "fingerprint": "x"},
        "topology": {}, "mesh": {"world_size": 1, "shape": [1]}, "regions": [],
        "tables": [], "precision": [],
        "predicted": {"step_ms": None, "mfu": None, "per_rank": None},
        "kernels": kernels,
    }


def test_the_validator_requires_each_kinds_fields() -> None:
    entry = {"name": "jagged_attention_0", "kind": "jagged_attention", "nodes": ["sdpa"],
             "q": "q", "k": "k", "v": "v", "offsets": "o", "clamp_min": 0, "max_len": 8,
             "scale": None}
    validate_plan(_plan([entry]))
    for field in ("nodes", "offsets", "scale"):
        broken = copy.deepcopy(entry)
        del broken[field]
        with pytest.raises(PlanError, match=f"kernels\\[0\\].{field} is missing") as exc:
            validate_plan(_plan([broken]), source="p.json")
        assert "jagged_attention entry needs" in str(exc.value)
        assert "compile the plan again" in exc.value.fix
    with pytest.raises(PlanError, match=r"kernels\[0\].kind is None"):
        validate_plan(_plan([{"name": "x"}]))
    with pytest.raises(PlanError, match=r"kernels\[0\] is not an object"):
        validate_plan(_plan(["x"]))
    # a kind no declaration names is a module-mode kernel: left to the runner's registry
    validate_plan(_plan([{"name": "m", "kind": "fused_mlp", "replaces": ["top"]}]))
