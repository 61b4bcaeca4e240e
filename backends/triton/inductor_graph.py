"""The rewritten graph as an ordinary ``GraphModule`` whose kernel nodes call gemc's custom
ops, for ``torch.compile`` (Inductor) to compile around them.

:class:`~.graph_runner.GraphRunner` interprets the captured graph node by node in Python,
so every op gemc does not specialise runs unfused and pays a launch each. Here the same
units (the runner's schedule, launchers and embedding modules are reused, so both paths
execute one plan identically) are *emitted* into a new FX graph instead:

* a generated group whose per-group choice is ``gemc`` -> one ``gemc::fused_group`` call
  (its operands cast to the autocast dtype first, as the interpreter's launcher does) and a
  ``getitem`` per output; a group whose choice is ``inductor`` -> its own ATen nodes,
  which Inductor fuses with their neighbours;
* ``jagged_attention`` -> ``gemc::jagged_attention`` on the padded q, k, v (then the
  transpose back to the graph's ``[B, H, L, D]``, a view);
* ``batched_embedding_bag`` -> the flat offsets (ATen ops) and one ``gemc::embedding_bag``;
* ``transposed_linear`` -> its ATen formulation (a batched GEMM reading ``x`` in place);
* every other node -> a copy (``device=`` arguments captured on meta point at the run's
  device; ``_assert_tensor_metadata`` nodes are dropped);
* a node with a ``call`` (the sharded lookups on several ranks) -> that callable, behind
  ``torch._dynamo.disable``: the exchange and the sparse optimizer stay gemc's eager code
  and Dynamo splits the graph around them.

``packed_tokens`` regions are not emitted (their token count is a per-batch shape the
interpreter sizes on the host); :func:`runner_for` names them, the region's ops run padded
and the runner warns.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from gemc import ir

from . import ops as gemc_ops
from .graph_runner import _SKIP, GraphRunner
from .transposed_linear import transposed_linear

__all__ = ["CHOICE_ENV", "Built", "build", "default_choice", "runner_for"]

GENERATED = ("gemm_epilogue", "norm", "pointwise", "reduction")
"""Kinds where a gemc kernel and Inductor's code compete for the same subgraph."""
SPECIAL = ("jagged_attention", "batched_embedding_bag", "transposed_linear")
"""Kinds gemc always keeps: Inductor has nothing equivalent (values + offsets attention,
one lookup for many tables with the optimizer fused) or they are an ATen rewrite."""
CHOICE_ENV = "GEMC_GROUP_CHOICE"
"""``gemc`` / ``inductor`` forces every generated group's choice (A/B runs); unset or
``auto``: the measured choice where there is one, else Inductor."""


def default_choice(entry: dict[str, Any], measured: Mapping[str, Any] | None = None) -> str:
    """``gemc`` or ``inductor`` for one plan entry: special kinds are gemc's; a generated
    group is gemc's only where a measurement recorded a win (``measured[name]["choice"]``),
    because without one Inductor's fused code is the safe default (it never loses to the
    op-by-op graph, and it fuses across the group's border)."""
    kind = entry["kind"]
    if kind not in GENERATED:
        return "gemc"
    forced = os.environ.get(CHOICE_ENV, "auto")
    if forced in ("gemc", "inductor"):
        return forced
    rec = (measured or {}).get(str(entry.get("name")))
    if isinstance(rec, Mapping) and rec.get("choice") in ("gemc", "inductor"):
        return str(rec["choice"])
    return "inductor"


@dataclass
class Built:
    """What :func:`build` made: the module to compile and what it did with each entry."""

    module: fx.GraphModule
    choices: dict[str, str]  # entry name -> "gemc" | "inductor"
    runner: GraphRunner  # owns the launchers and the embedding modules


def _attr_name(fqn: str) -> str:
    return "p_" + fqn.replace(".", "__")


