"""Which nodes of a packed token region run on the packed tokens, and which run padded.

Both runners (the Inductor graph's emitter, ``backends/triton/inductor_graph.py``, and the
interpreter, ``backends/triton/graph_runner.py``) compute a region node on the region's
packed tokens only when the op has a packed rule: it is pointwise (or a ``cat``), or it
acts per token on a packed first argument (:data:`FIRST_ONLY`, :data:`SIZED`) drawing no
random numbers (:func:`per_token`; a dropout's mask is drawn over its padded shape, as
eager draws it: :func:`draws`). Any other
op (an SDPA no gemc kernel took, a bag lookup) runs on the padded
tensor, its inputs scattered out and its output gathered back: exact, but at the padded
size. One SDPA has a packed rule of its own: a causal self-attention with no mask
(:func:`causal_self_attention`) over region values runs as gemc's jagged causal attention
on the tokens, where the region's tokens are a prefix of each row (the runners check that
their layout has no kept positions: a compact region's may not be). The cost model reads the same rule (:func:`on_tokens`), so a region is priced,
in time and in memory, at the size each of its nodes runs at. Why: MMoE's causal
self-attention inside its region ran padded while the plan priced it packed, one part of
the plan's 2.2 GB under MMoE's H200 peak (BENCHMARKS.md, eleventh session).

A row lookup of a padded ``[B, L]`` id grid that a region starts at (``aten.embedding``:
DIN's and SASRec's history tables) runs on the tokens too (:func:`gathered_lookup`): the
runners gather the *ids* to the region's layout and look up only those, instead of looking
up all ``B * L`` rows and gathering the rows. Exact by construction: a lookup is row-wise,
so each token's row is the one the padded lookup gives it, and the table's gradient adds
exactly the tokens' gradients (the padded rows' gradients were the ones nothing reads).
Why: the padded lookup read ``B * L`` rows and its backward scattered ``B * L`` gradient
rows, the padding ids' all into one row, one atomic after another (DIN h200: 2.6 ms per
history table for its 524,288 padding ids, BENCHMARKS.md "DIN's unpooled dense
gradients"); over the tokens only the real ids and, with padding representatives, one
padding id per row remain.
"""

from __future__ import annotations

import operator
from collections.abc import Container, Mapping
from typing import Any

import torch
from torch import fx

from gemc import ir
from gemc.fusion_spec import elementwise
from gemc.ir import GROUP

aten = torch.ops.aten

SIZED = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                   aten.expand.default})
"""Ops whose size argument names the batch and sequence sizes: rewritten to (1, T)."""
FIRST_ONLY = frozenset({
    aten.linear.default, aten.layer_norm.default, aten.transpose.int, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.flatten.using_ints, aten.unflatten.int,
    aten.unbind.int, aten.split.Tensor, aten.chunk.default, aten.clone.default,
    aten.contiguous.default, aten.select.int, aten.dropout.default,
    aten._to_copy.default, aten.to.dtype, aten.alias.default, aten.detach.default,
    aten.sum.dim_IntList, aten.mean.dim, operator.getitem,
})
"""Ops that act per token when their first argument is packed (the rest are weights,
dims or dtypes)."""


def is_pointwise(node: fx.Node) -> bool:
    """An elementwise op (or ``cat``): runs on packed tokens whatever its inputs are."""
    return elementwise(node) or node.target is aten.cat.default


