"""Cut any set of nodes out of a graph into a standalone GraphModule.

A fusion group, a region, one op probed for lowering, or "the graph minus what torch-mlir
cannot lower" are all the same question: which values flow into these nodes (they become
the new graph's placeholders, in first-use order) and which flow out (they become its
outputs, in graph order). Answering it once, generically, keeps every MLIR export honest
about its boundary: the ``inputs``/``outputs`` lists name the original nodes, so a caller
can feed the subgraph the same values the whole graph would and compare what comes out.

Pure torch.fx: no torch-mlir here, so it is usable (and testable) without it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import fx


@dataclass
class Extracted:
    """A standalone subgraph and its boundary, named by nodes of the source graph."""

    gm: fx.GraphModule
    inputs: list[fx.Node]  # source nodes whose values are the placeholders, in order
    outputs: list[fx.Node]  # source nodes whose values the subgraph returns, in order
    nodes: list[fx.Node]  # the source nodes copied in, in graph order


def _is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _is_multi(node: fx.Node) -> bool:
    """A node whose value is a tuple/list (read through getitem, never passed whole)."""
    return isinstance(node.meta.get("val"), (tuple, list))


def _normalize(gm: fx.GraphModule, nodes: Iterable[fx.Node]) -> list[fx.Node]:
    """The computing nodes of the set, in graph order.

    Placeholders, get_attr and output nodes are never copied: their values flow in as
    placeholders. A ``getitem`` whose tuple is produced outside the set is a value that
    flows in, so it leaves the set too (a placeholder cannot hold a tuple)."""
    given = list(nodes)
    for n in given:
        if n.graph is not gm.graph:
            raise ValueError(f"node {n.name} is not in this graph")
    chosen = {n for n in given if n.op in ("call_function", "call_method", "call_module")}
    changed = True
    while changed:
        changed = False
        for n in list(chosen):
            if _is_getitem(n) and isinstance(n.args[0], fx.Node) and n.args[0] not in chosen:
                chosen.discard(n)
                changed = True
    return [n for n in gm.graph.nodes if n in chosen]


def extract_subgraph(gm: fx.GraphModule, nodes: Iterable[fx.Node]) -> Extracted:
    """Copy ``nodes`` of ``gm`` into a new GraphModule; inputs/outputs are the values that
    cross the set's boundary. Node meta (``val``, gemc annotations) is copied."""
    body = _normalize(gm, nodes)
    if not body:
        raise ValueError("no computing node in the set (placeholders and outputs only?)")
    inside = set(body)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []

    def value_of(src: fx.Node) -> fx.Node:
        if src in env:
            return env[src]
        if _is_multi(src):
            raise ValueError(
                f"{src.name} produces a tuple and is read whole by a node of the set; "
                "include it in the set or read it through getitem"
            )
        ph = graph.placeholder(src.name)
        ph.meta = {k: v for k, v in src.meta.items() if k in ("val", "tensor_meta")}
        env[src] = ph
        inputs.append(src)
        return ph

    # Placeholders first, in the order the body first reads them: an fx graph wants every
    # placeholder before the first computing node.
    for n in body:
        for a in n.all_input_nodes:
            if a not in inside:
                value_of(a)
    for n in body:
        new = graph.node_copy(n, value_of)
        new.meta = dict(n.meta)
        env[n] = new

    outputs: list[fx.Node] = []
    results: list[fx.Node] = []
    for n in body:
        users_outside = [u for u in n.users if u not in inside]
        if not users_outside:
            continue
        if _is_multi(n):
            # Return the elements read outside, through the getitems that read them.
            for u in users_outside:
                if _is_getitem(u):
                    item = graph.call_function(operator.getitem, (env[n], u.args[1]))
                    item.meta = dict(u.meta)
                    outputs.append(u)
                    results.append(item)
                else:  # read whole outside: return every element
                    raise ValueError(f"{n.name} produces a tuple read whole by {u.name}")
        else:
            outputs.append(n)
            results.append(env[n])
    if not results:  # a set whose values nobody reads: return its tensor-valued sinks
        for n in body:
            if not any(u in inside for u in n.users) and isinstance(
                n.meta.get("val"), torch.Tensor
            ):
                outputs.append(n)
                results.append(env[n])
    graph.output(tuple(results))
    sub = fx.GraphModule(_owner_of(gm, body), graph)
    return Extracted(gm=sub, inputs=inputs, outputs=outputs, nodes=body)


def _owner_of(gm: fx.GraphModule, body: list[fx.Node]) -> torch.nn.Module:
    """The root module for the new GraphModule: the source one when the body calls
    submodules or methods that live on it, else an empty module (nothing to carry)."""
    if any(n.op == "call_module" for n in body):
        return gm
    return torch.nn.Module()