def _embedding_inputs(entry: dict[str, Any], ids: list[torch.Tensor],
                      offsets: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor,
                                                            torch.Tensor | None]:
    """The batched lookup's flat ids, offsets and per-id weights, from each table's ids and
    offsets (ATen ops, compiled with the rest; see ``GraphRunner._bag_layout``)."""
    tables = entry["tables"]
    ids = [t.to(torch.int64) for t in ids]
    offs = []
    for t, tid, off in zip(tables, ids, offsets):
        off = off.to(torch.int64)
        if not t["include_last_offset"]:
            off = torch.cat([off, off.new_full((1,), tid.numel())])
        offs.append(off)
    nnz = [tid.numel() for tid in ids]
    mean = [t["pooling"] == "mean" for t in tables]
    flat_offsets, psw = GraphRunner._bag_layout(offs, nnz, mean)
    return torch.cat(ids), flat_offsets, psw


def _call_group(kernel: str, autocast: str, gemm_operands: Sequence[int],
                inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A generated group through its custom op; under autocast the GEMM's operands are cast
    first (outside the op, so autograd casts their gradients back), as F.linear's are."""
    if autocast and gemm_operands:
        dt = getattr(torch, autocast)
        inputs = [t.to(dt) if i in gemm_operands and t.is_floating_point() else t
                  for i, t in enumerate(inputs)]
    return torch.ops.gemc.fused_group(kernel, inputs, autocast)


def _call_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                    clamp_min: int, max_len: int, scale: float | None) -> torch.Tensor:
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out, _ = torch.ops.gemc.jagged_attention(q, k, v, offsets, clamp_min, max_len, scale)
    return out.transpose(1, 2)


def _call_embeddings(name: str, module: nn.Module, entry: dict[str, Any],
                     ids: list[torch.Tensor], offsets: list[torch.Tensor]) -> list[torch.Tensor]:
    flat_ids, flat_offsets, psw = _embedding_inputs(entry, ids, offsets)
    out = torch.ops.gemc.embedding_bag(name, module.weights, module.momentum1,
                                       module.momentum2, flat_ids, flat_offsets, psw,
                                       module._anchor)
    return list(module.split_output(out))


def runner_for(gm: fx.GraphModule, entries: Sequence[dict[str, Any]],
               params: Mapping[str, torch.Tensor], *, device: torch.device | str = "cpu",
               calls: Mapping[str, Callable[..., Any]] | None = None
               ) -> tuple[GraphRunner, list[str]]:
    """The interpreter set up for the entries a compiled graph applies (its schedule,
    launchers and embedding modules are what :func:`build` emits), and the names of those
    it leaves out (``packed_tokens``: see the module doc)."""
    not_applied = [str(e.get("name")) for e in entries if e["kind"] == "packed_tokens"]
    kept = [e for e in entries if e["kind"] != "packed_tokens"]
    return GraphRunner(gm, kept, params, device=device, calls=calls, narrow=False), not_applied


