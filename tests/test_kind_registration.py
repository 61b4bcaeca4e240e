"""A kernel kind registered from outside gemc (here, this file) flows through every layer:
the plan builder writes its entry, the interpreter runs it and the emitter writes its
call into the graph torch.compile compiles, each through the one ``KindImplementation``
(gemc.backends.triton.kinds); values and gradients equal eager's. Its declaration reaches
the core's readers with it: the plan validator requires its fields, the cost model prices
it as a gemc island, the runner sends it to graph mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.torch import graph_mode
from gemc.backends.triton import inductor_graph, kinds
from gemc.backends.triton.graph_runner import GraphRunner
from gemc.backends.triton.kinds import KindImplementation, named
from gemc.cost_model.inductor_fusion import island_groups
from torch import fx, nn

from gemc import ir, kernel_kinds
from gemc.api import load_model, pass_context
from gemc.capture import capture
from gemc.errors import PlanError
from gemc.kernel_kinds import KernelKind
from gemc.pass_manager import PassManager
from gemc.pipeline import annotation_passes
from gemc.plan import validate_plan
from gemc.plan_builder import kernel_entries
from tests.fusion.helpers import eager_step, fresh_seed, params_of

ENTRY = "tests/test_kind_registration.py:build"
CALLS: list[int] = []


class Tanh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(6, 5), nn.Linear(5, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.outer(torch.tanh(self.inner(x))).squeeze(-1), y)


def build() -> object:
    from gemc.spec import ModelSpec

    def batch(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(step)
        return torch.randn(4, 6, generator=gen).to(device), torch.randn(4, generator=gen).to(device)

    return ModelSpec(model=Tanh(), example_inputs=batch(0), make_batch=batch)


def tanh_by_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """The toy kind's kernel: tanh written through the sigmoid (another formula, so a run
    of the original op instead would not be the kernel's)."""
    CALLS.append(x.numel())
    return 2 * torch.sigmoid(2 * x) - 1


def _entry(facts: dict, nodes: list[fx.Node]) -> dict:
    return {"input": nodes[0].args[0].name, "why": facts["why"]}


def _run(runner: GraphRunner, unit: dict, env: dict) -> None:
    e = unit["entry"]
    runner.output(e["nodes"][0], tanh_by_sigmoid(runner.operand(e["input"], env)), env)


def _emit(emitter, unit: dict) -> None:  # noqa: ANN001 - inductor_graph.Emitter
    e = unit["entry"]
    emitter.output(e["nodes"][0], emitter.call(tanh_by_sigmoid, (emitter.operand(e["input"]),)))


TOY = KindImplementation(KernelKind("toy_tanh", ("input",), __name__), entry=_entry,
                         reads=named("input"), run=_run, emit=_emit)


@pytest.fixture
def toy_kind():
    kinds.register(TOY)
    yield TOY
    kinds.unregister("toy_tanh")


def _marked():
    """The model's graph with its tanh marked as the toy kind (what a recogniser pass does)."""
    spec = load_model(ENTRY, {}, device="cpu")
    captured = capture(spec, entrypoint=ENTRY)
    ctx = pass_context(ENTRY, {}, captured, None)
    gm = PassManager(annotation_passes()).run(captured.gm, ctx)
    (tanh,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.tanh.default]
    tanh.meta[ir.GROUP] = "toy_tanh_0"
    tanh.meta[ir.KERNEL] = {"id": "toy_tanh_0", "kind": "toy_tanh", "why": "a test",
                            "before_ms": 2.0, "after_ms": 1.0}
    return gm, ctx, spec, tanh


def test_a_registered_kind_gets_its_plan_entry_and_runs_as_eager(toy_kind) -> None:
    gm, ctx, spec, tanh = _marked()
    (entry,) = kernel_entries(gm, ctx)
    assert entry == {"name": "toy_tanh_0", "kind": "toy_tanh", "nodes": [tanh.name],
                     "replaces": [""], "region": "", "library": __name__,  # the root module
                     "predicted": {"before_ms": 2.0, "after_ms": 1.0},
                     "input": tanh.args[0].name, "why": "a test"}
    batch = spec.make_batch(fresh_seed(), "cpu")
    ref, grads = eager_step(spec.model, batch)
    CALLS.clear()
    runner = GraphRunner(gm, [entry], params_of(spec.model))
    loss = runner(*batch)
    assert CALLS == [4 * 5]  # the interpreter ran the kind's kernel, once
    torch.testing.assert_close(loss, ref)
    loss.backward()
    for name, p in spec.model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], msg=name)


def test_a_registered_kind_is_emitted_into_the_compiled_graph(toy_kind) -> None:
    gm, ctx, spec, _ = _marked()
    entries = kernel_entries(gm, ctx)
    runner, left = inductor_graph.runner_for(gm, entries, params_of(spec.model))
    built = inductor_graph.build(runner)
    assert left == [] and built.choices == {"toy_tanh_0": "gemc"}
    assert "tanh_by_sigmoid" in built.module.code and "aten.tanh" not in built.module.code
    batch = spec.make_batch(fresh_seed(), "cpu")
    with torch.no_grad():
        torch.testing.assert_close(built.module(*batch), spec.model(*batch))


def test_an_unregistered_kind_is_refused_by_name() -> None:
    gm, ctx, _, _ = _marked()
    with pytest.raises(ValueError, match="kind 'toy_tanh', which no registered implementation"):
        kernel_entries(gm, ctx)
    with pytest.raises(ValueError, match="unknown kernel kind 'toy_tanh'"):
        GraphRunner(gm, [{"name": "t", "kind": "toy_tanh", "nodes": []}], {})


def test_a_kind_is_registered_once(toy_kind) -> None:
    with pytest.raises(ValueError, match="toy_tanh is already registered"):
        kinds.register(TOY)


def test_a_registered_kind_is_declared_to_the_core_readers(toy_kind) -> None:
    gm, ctx, _, tanh = _marked()
    assert kernel_kinds.KINDS["toy_tanh"] is TOY.kind
    (entry,) = kernel_entries(gm, ctx)
    # the runner executes it in graph mode (a kind it does not know it refuses by name)
    graph_mode.check_graph_mode([entry], world_size=1)
    # the cost model prices its nodes as a gemc kernel, not as Inductor's fused code
    assert island_groups(gm) == {"toy_tanh_0"}
    # the plan validator requires the fields its declaration lists
    plan = {"schema_version": 1, "gemc_version": "0", "planner": "default", "warnings": [],
            "model": {"entrypoint": ENTRY, "args": {}, "fingerprint": "x"},
            "topology": {}, "mesh": {"world_size": 1, "shape": [1]}, "regions": [],
            "tables": [], "precision": [],
            "predicted": {"step_ms": None, "mfu": None, "per_rank": None},
            "kernels": [{k: v for k, v in entry.items() if k != "input"}]}
    with pytest.raises(PlanError, match=r"kernels\[0\].input is missing"):
        validate_plan(plan)


def test_an_unregistered_kind_leaves_the_core_too() -> None:
    kinds.register(TOY)
    kinds.unregister("toy_tanh")
    assert "toy_tanh" not in kernel_kinds.KINDS
    with pytest.raises(PlanError, match="'toy_tanh', which the runner cannot execute"):
        graph_mode.check_graph_mode([{"name": "t", "kind": "toy_tanh"}], world_size=1)
