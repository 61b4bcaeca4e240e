"""The plan's precision choices, applied as autocast scopes.

``plan["precision"]`` is a list of sites. The runner executes entries of this form::

    {"target": "*",           "dtype": "bf16", ...}   # the whole forward under autocast
    {"target": "<module fqn>", "dtype": "fp32", ...}  # one module (a region, a layer)

    {"target": "<linear fqn>", "dtype": "fp8", "recipe": {"fwd": {"dtype": "fp8",
     "scaling": "rowwise"}, "dgrad": {...}, "wgrad": {...}}, ...}      # an fp8 linear

``dtype`` is one of ``bf16``, ``fp16``, ``fp32`` (``fp32`` turns autocast off inside that
module, e.g. to keep a numerically sensitive layer out of a bf16 region) or ``fp8``: the
``nn.Linear`` is swapped for :class:`gemc.backends.torch.fp8.Fp8Linear` (same parameters)
running each of its three GEMMs as ``recipe`` says. Other keys (``error``, ``sqnr_db``,
provenance) are informational and kept in the run report. An entry naming a dtype or a
module the runner cannot apply is a :class:`PlanError`, never silently skipped: a plan
whose precision is not what it says would make its predicted error meaningless.
``--precision`` on the command line adds a ``"*"`` entry; a ``"*"`` entry overrides every
entry before it (the compiler writes its ``"*"`` first), so ``--precision fp32`` means the
whole model. ``--fp8-linears N`` (:func:`forced_fp8_entries`) adds a row-wise fp8 entry for
every big linear, whatever the plan chose: a measurement switch, never a default.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from gemc.backends.torch import fp8
from torch import nn

from gemc.errors import GemcUserError, PlanError
from gemc.fp8_recipe import ALIGN, FP8_ROW, Fp8Recipe
from gemc.plan import FP32_MATMUL

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


@dataclass
class PrecisionPlan:
    """The resolved precision sites: a global autocast dtype and per-module overrides."""

    global_dtype: torch.dtype | None = None
    per_module: dict[str, torch.dtype] = field(default_factory=dict)
    fp8_linears: dict[str, fp8.Fp8Recipe] = field(default_factory=dict)  # fqn -> recipe
    # how fp32 GEMMs run ("ieee" / "tf32", the last "*" entry's); None: the process's setting
    fp32_matmul: str | None = None

    @property
    def compute_dtype(self) -> str:
        """The dtype most FLOPs run in, for the MFU peak (``fp32`` without autocast)."""
        if self.global_dtype in (None, torch.float32):
            return "fp32"
        return "bf16" if self.global_dtype == torch.bfloat16 else "fp16"

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """The context the whole forward runs in."""
        if self.global_dtype is None or self.global_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.global_dtype)


def _dtype(entry: dict[str, Any], where: str) -> torch.dtype:
    name = str(entry.get("dtype", "")).lower()
    if name not in DTYPES:
        raise PlanError(
            f"precision {entry.get('dtype')!r} is not supported by the runner",
            where=where,
            fix=f"use one of {', '.join(sorted(set(DTYPES)))} (fp8: give a 'recipe')",
        )
    return DTYPES[name]


def resolve(entries: list[dict[str, Any]], model: nn.Module) -> PrecisionPlan:
    """Check every entry against the model and return what to apply."""
    out = PrecisionPlan()
    modules = dict(model.named_modules())
    for i, entry in enumerate(entries):
        where = f"plan precision[{i}]"
        if not isinstance(entry, dict):
            raise PlanError(f"{where} is not an object", where=where, fix="recompile the plan")
        target = entry.get("target", entry.get("module", entry.get("region")))
        if target is None:
            raise PlanError(
                f"{where} names no target module (keys: {sorted(entry)})",
                where=where,
                fix="give 'target': '*' or a module fqn; per-node precision is not executable",
            )
        if str(entry.get("dtype", "")).lower() == "fp8":
            out.fp8_linears[target] = _fp8_recipe(entry, target, modules, where)
            continue
        dtype = _dtype(entry, where)
        if target in ("*", ""):
            out.global_dtype = dtype
            if "fp32_matmul" in entry:
                out.fp32_matmul = _fp32_matmul(entry, where)
            out.per_module.clear()
            out.fp8_linears.clear()
        elif target in modules:
            out.per_module[target] = dtype
        else:
            raise PlanError(
                f"{where} targets module '{target}', which the model does not have",
                where=where,
                fix="compile the plan again for this model",
            )
    return out


def _fp8_recipe(
    entry: dict[str, Any], target: str, modules: dict[str, nn.Module], where: str
) -> fp8.Fp8Recipe:
    module = modules.get(target)
    if not isinstance(module, nn.Linear):
        raise PlanError(
            f"{where} asks fp8 for '{target}', which is "
            + ("not in the model" if module is None else f"a {type(module).__name__}"),
            where=where,
            fix="fp8 applies to nn.Linear modules only; compile the plan again for this model",
        )
    try:
        fp8.check_linear_dims(module.in_features, module.out_features)
        return fp8.Fp8Recipe.from_dict(entry.get("recipe") or {})
    except ValueError as exc:
        raise PlanError(f"{where}: {exc}", where=where, fix="compile the plan again") from exc


def _fp32_matmul(entry: dict[str, Any], where: str) -> str:
    value = entry["fp32_matmul"]
    if value not in FP32_MATMUL:
        raise PlanError(f"{where} has fp32_matmul {value!r}", where=where,
                        fix=f"use one of {', '.join(FP32_MATMUL)}, or recompile the plan")
    return str(value)


def install(model: nn.Module, plan: PrecisionPlan, device_type: str) -> None:
    """Swap the fp8 linears, then wrap each per-module site's forward in its autocast scope
    (forward pre/post hooks). Sets how fp32 GEMMs run (TF32 or not) where the plan says:
    the plan was priced so, and the process's own setting would otherwise decide."""
    if plan.fp32_matmul is not None:
        torch.backends.cuda.matmul.allow_tf32 = plan.fp32_matmul == "tf32"
    fp8.swap_linears(model, plan.fp8_linears)
    for name, dtype in plan.per_module.items():
        module = model.get_submodule(name)
        stack: list[contextlib.AbstractContextManager] = []

        def pre(_m, args, _stack=stack, _dtype=dtype):  # noqa: ANN001, ANN202
            if _dtype == torch.float32:
                ctx = torch.autocast(device_type=device_type, enabled=False)
                # outside autocast nothing casts for us: lift low-precision inputs to fp32
                args = tuple(
                    a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                    for a in args
                )
            else:
                ctx = torch.autocast(device_type=device_type, dtype=_dtype)
            ctx.__enter__()
            _stack.append(ctx)
            return args

        def post(_m, _args, _out, _stack=stack) -> None:  # noqa: ANN001
            _stack.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


