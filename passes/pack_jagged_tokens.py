"""pack-jagged-tokens: run a padded sequence's token-wise work on its real tokens only.

Why: a recommendation model pads its jagged histories to ``[B, L, d]`` and then runs every
block over the padded tensor: LayerNorms, the qkv/out/MLP GEMMs, residuals, GELUs. At 50%
mean fill half of that work is on padding rows the model masks out later (the GEM h200
preset: ~80% of its FLOPs are in the sequence blocks). ``match-jagged-attention`` already
runs the attention over values + offsets; this pass lets the runner keep the whole
sequence tower in that packed layout, so the token-wise ops around the attention shrink by
the fill factor too.

When it applies: for each padded sequence a jagged attention reads (the ``index_put`` of
values over the attention's offsets into ``[B, L, ...]``), the padding rows are followed
through every use (:func:`.jagged_patterns.follow_padding`): views, casts, token-wise ops
(pointwise, ``linear``, ``layer_norm``, reductions over other dims), the keys/values of an
attention masked by the same lengths (which never read padding rows), and multiplies by the
key-padding mask (which zero them). If every path ends masked, no value the loss depends on
reads a padding row, so the runner may drop them: the nodes they reach form the region, and
each region node records where its batch and sequence dims are. If any path may read them
(an unmasked mean over the sequence, the graph's output), the pass warns, names the reader
and leaves the graph padded.

HSTU's pointwise attention (``match-silu-attention``) is a member of a region as one unit:
over offsets (no key mask; v written into zeros over them, as HSTU's authors pad q, k and v
for it), q, k and v each zero-padded over those offsets are the sources of one region (its
entry lists them under ``sources``), the queries' padding rows become the output's, the keys'
and values' are never read, and the kernel's own ``[L, L]`` nodes are no carriers. The runner then runs it on the
region's tokens (``gemc::jagged_silu_attention_values``). A gather of a region value at the
jagged positions of the region's own offsets (``x[row, col]``, the model's
``dense_to_jagged``) is an ``exit``: it reads real tokens only, so the runner takes it from
the tokens instead of scattering the value back first (unclamped lengths only). A source
written at those same positions is ``in_order``: its values are the tokens, viewed.

What the runner does with it (``backends/triton/graph_runner``): a region value is held with
batch dim 1 and sequence dim ``T`` (the real tokens, in offsets order: the layout of the
jagged attention, a length-0 history keeping its slot 0 when the mask clamps lengths to 1);
a tensor entering the region is gathered to that layout, a region value read outside it is
scattered back into zeros. Mask multiplies are in the region too (``zeroed``): their padding
rows are exactly zero, as the scatter writes them.

Guarded regions: around an attention whose key-padding mask is only known at run time (a
bool or additive mask input, ``arange < lengths``, a mask built in the graph from inputs:
the ``key_padding_attention`` / ``jagged_silu_attention`` entries with a ``mask``), the
padding rows are followed the same way, with that mask as the key mask, from every
floating ``[B, L, ...]`` graph input or embedding lookup the attention's history comes
from (the flows merged; an input itself stays padded and enters the region by a gather).
The region entry carries ``guard: "prefix-check"`` and the ``mask`` to check: once per
call, before the region's first node, the runner checks it (the guarded attention's check
kernel: a prefix on every row, an additive mask's values 0 or <= -1e4) and runs the region
packed over those lengths when it passes, else every region node padded, the model's own
computation (``packed_tokens.GUARD_STATS`` counts both; the run report carries it). The
region's fill is data, so it is priced at fill 1. ``nn.MultiheadAttention``'s views are
followed by where the batch sits in each shape (``[L, B * heads, d]``: the batch the outer
factor of a dim; ``[L * B, E]``: merged with the sequence), its fused attention as one unit.

Compact regions: where the flow holds without assuming the padding is a suffix (no causal
attention whose keys are clean only then), the region is ``compact``: a mask that keeps
positions in any order packs too, each row's kept tokens in order, their positions in the
layout (``packed_tokens.kept_positions``). Exact: every op is token-wise or an attention
masked by the key mask (order-invariant over its keys; a causal one keeps its meaning, the
order being kept). A history with a target item appended after its padding is never a
prefix, so only this packs it. A region holding HSTU's pointwise attention is never
compact: its bias and normaliser read positions, not ranks. ``every_row``: the region holds an attention that is NaN on a
row with no kept key (eager's softmax); it packs only when every row keeps one.

The compiled (Inductor) graph fixes its shapes when it is compiled, so there the check runs
ahead of it, on the batch, and picks a graph compiled for its outcome: packed at the token
count rounded up to a bucket, or padded (``backends/triton/region_guard``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import ir
from gemc.context import PassContext

from .jagged_patterns import (
    KeyMask,
    PaddingFlow,
    follow_padding,
    jagged_positions,
    keep_of,
    zero_padded_source,
)

aten = torch.ops.aten
PACKED = ir.PACKED  # re-exported: the keys are owned by gemc.ir (the plan builder reads them)
PACKED_REGION = ir.PACKED_REGION
PACKED_SKIPPED = ir.PACKED_SKIPPED
_GUARDED = ("key_padding_attention", "jagged_silu_attention")
_ATTENTIONS = ("jagged_attention", *_GUARDED)  # kernels priced on their own


def _sources(gm: fx.GraphModule) -> list[tuple[list[str], dict[str, Any]]]:
    """The padded sequences jagged attentions read, grouped per attention: (their names,
    the attention's layout facts). The softmax kernel names its one padded input; HSTU's
    pointwise kernel over offsets (no key mask: its values zero-padded over them) reads q,
    k and v each written into zeros over those offsets: one region with three sources, so
    the kernel reads and writes that region's tokens. A sequence already in a group is not
    taken again."""
    out: list[tuple[list[str], dict[str, Any]]] = []
    taken: set[str] = set()
    by_name = {n.name: n for n in gm.graph.nodes}
    for node in gm.graph.nodes:
        facts = node.meta.get(ir.KERNEL)
        if not facts:
            continue
        names: list[str] = []
        if facts.get("kind") == "jagged_attention":
            names = [facts["padded_from"]]
            layout = {k: facts[k] for k in ("offsets", "clamp_min", "max_len", "fill")}
        elif facts.get("kind") == "jagged_silu_attention" and facts.get("offsets"):
            for operand in (facts["q"], facts["k"], facts["v"]):
                found = zero_padded_source(by_name[operand])
                if found is not None and found[1].name == facts["offsets"] \
                        and (ir.shape_of(found[0]) or (0, 0))[1] == facts["max_len"] \
                        and found[0].name not in names:
                    names.append(found[0].name)
            layout = {"offsets": facts["offsets"], "clamp_min": 0,
                      "max_len": facts["max_len"], "fill": facts["fill"]}
        names = [n for n in names if n not in taken]
        if names:
            taken.update(names)
            out.append((names, layout))
    return out


def _merge(flows: list[PaddingFlow]) -> PaddingFlow | str:
    """One flow of several sources' (each node at one layout), or why not."""
    merged = PaddingFlow()
    for flow in flows:
        for part, into in ((flow.carriers, merged.carriers), (flow.zeroed, merged.zeroed)):
            for n, dims in part.items():
                if into.setdefault(n, dims) != dims:
                    return f"{n.name} reached with two layouts"
    if set(merged.carriers) & set(merged.zeroed):
        return "a mask multiply is also a carrier"
    return merged


def _source_facts(source: fx.Node, offsets: fx.Node, clamp_min: int) -> dict[str, Any]:
    """What the runner builds a region source's tokens from: the ``index_put``'s zeros,
    positions and values."""
    zeros, (row, pos), values = source.args[0], source.args[1], source.args[2]
    return {
        "padded_from": source.name,
        "zeros": zeros.name if isinstance(zeros, fx.Node) else None,
        "row": row.name,
        "pos": pos.name,
        "values": values.name,
        # the values already in the layout's order (no clamp, written at the jagged
        # positions of these offsets): the source is the values, viewed
        "in_order": clamp_min == 0 and jagged_positions(row, pos) is offsets,
    }


def _exits(flow: PaddingFlow, offsets: fx.Node, clamp_min: int) -> list[fx.Node]:
    """Readers outside the region that gather a region value at the jagged positions of
    the region's own offsets (``x[row, col]``, the model's ``dense_to_jagged``): each reads
    real tokens only, in offsets order, so the runner takes them from the packed tokens
    instead of scattering the value back to its padded shape first. Only with unclamped
    lengths (a clamped empty row's slot is no jagged position)."""
    if clamp_min != 0:
        return []
    out = []
    for node, dims in flow.carriers.items():
        for user in node.users:
            if user in flow.carriers or user in flow.zeroed or user in out \
                    or user.target is not aten.index.Tensor or user.args[0] is not node:
                continue
            indices = list(user.args[1])
            if dims != (0, 1) or len(indices) != 2:
                continue
            if jagged_positions(indices[0], indices[1]) is offsets:
                out.append(user)
    return out


def _price(nodes: list[fx.Node], copied: list[fx.Node], fill: float, ctx: PassContext
           ) -> dict[str, float]:
    """Forward+backward ms of the region's nodes padded, and packed: the token-wise work
    scales with the fill; the gathers and scatters at the boundary are priced as copies of
    the ``copied`` sources (in and out, forward and backward): a source whose values are
    the tokens already (``in_order``: viewed) copies nothing."""
    before = 0.0
    for n in nodes:
        facts = n.meta.get(ir.KERNEL) or {}
        if facts.get("kind") in _ATTENTIONS:
            continue  # already priced over the real tokens
        before += float(n.meta.get(ir.PREDICTED_MS) or 0.0)
    convert_ms = 0.0
    topology = getattr(ctx, "topology", None)
    if topology is not None:
        from gemc.cost_model import op_cost

        mem, _ = op_cost.memory_time(4 * sum(ir.nbytes(s) for s in copied), topology.gpu,
                                     getattr(ctx, "calibration", None), "copy")
        convert_ms = 1e3 * mem
    return {"before_ms": round(before, 6), "after_ms": round(before * fill + convert_ms, 6)}


@dataclass(frozen=True)
class PackJaggedTokens:
    """Marks each region node with ``gemc.packed`` and the source with the region's facts
    (``gemc.packed_region``), which the plan builder turns into a ``packed_tokens`` entry."""

    name: ClassVar[str] = "pack-jagged-tokens"
    requires: ClassVar[tuple[str, ...]] = ("match-jagged-attention",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        by_name = {n.name: n for n in gm.graph.nodes}
        count = 0
        for names, facts in _sources(gm):
            sources = [by_name[n] for n in names]
            offsets = by_name.get(facts["offsets"])
            if offsets is None or any(s.target is not aten.index_put.default for s in sources) \
                    or len({(ir.shape_of(s.args[2]) or (0,))[0] for s in sources}) != 1:
                continue  # (one layout: as many values in every source)
            layout = (offsets, int(facts["clamp_min"]), int(facts["max_len"]))
            flows = [follow_padding(s, (0, 1), layout) for s in sources]
            read = next(((s, f) for s, f in zip(sources, flows) if isinstance(f, fx.Node)),
                        None)
            if read is not None:
                ctx.warn(f"pack-jagged-tokens: {read[0].name} stays padded: its padding rows "
                         f"may be read unmasked by {read[1].name}")
                continue
            flow = _merge(flows)  # type: ignore[arg-type]
            if isinstance(flow, str):
                ctx.warn(f"pack-jagged-tokens: {', '.join(names)} stay padded ({flow})")
                continue
            rid = f"packed_tokens_{count}"
            count += 1
            nodes = _mark(gm, flow, rid)
            each = [_source_facts(s, offsets, layout[1]) for s in sources]
            shape = ir.shape_of(sources[0]) or (0, 0)
            sources[0].meta[PACKED_REGION] = {
                "id": rid,
                "kind": "packed_tokens",
                **each[0],
                # more than one source (HSTU's q, k, v): every one, the first included
                **({"sources": each} if len(each) > 1 else {}),
                "offsets": offsets.name,
                "clamp_min": layout[1],
                "max_len": layout[2],
                "batch": int(shape[0]),
                "fill": facts["fill"],
                # gathers at the region's jagged positions: read from the packed tokens
                "exits": [n.name for n in _exits(flow, offsets, layout[1])],
                **_price(nodes, [s for s, f in zip(sources, each) if not f["in_order"]],
                         float(facts["fill"]), ctx),
            }
        around = self._guarded_regions(gm, count, ctx)
        return PassResult(gm, count > 0 or bool(around))

    def _guarded_regions(self, gm: fx.GraphModule, first: int, ctx: PassContext
                         ) -> set[fx.Node]:
        """Regions around guarded attentions (a mask only known at run time): their padding
        rows followed from every ``[B, L, ...]`` tensor the attention's history comes from
        (a graph input, an embedding lookup); the runner checks the mask once per step and
        runs the region packed when every row is a prefix, padded otherwise. Returns the
        attentions a region reaches (its queries', keys' or values' history)."""
        by_name = {n.name: n for n in gm.graph.nodes}
        count = 0
        around: set[fx.Node] = set()
        taken: set[fx.Node] = {n for n in gm.graph.nodes if PACKED in n.meta}
        for node in gm.graph.nodes:
            facts = node.meta.get(ir.KERNEL) or {}
            if facts.get("kind") not in _GUARDED or not facts.get("mask"):
                continue
            if node in taken or any(a in taken for a in node.all_input_nodes):
                around.add(node)
                continue
            mask = by_name[facts["mask"]]
            # prefix: the region runs packed only when the run-time check finds one
            key_mask = KeyMask(mask, bool(facts.get("additive", False)),
                               keep_of(mask) or mask, int(ir.shape_of(mask)[0]),
                               int(facts["max_len"]), prefix=True)
            found = _guarded_flow(gm, node, key_mask)
            if isinstance(found, str):
                node.meta[PACKED_SKIPPED] = found
                ctx.warn(f"pack-jagged-tokens: the sequence around {node.name} stays padded "
                         f"({found})")
                continue
            flow, starts = found
            # compact: the same flow without the prefix assumption (no causal attention
            # relying on the padding being a suffix), so kept positions in any order pack
            loose = _guarded_flow(gm, node, replace(key_mask, prefix=False))
            compact = not isinstance(loose, str) and loose[0].carriers == flow.carriers \
                and loose[0].zeroed == flow.zeroed and not _by_position(flow)
            if set(flow.carriers) & taken or set(flow.zeroed) & taken:
                node.meta[PACKED_SKIPPED] = "overlap"
                ctx.warn(f"pack-jagged-tokens: the sequence around {node.name} stays padded "
                         "(overlap: its history meets another region's)")
                continue
            around.add(node)
            rid = f"packed_tokens_{first + count}"
            count += 1
            nodes = _mark(gm, flow, rid)
            taken |= set(nodes)
            check = key_mask.keep if ir.dtype_of(key_mask.keep) == torch.bool else mask
            head = starts[0]
            head.meta[PACKED_REGION] = {
                "id": rid,
                "kind": "packed_tokens",
                "guard": "prefix-check",
                "padded_from": head.name,
                "starts": [n.name for n in starts],
                "mask": check.name,
                "additive": check is mask and key_mask.additive,
                # kept positions in any order pack (the flow holds without the prefix)
                "compact": compact,
                # the guarded attentions in it whose key mask keeps what the region's check
                # reads (another spelling of one mask: a bool keep, the additive mask
                # nn.MultiheadAttention fills from it): the compiled graph runs them on the
                # region's tokens, as the check already found their layout
                "in_place": [n.name for n in nodes if _same_mask(n, key_mask)],
                # an attention NaN on a row with no kept key (eager's softmax): packed only
                # when every row keeps one (its NaN reaches the loss, masked or not)
                "every_row": any((n.meta.get(ir.KERNEL) or {}).get("nan_if_empty")
                                 for n in (node, *flow.carriers)),
                "clamp_min": 0,
                "max_len": key_mask.length,
                "batch": key_mask.batch,
                "fill": 1.0,  # data: unknown at compile time
                **_price(nodes, [head], 1.0, ctx),
            }
        return around


def _same_mask(node: fx.Node, key_mask: KeyMask) -> bool:
    """``node`` ends a guarded key-padding attention whose mask keeps exactly the keys
    ``key_mask`` keeps (the same keep-mask node, whatever spelling reaches the kernel)."""
    facts = node.meta.get(ir.KERNEL) or {}
    if facts.get("kind") != "key_padding_attention" or not facts.get("mask"):
        return False
    mask = next((n for n in node.graph.nodes if n.name == facts["mask"]), None)
    return mask is not None and keep_of(mask) is key_mask.keep


def _by_position(flow: PaddingFlow) -> bool:
    """The region holds HSTU's pointwise attention, whose bias and normaliser read each
    token's position in its row (and its causal rule the positions, not the ranks): its
    tokens cannot be compacted from a mask that is not a prefix."""
    return any((n.meta.get(ir.KERNEL) or {}).get("kind") == "jagged_silu_attention"
               for n in flow.carriers)


def _mark(gm: fx.GraphModule, flow: PaddingFlow, rid: str) -> list[fx.Node]:
    """Mark the flow's nodes as region ``rid`` (``gemc.packed``); its nodes in graph order."""
    for node, dims in flow.carriers.items():
        node.meta[PACKED] = {"id": rid, "dims": list(dims), "zeroed": False}
    for node, dims in flow.zeroed.items():
        node.meta[PACKED] = {"id": rid, "dims": list(dims), "zeroed": True}
    return [n for n in gm.graph.nodes if (n.meta.get(PACKED) or {}).get("id") == rid]


def _history_starts(attention: fx.Node, batch: int, length: int) -> list[fx.Node]:
    """Where the attention's padded history begins: the ancestors (of its own arguments)
    that are floating ``[B, L, ...]`` graph inputs or embedding lookups, in graph order."""
    seen = ir.ancestors(list(attention.all_input_nodes))
    out = []
    for n in seen:
        shape = tuple(ir.shape_of(n) or ())
        dtype = ir.dtype_of(n)
        if len(shape) < 3 or shape[:2] != (batch, length) or dtype is None \
                or not dtype.is_floating_point:
            continue
        if (n.op == "placeholder" and ir.PARAM not in n.meta) or \
                n.target is aten.embedding.default:
            out.append(n)
    order = {n: i for i, n in enumerate(attention.graph.nodes)}
    return sorted(out, key=order.__getitem__)


def _guarded_flow(gm: fx.GraphModule, attention: fx.Node, key_mask: KeyMask
                  ) -> tuple[PaddingFlow, list[fx.Node]] | str:
    """The padding flow from every start of the attention's history, merged (each node at
    one layout), and the starts that are in it; or why there is no region."""
    starts = _history_starts(attention, key_mask.batch, key_mask.length)
    if not starts:
        return "no-history-input: no [B, L, ...] input or lookup feeds the attention"
    flows = []
    for start in starts:
        flow = follow_padding(start, (0, 1), key_mask)
        if isinstance(flow, fx.Node):
            return f"padding rows of {start.name} may be read unmasked by {flow.name}"
        flows.append(flow)
    merged = _merge(flows)
    if isinstance(merged, str):
        return merged
    placeholders = [s for s in starts if s.op == "placeholder"]
    for s in placeholders:  # an input stays padded: it enters the region by a gather
        merged.carriers.pop(s)
    if attention not in merged.carriers and not any(
            a in merged.carriers for a in attention.all_input_nodes):
        return "the attention is not in the region"
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    inside = [s for s in starts if s.op != "placeholder"] or [
        min(merged.carriers, key=order.__getitem__)]
    return merged, inside