def build(runner: GraphRunner, *, autocast: torch.dtype | None = None,
          measured: Mapping[str, Any] | None = None) -> Built:
    """The rewritten graph of ``runner.gm`` with ``runner.entries`` as custom-op calls (see
    the module doc). The runner's ``params`` feed the graph's parameter placeholders (the
    same tensors: their gradients land on them). ``autocast``: the dtype of the autocast
    the module will run under (None: none); it is baked into the group calls, because
    compiled code does not see the ambient autocast state at run time. ``measured``: per
    entry name, a recorded measurement (see :func:`default_choice`)."""
    device = runner.device
    params = runner.params
    for name, module in runner.tables.items():
        gemc_ops.register_table(name, module)
    calls = dict(runner.calls)
    root = nn.Module()
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attrs: dict[str, fx.Node] = {}
    choices: dict[str, str] = {}
    auto = gemc_ops.dtype_name(autocast)

    def attr(name: str, value: torch.Tensor | nn.Module) -> fx.Node:
        if name not in attrs:
            if isinstance(value, nn.Parameter):
                root.register_parameter(name, value)
            elif isinstance(value, nn.Module):
                root.add_module(name, value)
            else:
                root.register_buffer(name, value)
            attrs[name] = graph.get_attr(name)
        return attrs[name]

    def arg(x: Any) -> Any:
        return fx.node.map_arg(x, env.__getitem__)

    def copy(node: fx.Node) -> None:
        new = graph.node_copy(node, env.__getitem__)
        if "device" in new.kwargs:  # captured on meta: run where the inputs are
            new.kwargs = {**new.kwargs, "device": device}
        env[node] = new

    by_name = runner.by_name
    output: fx.Node | None = None
    for key in runner.order:
        if key[0] == "n":
            node = key[1]
            if node.op == "placeholder":
                fqn = node.meta.get(ir.PARAM)
                if fqn is None:
                    env[node] = graph.placeholder(node.name)
                elif fqn in params:
                    env[node] = attr(_attr_name(fqn), params[fqn])
                else:
                    env[node] = graph.call_function(_missing_param, (fqn,))
            elif node.op == "output":
                output = node
            elif node.target in _SKIP or node in runner.skipped:
                continue
            elif node.name in calls:
                fn = torch._dynamo.disable(calls[node.name])
                env[node] = graph.call_function(fn, arg(node.args), arg(node.kwargs))
            else:
                copy(node)
            continue
        unit = runner.units[key[1]]
        entry = unit["entry"]
        name = str(entry.get("name"))
        kind = entry["kind"]
        choice = default_choice(entry, measured)
        if "structure" in entry and unit.get("shared_operand") and autocast is not None:
            choice = "inductor"  # its epilogue reads the GEMM operand unrounded (see runner)
        choices[name] = choice
        if choice == "inductor":
            for node in unit["nodes"]:
                copy(node)
            continue
        if "structure" in entry:
            impl = unit["run"].impl
            kernel = gemc_ops.register_group(entry, impl)
            gemm = tuple(getattr(impl, a) for a in ("ix", "iw", "ib")) \
                if hasattr(impl, "ix") else ()
            inputs = [env[by_name[n]] for n in entry["binding"]["inputs"]]
            call = graph.call_function(_call_group, (kernel, auto, gemm, inputs))
            for j, out_name in enumerate(entry["binding"]["outputs"]):
                env[by_name[out_name]] = graph.call_function(operator.getitem, (call, j))
        elif kind == "jagged_attention":
            q, k, v, offsets = (env[by_name[entry[x]]] for x in ("q", "k", "v", "offsets"))
            env[unit["nodes"][0]] = graph.call_function(
                _call_attention, (q, k, v, offsets, int(entry["clamp_min"]),
                                  int(entry["max_len"]), entry["scale"]))
        elif kind == "batched_embedding_bag":
            module = runner.tables[entry["name"]]
            mod = attr("t_" + name.replace(".", "__"), module)
            ids = [env[by_name[t["ids"]]] for t in entry["tables"]]
            offs = [env[by_name[t["offsets"]]] for t in entry["tables"]]
            call = graph.call_function(_call_embeddings, (name, mod, entry, ids, offs))
            for j, t in enumerate(entry["tables"]):
                env[by_name[t["output"]]] = graph.call_function(operator.getitem, (call, j))
        elif kind == "transposed_linear":
            bias = env[by_name[entry["bias"]]] if entry.get("bias") else None
            env[unit["nodes"][0]] = graph.call_function(
                transposed_linear, (env[by_name[entry["input"]]],
                                    env[by_name[entry["weight"]]], bias))
        else:
            raise ValueError(f"unknown kernel kind {kind!r}")
    if output is None:
        raise ValueError("graph has no output")
    result = arg(output.args[0])
    if isinstance(result, (list, tuple)) and len(result) == 1:
        result = result[0]
    graph.output(result)
    graph.eliminate_dead_code()
    module = fx.GraphModule(root, graph, class_name="GemcRewritten")
    return Built(module=module, choices=choices, runner=runner)


def _missing_param(fqn: str) -> torch.Tensor:
    raise KeyError(f"no tensor given for parameter placeholder {fqn}")


# ---- measuring a group: gemc's kernel against Inductor's code for the same subgraph ----------


MARGIN = 0.97
"""A generated group is gemc's only when its kernel is at least 3% faster than Inductor's
code for the same nodes: on a tie Inductor wins, as it also fuses across the group's border
(which a per-group measurement cannot see)."""


