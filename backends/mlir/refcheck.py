"""The independent check: a subgraph through MLIR on the CPU against eager PyTorch.

Two ways to get inputs for a cut-out subgraph:

- ``random_inputs``: fresh random tensors from each input's FakeTensor (floats ~ N(0, 1),
  bools mostly True so a mask never hides a whole row, integers 0 so an index is always in
  range). Right for dense chains (Linear, GELU, LayerNorm, attention with a mask).
- ``record_values``: run the *whole* graph eagerly on a real batch and keep every node's
  value; a subgraph is then fed exactly the values that flow into it there, and its
  outputs are compared with the values the whole graph computed. Right for anything that
  indexes (offsets, positions), where random integers would be out of range.

Eager PyTorch here is the extracted GraphModule itself (or the whole graph) run by
``torch.fx.Interpreter`` with ``device=meta`` arguments moved to the CPU: the same aten
calls the model made, not a second implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gemc.backends.mlir.extract import Extracted
from gemc.backends.mlir.lower import LINALG, lower_graph
from gemc.backends.mlir.refbackend import compile_reference
from torch import fx


class _OnDevice(fx.Interpreter):
    """Run a captured graph on ``device``: factory ops captured on meta allocate there."""

    def __init__(self, gm: fx.GraphModule, device: torch.device) -> None:
        super().__init__(gm)
        self.device = device
        self.values: dict[str, Any] = {}

    def call_function(self, target: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if isinstance(kwargs.get("device"), torch.device):
            kwargs = {**kwargs, "device": self.device}
        return super().call_function(target, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        self.values[n.name] = value
        return value


def run_eager(gm: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    out = _OnDevice(gm, torch.device("cpu")).run(*inputs)
    return tuple(out) if isinstance(out, (list, tuple)) else (out,)


def record_values(gm: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Every node's value (by name) from one eager run of ``gm`` on the CPU."""
    interp = _OnDevice(gm, torch.device("cpu"))
    with torch.no_grad():
        interp.run(*inputs)
    return interp.values


def random_inputs(sub: Extracted, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for node in sub.inputs:
        val = node.meta["val"]
        shape = tuple(int(s) for s in val.shape)
        if val.dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen, dtype=val.dtype))
        elif val.dtype == torch.bool:
            out.append(torch.rand(shape, generator=gen) < 0.9)
        else:
            out.append(torch.zeros(shape, dtype=val.dtype))
    return out


@dataclass
class Comparison:
    """MLIR's and eager's outputs for one subgraph, in ``sub.outputs`` order."""

    names: list[str]
    mlir: tuple[torch.Tensor, ...]
    eager: tuple[torch.Tensor, ...]

    def assert_close(self, rtol: float = 1e-4, atol: float = 1e-4) -> None:
        """fp32 tolerances: the reference backend sums in loop order, not in blocks."""
        assert len(self.mlir) == len(self.eager), (len(self.mlir), len(self.eager))
        for name, got, want in zip(self.names, self.mlir, self.eager):
            torch.testing.assert_close(
                got, want, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m, n=name: f"{n}: {m}"
            )


def compare(
    sub: Extracted,
    inputs: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor] | None = None,
    linalg_text: str | None = None,
) -> Comparison:
    """Run ``sub`` through linalg -> LLVM and eagerly (unless ``expected`` is given)."""
    if linalg_text is None:
        lowered = lower_graph(sub.gm, until=LINALG)
        if lowered.error is not None:
            raise lowered.error
        linalg_text = lowered.texts[LINALG]
    got = compile_reference(linalg_text)(*inputs)
    want = tuple(expected) if expected is not None else run_eager(sub.gm, inputs)
    return Comparison([n.name for n in sub.outputs], got, want)
