"""fp8 linear sites in graph mode: the captured graph's linear nodes call gemc's fp8 ops.

Why: in module mode an fp8 site is its ``nn.Linear`` swapped for ``Fp8Linear``; the captured
graph that graph mode trains never calls modules, so the runner refused fp8 next to kernels.
Here each ``aten.linear`` node the site's module ran (its ``nn_module_stack``) calls
``gemc::fp8_linear`` instead (:mod:`.fp8_ops`: its input quantised in one pass), and where
that input is a LayerNorm / RMSNorm over the last dim whose only user is this linear, the
two nodes become one ``gemc::norm_fp8_linear``: the norm writes fp8 and its row scales, the
normalised activation is never written in bf16. Both are custom ops with fakes and autograd
formulas, so Dynamo traces them and Inductor compiles everything around them. Each returns
what the module would (:func:`.fp8.linear_out_dtype`: bf16 under the plan's autocast).

The ops run the rowwise recipe (forward and dgrad fp8 row-wise, wgrad fp8 row-wise or
bf16); a site whose recipe has tensor-wise or fp32 GEMMs is refused by
:func:`unsupported_sites` with the fix. A generated kernel that replaces a rewritten node
(a GEMM epilogue over the linear, a norm group over the fused norm) is left out with a
warning naming it: its ops run in the fp8 op instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx

from gemc.fp8_recipe import BF16, FP8_ROW, Fp8Recipe, fusable_norm
from gemc.ir import module_path

from . import fp8, fp8_ops

__all__ = ["apply_fp8_sites", "op_wgrad_fp8", "unsupported_sites"]

LINEAR = torch.ops.aten.linear.default
NORMS: dict[Any, str] = {torch.ops.aten.layer_norm.default: "layer_norm"}  # -> ATen name
if hasattr(torch.ops.aten, "rms_norm"):
    NORMS[torch.ops.aten.rms_norm.default] = "rms_norm"


def op_wgrad_fp8(recipe: Fp8Recipe) -> bool | None:
    """Whether the ops run ``recipe`` with an fp8 weight gradient (True) or a bf16 one
    (False); None: they do not run it (tensor-wise or fp32 GEMMs)."""
    if recipe.fwd != FP8_ROW or recipe.dgrad != FP8_ROW or recipe.wgrad not in (FP8_ROW, BF16):
        return None
    return recipe.wgrad == FP8_ROW


def unsupported_sites(recipes: Mapping[str, Fp8Recipe]) -> list[str]:
    """The fp8 sites graph mode cannot run, each with its recipe's labels."""
    return [f"{fqn} (fwd={r.fwd.label}, dgrad={r.dgrad.label}, wgrad={r.wgrad.label})"
            for fqn, r in sorted(recipes.items()) if r.any_fp8 and op_wgrad_fp8(r) is None]


def _named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    fn.__name__ = fn.__qualname__ = name
    return fn


def _linear_call(wgrad_fp8: bool) -> Callable[..., Any]:
    def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
            ) -> torch.Tensor:
        out = fp8_ops.linear(x, weight, bias, wgrad_fp8=wgrad_fp8)
        return out.to(fp8.linear_out_dtype(x))
    return _named(run, f"gemc_fp8_linear_{'gw8' if wgrad_fp8 else 'gw16'}")


def _norm_linear_call(kind: str, eps: float | None, wgrad_fp8: bool) -> Callable[..., Any]:
    def run(x: torch.Tensor, norm_weight: torch.Tensor | None, norm_bias: torch.Tensor | None,
            weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        e = torch.finfo(x.dtype).eps if eps is None else eps  # rms_norm's default
        out = fp8_ops.norm_linear(x, norm_weight, norm_bias, e, weight, bias, kind=kind,
                                  wgrad_fp8=wgrad_fp8)
        return out.to(fp8.linear_out_dtype(x))
    return _named(run, f"gemc_{kind}_norm_fp8_linear")


def _arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _fusable_norm(x: Any) -> tuple[str, Any, Any, Any, float | None] | None:
    """(kind, input, weight, bias, eps) when ``x`` is a norm over the last dim alone that
    only this linear reads (:func:`gemc.fp8_recipe.fusable_norm`, the rule the precision
    pass prices by)."""
    if not isinstance(x, fx.Node) or x.op != "call_function" or x.target not in NORMS:
        return None
    kind = fusable_norm(NORMS[x.target], _arg(x, 1, "normalized_shape"), len(x.users))
    if kind is None:
        return None
    if kind == "layer":
        return kind, x.args[0], _arg(x, 2, "weight"), _arg(x, 3, "bias"), \
            float(_arg(x, 4, "eps", 1e-5))
    eps = _arg(x, 3, "eps")
    return kind, x.args[0], _arg(x, 2, "weight"), None, None if eps is None else float(eps)


def apply_fp8_sites(gm: fx.GraphModule, recipes: Mapping[str, Fp8Recipe],
                    kernels: list[dict[str, Any]]
                    ) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Rewrite every linear node of an fp8 site (in place). Returns the kernels that replace
    no rewritten node, and by node name how each was rewritten (``fp8_linear`` or
    ``norm_fp8_linear``; the norm node fused away under its own name, ``fused``)."""
    taken: dict[str, str] = {}
    hit: set[str] = set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not LINEAR:
            continue
        recipe = recipes.get(module_path(node))
        if recipe is None or not recipe.any_fp8:
            continue
        hit.add(module_path(node))
        wgrad = op_wgrad_fp8(recipe)
        if wgrad is None:
            raise ValueError(f"fp8 site {module_path(node)}: recipe not run by the fp8 ops")
        x, weight, bias = node.args[0], _arg(node, 1, "weight"), _arg(node, 2, "bias")
        norm = _fusable_norm(x)
        if norm is None:
            node.target = _linear_call(wgrad)
            node.args, node.kwargs = (x, weight, bias), {}
            taken[node.name] = "fp8_linear"
            continue
        kind, inp, nw, nb, eps = norm
        node.target = _norm_linear_call(kind, eps, wgrad)
        node.args, node.kwargs = (inp, nw, nb, weight, bias), {}
        taken[node.name] = "norm_fp8_linear"
        taken[x.name] = "fused"
        gm.graph.erase_node(x)
    missing = sorted(f for f, r in recipes.items() if r.any_fp8 and f not in hit)
    if missing:
        warnings.warn(
            f"gemc: fp8 site(s) {', '.join(missing[:6])} have no aten.linear node in the "
            "captured graph: they run as captured (bf16 under the plan's autocast)",
            stacklevel=2)
    if not taken:
        return kernels, taken
    gm.recompile()
    kept, dropped = [], []
    for entry in kernels:
        hit = [n for n in entry.get("nodes", []) if n in taken]
        (dropped if hit else kept).append(entry)
    if dropped:
        names = ", ".join(str(e.get("name")) for e in dropped[:6])
        warnings.warn(
            f"gemc: {len(dropped)} kernel(s) not applied: they replace a linear of an fp8 "
            f"site or the norm fused into it: {names}; those ops run in gemc's fp8 ops",
            stacklevel=2)
    return kept, taken
