"""One declaration per kernel kind (gemc/kernel_kinds.py) and one implementation per graph-mode
kind (gemc.backends.triton.kinds): the implementations cover exactly the declared kinds, so
a kind without a runtime fails here, not at a run; the plan validator requires each kind's
fields; the cost model prices what the declarations say Inductor compiles."""

from __future__ import annotations

import copy

import pytest
from gemc.backends.torch import graph_mode
from gemc.backends.torch import kernels as module_kernels
from gemc.backends.triton import inductor_graph, kinds
from gemc.backends.triton.kinds import KindImplementation, named

from gemc import kernel_kinds
from gemc.errors import PlanError
from gemc.kernel_kinds import KINDS, KernelKind
from gemc.plan import validate_plan


def test_names_are_unique_and_the_kinds_partition() -> None:
    assert tuple(KINDS.values()) == kernel_kinds.DECLARED
    with pytest.raises(ValueError, match="kernel kind norm is already declared"):
        kernel_kinds.declare(KernelKind("norm", ("a",)))
    with pytest.raises(ValueError, match="kernel kind norm is built in"):
        kernel_kinds.forget("norm")
    units, layouts = set(kernel_kinds.unit_kinds()), set(kernel_kinds.layout_kinds())
    assert not units & layouts
    assert units | layouts == set(kernel_kinds.graph_kinds())
    assert set(kernel_kinds.generated_kinds()) <= units


def test_every_declared_graph_kind_has_one_implementation_and_nothing_else_has() -> None:
    """The plan builder, the interpreter and the emitter read a kind's implementation
    (gemc.backends.triton.kinds): every declared graph-mode kind has one, built on its
    declaration, and no kind is implemented that nobody declared."""
    registered = kinds.registered()
    assert set(registered) == set(kernel_kinds.graph_kinds())
    for name, implementation in registered.items():
        assert implementation.kind is KINDS[name]
    assert {k.kind.name for k in kinds.layouts()} == set(kernel_kinds.layout_kinds())
    assert all(kinds.unit(name) is None for name in kernel_kinds.layout_kinds())
    # the runner hands the graph kinds to graph mode, the rest to the module-mode registry,
    # where every declared module-mode kind must find its applier
    graph_mode.check_graph_mode([{"kind": k} for k in kernel_kinds.graph_kinds()],
                                world_size=1)
    module = {k.name for k in KINDS.values() if k.mode == "module"}
    assert module <= set(module_kernels.registered())


def test_an_implementation_that_lacks_a_layers_part_is_refused() -> None:
    unit = KernelKind("u", ("a",))
    parts = dict(entry=lambda f, n: {}, reads=named("a"), run=lambda r, u, e: None,
                 emit=lambda e, u: None)
    KindImplementation(unit, **parts)
    for missing in parts:
        with pytest.raises(ValueError, match=f"a unit kind needs {missing}"):
            KindImplementation(unit, **{k: v for k, v in parts.items() if k != missing})
    with pytest.raises(ValueError, match="a unit kind has no layout_setup"):
        KindImplementation(unit, **parts, layout_setup=lambda r, e: None)
    layout = KernelKind("l", ("a",), layout=True)
    with pytest.raises(ValueError, match="a layout needs layout_entries, layout_setup"):
        KindImplementation(layout, **parts)
    with pytest.raises(ValueError, match="implemented by an applier"):
        KindImplementation(KernelKind("m", (), mode="module"), **parts)


def test_the_cost_model_prices_as_inductor_code_what_the_declarations_say() -> None:
    compiled = set(kernel_kinds.inductor_compiled_kinds())
    assert {"transposed_linear", *kernel_kinds.generated_kinds()} == compiled


def test_the_kind_decides_the_default_choice(monkeypatch) -> None:
    monkeypatch.delenv(inductor_graph.CHOICE_ENV, raising=False)
    for kind in KINDS.values():
        entry = {"name": "x", "kind": kind.name}
        assert inductor_graph.default_choice(entry) == kind.default_choice
        won = inductor_graph.default_choice(entry, {"x": {"choice": "gemc"}})
        lost = inductor_graph.default_choice(entry, {"x": {"choice": "inductor"}})
        # a measurement decides only where gemc's kernel competes with Inductor's code
        assert (won, lost) == (("gemc", "inductor") if kind.generated else ("gemc", "gemc"))


def test_a_declaration_that_contradicts_itself_is_refused() -> None:
    with pytest.raises(ValueError, match="only a generated kind competes"):
        KernelKind("k", ("a",), default_choice="inductor")
    with pytest.raises(ValueError, match="mode 'eager'"):
        KernelKind("k", ("a",), mode="eager")
    with pytest.raises(ValueError, match="a layout is a graph-mode kind"):
        KernelKind("k", ("a",), mode="module", layout=True)
    with pytest.raises(ValueError, match="not an ATen formulation"):
        KernelKind("k", ("a",), generated=True, aten_formulation=True)


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
