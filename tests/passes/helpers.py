"""Run the annotation pipeline up to a pass, on a model from tests/models."""

from __future__ import annotations

from torch import fx

from gemc.api import load_model, pass_context
from gemc.capture import capture
from gemc.dump import format_graph
from gemc.pass_manager import PassManager
from gemc.pipeline import default_pipeline
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
