"""Module-scoped precision sites in graph mode: the plan's per-module autocast, node by node.

Why: in module mode a site (``{"target": "top.0", "dtype": "fp32"}``) is a pair of forward
hooks around the module (:func:`gemc.backends.torch.precision.install`). The captured graph
that graph mode trains never calls those hooks, so the runner used to refuse such a plan
whenever it also had kernels — a plan gemc's own precision pass emits (DLRM's top MLP keeps
its first and last layers fp32 when bf16 misses the SQNR bound). Here each node the module
ran (its ``nn_module_stack``) is wrapped in that scope instead: fp32 turns autocast off and
lifts narrower float inputs to fp32, exactly as the hook lifts the module's inputs (inside
the module every value is then fp32 already); another dtype runs under
``torch.autocast(dtype)``. Dynamo traces the wrapper's context manager, so Inductor compiles
the scoped ops like any others.

A kernel that replaces a scoped node would run at the whole model's precision instead of
the site's; such kernels are left out, with a warning that names them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx

from gemc.ir import innermost_scope, module_path

__all__ = ["kernels_outside", "scope_module_precision"]


def _lift(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float32 \
            and x.dtype.itemsize < 4:
        return x.float()
    if isinstance(x, (list, tuple)):
        return type(x)(_lift(v) for v in x)
    return x


def scoped(op: Callable[..., Any], dtype: torch.dtype, device_type: str) -> Callable[..., Any]:
    """``op`` run in a site's scope (see the module doc)."""
    if dtype == torch.float32:
        def run(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device_type=device_type, enabled=False):
                return op(*_lift(args), **{k: _lift(v) for k, v in kwargs.items()})
    else:
        def run(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device_type=device_type, dtype=dtype):
                return op(*args, **kwargs)
    run.__name__ = f"gemc_{str(dtype).removeprefix('torch.')}_scope"
    run.__qualname__ = run.__name__
    return run


def scope_module_precision(gm: fx.GraphModule, sites: Mapping[str, torch.dtype],
                           kernels: list[dict[str, Any]], device_type: str
                           ) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Wrap every node of ``gm`` that ran inside a site's module in that site's scope (in
    place). Returns the kernels that replace no scoped node, and by node name the site each
    scoped node took (for the run report and tests)."""
    taken: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        site = innermost_scope(module_path(node), sites)
        if site is None:
            continue
        node.target = scoped(node.target, sites[site], device_type)
        taken[node.name] = site
    if not taken:
        return kernels, taken
    gm.recompile()
    kept = kernels_outside(
        kernels, taken,
        "they replace ops inside a module-scoped precision site and would run at the whole "
        "model's precision", "their ops run in the site's precision instead")
    return kept, taken


def kernels_outside(kernels: list[dict[str, Any]], taken: Mapping[str, str], why: str,
                    instead: str) -> list[dict[str, Any]]:
    """The kernels that replace no node of ``taken`` (node name -> its site); the others are
    left out with one warning naming each and the sites it touches (``why``: why they cannot
    run, ``instead``: what runs in their place)."""
    kept, dropped = [], []
    for entry in kernels:
        hit = sorted({taken[n] for n in entry.get("nodes", []) if n in taken})
        if hit:
            dropped.append((entry, hit))
        else:
            kept.append(entry)
    if dropped:
        names = ", ".join(f"{e.get('name')} ({'/'.join(h)})" for e, h in dropped[:6])
        warnings.warn(f"gemc: {len(dropped)} kernel(s) not applied: {why}: {names}; {instead}",
                      stacklevel=3)
    return kept
