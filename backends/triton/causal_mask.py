"""A causal mask read from the model's weights, checked at run time, and HSTU's padded
formula for when it is not one.

Why: generative-recommenders' HSTU registers its causal mask once,
``register_buffer("_attn_mask", torch.tril(torch.ones(M, M)))``, and multiplies the SiLU
scores by ``_attn_mask[:n, :n]``. gemc captures the graph on ``meta``, so the buffer's
values are not in it and ``match-silu-attention`` cannot prove the mask causal; it records
the factor as a candidate (``causal_mask``, computed from the weights ``causal_mask_of``).
Here the runner decides: :func:`stored_mask_is_causal` compares the factor with the
lower-triangular ones on its device (one host read), and caches the answer per the
weights' storage, version and layout, so the check runs once per change of the buffer
(an in-place write, ``load_state_dict``'s copy, a new tensor assigned), not every step.
When it is not causal, :func:`silu_formula` computes what the model's graph computed, on
the padded tensors (forward and, through autograd, backward), counted as a fallback in
``key_padding_attention.STATS`` (the run report's ``guarded_attention``).

What the cache cannot see: a write that bypasses the version counter (``mask.data[...] =
...``, or a write through ``.detach()``'s tensor: both share the storage, not the version).
Write a buffer in place as ``with torch.no_grad(): mask.copy_(...)`` or assign a new one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["CHECKS", "MaskChecks", "silu_formula", "stored_mask_is_causal"]

_CACHE_SIZE = 64
_cache: OrderedDict[tuple[Any, ...], tuple[tuple[torch.Tensor, ...], bool]] = OrderedDict()


@dataclass
class MaskChecks:
    """How often a stored causal mask was compared with the ``tril`` (``checks``) and
    found not to be one (``not_causal``); a cached answer counts in neither."""

    checks: int = 0
    not_causal: int = 0

    def reset(self) -> None:
        self.checks = self.not_causal = 0
        _cache.clear()

    def as_dict(self) -> dict[str, int]:
        return {"checks": self.checks, "not_causal": self.not_causal}


CHECKS = MaskChecks()


def _key(mask: torch.Tensor, sources: Sequence[torch.Tensor], length: int
         ) -> tuple[Any, ...]:
    """Each weight's storage address, version and layout, with the factor's dtype and
    shape: the factor is a function of these weights only (the pass proved it), so equal
    keys mean an equal factor. The cache holds the weights themselves, so no other tensor
    can take their storage's address while the answer is kept."""
    return (length, mask.dtype, tuple(mask.shape), mask.device, tuple(
        (s.untyped_storage().data_ptr(), s.storage_offset(), s._version, tuple(s.shape),
         s.stride(), s.dtype) for s in sources))


def stored_mask_is_causal(mask: torch.Tensor, sources: Sequence[torch.Tensor],
                          length: int) -> bool:
    """Whether ``mask`` (``[..., L, L]``, leading dims 1) is the lower-triangular ones, value
    for value (bool, or 0 / 1 in its dtype: exactly what multiplying by it or selecting
    with it keeps), and needs no gradient (a trained mask's gradient is the formula's).
    Cached per ``sources`` (the weights it is computed from): see the module doc."""
    if mask.requires_grad or tuple(mask.shape[-2:]) != (length, length) \
            or any(int(s) != 1 for s in mask.shape[:-2]):
        return False
    key = _key(mask, sources, length)
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit[1]
    CHECKS.checks += 1
    tril = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    square = mask.detach().reshape(length, length)
    causal = bool(torch.equal(square, tril.to(square.dtype)))  # the one host read
    CHECKS.not_causal += not causal
    _cache[key] = (tuple(sources), causal)
    while len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return causal


def silu_formula(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                 bias: torch.Tensor | None, entry: Mapping[str, Any]) -> torch.Tensor:
    """The model's padded HSTU attention of ``[B, H, L, D]`` q, k, v under its whole
    visibility mask ``visible`` (as the scores read it, broadcast to ``[B, H, L, L]``):
    ``silu(scale * q k^T + bias) / norm``, masked as the model masked it (``where(visible,
    a, 0)`` or ``a * visible``), times v. The exact fallback: every row, padding ones
    included, is the model's, and autograd gives its backward."""
    s = torch.matmul(q, k.transpose(-1, -2))
    if float(entry["scale"]) != 1.0:
        s = s * float(entry["scale"])
    if bias is not None:
        s = s + bias
    a = F.silu(s) / int(entry["norm"])
    # selection keeps a where visible is non-zero (bool, or a float the model compared
    # with 0: ``masked_fill(visible == 0, 0)``); a multiply scales by it
    a = torch.where(visible.to(torch.bool), a, 0.0) if entry.get("visible_where") \
        else a * visible
    return torch.matmul(a, v)
