"""The author's initialisation of each weight, read from the model's build on meta.

Why: the runner never runs the author's build on the tables (they may be 10^10 rows), and
it re-initialises a dense module that has ``reset_parameters()`` with that method. A
recommendation model's author nearly always initialises otherwise: pytorch-fm's FFM calls
``nn.init.xavier_uniform_`` on its tables, DeepCTR-Torch ``nn.init.normal_(std=1e-4)`` on
its tables and DNN weights, DLRM and TorchRec draw tables from ``U(-sqrt(1/rows), ...)``.
Filled with N(0, 1) instead, a table of a CTR model starts with second-order terms some
orders of magnitude off, and the run silently trains another model than eager.

While the entrypoint builds the model on meta (gemc.entrypoint), every ``torch.nn.init``
call and every in-place random fill of a tensor (``w.data.uniform_(-a, a)``) is seen; the
last one that covers a whole tensor is its *recipe*: an elementwise distribution
(``normal`` mean/std, ``uniform`` low/high, ``constant``), with the xavier / kaiming bounds
computed from the tensor's shape as torch does. A call made from torch's own modules
(``nn.Linear.reset_parameters``) is the module's default; one made from the model's code
is the author's (``by_author``). The runner draws a table's blocks from its recipe
(gemc.backends.torch.init.fill_table_slice_) and takes the author's values of a dense
weight the author initialised (its real build, as for a weight without
``reset_parameters``). A fill that is no elementwise distribution (``orthogonal_``,
``eye_``, ``copy_`` from a pretrained matrix) is recorded as ``unknown`` and named.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, replace
from typing import Any

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


@dataclass(frozen=True)
class Recipe:
    """One elementwise initial distribution: ``normal`` (a = mean, b = std), ``uniform``
    (a = low, b = high), ``constant`` (a = value); ``given``: values the build passed in
    (``nn.Embedding.from_pretrained(vectors)``, ``_weight=``, ``w.data.copy_(vectors)``),
    which only the author's build has; or ``unknown`` (``call`` names it)."""

    kind: str
    a: float = 0.0
    b: float = 0.0
    call: str = ""
    by_author: bool = False
    # a fill of a part of the tensor came after this one: nn.Embedding's reset zeroes its
    # padding row so; an author's whole-table fill afterwards leaves that row drawn
    part_after: bool = False

    def zeroes_padding_row(self) -> bool:
        """Whether the table's padding row starts at zero: unless the author filled the
        whole table after the module's reset zeroed it (RecBole's ``_init_weights``
        ``weight.data.normal_(0, 0.02)`` on an ``nn.Embedding(padding_idx=0)``) and wrote
        no part of it afterwards."""
        return not self.by_author or self.part_after

    def describe(self) -> str:
        if self.kind == "normal":
            return f"N({self.a:g}, {self.b:g}^2)"
        if self.kind == "uniform":
            return f"U({self.a:g}, {self.b:g})"
        if self.kind == "constant":
            return f"constant {self.a:g}"
        if self.kind == "given":
            return f"values given by the build ({self.call})"
        return f"{self.call} (not an elementwise distribution)"


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    field = math.prod(shape[2:]) if len(shape) > 2 else 1
    fan_in = shape[1] * field if len(shape) > 1 else shape[0]
    return fan_in, shape[0] * field


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def recipe_of(call: str, tensor: torch.Tensor, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Recipe:
    """The distribution ``torch.nn.init.<call>(tensor, *args, **kwargs)`` (or the in-place
    method ``tensor.<call>(*args)``) draws from, from the tensor's shape alone."""
    shape = tuple(tensor.shape)
    if call in ("normal_", "trunc_normal_"):  # trunc_normal_'s default cut is +-2 (ignored)
        return Recipe("normal", float(_arg(args, kwargs, 0, "mean", 0.0)),
                      float(_arg(args, kwargs, 1, "std", 1.0)), call)
    if call == "uniform_":
        return Recipe("uniform", float(_arg(args, kwargs, 0, "a" if "a" in kwargs else "from", 0.0)),
                      float(_arg(args, kwargs, 1, "b" if "b" in kwargs else "to", 1.0)), call)
    if call in ("constant_", "fill_"):
        return Recipe("constant", float(_arg(args, kwargs, 0, "val" if "val" in kwargs else "value", 0.0)),
                      call=call)
    if call == "copy_":
        return Recipe("given", call="copy_")
    if call in ("zeros_", "zero_"):
        return Recipe("constant", 0.0, call=call)
    if call == "ones_":
        return Recipe("constant", 1.0, call=call)
    if len(shape) >= 2 and call in ("xavier_uniform_", "xavier_normal_"):
        fan_in, fan_out = _fans(shape)
        std = float(_arg(args, kwargs, 0, "gain", 1.0)) * math.sqrt(2.0 / (fan_in + fan_out))
        if call == "xavier_uniform_":
            return Recipe("uniform", -math.sqrt(3.0) * std, math.sqrt(3.0) * std, call)
        return Recipe("normal", 0.0, std, call)
    if len(shape) >= 2 and call in ("kaiming_uniform_", "kaiming_normal_"):
        a = float(_arg(args, kwargs, 0, "a", 0.0))
        mode = _arg(args, kwargs, 1, "mode", "fan_in")
        nonlinearity = _arg(args, kwargs, 2, "nonlinearity", "leaky_relu")
        fan = _fans(shape)[0 if mode == "fan_in" else 1]
        std = torch.nn.init.calculate_gain(nonlinearity, a) / math.sqrt(fan)
        if call == "kaiming_uniform_":
            return Recipe("uniform", -math.sqrt(3.0) * std, math.sqrt(3.0) * std, call)
        return Recipe("normal", 0.0, std, call)
    return Recipe("unknown", call=call)


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage()._cdata)
    except Exception:  # a tensor subclass without a storage
        return None


