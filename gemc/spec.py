"""The model entrypoint contract: what a user's `build(**kwargs)` returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ModelSpec:
    """A model as gemc sees it.

    ``model.forward(*example_inputs)`` returns the scalar training loss. An argument may
    be a tensor or a structure of them as a data pipeline hands it over (a dict of
    features, nested lists / tuples; gemc.batch_structure flattens it once, where the model
    is built, and the forward still receives it as written). ``example_inputs`` may live on
    any device (a real batch on the CPU, or meta): capture moves them to meta
    with the model, so GEM-scale models compile without allocating a byte of weights;
    their shapes are the representative batch the cost model prices.
    ``make_batch(step, device)`` returns a real synthetic batch (same structure) for the
    runner and the precision probe; it must be deterministic in ``step``.
    """

    model: torch.nn.Module
    example_inputs: tuple[Any, ...]
    make_batch: Callable[[int, torch.device | str], tuple[Any, ...]]
    # Optional, free-form facts the model author wants in the plan (preset, table counts).
    info: dict[str, Any] = field(default_factory=dict)
    # Samples in one batch of ``make_batch``: stated by the author, never guessed from a
    # tensor's first dimension (the first input is often flat jagged ids). samples/s, MFU
    # and the precision probe's batch scaling use it.
    batch_size: int | None = None
    # Set by gemc when it builds the spec through an entrypoint: (entrypoint, kwargs). The
    # runner calls it again to take the author's initial values of tensors that no
    # reset_parameters() writes (see gemc.backends.torch.init.init_dense_).
    origin: tuple[str, dict[str, Any]] | None = field(default=None, init=False, repr=False,
                                                      compare=False)
    # Set by gemc when it builds the spec on meta: parameter / buffer FQN -> how the build
    # initialised it (gemc.init_recipes.Recipe), so the runner starts where eager does.
    init_recipes: dict[str, Any] = field(default_factory=dict, init=False, repr=False,
                                         compare=False)


class BatchSizeWarning(UserWarning):
    """The model states no batch size: samples/s is reported as null, never guessed."""


BATCH_SIZE_MISSING = (
    "the model states no batch size (ModelSpec.batch_size is None and info has no "
    "'batch_size'): samples/s are reported as null and the precision probe cannot scale "
    "its batch; return ModelSpec(..., batch_size=B) with B the samples in one batch"
)


def batch_size_of(spec: ModelSpec) -> tuple[int | None, str | None]:
    """The samples in one batch, and where that number came from.

    ``ModelSpec.batch_size`` first; else ``info["batch_size"]``, which the bundled
    examples set before the field existed; else ``(None, None)``. Never a tensor's first
    dimension: a model's first input is often flat jagged ids, not one row per sample.
    """
    size = spec.batch_size
    if _positive_int(size):
        return int(size), "ModelSpec.batch_size"  # type: ignore[arg-type]
    info = spec.info.get("batch_size") if isinstance(spec.info, dict) else None
    if size is None and _positive_int(info):
        return int(info), "ModelSpec.info['batch_size']"  # type: ignore[arg-type]
    return None, None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
