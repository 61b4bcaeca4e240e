"""Run passes on small graphs: the pipeline up to a pass on a model from tests/models, or
chosen passes on a module a test writes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from gemc.api import load_model, pass_context
from gemc.capture import capture
from gemc.context import PassContext
from gemc.dump import format_graph
from gemc.pass_manager import Pass, PassManager
from gemc.pipeline import annotation_passes, default_pipeline
from gemc.spec import ModelSpec
from tests.conftest import TOY


def run_until(pass_name: str, func: str = "build", topology=None) -> fx.GraphModule:
    entry = f"{TOY}:{func}"
    spec = load_model(entry)
    captured = capture(spec, entrypoint=entry)
    passes = []
    for p in default_pipeline():
        passes.append(p)
        if p.name == pass_name:
            break
    ctx = pass_context("toy", {}, captured, topology)
    return PassManager(passes).run(captured.gm, ctx)


def dump_after(pass_name: str, func: str = "build") -> str:
    return format_graph(run_until(pass_name, func), f"after {pass_name}")


def graph_of(model: torch.nn.Module, inputs: Sequence[torch.Tensor], passes: Sequence[Pass],
             *, topology: str | None = None, precision_probe: Any = None) -> tuple[fx.GraphModule, PassContext]:
    """``model`` (a small module written in the test, returning a scalar loss) captured as
    a compile captures it and run through ``passes`` only (verified after each, as in a
    compile); ``topology`` a spec such as ``"h200:1x1"``; ``precision_probe`` what
    choose-precision measures with (``PassContext.precision_probe``). Returns the graph and the
    context (its warnings)."""
    from gemc.cost_model.topology import parse_topology

    inputs = tuple(inputs)
    spec = ModelSpec(model=model, example_inputs=inputs, make_batch=lambda step, device: inputs)
    captured = capture(spec, entrypoint="test")
    ctx = PassContext(entrypoint="test", param_fqns=captured.param_fqns,
                      param_shapes=captured.param_shapes, param_dtypes=captured.param_dtypes,
                      param_aliases=captured.param_aliases,
                      constant_fqns=captured.constant_fqns,
                      topology=parse_topology(topology) if topology else None,
                      precision_probe=precision_probe)
    return PassManager(list(passes)).run(captured.gm, ctx), ctx


def annotated(*passes: Pass) -> list[Pass]:
    """The annotation passes (kind, FLOPs and bytes, tables, regions) and then ``passes``:
    what every later pass reads."""
    return [*annotation_passes(), *passes]


def node(gm: fx.GraphModule, target: Any, index: int = 0) -> fx.Node:
    """The ``index``-th node calling ``target`` (an ATen overload), in graph order."""
    found = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]
    assert len(found) > index, f"no {index}th {target} in the graph"
    return found[index]