FORCED_FP8_FLAG = "--fp8-linears"


def forced_fp8_entries(model: nn.Module, min_features: int,
                       entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A row-wise fp8 site (all three GEMMs) for every ``nn.Linear`` of ``model`` whose in and
    out features are both >= ``min_features`` (and multiples of 16, as ``_scaled_mm`` needs).

    Why: the precision pass picks fp8 only where the cost model predicts a gain, so measuring
    fp8 where it was not picked needs it forced (the lead's A/B on the zoo's big linears).
    Left alone: a linear the plan already makes fp8 (its recipe stands) and one inside a
    module the plan keeps fp32 (the pass measured bf16 too inaccurate there). The entries go
    after the plan's and ``--precision``'s, so a ``"*"`` entry does not clear them."""
    if isinstance(min_features, bool) or not isinstance(min_features, int) \
            or min_features < ALIGN:
        raise GemcUserError(f"the fp8 linear size {min_features!r} is not an integer >= "
                            f"{ALIGN}", where=FORCED_FP8_FLAG,
                            fix="give the smallest in/out features to force fp8 on, e.g. 1024")
    fp8_sites = {e.get("target") for e in entries if str(e.get("dtype", "")).lower() == "fp8"}
    fp32_sites = [str(e.get("target")) for e in entries
                  if str(e.get("dtype", "")).lower() in ("fp32", "float32")
                  and e.get("target") not in ("*", "")]
    out = []
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear) or fqn in fp8_sites:
            continue
        if min(module.in_features, module.out_features) < min_features or \
                module.in_features % ALIGN or module.out_features % ALIGN:
            continue
        if any(fqn == s or fqn.startswith(s + ".") for s in fp32_sites):
            continue
        out.append({"target": fqn, "dtype": "fp8", "source": FORCED_FP8_FLAG,
                    "recipe": Fp8Recipe.uniform(FP8_ROW).to_dict()})
    return out
