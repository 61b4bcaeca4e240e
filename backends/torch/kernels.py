"""The plan's generated kernels, substituted into the model through a registry.

``plan["kernels"]`` lists kernels the compiler generated or selected. The runner executes
entries of this form::

    {"name": "...", "kind": "<registered kind>", "replaces": ["<module fqn>", ...],
     "source": "path/to/kernel.py", "sha256": "<hex of the source file>", ...}

``kind`` picks an *applier* registered with :func:`register`: a function
``applier(model, entry, ctx) -> None`` that swaps the named modules for ones calling the
kernel (as an autograd function). ``source``/``sha256``, when given, are checked before
anything is applied, so a plan never runs a kernel other than the one it was compiled
with. An entry whose kind nobody registered, or whose source is missing or changed, is a
:class:`PlanError`: silently running the eager ops instead would report the wrong speed and
hide the fact that the plan was not executed as written.

The kinds the compiler emits are declared in :mod:`gemc.kernel_kinds`; those of mode
``graph`` (all of them today: fused groups, ``batched_embedding_bag``, the attentions,
``transposed_linear``, and the ``packed_tokens`` layout) replace graph nodes rather than
modules and are executed by graph mode (:mod:`.graph_mode`), not through this registry. The registry is for kernels that
swap whole modules, which keeps them usable in multi-rank (module-mode) runs; backends
register their appliers on import, and ``--kernel-module`` on the command line imports such
a module before the plan is applied.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from gemc.errors import PlanError


@dataclass(frozen=True)
class KernelContext:
    """What an applier may need: where it runs and the plan it belongs to."""

    device: str
    rank: int
    world_size: int
    plan_dir: Path
    plan: dict[str, Any]


Applier = Callable[[nn.Module, dict[str, Any], KernelContext], None]
_REGISTRY: dict[str, Applier] = {}


def register(kind: str, applier: Applier) -> None:
    """Make ``kind`` executable; a second registration of the same kind replaces the first."""
    _REGISTRY[kind] = applier


def registered() -> list[str]:
    return sorted(_REGISTRY)


def import_modules(names: list[str]) -> None:
    """Import modules that register appliers (``--kernel-module``)."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise PlanError(
                f"kernel module '{name}' could not be imported: {exc}",
                where="--kernel-module",
                fix="install the backend or drop --kernel-module",
            ) from exc


def _check_source(entry: dict[str, Any], where: str, plan_dir: Path) -> None:
    source = entry.get("source")
    if source is None:
        return
    path = Path(source)
    if not path.is_absolute():
        path = plan_dir / path
    if not path.is_file():
        raise PlanError(
            f"{where}: kernel source '{source}' does not exist",
            where=where,
            fix="keep the generated kernel files next to the plan (compile again)",
        )
    expected = entry.get("sha256")
    if expected:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != str(expected).removeprefix("sha256:"):
            raise PlanError(
                f"{where}: kernel source '{source}' changed since the plan was compiled",
                where=str(path),
                fix="compile the plan again",
            )


def apply(model: nn.Module, entries: list[dict[str, Any]], ctx: KernelContext) -> list[str]:
    """Check every entry, then apply each; returns the names applied (for the report)."""
    for i, entry in enumerate(entries):
        where = f"plan kernels[{i}]"
        if not isinstance(entry, dict):
            raise PlanError(f"{where} is not an object", where=where, fix="recompile the plan")
        kind = entry.get("kind")
        if kind not in _REGISTRY:
            raise PlanError(
                f"{where} ({entry.get('name', '?')}) has kind {kind!r}, which the runner "
                "cannot execute",
                where=where,
                fix=(
                    f"known kinds: {', '.join(registered()) or '(none registered)'}; import "
                    "the backend that provides it with --kernel-module, or compile without it"
                ),
            )
        _check_source(entry, where, ctx.plan_dir)
    applied = []
    for entry in entries:
        _REGISTRY[entry["kind"]](model, entry, ctx)
        applied.append(str(entry.get("name", entry["kind"])))
    return applied