def _subgraph(runner: GraphRunner, unit: dict[str, Any], device: torch.device
              ) -> fx.GraphModule:
    """The group's own ATen nodes as a module of its binding's inputs and outputs."""
    entry = unit["entry"]
    by_name = runner.by_name
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for name in entry["binding"]["inputs"]:
        env[by_name[name]] = graph.placeholder(name)
    for node in unit["nodes"]:
        new = graph.node_copy(node, env.__getitem__)
        if "device" in new.kwargs:
            new.kwargs = {**new.kwargs, "device": device}
        env[node] = new
    graph.output(tuple(env[by_name[n]] for n in entry["binding"]["outputs"]))
    return fx.GraphModule(nn.Module(), graph)


def _example(node: fx.Node, device: torch.device, autocast: torch.dtype | None
             ) -> torch.Tensor:
    val = node.meta["val"]
    if not val.dtype.is_floating_point:
        return torch.zeros(val.shape, dtype=val.dtype, device=device)
    dtype = val.dtype
    if autocast is not None and node.meta.get(ir.PARAM) is None:
        dtype = autocast  # activations arrive in the autocast dtype; parameters stay fp32
    return torch.randn(val.shape, dtype=dtype, device=device).requires_grad_()


def _time_ms(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median ms of ``fn`` (forward and backward) after two warm-up calls."""
    import statistics
    import time

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_groups(runner: GraphRunner, *, autocast: torch.dtype | None = None,
                   repeats: int = 20, names: Sequence[str] | None = None,
                   timer: Callable[[Callable[[], Any], torch.device, int], float] | None = None
                   ) -> dict[str, dict[str, Any]]:
    """Per generated group (or those in ``names``): forward + backward of gemc's kernel
    (the custom op) and of Inductor's code for the same nodes, at the group's captured
    shapes on the runner's device, and the choice (see MARGIN). A group that fails to run
    either way is recorded with its error and left to Inductor. Meaningful on a GPU only;
    on the CPU the kernels run in Triton's interpreter."""
    out: dict[str, dict[str, Any]] = {}
    for unit in runner.units:
        entry = unit["entry"]
        name = str(entry.get("name"))
        if "structure" not in entry or (names is not None and name not in names):
            continue
        rec: dict[str, Any] = {"kind": entry["kind"]}
        try:
            rec.update(_measure_one(runner, unit, autocast, repeats, timer or _time_ms))
            rec["choice"] = "gemc" if rec["gemc_ms"] < MARGIN * rec["inductor_ms"] \
                else "inductor"
        except Exception as exc:  # noqa: BLE001 - recorded, and the group stays Inductor's
            rec.update(choice="inductor", error=f"{type(exc).__name__}: {exc}")
        out[name] = rec
    return out


def _measure_one(runner: GraphRunner, unit: dict[str, Any], autocast: torch.dtype | None,
                 repeats: int, timer: Callable[[Callable[[], Any], torch.device, int], float]
                 ) -> dict[str, float]:
    entry = unit["entry"]
    device = runner.device
    auto = gemc_ops.dtype_name(autocast)
    impl = unit["run"].impl
    kernel = gemc_ops.register_group(entry, impl)
    gemm = tuple(getattr(impl, a) for a in ("ix", "iw", "ib")) if hasattr(impl, "ix") else ()
    inputs = [_example(runner.by_name[n], device, autocast) for n in entry["binding"]["inputs"]]
    floats = [t for t in inputs if t.requires_grad]
    n_out = len(entry["binding"]["outputs"])
    compiled = torch.compile(_subgraph(runner, unit, device), dynamic=False)

    def step(f: Callable[[], Sequence[torch.Tensor]]) -> Callable[[], None]:
        def run() -> None:
            with torch.autocast(device.type, dtype=autocast or torch.bfloat16,
                                enabled=autocast is not None):
                outs = [o for o in f()[:n_out] if o.is_floating_point()]
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            for t in floats:
                t.grad = None
        return run

    return {"gemc_ms": timer(step(lambda: _call_group(kernel, auto, gemm, inputs)), device,
                             repeats),
            "inductor_ms": timer(step(lambda: compiled(*inputs)), device, repeats)}
