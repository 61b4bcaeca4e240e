"""``transposed_linear``: ``linear(x.transpose(-1, -2), w, b)`` as a batched GEMM reading ``x``
in place (the kernel: :func:`gemc.backends.triton.transposed_linear.transposed_linear`).

The whole kind in one object, as a new kind is written: the recogniser is the
``fold-transposed-linear`` pass (it marks the linear ``gemc.group`` / ``gemc.kernel``);
its declaration (``gemc.kernel_kinds``) says the entry needs ``input`` and ``weight`` and
that the kernel is an ATen formulation Inductor compiles; this module says what the entry
holds (the three operands' node names) and how the interpreter and the emitter run it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import fx

from gemc.kernel_kinds import KINDS

from ..transposed_linear import transposed_linear
from .implementation import Entry, Env, KindImplementation, Unit, named

if TYPE_CHECKING:
    from ..graph_runner import GraphRunner
    from ..inductor_graph import Emitter


def entry(facts: dict[str, Any], nodes: list[fx.Node]) -> Entry:
    """The linear's operands by node name (``bias`` null when it has none)."""
    node = nodes[0]
    bias = node.args[2] if len(node.args) > 2 else None
    return dict(input=node.args[0].name, weight=node.args[1].name,
                bias=bias.name if isinstance(bias, fx.Node) else None)


def run(runner: GraphRunner, unit: Unit, env: Env) -> None:
    """The interpreter's call: the operands' values in, the linear's value out."""
    e = unit["entry"]
    bias = runner.operand(e["bias"], env) if e.get("bias") else None
    value = transposed_linear(runner.operand(e["input"], env), runner.operand(e["weight"], env),
                              bias)
    runner.output(e["nodes"][0], value, env)


def emit(emitter: Emitter, unit: Unit) -> None:
    """The same call as a node of the graph ``torch.compile`` compiles."""
    e = unit["entry"]
    bias = emitter.operand(e["bias"]) if e.get("bias") else None
    value = emitter.call(transposed_linear, (emitter.operand(e["input"]),
                                             emitter.operand(e["weight"]), bias))
    emitter.output(e["nodes"][0], value)


IMPLEMENTATIONS = (
    KindImplementation(KINDS["transposed_linear"], entry=entry,
                       reads=named("input", "weight", "bias"), run=run, emit=emit),
)
