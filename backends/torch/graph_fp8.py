"""fp8 linear sites in graph mode: the captured graph's linear nodes call the fp8 linear.

Why: in module mode an fp8 site is its ``nn.Linear`` swapped for
:class:`~gemc.backends.torch.fp8.Fp8Linear`; the captured graph that graph mode trains never
calls modules, so the runner used to refuse a plan with fp8 sites and generated kernels.
Here each ``aten.linear`` node that ran in a site's module (its ``nn_module_stack``) calls
:func:`gemc.backends.torch.fp8.fp8_linear` with the site's recipe instead. That function is
the quantisation as ATen ops (row-wise amax, power-of-two scale, cast to e4m3) in front of
one ``gemc::fp8_linear`` custom op whose autograd formula quantises the output gradient the
same way and runs the backward GEMMs as custom ops (not an ``autograd.Function``, which
torch 2.11's Dynamo failed to trace: see :mod:`.fp8`). So ``torch.compile`` records one node
per site on every torch version, and Inductor fuses each quantisation into the kernel that
produced the operand: a LayerNorm before the linear writes the fp8 activation and its row
scales in the same kernel, the weight's quantisation is one pass over the weight, and the
backward's quantisations of the output gradient fuse into whatever produced it.

Whether the device runs ``_scaled_mm`` natively, and who quantises (ATen ops or gemc's
kernels: ``GEMC_FP8_QUANTIZER``, :data:`.fp8.QUANTIZERS`), are decided here, once, outside the trace
(off a GPU with fp8 tensor cores the same quantisation is dequantised into an fp32 matmul:
the emulation of :mod:`.fp8`). The recipe is baked into each site's call, so a recipe that
changes during the run (the fp8 audit's switch to bf16, :mod:`.fp8_audit`) reaches the
graph only through :func:`retarget_fp8_sites` and a rebuild of the compiled graphs. A
generated kernel that replaces a rewritten linear (a GEMM
epilogue) is left out with a warning naming it; its other ops then run as Inductor compiles
them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx

from gemc.ir import module_path

from . import fp8
from .graph_precision import kernels_outside

__all__ = ["apply_fp8_sites", "retarget_fp8_sites"]

LINEAR = torch.ops.aten.linear.default


def _site_call(recipe: fp8.Fp8Recipe, emulate: bool, quantizer: str) -> Callable[..., Any]:
    """``aten.linear``'s signature, running ``recipe``."""
    def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
            ) -> torch.Tensor:
        return fp8.fp8_linear(x, weight, bias, recipe, emulate=emulate, quantizer=quantizer)

    r = recipe
    run.__name__ = run.__qualname__ = (
        f"gemc_fp8_linear_{r.fwd.label}_{r.dgrad.label}_{r.wgrad.label}".replace("-", "_"))
    return run


def _arg(node: fx.Node, i: int, name: str) -> Any:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name)


def apply_fp8_sites(gm: fx.GraphModule, recipes: Mapping[str, fp8.Fp8Recipe],
                    kernels: list[dict[str, Any]], device: torch.device
                    ) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Rewrite every ``aten.linear`` node of an fp8 site in ``recipes`` (linear fqn -> recipe)
    in place. Returns the kernels that replace no rewritten node, and by node name the site
    each rewritten node belongs to. A site with no linear node in the graph is named in a
    warning (it runs as captured)."""
    emulate = not fp8.hardware_fp8(device)
    quantizer = fp8.default_quantizer()
    taken: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not LINEAR:
            continue
        site = module_path(node)
        recipe = recipes.get(site)
        if recipe is None or not recipe.any_fp8:
            continue
        node.target = _site_call(recipe, emulate, quantizer)
        node.args = (node.args[0], _arg(node, 1, "weight"), _arg(node, 2, "bias"))
        node.kwargs = {}
        taken[node.name] = site
    missing = sorted(f for f, r in recipes.items() if r.any_fp8 and f not in taken.values())
    if missing:
        warnings.warn(
            f"gemc: fp8 site(s) {', '.join(missing[:6])} have no aten.linear node in the "
            "captured graph: they run as captured (in the plan's autocast dtype)",
            stacklevel=2)
    if not taken:
        return kernels, taken
    gm.recompile()
    kept = kernels_outside(kernels, taken, "they replace the linear of an fp8 site",
                           "those linears run in fp8, the rest as Inductor compiles it")
    return kept, taken


def retarget_fp8_sites(gm: fx.GraphModule, nodes: Mapping[str, str],
                       recipes: Mapping[str, fp8.Fp8Recipe], device: torch.device) -> list[str]:
    """Point the nodes :func:`apply_fp8_sites` rewrote (``nodes``: node name -> site) of each
    site in ``recipes`` at that site's new recipe, in place; returns the nodes changed.

    Why a function of its own: the recipe is a constant of the call a node makes, and a
    graph compiled from it keeps it, so changing the module's recipe changes nothing in
    graph mode; the caller rebuilds its compiled graphs after this."""
    emulate = not fp8.hardware_fp8(device)
    quantizer = fp8.default_quantizer()
    changed = []
    for node in gm.graph.nodes:
        site = nodes.get(node.name)
        if site is not None and site in recipes:
            node.target = _site_call(recipes[site], emulate, quantizer)
            changed.append(node.name)
    if changed:
        gm.recompile()
    return changed
