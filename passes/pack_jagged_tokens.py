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

What the runner does with it (``backends/triton/graph_runner``): a region value is held with
batch dim 1 and sequence dim ``T`` (the real tokens, in offsets order: the layout of the
jagged attention, a length-0 history keeping its slot 0 when the mask clamps lengths to 1);
a tensor entering the region is gathered to that layout, a region value read outside it is
scattered back into zeros. Mask multiplies are in the region too (``zeroed``): their padding
rows are exactly zero, as the scatter writes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import ir
from gemc.context import PassContext

from .jagged_patterns import follow_padding

aten = torch.ops.aten
PACKED = ir.PREFIX + "packed"  # {"id", "dims": [batch dim, sequence dim], "zeroed"} per node
PACKED_REGION = ir.PREFIX + "packed_region"  # the region's facts, on its source node
PACKED_SKIPPED = ir.PREFIX + "packed_skipped"  # why an attention's history stays padded
_GUARDED = ("key_padding_attention", "jagged_silu_attention")


def _sources(gm: fx.GraphModule) -> dict[str, dict[str, Any]]:
    """Padded sequences a jagged attention reads: name -> the attention's layout facts."""
    out: dict[str, dict[str, Any]] = {}
    for node in gm.graph.nodes:
        facts = node.meta.get(ir.KERNEL)
        if not facts or facts.get("kind") != "jagged_attention":
            continue
        out.setdefault(facts["padded_from"], {k: facts[k] for k in
                                              ("offsets", "clamp_min", "max_len", "fill")})
    return out


def _price(nodes: list[fx.Node], source: fx.Node, fill: float, ctx: PassContext
           ) -> dict[str, float]:
    """Forward+backward ms of the region's nodes padded, and packed: the token-wise work
    scales with the fill; the gathers and scatters at the boundary are priced as copies of
    the source (in and out, forward and backward)."""
    before = 0.0
    for n in nodes:
        facts = n.meta.get(ir.KERNEL) or {}
        if facts.get("kind") == "jagged_attention":
            continue  # already priced over the real tokens
        before += float(n.meta.get(ir.PREDICTED_MS) or 0.0)
    convert_ms = 0.0
    topology = getattr(ctx, "topology", None)
    if topology is not None:
        from gemc.cost_model import op_cost

        mem, _ = op_cost.memory_time(4 * ir.nbytes(source), topology.gpu,
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
        for source_name, facts in _sources(gm).items():
            source = by_name.get(source_name)
            offsets = by_name.get(facts["offsets"])
            if source is None or offsets is None or source.target is not aten.index_put.default:
                continue
            layout = (offsets, int(facts["clamp_min"]), int(facts["max_len"]))
            flow = follow_padding(source, (0, 1), layout)
            if isinstance(flow, fx.Node):
                ctx.warn(f"pack-jagged-tokens: {source.name} stays padded: its padding rows "
                         f"may be read unmasked by {flow.name}")
                continue
            rid = f"packed_tokens_{count}"
            count += 1
            for node, dims in flow.carriers.items():
                node.meta[PACKED] = {"id": rid, "dims": list(dims), "zeroed": False}
            for node, dims in flow.zeroed.items():
                node.meta[PACKED] = {"id": rid, "dims": list(dims), "zeroed": True}
            zeros, (row, pos), values = source.args[0], source.args[1], source.args[2]
            nodes = [n for n in gm.graph.nodes if (n.meta.get(PACKED) or {}).get("id") == rid]
            shape = ir.shape_of(source) or (0, 0)
            source.meta[PACKED_REGION] = {
                "id": rid,
                "kind": "packed_tokens",
                "padded_from": source.name,
                "zeros": zeros.name if isinstance(zeros, fx.Node) else None,
                "row": row.name,
                "pos": pos.name,
                "values": values.name,
                "offsets": offsets.name,
                "clamp_min": layout[1],
                "max_len": layout[2],
                "batch": int(shape[0]),
                "fill": facts["fill"],
                **_price(nodes, source, float(facts["fill"]), ctx),
            }
        self._report_guarded(gm, ctx)
        return PassResult(gm, count > 0)

    @staticmethod
    def _report_guarded(gm: fx.GraphModule, ctx: PassContext) -> None:
        """Name why the token-wise work around a guarded attention (a mask from the data)
        stays padded: a region needs the layout of an ``index_put`` of jagged values, and a
        mask only known at run time would need the whole region guarded (not built yet)."""
        for node in gm.graph.nodes:
            facts = node.meta.get(ir.KERNEL) or {}
            if facts.get("kind") not in _GUARDED or PACKED in node.meta \
                    or facts.get("offsets"):  # padding proven by an index_put, no mask
                continue
            node.meta[PACKED_SKIPPED] = "mask-source"
            ctx.warn(f"pack-jagged-tokens: the sequence around {node.name} stays padded "
                     "(mask-source: a run-time-checked mask; regions follow index_put sources "
                     "only)")
