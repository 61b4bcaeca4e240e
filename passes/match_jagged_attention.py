"""match-jagged-attention: padded SDPA over a jagged history -> the jagged attention kernel.

Why: a recommendation model pads its variable-length histories to ``[B, L, d]`` and masks
the padding keys; at 50% mean fill about half of the attention FLOPs (and of its time on
an H200) are spent on padding. ``gemc.backends.triton.jagged_attention`` computes the same
softmax attention over values + offsets, with work proportional to ``sum(len_b ** 2)``.

The pattern, as the GEM example writes it::

    lengths = offsets[1:] - offsets[:-1]
    row = repeat_interleave(arange(B), lengths); pos = arange(N) - offsets[row]
    seq = new_zeros(B, L, d).index_put((row, pos), values)        # jagged -> padded
    attn_len = lengths.clamp(min=1)                                # optional
    mask = arange(L)[None, :] < attn_len[:, None]                  # key padding
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])

Matched when: the mask is ``arange(L) < lens[:, None]`` (through views), broadcast over
heads and queries; ``lens`` is ``offsets[1:] - offsets[:-1]``, optionally clamped below;
the graph pads a jagged tensor over the same offsets with ``index_put`` (over
``repeat_interleave`` of those lengths) into ``[B, L, ...]``; q, k and v are
``[B, H, L, D]`` views of one projection of a tensor derived from that padded sequence
(so query position ``i`` is sequence position ``i``); no dropout, not causal.

Semantics kept exactly: the kernel runs over the *mask's* lengths (``clamp(min=1)``
included), so a length-0 history attends to its padding slot 0 exactly as the model does
(and the model's ``has_hist`` multiply then zeroes it, as before). Query rows at or past a
row's length are padding: the model computes attention there and never reads it (the
padded positions are masked out of every later key and of the final pooling); the kernel
leaves them zero.

Every other SDPA whose mask is a key-padding mask, whatever its source, becomes a
``key_padding_attention`` (:func:`match_key_padding`): a bool or additive float ``[B, L]``
mask broadcast over heads and queries (a graph input, ``arange < lengths``, offsets,
``nn.MultiheadAttention``'s ``key_padding_mask`` as it exports: ``masked_fill(zeros, ~m,
-inf)`` viewed over heads), optionally and-ed with the causal mask. The graph cannot prove
such a mask is a prefix, so the op (``backends/triton/key_padding_attention``) checks it at
run time and falls back to the padded attention (counted). Self-attention runs jagged when
nothing reads its padding query rows unmasked, else every query row is computed over the
real keys (under a causal mask, where that kernel has no causal rule, it stays padded
SDPA); cross-attention (dense queries of another length: a target item, summary
queries) likewise. Readers of one token per row (``passes/row_reads``: RecBole's
``gather_indexes(out, lengths - 1)``, ``out[arange(B), lengths - 1]``) read the padding
rows only where their positions miss the mask's kept keys: they do not count as readers;
the entry lists them (``read_rows``) and the op checks their positions with the mask,
computing every query row (causal: the exact padded attention) on a call where one
misses. SASRec as RecBole writes it, causal, was padded SDPA for its readout alone. Over
offsets, a reader whose position the graph proves real (``row_reads.kept_by_offsets``:
``out[arange(B), lengths.clamp(min=1) - 1]`` under the same clamped mask, ``out[:, 0]``)
reads no padding query row: the attention stays ``jagged_attention``, unchecked; any other
reader makes it the guarded attention above. An SDPA with no mask at all whose queries are a padded history ``[B, H, L, D]`` over
dense keys ``[B, H, M, D]`` (history items attending to candidate or feature tokens, or to
a learned memory) becomes a ``jagged_query_attention`` (:func:`match_query_padding`) when,
under one of the graph's key-padding masks over ``[B, L]`` (offsets: a proven prefix; any
boolean keep-mask: checked per row at run time, a row that is no prefix computes every query
row), nothing reads its padding query rows unmasked: only ``len_b * M`` of the ``L * M``
scores are computed (``backends/triton/jagged_query_attention``), where its measured time
says it wins (:data:`QUERY_KERNEL_TIME_PER_FILL`). An SDPA left padded carries its reason (``gemc.jagged_skipped``:
``dropout``, ``no-key-padding-mask``, ``mask-varies-over-queries``, ...) in the dump and a
warning.

Every match is priced against the model's own attention first (``attention_choice``: one
rule for the three attention match passes): where gemc's kernel is priced slower (its work
at the fill, plus the host time a guarded call's sync exposes) the model's stays, named
``kept-padded: ...`` with both prices; ``GEMC_ATTENTION_KERNEL`` forces either way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import ir
from gemc.context import PassContext

from .attention_choice import choose
from .jagged_patterns import (
    KeyMask,
    attention_key_mask,
    descends,
    key_padding_mask,
    padded_sequences,
    padding_masks,
    padding_rows_read_by,
    projection_source,
)
from .row_reads import follow_with_reads, read_specs

aten = torch.ops.aten
SKIPPED = ir.PREFIX + "jagged_skipped"  # why an attention was not made jagged (a named reason)

QUERY_KERNEL_TIME_PER_FILL = 3.57
"""The history-query kernel's forward + backward time over padded SDPA's, per unit of fill,
measured on the H200 (fifteenth session, ``benchmarks/kernels.py --cases query``: 9.435 ms
against padded SDPA's 5.281 ms at fill 0.50; B 4,096, L 512, 16 dense keys; the forward
alone 0.94x padded). Its backward costs more per real row than the padded backward saves.
So the kernel replaces the padded SDPA only where ``fill`` times this is under 1 (a fill
under 0.28). A mask given as data has fill 1 at compile time, so it never qualifies."""
QUERY_KERNEL_ENV = "GEMC_QUERY_KERNEL"
"""``always``: apply the history-query kernel wherever it matches, whatever its price (the
kernel's tests and measurements)."""


def match(gm: fx.GraphModule, node: fx.Node) -> dict[str, Any] | None:
    """The jagged-attention facts of an SDPA node, or None when it is not the pattern.
    (Whether its padding rows are read is checked separately: :func:`padding_rows_read_by`.)"""
    if node.target is not aten.scaled_dot_product_attention.default:
        return None
    args = list(node.args) + [None] * (8 - len(node.args))
    q, k, v = args[0], args[1], args[2]
    mask = node.kwargs.get("attn_mask", args[3])
    dropout = node.kwargs.get("dropout_p", args[4] or 0.0)
    causal = node.kwargs.get("is_causal", args[5] or False)
    scale = node.kwargs.get("scale", args[6])
    gqa = node.kwargs.get("enable_gqa", args[7] or False)
    if mask is None or dropout or causal or gqa:
        return None
    shapes = [ir.shape_of(x) for x in (q, k, v)]
    if any(s is None or len(s) != 4 for s in shapes) or not shapes[0] == shapes[1] == shapes[2]:
        return None
    batch, heads, length, head_dim = shapes[0]
    mshape = ir.shape_of(mask)
    if mask is None or ir.dtype_of(mask) != torch.bool or mshape is None or len(mshape) != 4:
        return None
    if mshape[0] != batch or mshape[1] != 1 or mshape[2] != 1 or mshape[3] != length:
        return None
    found = key_padding_mask(mask)
    if found is None or found[2] != length:
        return None
    offsets, clamp_min, _ = found
    source = projection_source(q, k, v)
    if source is None:
        return None
    padded = [p for p in padded_sequences(gm, offsets, length) if descends(source, p)]
    if not padded or (ir.shape_of(offsets) or (0,))[0] != batch + 1:
        return None
    values = padded[0].args[2]
    total = (ir.shape_of(values) or (batch * length,))[0]
    return {
        "offsets": offsets.name,
        "_mask": (offsets, int(clamp_min), int(length)),
        "clamp_min": int(clamp_min),
        "max_len": int(length),
        "heads": int(heads),
        "head_dim": int(head_dim),
        "scale": float(scale) if scale is not None else None,
        "causal": False,
        "padded_from": padded[0].name,
        "fill": round(min(1.0, total / max(1, batch * length)), 6),
    }


def match_key_padding(node: fx.Node) -> dict[str, Any] | str:
    """The facts of an SDPA under a key-padding mask from any source (a graph input, an
    additive float mask, ``arange < lengths``, ``nn.MultiheadAttention``'s key_padding_mask,
    optionally and-ed with the causal mask), or the named reason it is not one. The mask's
    prefix property is not proven here: the op checks it at run time and falls back."""
    a = ir.sdpa_args(node)
    if a["dropout_p"]:
        return "dropout"
    if a["enable_gqa"]:
        return "grouped-query"
    if a["is_causal"] and a["attn_mask"] is not None:
        return "causal-with-explicit-mask"
    shapes = [ir.shape_of(x) for x in (a["query"], a["key"], a["value"])]
    if any(s is None or len(s) != 4 for s in shapes):
        return "not-4d"
    if shapes[1] != shapes[2] or tuple(shapes[0][:2]) != tuple(shapes[1][:2]) \
            or shapes[0][3] != shapes[1][3]:
        return "qkv-shapes"
    batch, heads, length, head_dim = (int(x) for x in shapes[1])
    queries = int(shapes[0][2])
    if a["attn_mask"] is None:
        return "no-key-padding-mask"
    found = attention_key_mask(a["attn_mask"], batch, length)
    if isinstance(found, str):
        return found
    mask, causal = found
    if causal and queries != length:
        return "causal-cross-attention"
    scale = a["scale"]
    return {
        "mask": mask.node.name,
        "_key_mask": mask,
        "additive": mask.additive,
        "causal": bool(causal),
        "zero_padding_queries": queries == length,
        "queries": queries,
        "max_len": length,
        "heads": heads,
        "head_dim": head_dim,
        "scale": float(scale) if scale is not None else None,
        "fill": 1.0,  # unknown at compile time: data, checked per call
    }


def match_query_padding(gm: fx.GraphModule, node: fx.Node) -> dict[str, Any] | None:
    """The facts of an SDPA with no mask whose queries are a padded history ``[B, H, L, D]``
    over dense keys ``[B, H, M, D]``: the first key-padding mask over ``[B, L]`` in the
    graph (:func:`padding_masks`: offsets first, proven prefixes) under which nothing reads
    the output's padding query rows unmasked, or None. Exact whatever q, k, v are: a query
    row's output depends on that row and the keys only, so rows nobody reads may be left
    zero (and get no gradient, as under the mask multiply that discards them in eager)."""
    a = ir.sdpa_args(node)
    if a["attn_mask"] is not None or a["dropout_p"] or a["is_causal"] or a["enable_gqa"]:
        return None
    shapes = [ir.shape_of(x) for x in (a["query"], a["key"], a["value"])]
    if any(s is None or len(s) != 4 for s in shapes) or shapes[1] != shapes[2] \
            or tuple(shapes[0][:2]) != tuple(shapes[1][:2]) or shapes[0][3] != shapes[1][3]:
        return None
    batch, heads, length, head_dim = (int(x) for x in shapes[0])
    for facts in padding_masks(gm, batch, length):
        if padding_rows_read_by(node, facts) is not None:
            continue
        scale = a["scale"]
        common = {"queries": length, "keys": int(shapes[1][2]), "heads": heads,
                  "head_dim": head_dim, "scale": float(scale) if scale is not None else None}
        if isinstance(facts, KeyMask):  # checked at run time: fill unknown
            return {"mask": facts.keep.name, "_mask": facts.keep, **common, "fill": 1.0}
        offsets, clamp_min, _ = facts
        padded = padded_sequences(gm, offsets, length)
        total = (ir.shape_of(padded[0].args[2]) or (batch * length,))[0] if padded \
            else batch * length
        return {"offsets": offsets.name, "clamp_min": int(clamp_min), "_mask": None, **common,
                "fill": round(min(1.0, int(total) / max(1, batch * length)), 6)}
    return None


def _price(node: fx.Node, facts: dict[str, Any], ctx: PassContext) -> dict[str, float] | None:
    topology = ctx.topology
    if topology is None:
        return None
    from gemc.cost_model import op_cost

    gpu, calib = topology.gpu, ctx.calibration
    before = node.meta.get(ir.PREDICTED_MS)
    if before is None:
        before = op_cost.node_cost(node, gpu, calib).total_ms
    a = node.meta.get(ir.ATTENTION) or {}
    dtype = op_cost.dtype_name(ir.dtype_of(node))
    fwd, bwd, _ = op_cost.attention_time(a.get("batch", 1), facts["heads"], facts["max_len"],
                                         facts["max_len"], facts["head_dim"], False, dtype, gpu,
                                         calib)
    # E[len^2] / L^2 <= E[len] / L = fill: the jagged work is at most fill x the padded work.
    convert = 8 * ir.nbytes(node) * 2  # q, k, v, out padded<->jagged, forward and backward
    mem, _ = op_cost.memory_time(convert, gpu, calib, "copy")
    after = 1e3 * ((fwd + bwd) * facts["fill"] + mem)
    return {"before_ms": round(float(before), 6), "after_ms": round(after, 6)}


def _price_guarded(node: fx.Node, facts: dict[str, Any], mask: fx.Node, ctx: PassContext
                   ) -> dict[str, float] | None:
    """A guarded attention's forward+backward ms, padded and as compiled: the fill of a
    data-given mask is unknown at compile time, so the attention is priced at fill 1 (no
    saving claimed) plus what the guard adds: reading the mask, and for the jagged
    self-attention path the padded <-> jagged copies of q, k, v and the output."""
    moved = ir.nbytes(mask) + (8 * ir.nbytes(node) * 2 if facts["zero_padding_queries"] else 0)
    return _price_scaled(node, float(facts["fill"]), moved, ctx)


def _price_query(node: fx.Node, facts: dict[str, Any], mask: fx.Node | None,
                 ctx: PassContext) -> dict[str, float] | None:
    """A query-padded attention's forward+backward ms, padded and as compiled: its work is
    ``sum(len_b) * M``, the padded ``B * L * M`` times the fill exactly (a guarded mask's
    fill is data: priced at 1, plus reading the mask for the check), at the kernel's measured
    cost per unit of fill (:data:`QUERY_KERNEL_TIME_PER_FILL`). No copies: the kernel reads
    the padded layout in place."""
    return _price_scaled(node, float(facts["fill"]) * QUERY_KERNEL_TIME_PER_FILL,
                         ir.nbytes(mask) if mask else 0, ctx)


def _price_scaled(node: fx.Node, fill: float, moved: int, ctx: PassContext
                  ) -> dict[str, float] | None:
    """``before``: the node's padded ms; ``after``: ``before * fill`` plus ``moved`` bytes
    of copies (None without a topology to price on)."""
    topology = ctx.topology
    if topology is None:
        return None
    from gemc.cost_model import op_cost

    gpu, calib = topology.gpu, ctx.calibration
    before = node.meta.get(ir.PREDICTED_MS)
    if before is None:
        before = op_cost.node_cost(node, gpu, calib).total_ms
    mem, _ = op_cost.memory_time(moved, gpu, calib, "copy")
    after = float(before) * fill + 1e3 * mem
    return {"before_ms": round(float(before), 6), "after_ms": round(after, 6)}


def _not_jagged(node: fx.Node, reader: fx.Node) -> str:
    """Why ``node``, over offsets, is not ``jagged_attention``: ``reader`` reads its padding
    query rows. Where the guarded kernel took it with ``reader`` as a checked reader of one
    token per row (``read_rows``: its positions not proven real by the graph), the warning
    says so, as nothing reads the padding unmasked then."""
    reads = (node.meta.get(ir.KERNEL) or {}).get("read_rows") or ()
    if any(r["reader"] == reader.name for r in reads):
        return (f"match-jagged-attention: {node.name} is the guarded kernel, not jagged "
                f"attention: {reader.name} reads one token per row at positions the graph "
                "does not prove real tokens (e.g. lengths - 1 of a row that may be empty), "
                "checked with the mask at run time (the padded attention where one is not)")
    return (f"match-jagged-attention: {node.name} is not jagged attention: the rows of its "
            f"padding queries are read unmasked by {reader.name}")


_KEPT_WARNING = "match-jagged-attention: {node} stays padded SDPA ({why})"


@dataclass(frozen=True)
class MatchJaggedAttention:
    """Annotates matching SDPA nodes with ``gemc.group`` and ``gemc.kernel`` (the facts the
    runner needs: offsets node, clamp, max_len, scale)."""

    name: ClassVar[str] = "match-jagged-attention"
    requires: ClassVar[tuple[str, ...]] = ("classify-ops",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        count = guarded = queries = 0
        for node in gm.graph.nodes:
            if ir.GROUP in node.meta or node.target is not aten.scaled_dot_product_attention.default:
                continue
            facts = match(gm, node)
            if facts is not None:
                # a reader of one token per row whose position the graph proves real
                # (``row_reads.kept_by_offsets``: SASRec's last token under a clamped mask)
                # reads no padding query row: the kernel's zero rows are never read
                flow = follow_with_reads(node, (0, 2), facts.pop("_mask"))
                reader = flow if isinstance(flow, fx.Node) else None
                if reader is None:
                    kept = choose(gm, node, [node], facts, "jagged_attention", ctx,
                                  skip_key=SKIPPED, warning=_KEPT_WARNING)
                    if kept is not None:
                        self._skip(node, kept, ctx)
                        continue
                    gid = f"jagged_attention_{count}"
                    count += 1
                    node.meta[ir.GROUP] = gid
                    price = _price(node, facts, ctx)
                    node.meta[ir.KERNEL] = {"id": gid, "kind": "jagged_attention", **facts,
                                            **(price or {})}
                    continue
            if self._query_padded(gm, node, queries, ctx):
                queries += 1
            elif SKIPPED not in node.meta and self._guarded(gm, node, guarded, ctx):
                guarded += 1
            if facts is not None and reader is not None:
                ctx.warn(_not_jagged(node, reader))
        return PassResult(gm, count + guarded + queries > 0)

    @staticmethod
    def _query_padded(gm: fx.GraphModule, node: fx.Node, index: int, ctx: PassContext
                      ) -> bool:
        """Make ``node`` a ``jagged_query_attention`` if it has no mask and its padding
        query rows (under some key-padding mask of the graph) are never read unmasked."""
        found = match_query_padding(gm, node)
        if found is None:
            return False
        slower = float(found["fill"]) * QUERY_KERNEL_TIME_PER_FILL
        if slower >= 1.0 and os.environ.get(QUERY_KERNEL_ENV) != "always":
            MatchJaggedAttention._skip(
                node, f"query-kernel-slower: fill {found['fill']:g} x {QUERY_KERNEL_TIME_PER_FILL}"
                f" = {slower:.2f} of padded SDPA's time (the kernel's measured backward; "
                f"{QUERY_KERNEL_ENV}=always applies it anyway)", ctx)
            return False
        gid = f"jagged_query_attention_{index}"
        node.meta[ir.GROUP] = gid
        price = _price_query(node, found, found.pop("_mask"), ctx)
        node.meta[ir.KERNEL] = {"id": gid, "kind": "jagged_query_attention", **found,
                                **(price or {})}
        return True

    def _guarded(self, gm: fx.GraphModule, node: fx.Node, index: int, ctx: PassContext
                 ) -> bool:
        """Make ``node`` a guarded key-padding attention if its mask is one (any source);
        else record why not. Padding query rows that something reads are computed (over the
        real keys), except under a causal mask (the varlen-key kernel is not causal)."""
        found = match_key_padding(node)
        if isinstance(found, str):
            self._skip(node, found, ctx)
            return False
        mask: KeyMask = found.pop("_key_mask")
        reader = None
        if found["zero_padding_queries"]:
            flow = follow_with_reads(node, (0, 2), mask)
            reader = flow if isinstance(flow, fx.Node) else None
            if not isinstance(flow, fx.Node) and flow.reads:
                # read one token per row (x[arange(B), lengths - 1]): the padding query
                # rows stay unread, and so zero, where the op's check finds every
                # position kept; where not, it computes them (causal: the padded path)
                found["read_rows"] = read_specs(flow)
        if reader is not None:
            if found["causal"]:
                self._skip(node, f"padding-rows-read-by:{reader.name}", ctx)
                return False
            # every query row computed, over the real keys: exact, a smaller saving
            found["zero_padding_queries"] = False
            found["padding_rows_read_by"] = reader.name
        kept = choose(gm, node, [node], found, "key_padding_attention", ctx, skip_key=SKIPPED,
                      warning=_KEPT_WARNING)
        if kept is not None:  # priced slower than the model's SDPA: see attention_choice
            self._skip(node, kept, ctx)
            return False
        gid = f"key_padding_attention_{index}"
        node.meta[ir.GROUP] = gid
        price = _price_guarded(node, found, mask.node, ctx)
        node.meta[ir.KERNEL] = {"id": gid, "kind": "key_padding_attention", **found,
                                **(price or {})}
        return True

    @staticmethod
    def _skip(node: fx.Node, reason: str, ctx: PassContext) -> None:
        """Record why an attention stays padded SDPA: on the node (the dump shows it as
        ``jagged_skipped=...``) and as a warning naming the reason."""
        node.meta[SKIPPED] = reason
        later = ""
        if reason == "no-key-padding-mask" and ir.sdpa_args(node)["is_causal"] is True:
            later = ("; if pack-jagged-tokens puts this causal attention in a packed region, "
                     "it runs jagged on the region's tokens there (the region's nodes list it)")
        ctx.warn(f"match-jagged-attention: {node.name} stays padded SDPA ({reason}){later}")
