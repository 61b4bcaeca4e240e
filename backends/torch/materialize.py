"""Rebuild the plan's model on meta, prove it is the model the plan was compiled for, and
materialize only what this rank holds.

The plan names the model by entrypoint and arguments; the runner calls the entrypoint under
``torch.device("meta")`` (no weights allocated), recomputes the compiler's fingerprint of
the captured graph and parameter shapes, and refuses to run a plan compiled for another
model. Only rank 0 captures (torch.export is the slow part); the verdict is broadcast.

Materialization: tables are first replaced by their sharded modules (whose parameters are
the local shard, still on meta), then ``to_empty`` allocates every remaining tensor on the
rank's device and :mod:`.init` fills them deterministically.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gemc.backends.torch.embedding import ShardedEmbedding, module_fqn
from gemc.backends.torch.init import (
    TABLE,
    InitReport,
    derive_seed,
    fill_table_slice_,
    init_dense_,
    real_dense_state,
)
from torch import nn

from gemc.errors import PlanError
from gemc.init_recipes import Recipe
from gemc.plan import Model
from gemc.spec import ModelSpec


def _entrypoint_for(model: Model, plan_dir: Path | None) -> str:
    """The plan's entrypoint, resolved from any working directory.

    ``FILE.py:FUNC`` is tried as typed (from the current directory), then relative to the
    plan's folder (``entrypoint_from_plan``, or the typed path for older plans), then at the
    absolute path of the compile. ``package.module:FUNC`` is imported as it is. The model's
    fingerprint is checked afterwards, so a file found in the wrong place cannot run.
    """
    entrypoint = model.entrypoint
    target, sep, func = entrypoint.rpartition(":")
    if not sep or not target.endswith(".py"):
        return entrypoint
    tried: list[tuple[str, Path]] = [("as typed, from the current directory", Path(target))]
    if plan_dir is not None:
        rel = model.entrypoint_from_plan
        rel_file = rel.rpartition(":")[0] if isinstance(rel, str) else target
        tried.append(("relative to the plan's folder", plan_dir / rel_file))
    absolute = model.entrypoint_absolute
    if isinstance(absolute, str):
        tried.append(("where it was compiled", Path(absolute.rpartition(":")[0])))
    for _, path in tried:
        if path.is_file():
            return entrypoint if path == Path(target) else f"{path}:{func}"
    raise PlanError(
        f"the plan's model file is not found: {target} "
        + "; ".join(f"{how}: {path.resolve()}" for how, path in tried),
        where="plan model.entrypoint",
        fix="run from the directory of the compile, keep the model file where it was "
        "relative to the plan, or compile the plan again here",
    )


def load_plan_model(model: Model, plan_dir: Path | None = None) -> ModelSpec:
    """The model the plan names (``Plan.model``), built on meta."""
    from gemc.entrypoint import load_model

    return load_model(_entrypoint_for(model, plan_dir), dict(model.args or {}), device="meta")


def check_fingerprint(
    model: Model, spec: ModelSpec, *, rank: int = 0, world_size: int = 1,
    every_rank: bool = False,
) -> Any:
    """Raise PlanError (on every rank) when the rebuilt model is not the plan's model.

    Returns the capture (``gemc.capture.Captured``) where one was made: rank 0's, and with
    ``every_rank`` (graph mode on several ranks, which executes that very graph) each
    rank's own; None elsewhere. Every capture's fingerprint is checked on every rank.
    """
    from gemc.capture import capture, frozen_draws_warning

    expected = model.fingerprint
    verdict: Any = None
    captured = None
    if rank == 0 or every_rank:
        try:
            # the compile refused host draws unless asked to freeze them: a plan exists, so
            # they were accepted (or predate the check); graph mode runs this very graph
            captured = capture(spec, host_randomness="freeze", constant_values=every_rank)
            if captured.frozen_draws:
                warnings.warn(f"{frozen_draws_warning(captured)} (graph mode runs this "
                              "graph; module mode runs the forward as written)", stacklevel=2)
            verdict = captured.fingerprint
        except Exception as exc:  # a capture error is reported on every rank, not hung
            verdict = exc
    verdicts: list[Any] = [verdict]
    if world_size > 1 and dist.is_initialized():
        verdicts = [None] * world_size
        dist.all_gather_object(verdicts, verdict)
    for got in verdicts:
        if got is None:
            continue
        if isinstance(got, BaseException):
            raise got
        if got != expected:
            raise PlanError(
                "the plan was compiled for a different model: model fingerprint "
                f"{expected[:23]}... in the plan, {str(got)[:23]}... for "
                f"{model.entrypoint} with args {dict(model.args or {})}"
                + _loaded_from(model, spec),
                where="plan model.fingerprint",
                fix="compile the plan again for this model (gemc compile ... --out plan.json)",
            )
    return captured


def _loaded_from(model: Model, spec: ModelSpec) -> str:
    """Where the model was found, when not as the plan names it (see _entrypoint_for)."""
    used = spec.origin[0] if spec.origin else None
    return f" (loaded from {used})" if used and used != model.entrypoint else ""


def materialize_(
    model: nn.Module,
    device: torch.device,
    seed: int,
    table_modules: list[str],
    *,
    origin: tuple[str, dict[str, Any]] | None = None,
    recipes: Mapping[str, Recipe] | None = None,
) -> InitReport:
    """Allocate on ``device`` and initialize deterministically (see :mod:`.init`).

    ``table_modules`` are module paths: a :class:`ShardedEmbedding` fills its shard, a plain
    ``nn.Embedding``/``nn.EmbeddingBag`` (the reference) is filled whole with the same values.
    ``origin``: the spec's (entrypoint, kwargs), to take the author's values of tensors no
    ``reset_parameters()`` writes (built once, for real, only when some tensor needs it).
    ``recipes``: the spec's ``init_recipes`` (gemc.init_recipes): a table is drawn from its
    author's distribution, and a dense weight the author initialised takes the author's
    values. Returns how each part was initialized, for the run report.
    """
    shapes = {
        (int(m.num_embeddings), int(m.embedding_dim))
        for m in (model.get_submodule(n) for n in table_modules)
    }
    author: Any = None
    if origin is not None:
        from gemc.entrypoint import AuthorBuild

        author = AuthorBuild(origin, shapes, derive_seed(seed, "author-build"))
    else:  # a spec built outside gemc: its real values are the author's
        snapshot = real_dense_state(model, skip=table_modules)
        if snapshot:
            author = _Snapshot(snapshot)
    if author is not None:
        author = _Once(author)  # the dense part's values and given tables': one build
    _to_empty_keeping_ties(model, device)
    recipes = dict(recipes or {})
    report = init_dense_(model, seed, skip=table_modules, author_build=author,
                         author_init={f for f, r in recipes.items() if r.by_author})
    for name in table_modules:
        module = model.get_submodule(name)
        report.tables += 1
        report.numel[TABLE] += module.weight.numel() if module.weight is not None else 0
        recipe = recipes.get(f"{name}.weight")
        given = _given_values(author, f"{name}.weight") \
            if recipe is not None and recipe.kind == "given" else None
        if recipe is not None and recipe.kind in ("unknown", "given") and given is None:
            warnings.warn(
                f"gemc: table '{name}.weight' is initialised by the model with "
                f"{recipe.describe()}; the runner cannot draw that shard by shard (nor "
                "find the values in the model's build for real) and fills it N(0, 1) "
                "instead (initialise it with an elementwise distribution, e.g. "
                "nn.init.normal_ / uniform_ / xavier_uniform_, or pass pretrained values "
                "as nn.Embedding.from_pretrained(vectors) / _weight=, to start where eager "
                "does)", stacklevel=2)
            recipe = None
        if isinstance(module, ShardedEmbedding):
            module.init_recipe = recipe
            module.reset_parameters(given)
        elif given is not None:
            module.weight.data.copy_(given)
        else:
            weight = module.weight
            fill_table_slice_(
                weight.data,
                fqn=f"{name}.weight",
                rows=weight.shape[0],
                dim=weight.shape[1],
                row_offset=0,
                col_offset=0,
                seed=seed,
                padding_idx=getattr(module, "padding_idx", None),
                recipe=recipe,
            )
    return report


def _to_empty_keeping_ties(model: nn.Module, device: torch.device | str) -> None:
    """``model.to_empty(device)`` with tied tensors still tied.

    From meta, torch's ``Module._apply`` cannot swap a parameter's data in place, so it
    makes a new Parameter for every module holding one: ``out.weight = emb.weight`` came out
    as two tensors, trained apart, in the runner and in the reference alike (silently: a
    tied model trained as an untied one). Each module's slot is pointed back at the first
    name's new tensor."""
    slots: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for module in model.modules():
        for kind, held in (("_parameters", module._parameters), ("_buffers", module._buffers)):
            for attr, tensor in held.items():
                if tensor is not None:
                    slots.setdefault(id(tensor), []).append((module, kind, attr))
    model.to_empty(device=device)
    for group in slots.values():
        (first, kind, attr), rest = group[0], group[1:]
        for module, other_kind, other_attr in rest:
            getattr(module, other_kind)[other_attr] = getattr(first, kind)[attr]


class _Once:
    """An author's build, run at most once (its dense values and any given tables')."""

    def __init__(self, build: Any) -> None:
        self.build, self.description = build, getattr(build, "description", None)
        self.value: Any = None

    def __call__(self) -> Any:
        if self.value is None:
            self.value = self.build()
        return self.value


def _given_values(author: Any, fqn: str) -> torch.Tensor | None:
    """The values the author's build hands table ``fqn`` (``from_pretrained``), or None."""
    if author is None:
        return None
    real = author()
    value = real.get(fqn) if isinstance(real, Mapping) else \
        dict(real.named_parameters(remove_duplicate=False)).get(fqn)
    return None if value is None or value.is_meta else value.detach()


class _Snapshot:
    """The model's own values, taken before ``to_empty``, served as the author's build."""

    description = "the model's own values (it was built for real, not through gemc)"

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def __call__(self) -> dict[str, torch.Tensor]:
        return self.state


def table_module_names(plan: dict[str, Any]) -> list[str]:
    return [module_fqn(t["fqn"]) for t in plan["tables"]]
