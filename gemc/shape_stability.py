"""Which batch inputs may change shape from step to step, checked where the model is compiled.

The runner's graph mode runs the graph torch.export captured at the example batch's shapes.
Where the forward reads a size from an input (``values.numel()``, ``output_size=n``,
``torch.arange(n)``), that size is a constant of the graph: a batch of another shape would
run with the example's (a crash in the compiled backward, or another loss, silently). But a
jagged input whose total varies by step (a KeyedJaggedTensor's values: ids read only by
their lookups) leaves no size in the graph, and refusing it would send every such data
pipeline to module mode. So the compile captures the model a second time, on the first of
``make_batch(1..3)`` whose inputs' shapes differ from the example's, and compares the two
graphs op by op: equal up to the tensors' shapes, no size of the batch is a constant of
the graph, and the inputs that changed may change at run time (``GraphExecutor`` checks
the others). Any other difference (a literal that moved with the batch) names the node
and keeps every input's shape fixed. Nodes whose shapes moved are returned too: a
generated kernel over one of them was specialised to the example's sizes (the plan builder
keeps the shapes fixed then)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from gemc.data_dependent import source_line
from gemc.spec import ModelSpec

# the later steps whose batches are made to find one of another shape (a jagged total may
# repeat by chance: a probe's step 1 had step 0's 15 ids, its step 2 had 14)
SAMPLED_STEPS = (1, 2, 3)


@dataclass(frozen=True)
class ShapeStability:
    """``inputs``: the batch inputs (placeholder names) whose shapes differ between the
    example and a sampled later batch and that the graph holds no size of; ``held``: why none may vary (a node whose
    literal moved with the batch), or ``""``; ``nodes``: the graph nodes whose shapes
    moved."""

    inputs: tuple[str, ...] = ()
    held: str = ""
    nodes: frozenset[str] = frozenset()


def _user_inputs(gm: fx.GraphModule, param_fqns: dict[str, str]) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder" and n.name not in param_fqns]


def _shape(node: fx.Node) -> Any:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(val.shape)
    if isinstance(val, (list, tuple)):
        return tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in val)
    return None


def _literal(x: Any) -> Any:
    """An argument as the graph holds it: nodes by name, everything else as written."""
    return pytree.tree_map(lambda a: ("node", a.name) if isinstance(a, fx.Node) else a, x)


def check(spec: ModelSpec, first: Any, recapture: Callable[[ModelSpec], Any]
          ) -> ShapeStability:
    """The batch inputs that may vary (see the module doc). ``first``: the compile's
    :class:`~gemc.capture.Captured`; ``recapture``: capture a spec the same way. Nothing
    varies (and nothing is captured again) where the sampled batches have the example's
    shapes, or where one cannot be made on this machine (it is the runner's to make)."""
    if spec.make_batch is None:
        return ShapeStability()
    inputs = _user_inputs(first.gm, first.param_fqns)
    for step in SAMPLED_STEPS:  # the first later batch whose shapes differ
        try:
            with torch.device("cpu"), contextlib.redirect_stdout(None):
                second = spec.make_batch(step, "cpu")
        except Exception:  # noqa: BLE001 -- a batch the compile cannot make: none may vary
            return ShapeStability()
        flat = [x for x in pytree.tree_leaves(tuple(second)) if isinstance(x, torch.Tensor)]
        if len(flat) != len(inputs):
            return ShapeStability()
        moved = [n.name for n, t in zip(inputs, flat) if _shape(n) != tuple(t.shape)]
        if moved:
            break
    else:
        return ShapeStability()
    try:
        other = recapture(replace(spec, example_inputs=tuple(second)))
    except Exception as exc:  # noqa: BLE001 -- the second batch does not capture
        return ShapeStability(held=f"the model does not capture on make_batch({step}) ({exc})")
    a, b = list(first.gm.graph.nodes), list(other.gm.graph.nodes)
    if len(a) != len(b):
        return ShapeStability(held=f"its graph on make_batch({step}) has {len(b)} nodes, not "
                                   f"{len(a)}: the batch's shapes change the traced program")
    nodes = set()
    for x, y in zip(a, b):
        if (x.op, str(x.target), _literal(x.args), _literal(x.kwargs)) != \
                (y.op, str(y.target), _literal(y.args), _literal(y.kwargs)):
            return ShapeStability(held=f"node {x.name} ({x.target}) holds a size of the "
                                       f"batch ({source_line(x) or 'forward'})")
        if _shape(x) != _shape(y):
            nodes.add(x.name)
    return ShapeStability(tuple(moved), "", frozenset(nodes))


__all__ = ["ShapeStability", "check"]
