"""The causal ``[L, L]`` mask recognised by its values, not by how it is spelled.

Not a pass: the recogniser ``jagged_patterns`` (and through it ``match-jagged-attention``,
``match-softmax-attention`` and ``match-silu-attention``) asks whether a mask is causal.

Why values: users write the causal mask in many ways, ``torch.tril(torch.ones(L, L))``,
``torch.triu(ones, diagonal=1)`` as the blocked keys (``masked_fill(mask, -inf)``,
``nn.MultiheadAttention``'s bool ``attn_mask``), ``arange(L)[:, None] >= arange(L)[None,
:]``, ``(i - j) >= 0``, ``~(j > i)``, ``triu(ones, 1) == 0``, ``tril(ones) == 1``,
``nn.Transformer.generate_square_subsequent_mask`` (``triu(full(-inf), 1)``),
``torch.log(tril(ones))``, ``where(tril > 0, 0.0, -inf)``, and each is a different graph.
What they share is a function of the two positions. A mask that reads no input, no
weight and no random number is a constant of the graph: its shape is static, so this
module computes it (:func:`square_value`, on the CPU, the subgraph's ATen ops as they are)
and compares the values, entry for entry, with the lower triangle. Exact by construction:
the very ops the model runs, so any spelling that gives these values is the causal mask,
and none that does not.

What it cannot see: a mask that reads the model's weights (a registered buffer, whose
values the ``meta`` capture does not hold): ``jagged_patterns.stored_mask_sources`` and
``backends/triton/causal_mask`` check that one at run time, for HSTU's SiLU attention.
A mask larger than :data:`MAX_ELEMENTS` per intermediate is not computed (no claim).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

from gemc import ir
from gemc.guard_sample import ADDITIVE_MASKED_GAP
from gemc.packed_rules import draws

__all__ = ["MAX_ELEMENTS", "additive_causal", "causal_form", "is_causal_drop",
           "is_causal_keep", "square_value"]

MAX_ELEMENTS = 1 << 24
"""The largest intermediate (elements) computed at compile time: an ``L = 4096`` mask."""
_FORM_KEY = "_gemc_causal_form"  # node.meta cache: {length: causal_form}
_FACTORIES_DEVICE = "device"
_UNINITIALISED = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
                  torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default,
                  torch.ops.aten.new_empty_strided.default}
"""Ops whose values are whatever memory held: computing them proves nothing."""


def _square(shape: tuple[int, ...], length: int) -> bool:
    return len(shape) >= 2 and shape[-2:] == (length, length) \
        and all(int(s) == 1 for s in shape[:-2])


def _computable(nodes: set[fx.Node]) -> bool:
    """Every node is an ATen op (or a getitem of one) that reads no graph input, draws no
    random number and is no uninitialised allocation, with every value at most
    :data:`MAX_ELEMENTS` elements."""
    for n in nodes:
        if n.op != "call_function":
            return False
        target = n.target
        if not (isinstance(target, torch._ops.OpOverload)
                or getattr(target, "__name__", "") == "getitem") or draws(n) \
                or target in _UNINITIALISED:
            return False
        val = n.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        for v in vals:
            if not isinstance(v, torch.Tensor) or v.numel() > MAX_ELEMENTS:
                return False
    return True


def _evaluate(node: fx.Node) -> torch.Tensor | None:
    """``node``'s value, computed from its constant subgraph on the CPU, or None."""
    nodes = ir.ancestors([node])
    if not _computable(nodes):
        return None
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    env: dict[fx.Node, Any] = {}
    with torch.no_grad():
        for n in sorted(nodes, key=order.__getitem__):
            args = fx.node.map_arg(n.args, env.__getitem__)
            kwargs = dict(fx.node.map_arg(n.kwargs, env.__getitem__))
            if _FACTORIES_DEVICE in kwargs:  # a factory: made here, on the CPU
                kwargs[_FACTORIES_DEVICE] = torch.device("cpu")
            kwargs.pop("pin_memory", None)
            try:
                env[n] = n.target(*args, **kwargs)
            except Exception:  # an op this evaluation cannot run: no claim
                return None
    value = env[node]
    return value if isinstance(value, torch.Tensor) else None


def square_value(node: Any, length: int) -> torch.Tensor | None:
    """The ``[L, L]`` values of ``node`` when it is ``[..., L, L]`` (leading dims 1) and a
    constant of the graph (computed from nothing but static shapes and scalars), else
    None."""
    if not isinstance(node, fx.Node) or not _square(tuple(ir.shape_of(node) or ()), length):
        return None
    value = _evaluate(node)
    return None if value is None else value.reshape(length, length)


def causal_form(node: Any, length: int) -> str | None:
    """What ``node`` is as a causal mask, by its values (query ``i``, key ``j``):
    ``"keep"``: the lower triangle ``j <= i``, True / 1 there and False / 0 above (bool, or
    a number of 0 and 1: what ``&``, a multiply and a select by it keep); ``"drop"``: the
    boolean strictly-upper triangle ``j > i``, the keys a causal query may not see
    (``masked_fill``'s mask, ``nn.MultiheadAttention``'s bool ``attn_mask``); additive, 0
    where ``j <= i``: ``"add-inf"`` with ``-inf`` above the diagonal, ``"add-finite"`` with
    finite values at most ``-1e4`` there; None for anything else. Cached on the node (the
    graph's constants do not change; the answer, not the values, is kept)."""
    if not isinstance(node, fx.Node) or not _square(tuple(ir.shape_of(node) or ()), length):
        return None
    cache = node.meta.setdefault(_FORM_KEY, {})
    if length not in cache:
        cache[length] = _form(square_value(node, length), length)
    return cache[length]


def _form(value: torch.Tensor | None, length: int) -> str | None:
    if value is None or value.is_complex():
        return None
    lower = torch.ones(length, length, dtype=torch.bool).tril()
    if value.dtype == torch.bool and torch.equal(value, ~lower):
        return "drop"
    if torch.equal(value, lower.to(value.dtype)):
        return "keep"
    if not value.dtype.is_floating_point or not bool((value[lower] == 0).all()):
        return None
    dropped = value[~lower]
    if bool((dropped == -math.inf).all()):
        return "add-inf"
    if bool((dropped <= -ADDITIVE_MASKED_GAP).all()):
        return "add-finite"
    return None


def is_causal_keep(node: Any, length: int) -> bool:
    """``node``'s values are the causal keep-mask (:func:`causal_form` ``"keep"``)."""
    return causal_form(node, length) == "keep"


def is_causal_drop(node: Any, length: int) -> bool:
    """``node`` is the boolean mask of the keys a causal query may not see
    (:func:`causal_form` ``"drop"``)."""
    return causal_form(node, length) == "drop"


def additive_causal(node: Any, length: int) -> bool | None:
    """Whether ``node`` is an additive causal mask with ``-inf`` above the diagonal (True)
    or a finite value at most ``-1e4`` there (False: the kernel's ``-inf`` fallback would
    differ on a row that sees no key); None when it is no additive causal mask."""
    form = causal_form(node, length)
    return {"add-inf": True, "add-finite": False}.get(form or "")