def _called_by_author() -> bool:
    """Whether the fill was called from the model's code, not from inside torch (a
    module's own ``reset_parameters``) or gemc."""
    frame = sys._getframe(2)
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(here) or name.startswith(_TORCH_DIR) and (
                "nn" + os.sep + "init.py" in name or "overrides.py" in name
                or "_tensor.py" in name or "utils" + os.sep + "_device.py" in name):
            frame = frame.f_back
            continue
        return not name.startswith(_TORCH_DIR)
    return False


class FillRecorder:
    """The last whole-tensor fill of every storage, while the build runs (see
    gemc.entrypoint's meta build, which calls :meth:`note`)."""

    def __init__(self) -> None:
        self.fills: dict[int, Recipe] = {}

    def note(self, call: str, tensor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            return
        key = _storage_key(tensor)
        if key is None:
            return
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            # a part of a tensor (the padding row's zeroing): not its recipe, but after it
            if key in self.fills:
                self.fills[key] = replace(self.fills[key], part_after=True)
            return
        recipe = recipe_of(call, tensor, tuple(args), dict(kwargs))
        by_author = _called_by_author()
        if recipe.kind == "given" and not by_author:
            return  # a copy inside torch (a module's own build), no author's data
        self.fills[key] = Recipe(recipe.kind, recipe.a, recipe.b, recipe.call, by_author)

    def note_given(self, tensor: Any, call: str) -> None:
        """``tensor``'s values were handed in by the model's code (pretrained vectors)."""
        key = _storage_key(tensor) if isinstance(tensor, torch.Tensor) else None
        if key is not None:
            self.fills[key] = Recipe("given", call=call, by_author=True)

    def recipes(self, model: torch.nn.Module) -> dict[str, Recipe]:
        """Parameter / buffer FQN -> its recipe, for those the build filled."""
        out = {}
        for name, t in (*model.named_parameters(remove_duplicate=False),
                        *model.named_buffers(remove_duplicate=False)):
            key = _storage_key(t)
            if key is not None and key in self.fills:
                out[name] = self.fills[key]
        return out


IN_PLACE_FILLS = ("uniform_", "normal_", "fill_", "zero_", "copy_")
"""Tensor methods the build may fill a weight with directly (``w.data.normal_(0, 0.01)``)."""
