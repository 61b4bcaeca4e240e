"""Structured batches, taken as written: a dict of features, nested lists and tuples.

Real pipelines hand a model a dict (``batch["ids"]``, ``batch["history"]``), a named tuple
or a list of per-feature tensors; the author's ``forward(self, batch)`` reads it so. gemc's
stages after the entrypoint (capture's input placeholders, the guards' checks of an input,
the prefetch's positions of a table's ids in the batch, the runner's batches) all speak
one flat tuple of tensors. So the one translation happens here, once, where the model is
built: :func:`flat_spec` gives a spec whose model takes the batch's tensors flat and hands
the author's forward its own structure, and whose ``make_batch`` flattens each batch the
same way, checking it has the example's structure. Parameter names are the author's (the
model is a shallow copy whose ``forward`` alone differs), and the flat inputs are named
after the forward's own arguments and keys (``batch_ids``), which is how the dumps and
the plan name them.
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.utils._pytree as pytree

from gemc.capture_idioms import NESTED_FIX
from gemc.errors import EntrypointError, GemcUserError
from gemc.spec import ModelSpec


class BatchStructureError(GemcUserError):
    """A batch from ``make_batch`` is not shaped like ``example_inputs``."""


def is_flat(inputs: tuple[Any, ...]) -> bool:
    """Whether ``inputs`` is already a tuple of tensors (nothing to translate)."""
    return all(isinstance(t, torch.Tensor) for t in inputs)


def example_leaves(inputs: tuple[Any, ...], entrypoint: str) -> list[torch.Tensor]:
    """The tensors of an example batch, in the order the flat spec takes them; a value
    that is not a tensor is a named EntrypointError."""
    return _leaves(inputs, entrypoint)[0]


def _leaves(inputs: tuple[Any, ...], entrypoint: str
            ) -> tuple[list[torch.Tensor], list[tuple[Any, ...]], pytree.TreeSpec]:
    with_paths, spec = pytree.tree_flatten_with_path(inputs)
    for path, leaf in with_paths:
        if not isinstance(leaf, torch.Tensor):
            raise EntrypointError(
                f"ModelSpec.example_inputs{pytree.keystr(path)} is a {type(leaf).__name__}, "
                "not a tensor",
                where=f"{entrypoint} -> ModelSpec.example_inputs{pytree.keystr(path)}",
                fix="a batch may nest dicts, lists, tuples and named tuples (a dataclass once "
                "registered with torch.utils._pytree.register_dataclass), and every value in "
                "it must be a tensor (make a constant a tensor, or an attribute of the model)",
            )
        if leaf.is_nested:
            raise _nested_input_error(pytree.keystr(path), leaf, entrypoint)
    if not with_paths:
        raise EntrypointError(
            "ModelSpec.example_inputs holds no tensor",
            where=f"{entrypoint} -> ModelSpec.example_inputs",
            fix="give the batch the forward takes: example_inputs=(batch,)",
        )
    return [leaf for _, leaf in with_paths], [p for p, _ in with_paths], spec


def _nested_input_error(key: str, leaf: torch.Tensor, entrypoint: str) -> EntrypointError:
    """A ``torch.nested`` tensor in the batch. Its ragged dimension is a symbolic "nested
    int" with no integer value: gemc's checks of the batch, its non-strict torch.export
    capture (the graph's input placeholders) and the runner's batches all need dense
    tensors with integer shapes (reading the shape crashed inside torch before this check:
    ``'NestedIntNode' object has no attribute 'int_'``). The same data as a values tensor
    plus an offsets tensor is what gemc treats as jagged."""
    layout = str(leaf.layout).removeprefix("torch.")
    return EntrypointError(
        f"ModelSpec.example_inputs{key} is a torch.nested tensor (layout {layout}); gemc "
        "takes a batch of dense tensors only (its capture, torch.export non-strict, and its "
        "runner cannot take a nested tensor's ragged dimension as an input)",
        where=f"{entrypoint} -> ModelSpec.example_inputs{key}",
        fix="hand the forward the nested tensor's parts, nt.values() and nt.offsets(), as "
        f"two entries of the batch (e.g. batch['hist_values'], batch['hist_offsets']); {NESTED_FIX}",
    )


def input_names(forward: Callable[..., Any], paths: list[tuple[Any, ...]]) -> list[str]:
    """Names for the flat inputs: the forward's argument, then each key or index on the
    way to the tensor (``batch["ids"]`` -> ``batch_ids``), as Python identifiers, unique."""
    try:
        params = [p.name for p in inspect.signature(forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names: list[str] = []
    for path in paths:
        first = path[0].idx if isinstance(path[0], pytree.SequenceKey) else None
        parts = [params[first] if first is not None and first < len(params) else "input"]
        for key in path[1:]:
            part = getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))
            parts.append(str(part))
        name = re.sub(r"\W+", "_", "_".join(parts)).strip("_") or "input"
        if name[0].isdigit():
            name = f"input_{name}"
        base, k = name, 1
        while name in names:
            k += 1
            name = f"{base}_{k}"
        names.append(name)
    return names


def flat_spec(spec: ModelSpec, entrypoint: str) -> ModelSpec:
    """``spec`` with a flat batch: itself when its inputs are a tuple of tensors already."""
    if is_flat(spec.example_inputs):
        return spec
    leaves, paths, structure = _leaves(spec.example_inputs, entrypoint)
    model = spec.model
    original = type(model).forward
    flat_model = copy.copy(model)  # shares the author's parameters, buffers and submodules
    names = input_names(model.forward, paths)

    def forward(*flat: torch.Tensor) -> Any:
        return original(flat_model, *pytree.tree_unflatten(list(flat), structure))

    # torch.export names its input placeholders after the forward's signature
    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
    flat_model.forward = forward  # type: ignore[method-assign]
    make_batch = spec.make_batch

    def flat_batch(step: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        batch = make_batch(step, device)
        got, got_structure = pytree.tree_flatten(batch)
        if got_structure != structure or not is_flat(tuple(got)):
            raise BatchStructureError(
                f"make_batch({step}) returned a batch shaped {_shape_text(got_structure)}, "
                f"but example_inputs is shaped {_shape_text(structure)}",
                where=f"{entrypoint} -> ModelSpec.make_batch({step}, {str(device)!r})",
                fix="return the same structure (keys, nesting, order) as example_inputs, "
                "with tensors only",
            )
        return tuple(got)

    flat = replace(spec, model=flat_model, example_inputs=tuple(leaves), make_batch=flat_batch)
    flat.origin = spec.origin
    return flat


def _shape_text(structure: pytree.TreeSpec) -> str:
    text = str(structure)
    return text if len(text) <= 300 else text[:297] + "..."