def draws(node: fx.Node) -> bool:
    """The op draws random numbers: ATen tags it ``nondeterministic_seeded`` (dropout,
    ``bernoulli``, ``rand_like``, ...), unless it is a dropout that draws none (``p`` 0 or
    not training: ATen returns its input without touching the generator).

    Why it matters: a draw is one number per element of the op's shape, in order, so on
    the packed tokens (``[1, T, ...]``) the same generator hands the real tokens other
    numbers than eager's ``[B, L, ...]`` op gives them: torch's own encoder layer with its
    default dropout trained on other dropout masks than eager under gemc's packed region
    (its loss 12% off eager's at step 1, where the runner seeds both alike). Such an op
    runs on the padded tensor (its input scattered, the same op, its output gathered back):
    eager's draws exactly, at the padded size."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload) \
            or torch.Tag.nondeterministic_seeded not in t.tags:
        return False
    if t in (aten.dropout.default, aten.native_dropout.default):
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p")
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return not (p == 0 or train is False)
    return True


def per_token(node: fx.Node) -> bool:
    """The op acts per token on a packed first argument (:data:`FIRST_ONLY`,
    :data:`SIZED`) and draws no random numbers (:func:`draws`); the caller checks that the
    first argument is packed."""
    return (node.target in FIRST_ONLY or node.target in SIZED) and not draws(node)


def causal_self_attention(node: fx.Node) -> bool:
    """``scaled_dot_product_attention(q, k, v, is_causal=True)`` with no mask, no dropout,
    no grouped heads, and queries, keys and values of one shape (a self-attention).

    Why it may run on a region's tokens: over a history padded at its end (a prefix kept
    per row, which a non-compact region's check proves at run time), a real query at
    position p sees the keys 0..p, all real, so its row is the jagged causal attention's
    over the row's tokens, exactly; the padding query rows it would also compute are the
    region's padding, which the pass proved nothing reads (MMoE's causal history tower,
    written as SASRec is: right-padded, ``is_causal=True``, no mask)."""
    if node.target is not aten.scaled_dot_product_attention.default:
        return False
    a = ir.sdpa_args(node)
    if a["is_causal"] is not True or a["attn_mask"] is not None or a["dropout_p"] \
            or a["enable_gqa"]:
        return False
    shapes = [ir.shape_of(a[x]) if isinstance(a[x], fx.Node) else None
              for x in ("query", "key", "value")]
    return shapes[0] is not None and len(shapes[0]) == 4 and shapes[0] == shapes[1] == shapes[2]


def attention_operands(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node]:
    """q, k and v of a :func:`causal_self_attention` node."""
    a = ir.sdpa_args(node)
    return a["query"], a["key"], a["value"]


def gathered_lookup(node: fx.Node, members: Container[fx.Node]) -> bool:
    """Region node ``node`` is a row lookup whose ids the runners gather to the region's
    layout before looking up (see the module doc): ``aten.embedding`` of a weight and an id
    tensor from outside the region (``members``), its region dims two plain dims of the
    ids (the output is ``ids.shape + [d]``), without ``scale_grad_by_freq`` (its gradient
    divides by each id's count over the whole grid, which the padding ids change)."""
    if node.op != "call_function" or node.target is not aten.embedding.default \
            or len(node.args) < 2:
        return False
    weight, ids = node.args[0], node.args[1]
    if not isinstance(ids, fx.Node) or ids in members or weight in members:
        return False
    scale = node.args[3] if len(node.args) > 3 else node.kwargs.get("scale_grad_by_freq")
    dims = (node.meta.get(ir.PACKED) or {}).get("dims")
    rank = len(ir.shape_of(ids) or ())
    return not scale and dims is not None and len(dims) == 2 and dims[0] != dims[1] \
        and 0 <= min(dims) and max(dims) < rank


def runs_packed(node: fx.Node, packed: Container[fx.Node]) -> bool:
    """Whether the runners compute region node ``node`` on the packed tokens (``packed``:
    the region's nodes). False: it runs on the padded tensor and is gathered back."""
    if is_pointwise(node) or gathered_lookup(node, packed):
        return True
    if causal_self_attention(node):
        return all(x in packed for x in attention_operands(node))
    first = node.args[0] if node.args else None
    return per_token(node) and isinstance(first, fx.Node) and first in packed


def source_names(region: Mapping[str, Any]) -> set[str]:
    """The nodes a region's facts (``gemc.packed_region``) name as its sources: the padded
    tensors the runners build the tokens from (HSTU's q, k and v: three), which run on the
    tokens whatever their op."""
    return {str(f["padded_from"]) for f in region.get("sources") or [region]
            if "padded_from" in f}


def on_tokens(node: fx.Node, members: Container[fx.Node], sources: Container[str]) -> bool:
    """Whether region node ``node`` runs on the region's tokens in the runners: a member of
    a gemc kernel (it runs on the tokens in place), a source named in ``sources``
    (:func:`source_names`), or an op with a packed rule (:func:`runs_packed`)."""
    return node.meta.get(GROUP) is not None or node.name in sources \
        or runs_packed(node, members)
