"""torch-mlir: FX graph -> torch dialect -> linalg-on-tensors, with diagnostics kept.

torch-mlir is optional at runtime (the GPU machines do not have it), so nothing here is
imported at module load: ``available()`` says whether it can be, and every function imports
it on first use. Pipelines are run through our own pass manager call rather than
``torch_mlir.compiler_utils.run_pipeline_with_repro_report``, because that one lets MLIR's
diagnostics go straight to the process's stderr and leaves a repro file in /tmp on every
failure; here they are collected and returned as the reason an op does not lower.

Stages (the names used in file names and in ``unsupported.txt``):

- ``raw``: the FX importer's output (``torch.aten.*`` ops, or ``torch.operator "..."`` for
  ops the torch dialect does not know), before any torch-mlir pass;
- ``torch``: torch-mlir's backend contract (decomposed, value semantics, shapes known);
- ``linalg``: linalg-on-tensors (+ arith, math, tensor, tm_tensor), what a CPU/GPU code
  generator consumes.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from typing import Any

from torch import fx

RAW, TORCH, LINALG = "raw", "torch", "linalg"
TORCH_PIPELINE = (
    "builtin.module(func.func(torch-match-quantized-custom-ops),"
    "torchdynamo-export-to-torch-backend-pipeline)"
)
LINALG_PIPELINE = (
    "builtin.module(torch-backend-to-linalg-on-tensors-backend-pipeline{allow-non-finites=true})"
)


def available() -> bool:
    """Whether torch-mlir can be imported (it is not installed on every machine)."""
    try:
        return importlib.util.find_spec("torch_mlir.fx") is not None
    except ModuleNotFoundError:
        return False


class LoweringError(Exception):
    """A pipeline failed; ``messages`` are MLIR's error diagnostics, first one first."""

    def __init__(self, stage: str, messages: list[str]) -> None:
        self.stage = stage
        self.messages = messages or ["pass pipeline failed without a diagnostic"]
        self.leftover: list[str] = []  # torch ops still in the module when it failed
        super().__init__(f"lowering to {stage} failed: {self.messages[0]}")


@dataclass
class Lowered:
    """The text of each stage reached, and why the next one was not (if it was not)."""

    texts: dict[str, str] = field(default_factory=dict)
    error: LoweringError | None = None

    @property
    def reached(self) -> str | None:
        return next((s for s in (LINALG, TORCH, RAW) if s in self.texts), None)


def new_context() -> Any:
    """An MLIR context with the torch dialect registered (upstream dialects load lazily)."""
    from torch_mlir import ir
    from torch_mlir.dialects import torch as torch_d

    ctx = ir.Context()
    torch_d.register_dialect(ctx)
    return ctx


def import_graph(gm: fx.GraphModule, func_name: str = "main", context: Any = None) -> Any:
    """Import a graph whose placeholders are all function arguments (parameters included:
    nothing is frozen into the module, so a GEM-scale graph on ``meta`` imports without
    weights). Types come from each node's FakeTensor ``val``."""
    from torch_mlir.extras.fx_importer import FxImporter

    importer = FxImporter(context=context if context is not None else new_context())
    importer.import_stateless_graph(gm.graph, func_name=func_name)
    return importer.module


def run_pipeline(module: Any, pipeline: str, stage: str) -> None:
    """Run ``pipeline`` on ``module`` in place; raise LoweringError with the diagnostics."""
    from torch_mlir import ir
    from torch_mlir.passmanager import PassManager

    messages: list[str] = []

    def on_diagnostic(diag: Any) -> bool:
        if diag.severity == ir.DiagnosticSeverity.ERROR:
            text = str(diag.message).strip()
            notes = [str(n.message).strip() for n in diag.notes]
            messages.append("; ".join([text, *notes]) if notes else text)
        return True  # handled: keep it off the process's stderr

    ctx = module.context
    handler = ctx.attach_diagnostic_handler(on_diagnostic)
    try:
        with ctx:
            ctx.emit_error_diagnostics = True
            pm = PassManager.parse(pipeline)
            try:
                pm.run(module.operation)
            except Exception as exc:  # MLIRError: its text holds the same diagnostics
                raise LoweringError(stage, messages or [_first_line(str(exc))]) from None
    finally:
        handler.detach()


def lower_graph(
    gm: fx.GraphModule, func_name: str = "main", until: str = LINALG, context: Any = None
) -> Lowered:
    """Import ``gm`` and lower it stage by stage, keeping the text of every stage reached.

    Never raises for an op torch-mlir does not handle: the failure is in ``Lowered.error``.
    ``context``: reuse one (creating a context costs more than lowering a small graph).
    """
    out = Lowered()
    try:
        module = import_graph(gm, func_name, context)
    except Exception as exc:  # the importer raises plain Python errors for unknown values
        out.error = LoweringError(RAW, [f"{type(exc).__name__}: {_first_line(str(exc))}"])
        return out
    out.texts[RAW] = str(module)
    if until == RAW:
        return out
    for stage, pipeline in ((TORCH, TORCH_PIPELINE), (LINALG, LINALG_PIPELINE)):
        try:
            run_pipeline(module, pipeline, stage)
        except LoweringError as exc:
            exc.leftover = leftover_torch_ops(str(module))
            out.error = exc
            return out
        out.texts[stage] = str(module)
        if stage == until:
            break
    return out


def parsing_context() -> Any:
    """A context that knows every dialect our stages print: torch, plus the ones the
    linalg lowering emits that are not upstream (``tm_tensor``, ``torch_c``).

    torch-mlir's Python API registers only the torch dialect; the others are loaded as
    dependencies of the passes that produce them. Running the linalg pipeline once on an
    empty module loads them, the same way a real lowering would."""
    from torch_mlir import ir

    ctx = new_context()
    with ctx:
        empty = ir.Module.parse("module {}")
    run_pipeline(empty, LINALG_PIPELINE, LINALG)
    return ctx


def parse_module(text: str, context: Any = None) -> Any:
    """Parse MLIR text written by this module (any stage) back into a Module."""
    from torch_mlir import ir

    ctx = context if context is not None else parsing_context()
    with ctx:
        return ir.Module.parse(text)


_TORCH_OP = re.compile(r'torch\.operator "([\w.]+)"|\b(torch\.(?:aten|prim)\.[\w.]+)')


def leftover_torch_ops(text: str) -> list[str]:
    """The torch-dialect compute ops a failed lowering left behind, in order of appearance.

    MLIR's first diagnostic often names a constant the failed op used (``torch.constant.int``)
    rather than the op itself; the ops still in the module say which one it was."""
    found: dict[str, None] = {}
    for m in _TORCH_OP.finditer(text):
        found.setdefault(m.group(1) or m.group(2), None)
    return list(found)


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[0][:500] if lines else "(no message)"
