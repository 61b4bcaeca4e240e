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
written at those same positions is ``in_order``: its values are the tokens, viewed. A reader of one token per row after it
(``passes/row_reads``) at position 0 or at ``lengths.clamp(min=1) - 1`` reads slot 0 of an
empty row, which the attention gives 0 as the model does: the region is then laid out over
the lengths clamped to 1 (``clamp_min`` 1: each empty row keeps its slot 0, the sources
copied, no exits) and stays offset-proven, the reader ``proven`` and read from the tokens.
The unclamped ``lengths - 1`` (HSTU retrieval's user embedding, RecBole's
``gather_indexes``) reads position ``L - 1`` of an empty row (eager's ``-1``): the same
layout then gives that slot position ``L - 1`` instead (``empty_last``:
``packed_tokens.with_empty_last``), so what enters the region is gathered there from ``L -
1`` (a position embedding over all ``L``), the attention gives it 0 as the model gives
that position, and the reader reads it; exact because every other region op is token-wise
(its flow followed unclamped, so a mask multiply zeroes the slot as eager's mask zeroes
``L - 1``). Where one slot cannot be exact the tower stays padded (the kernel kept, exact
there), the warning naming the reader and why: readers of both position 0 and ``lengths -
1`` (an empty row would need two slots), an SDPA in the tower (eager's query ``L - 1``
mixes the row's padded positions), any other position (no mask to check it with).

What the runner does with it (``backends/triton/graph_runner``): a region value is held with
batch dim 1 and sequence dim ``T`` (the real tokens, in offsets order: the layout of the
jagged attention, a length-0 history keeping its slot 0 when the mask clamps lengths to 1,
or its slot at position ``L - 1`` with ``empty_last``);
a tensor entering the region is gathered to that layout, a region value read outside it is
scattered back into zeros. Mask multiplies are in the region too (``zeroed``): their padding
rows are exactly zero, as the scatter writes them.

Guarded regions: around an attention whose key-padding mask is only known at run time (a
bool or additive mask input, ``arange < lengths``, a mask built in the graph from inputs:
the ``key_padding_attention`` / ``jagged_silu_attention`` entries with a ``mask``), the
padding rows are followed the same way, with that mask as the key mask, from every
floating ``[B, L, ...]`` graph input or embedding lookup the attention's history comes
from (the flows merged; an input itself stays padded and enters the region by a gather; a
lookup of a padded ``[B, L]`` id grid is in the region, listed in its ``lookups``: on a
packed call the runners gather its *ids* and look up those only, ``T`` rows forward and
backward instead of ``B * L``, ``gemc.packed_rules.gathered_lookup``).
The region entry carries ``guard: "prefix-check"`` and the ``mask`` to check: once per
call, before the region's first node, the runner checks it (the guarded attention's check
kernel: a prefix on every row, an additive mask's values 0 or <= -1e4) and runs the region
packed over those lengths when it passes, else every region node padded, the model's own
computation (``packed_tokens.GUARD_STATS`` counts both; the run report carries it). The
region's fill is data: it is priced at the fill the same check finds on the entrypoint's
example batch (``gemc.guard_sample.sample_fill``: its real tokens as the compiled graph
rounds them, ``fill_source: "sample batch"``), and at fill 1 (padded), with a warning
naming why, where there is no real sample or the sample fails the check.
``nn.MultiheadAttention``'s views are
followed by where the batch sits in each shape (``[L, B * heads, d]``: the batch the outer
factor of a dim; ``[L * B, E]``: merged with the sequence), its fused attention as one unit.
A ``[B, 1, 1, L]`` mask (Hugging Face's extended mask, ``(1.0 - m[:, None, None, :]) *
MIN``) is its rows: the check reads the boolean ``[B, L]`` it is made from
(``jagged_patterns.keep_of``), or its rows viewed where the graph shows none.

Readers of one token per row (``passes/row_reads``: RecBole's ``gather_indexes(out,
lengths - 1)``, ``out[arange(B), lengths - 1]``, ``out[:, 0]``, ``out[:, -1:]``, the rows
flattened: ``out.reshape(B * L, d)[arange(B) * L + lengths - 1]``) read no padding exactly
when each row's position is one the mask keeps, which only the data says: such a reader
ends the flow as a *conditional* reader, listed in the region's ``reads`` (its node, the
value it reads, its positions: an index node or a constant), and the region's check also
checks those positions (``gemc.guard_sample.missed_reads``): a row reading a dropped
position runs the region padded, counted (``GUARD_STATS.missed_reads``). A packed call
reads each row's token from the packed tokens (``packed_tokens.read_rows``: the slot
``offsets[b] + pos[b]``, or in a compact layout the slot holding that position), no
scatter back. Positions computed from a value the padding reaches cannot be checked before
the region: such a reader stays a reader.

Readers in offset-proven regions: under a mask over the padding's own offsets, a reader whose
position the graph proves real (``row_reads.kept_by_offsets``: with ``lengths.clamp(min=1)``
in the mask, SASRec's last token ``out[arange(B), attn_len - 1]`` or ``out[:, 0]``) ends the
flow unchecked: the region stays offset-proven (no check, the jagged attention kept), lists
it in ``reads`` (``proven``), and reads it from the tokens. Any other position there (the
unclamped ``lengths - 1``, ``-1`` on an empty row, which eager reads at ``L - 1``: padding;
``out[:, -1]``) is data: the attention is then a guarded one (``match-jagged-attention``)
and so is the region, started at the ``index_put`` that pads the history (a history start as
an input or a lookup is), its mask (built over the offsets) and the reader's positions
checked per call as above, padded and counted on a miss. A causal attention over such a
history (never ``jagged_attention``) packs the same way.

Compact regions: where the flow holds without assuming the padding is a suffix (no causal
attention whose keys are clean only then), the region is ``compact``: a mask that keeps
positions in any order packs too, each row's kept tokens in order, their positions in the
layout (``packed_tokens.kept_positions``). Exact: every op is token-wise or an attention
masked by the key mask (order-invariant over its keys; a causal one keeps its meaning, the
order being kept). A history with a target item appended after its padding is never a
prefix, so only this packs it. A region holding HSTU's pointwise attention is never
compact: its bias and normaliser read positions, not ranks; nor is one holding a
written-out causal softmax over ``-inf`` (``nan_if_unseen``): NaN on each query row ahead
of its row's first kept key, which only the padded formula gives. ``every_row``: the region holds an attention that is NaN on a
row with no kept key (eager's softmax); it packs only when every row keeps one.

Histories no attention reads: a boolean ``[B, L]`` keep-mask (an input, ``arange(L) <
lengths``) multiplied into values that come from ``[B, L, ...]`` lookups or inputs, with no
attention kernel using it (DIN: an MLP scores each behaviour, the scores are masked and
sum-pooled), gets a guarded region the same way, its flow followed from those lookups. A
product by a masked value (``(scores * mask)[..., None] * keys``) zeroes padding rows as a
multiply by the mask does.

Padding as one weighted token per row (``passes/pad_reps``): DIN's Dice takes the mean and
variance over all ``B * L`` rows, so its padded tokens are read, and leaving the history
padded leaves DIN's dominant cost (the activation unit: an MLP over every (sample,
behaviour) pair) on the padding. But within a row every padded token is one value when
every source's padded entries are equal within the row (data: DIN pads the ids with 0)
and every other operand is constant over the token axis (structural: the candidate
``expand``-ed over ``L``, weights, the statistics themselves). Then the padded computation
is the packed one over the real tokens plus one representative per row with padding (its
first padded position), weighted by ``L - len``, with every reduction over the token axis
weighted (sum, mean, var and std over both token dims, any correction): forward and
backward equal eager's up to summation order. Where the plain flow stops at such
reductions only, the region entry carries ``pad_rep``, the ``rep_sources`` its check
compares (a row whose padded entries differ runs the region padded, counted as
``GUARD_STATS.unequal_padding``) and the ``weighted`` reductions; it is priced at its real
tokens plus one per row with padding, and laid out as a prefix of ``min(len + 1, L)``
(never compact). Any other reader (a per-row statistic, an ``amax``: its gradient splits
among ties, and the copies are ties; a scan; the output), an operand varying by position
(a position embedding), a dropout (its copies differ) or an attention in the region keeps
the history padded, the warning saying why.

Around a guarded attention whose history a reader after it reads unmasked (TransAct: an
un-masked max pool over the encoder's outputs and a slice of its first tokens, under a key
mask that is no prefix: padding OR a recent-time window), the history packs over padding
representatives laid out from its sources (``pad_reps.follow_around_attention``,
``rep_layout: "sources"``): each row keeps its tokens up to the last position where a
source differs from the row's last position, and one representative for the trailing run
(computed per call: ``guard_sample.trailing_lengths``; there is no miss to fall back on).
Token-wise ops run on those tokens; so does every attention in the region (a per-key
mask, not causal, listed as ``rep_attentions``): each real key biased by its own mask
entry, each representative key by the ``logsumexp`` of the entries it stands for
(``packed_tokens.rep_attention``); the readers outside the region read the value
scattered back, each row's representative on its padded positions (eager's padded value). A source the check cannot compute ahead
(ids looked up in a buffer) is checked through its token-wise origin (the raw ids).

Every history left padded is a warning (in the plan's ``warnings``) naming the reader, its
op and what it reduces over, and the module it was traced in (:func:`why_read`): e.g. "a
reduction over the token axis (amax over the B*L = 2048*512 rows in amax_1, from
attention.dnn.3 (MaxDice)) reads padded tokens; packing would change the result", followed
by why padding representatives do not apply either where they were tried.

The compiled (Inductor) graph fixes its shapes when it is compiled, so there the check runs
ahead of it, on the batch, and picks a graph compiled for its outcome: packed at the token
count rounded up to a bucket, or padded (``backends/triton/region_guard``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import ir
from gemc.context import PassContext
from gemc.guard_sample import SAMPLE, sample_fill
from gemc.packed_rules import gathered_lookup, on_tokens

from .attention_choice import settle
from .jagged_patterns import (
    _CASTS,
    _VIEWS,
    KeyMask,
    PaddingFlow,
    drops_to_minus_inf,
    jagged_positions,
    keep_of,
    zero_padded_source,
)
from .pad_reps import (
    follow_around_attention,
    follow_weighted,
    outside_readers,
    reductions,
    rep_facts,
)
from .row_reads import (
    follow_with_reads,
    kept_by_offsets,
    read_specs,
    reader_at,
    unproven_reader,
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
        elif facts.get("kind") == "jagged_silu_attention" and facts.get("offsets") \
                and not facts.get("causal_mask"):
            # (a causal mask read from the weights is checked per call, and its exact
            # fallback is the padded formula: such an attention starts no region)
            for operand in (facts["q"], facts["k"], facts["v"]):
                found = zero_padded_source(by_name[operand])
                # a region starts at an index_put (its scatter is what the runners
                # replace); an index_copy at flat positions gets the kernel, not packing
                if found is not None and found[0].target is aten.index_put.default \
                        and found[1].name == facts["offsets"] \
                        and (ir.shape_of(found[0]) or (0, 0))[1] == facts["max_len"] \
                        and found[0].name not in names:
                    names.append(found[0].name)
            layout = {"offsets": facts["offsets"], "clamp_min": 0,
                      "max_len": facts["max_len"], "fill": facts["fill"], "silu": True}
        names = [n for n in names if n not in taken]
        if names:
            taken.update(names)
            out.append((names, layout))
    return out


def _merge(flows: list[PaddingFlow]) -> PaddingFlow | str:
    """One flow of several sources' (each node at one layout), or why not."""
    merged = PaddingFlow()
    for flow in flows:
        for part, into in ((flow.carriers, merged.carriers), (flow.zeroed, merged.zeroed),
                           (flow.reads, merged.reads)):
            for n, dims in part.items():
                if into.setdefault(n, dims) != dims:
                    return f"{n.name} reached with two layouts"
    if set(merged.carriers) & set(merged.zeroed):
        return "a mask multiply is also a carrier"
    return merged


def _stopped(flows: list[PaddingFlow | fx.Node]) -> bool:
    """Some source's padding may be read (its flow stopped at a node)."""
    return any(isinstance(f, fx.Node) for f in flows)


def _empty_row_layout(sources: list[fx.Node], offsets: fx.Node, length: int
                      ) -> tuple[tuple[fx.Node, int, int], list[Any], bool] | str | None:
    """For HSTU's attention over offsets read one token per row where the unclamped flow
    stops: a layout giving each empty row one slot, ``(layout, flows, empty_last)``; or
    why none fits (a string), or None when no reader of an empty row explains the stop.

    Why a slot: the model's attention is 0 at every position of an empty row, as the
    kernel gives it on a slot whose q, k and v are the sources' zeros (``jagged_patterns.
    _silu_unit``), and every other region op is token-wise, so a slot standing for one
    position ``p`` of an empty row holds eager's value at ``p`` when everything entering
    the region is gathered there from ``p``. Position 0 (``x[:, 0]``, ``x[arange(B),
    lengths.clamp(min=1) - 1]``): slot 0, the layout over the lengths clamped to 1, as
    before. The unclamped ``lengths - 1`` (HSTU retrieval's user embedding, RecBole's
    ``gather_indexes``): position ``L - 1`` (eager's ``-1``), the same layout with that
    slot's position ``L - 1`` (``empty_last``: ``packed_tokens.with_empty_last``), its flow
    followed unclamped so every mask multiply zeroes it as eager's mask zeroes ``L - 1``.
    Refused there: readers of both positions (one slot per empty row), and an attention
    other than HSTU's over these offsets (an SDPA mixes an empty row's padded positions
    into ``L - 1``: eager's causal query ``L - 1`` reads every one of them)."""
    first = (offsets, 1, length)
    flows = [follow_with_reads(s, (0, 1), first) for s in sources]
    if not _stopped(flows):
        return first, flows, False
    unclamped = (offsets, 0, length)
    last = [follow_with_reads(s, (0, 1), unclamped, empty_last=True) for s in sources]
    if _stopped(last):
        # each layout stopped at a reader the other one proves: readers of both positions
        stops = [next((s, f) for s, f in zip(sources, fl) if isinstance(f, fx.Node))
                 for fl in (flows, last)]
        reads = [reader_at(s, (0, 1), unclamped, n) for s, n in stops]
        if reads[0] is not None and reads[1] is not None \
                and kept_by_offsets(reads[0], unclamped, empty_last=True) \
                and kept_by_offsets(reads[1], first):
            (_, at_last), (_, at_first) = stops
            return (f"{at_last.name}{_module_of(at_last)} reads the unclamped lengths - 1 "
                    f"(position L - 1 of an empty row) and {at_first.name}"
                    f"{_module_of(at_first)} position 0 of an empty row: a packed empty "
                    "row keeps one slot, so it holds only one of them; read both at one "
                    "position to keep the tower packed")
        return None
    merged = _merge(last)  # flows that do not merge: the caller names why
    mixing = None if isinstance(merged, str) else next(
        (n for n in merged.carriers if n.target is aten.scaled_dot_product_attention.default),
        None)
    if mixing is not None:
        reader = next(iter(merged.reads), mixing)
        return (f"{reader.name}{_module_of(reader)} reads the unclamped lengths - 1, "
                f"position L - 1 of an empty row, and the attention {mixing.name}"
                f"{_module_of(mixing)} mixes that row's padded positions into it (eager's "
                "value there is no token-wise one an empty row's single slot could hold); "
                "read lengths.clamp(min=1) - 1 (or position 0) to keep the tower packed")
    return first, last, True


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


def _price(nodes: list[fx.Node], copied: list[fx.Node], fill: float, ctx: PassContext,
           sources: list[fx.Node]) -> dict[str, float]:
    """Forward+backward ms of the region's nodes padded, and packed: the token-wise work
    scales with the fill, except a node the runners run padded (``gemc.packed_rules``:
    ``sources``, the tokens' padded inputs, run on them); the gathers and scatters at the
    boundary are priced as copies of the ``copied`` sources (in and out, forward and backward): a source whose values are
    the tokens already (``in_order``: viewed) copies nothing."""
    before = padded = 0.0
    members, names = set(nodes), {s.name for s in sources}
    for n in nodes:
        facts = n.meta.get(ir.KERNEL) or {}
        if facts.get("kind") in _ATTENTIONS:
            continue  # already priced over the real tokens
        ms = float(n.meta.get(ir.PREDICTED_MS) or 0.0)
        before += ms
        if not on_tokens(n, members, names):
            padded += ms  # no packed rule: the runners run it on the padded tensor
    convert_ms = 0.0
    topology = ctx.topology
    if topology is not None:
        from gemc.cost_model import op_cost

        mem, _ = op_cost.memory_time(4 * sum(ir.nbytes(s) for s in copied), topology.gpu,
                                     ctx.calibration, "copy")
        convert_ms = 1e3 * mem
    after = (before - padded) * fill + padded + convert_ms
    return {"before_ms": round(before, 6), "after_ms": round(after, 6)}


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
            why = ("its offsets are not in the graph" if offsets is None else
                   "a source is not an index_put of values into the padded shape"
                   if any(s.target is not aten.index_put.default for s in sources) else
                   "its sources hold different numbers of tokens (one layout needs as many "
                   "in each)" if len({(ir.shape_of(s.args[2]) or (0,))[0] for s in sources})
                   != 1 else None)
            if why is not None:
                ctx.warn(f"pack-jagged-tokens: {', '.join(names)} stay padded ({why})")
                continue
            layout = (offsets, int(facts["clamp_min"]), int(facts["max_len"]))
            # readers of one token per row whose positions the graph proves real
            # (``row_reads.kept_by_offsets``) end the flow unchecked (``proven``)
            flows = [follow_with_reads(s, (0, 1), layout) for s in sources]
            empty_last, why_padded = False, None
            if facts.get("silu") and _stopped(flows):
                found = _empty_row_layout(sources, offsets, layout[2])
                if isinstance(found, str):
                    why_padded = found
                elif found is not None:
                    layout, flows, empty_last = found
            read = next(((s, f) for s, f in zip(sources, flows) if isinstance(f, fx.Node)),
                        None)
            if read is not None:
                shape = ir.shape_of(read[0]) or (0, 0)
                if facts.get("silu") and unproven_reader(read[0], (0, 1), layout, read[1]):
                    ctx.warn(f"pack-jagged-tokens: {read[0].name} stays padded: " + (
                        why_padded or
                        f"{read[1].name}{_module_of(read[1])} reads one token per row at "
                        "positions the graph does not prove real tokens or the one "
                        "position an empty row keeps (position 0, lengths.clamp(min=1) - "
                        "1, or lengths - 1 of the history's own offsets), and HSTU's "
                        "attention over offsets has no mask to check them with at run "
                        "time; read one of those to keep the tower packed"))
                    continue
                ctx.warn(f"pack-jagged-tokens: {read[0].name} stays padded: its padding rows "
                         f"may be read unmasked by {read[1].name}: "
                         f"{why_read(read[1], int(shape[0]), int(shape[1]))}")
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
                # each empty row's one slot stands for its position L - 1, not 0 (the
                # unclamped lengths - 1 read: packed_tokens.with_empty_last)
                **({"empty_last": True} if empty_last else {}),
                "max_len": layout[2],
                "batch": int(shape[0]),
                "fill": facts["fill"],
                # gathers at the region's jagged positions: read from the packed tokens
                "exits": [n.name for n in _exits(flow, offsets, layout[1])],
                # proven readers of one token per row: read from the packed tokens
                **({"reads": read_specs(flow)} if flow.reads else {}),
                **_price(nodes, [s for s, f in zip(sources, each) if not f["in_order"]],
                         float(facts["fill"]), ctx, sources),
            }
        around = self._guarded_regions(gm, count, ctx)
        made = {n.meta[PACKED]["id"] for n in gm.graph.nodes if PACKED in n.meta}
        unattended = _unattended_histories(gm, len(made), ctx)
        # the guarded attentions priced slower than the model's for their per-call sync
        # alone: kept where a region above runs them on its tokens (no sync of their own)
        ungrouped = settle(gm, ctx)
        return PassResult(gm, count > 0 or bool(around) or unattended > 0 or ungrouped > 0)

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
            shape = tuple(ir.shape_of(mask) or ())
            if len(shape) < 2 or any(s != 1 for s in shape[1:-1]):
                node.meta[PACKED_SKIPPED] = "mask-rows-broadcast"
                ctx.warn(f"pack-jagged-tokens: the sequence around {node.name} stays padded "
                         f"(mask-rows-broadcast: its key mask {mask.name} is {list(shape)}, "
                         "not [B, L] or a view of its rows [B, 1, ..., 1, L])")
                continue
            # a [B, 1, 1, L] mask (Hugging Face's extended mask: the arithmetic after the
            # unsqueezes) is its rows, viewed: the check reads the boolean [B, L] it is made
            # from where the graph shows one (keep_of), else the rows of the mask itself
            # (gemc.guard_sample.mask_rows)
            # prefix: the region runs packed only when the run-time check finds one
            key_mask = KeyMask(mask, bool(facts.get("additive", False)),
                               keep_of(mask) or mask, int(ir.shape_of(mask)[0]),
                               int(facts["max_len"]), prefix=True)
            found = _guarded_flow(gm, node, key_mask)
            extra: dict[str, Any] | None = None
            if isinstance(found, str) and found.startswith("padding rows"):
                # read unmasked after the attention (TransAct's max pool over every
                # position): padding as one representative per row, laid out from the
                # sources, the attention on padded operands (pad_reps)
                extra, found = _reps_around(gm, node, key_mask, found)
            if isinstance(found, str):
                node.meta[PACKED_SKIPPED] = found
                ctx.warn(f"pack-jagged-tokens: the sequence around {node.name} stays padded "
                         f"({found})")
                continue
            flow, starts = found
            # compact: the same flow without the prefix assumption (no causal attention
            # relying on the padding being a suffix), so kept positions in any order pack
            compact = extra is None and _compact(
                flow, _guarded_flow(gm, node, replace(key_mask, prefix=False)))
            if set(flow.carriers) & taken or set(flow.zeroed) & taken:
                node.meta[PACKED_SKIPPED] = "overlap"
                ctx.warn(f"pack-jagged-tokens: the sequence around {node.name} stays padded "
                         "(overlap: its history meets another region's)")
                continue
            around.add(node)
            rid = f"packed_tokens_{first + count}"
            count += 1
            taken |= set(_guarded_entry(gm, rid, flow, starts, key_mask, mask, compact,
                                        [node], ctx, extra))
        return around


def _guarded_entry(gm: fx.GraphModule, rid: str, flow: PaddingFlow, starts: list[fx.Node],
                   key_mask: KeyMask, mask: fx.Node, compact: bool, also: list[fx.Node],
                   ctx: PassContext, extra: dict[str, Any] | None = None) -> list[fx.Node]:
    """Mark ``flow`` as guarded region ``rid`` (checked at run time on ``mask``) and put its
    entry on its first start; ``also``: nodes beside the flow whose kernel facts count for
    ``every_row`` (the attention it is built around); ``extra``: more facts of the entry
    (padding representatives: ``pad_reps.rep_facts``), which the sampled fill reads too.
    Returns the region's nodes."""
    nodes = _mark(gm, flow, rid)
    members = [n.meta.get(ir.KERNEL) or {} for n in (*also, *flow.carriers)]
    # a written-out causal softmax over -inf is NaN on each query row that sees no kept
    # key: over a mask that is no prefix, rows beyond the empty ones (packed: none)
    compact = compact and not any(m.get("nan_if_unseen") for m in members)
    # an additive mask that drops at a finite value (BERT's -1e4, finfo.min) is checked as
    # itself: a row it drops whole attends uniformly over every key in eager, which its
    # additive rule keeps (gemc.guard_sample.kept_keys) and the boolean it is made from
    # would drop (MMoE's tower: its losses off by 1e-3 when the boolean was checked)
    finite = key_mask.additive and not drops_to_minus_inf(mask)
    check = key_mask.keep if ir.dtype_of(key_mask.keep) == torch.bool and not finite \
        else mask
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
        # an attention NaN on a row with no kept key (eager's softmax), or uniform over
        # all its keys (a finite masked_fill value): packed only when every row keeps one
        # (its NaN reaches the loss, masked or not; the uniform row reads padding)
        "every_row": any(_empty_rows_differ(m) for m in members),
        "clamp_min": 0,
        "max_len": key_mask.length,
        "batch": key_mask.batch,
        # readers of one token per row (``x[arange(B), lengths - 1]``): their positions
        # are checked with the mask (a row reading a padding token runs the region
        # padded), and a packed run reads each row's token from the packed tokens
        "reads": read_specs(flow),
        # lookups of the history's ids: the runners gather the ids to the region's layout
        # and look up only those (gemc.packed_rules.gathered_lookup)
        "lookups": _lookups(nodes),
        **(extra or {}),
    }
    # the fill is data: read off the example batch by the run-time check's own rule
    sampled = sample_fill(gm, head.meta[PACKED_REGION], ctx.sample_inputs)
    if sampled["fill_source"] != SAMPLE:
        ctx.warn(f"guarded-region fill: {rid} (mask {check.name}) is priced padded "
                 f"(fill 1): {sampled['fill_source'].removeprefix('padded: ')}; the run "
                 "packs whatever its batches allow")
    head.meta[PACKED_REGION].update(sampled)
    # what enters by a gather: the head's values, or a gathered lookup's ids (the rows
    # are looked up on the tokens)
    entering = head.args[1] if head.name in head.meta[PACKED_REGION]["lookups"] else head
    head.meta[PACKED_REGION].update(_price(nodes, [entering], sampled["fill"], ctx, [head]))
    return nodes


def _lookups(nodes: list[fx.Node]) -> list[str]:
    """The region's row lookups whose ids enter it gathered (``packed_rules.
    gathered_lookup``): a guarded region started at a history's ``[B, L, d]`` lookup then
    looks up its tokens' ids only (its real tokens, and each row's padding representative
    where it has them), not all ``B * L``; the padded run (the check's miss) looks up all
    of them, as the model does."""
    members = set(nodes)
    return [n.name for n in nodes if gathered_lookup(n, members)]


def _same_mask(node: fx.Node, key_mask: KeyMask) -> bool:
    """``node`` ends a guarded key-padding attention whose mask keeps exactly the keys
    ``key_mask`` keeps (the same keep-mask node, whatever spelling reaches the kernel)."""
    facts = node.meta.get(ir.KERNEL) or {}
    if facts.get("kind") != "key_padding_attention" or not facts.get("mask"):
        return False
    mask = next((n for n in node.graph.nodes if n.name == facts["mask"]), None)
    return mask is not None and keep_of(mask) is key_mask.keep


def _compact(flow: PaddingFlow, loose: tuple[PaddingFlow, list[fx.Node]] | str) -> bool:
    """The region of ``flow`` packs kept positions in any order: ``loose``, the same flow
    followed without the prefix assumption, is the same, and no op reads positions."""
    return not isinstance(loose, str) and loose[0].carriers == flow.carriers \
        and loose[0].zeroed == flow.zeroed and loose[0].reads == flow.reads \
        and not _by_position(flow)


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


def _empty_rows_differ(kernel: dict[str, Any]) -> bool:
    """Whether an attention entry's rows that keep no key are not what the kernels give
    (0): NaN (a written-out softmax over ``-inf``) or the mean of every value (over a
    finite ``masked_fill`` value)."""
    return bool(kernel.get("nan_if_empty")) or kernel.get("fill_value") is not None


def _history_starts(attention: fx.Node, batch: int, length: int) -> list[fx.Node]:
    """Where the attention's padded history begins: the ancestors (of its own arguments)
    that are floating ``[B, L, ...]`` graph inputs, embedding lookups or jagged values
    written into zeros, in graph order."""
    seen = ir.ancestors(list(attention.all_input_nodes))
    return _starts_among(seen, attention.graph, batch, length, padded=True)


def _starts_among(seen: set[fx.Node], graph: fx.Graph, batch: int, length: int,
                  padded: bool = False) -> list[fx.Node]:
    """The floating ``[B, L, ...]`` graph inputs and embedding lookups of ``seen``, in graph
    order; with ``padded`` also the ``index_put`` nodes of jagged values into zeros over
    offsets (``zero_padded_source``). Why those, around a guarded attention: a history
    padded from values + offsets is an offset-proven region's source, but where that region
    cannot be (its attention causal, or a reader of one token per row whose position the
    graph does not prove real: ``out[arange(B), lengths - 1]`` with empty rows possible)
    the mask built over those offsets is checked at run time as any key mask is, and the
    region starts where the padded history does. (Histories no attention reads keep to
    inputs and lookups: one padded by offsets is the offset-proven pass's, which already
    said why it stays padded.)"""
    out = []
    for n in seen:
        shape = tuple(ir.shape_of(n) or ())
        dtype = ir.dtype_of(n)
        if len(shape) < 3 or shape[:2] != (batch, length) or dtype is None \
                or not dtype.is_floating_point:
            continue
        if (n.op == "placeholder" and ir.PARAM not in n.meta) or \
                n.target is aten.embedding.default or \
                (padded and n.target is aten.index_put.default
                 and (zero_padded_source(n) or (None,))[0] is n):
            out.append(n)
    order = {n: i for i, n in enumerate(graph.nodes)}
    return sorted(out, key=order.__getitem__)


def _guarded_flow(gm: fx.GraphModule, attention: fx.Node, key_mask: KeyMask
                  ) -> tuple[PaddingFlow, list[fx.Node]] | str:
    """The padding flow from every start of the attention's history, merged (each node at
    one layout), and the starts that are in it; or why there is no region."""
    starts = _history_starts(attention, key_mask.batch, key_mask.length)
    if not starts:
        return "no-history-input: no [B, L, ...] input or lookup feeds the attention"
    found = _flow_from(gm, starts, key_mask)
    if isinstance(found, str):
        return found
    if attention not in found[0].carriers and not any(
            a in found[0].carriers for a in attention.all_input_nodes):
        return "the attention is not in the region"
    return found


def _flow_from(gm: fx.GraphModule, starts: list[fx.Node], key_mask: KeyMask,
               follow: Callable[..., PaddingFlow | fx.Node] = follow_with_reads
               ) -> tuple[PaddingFlow, list[fx.Node]] | str:
    """The padding flow from every one of ``starts`` (a history's inputs and lookups),
    merged (each node at one layout), and the starts that are in it; or why there is no
    region. ``follow``: how one start's padding is followed (``pad_reps.follow_weighted``
    lets weighted reductions over the token axis read it)."""
    flows = []
    for start in starts:
        flow = follow(start, (0, 1), key_mask)
        if isinstance(flow, fx.Node):
            return (f"padding rows of {start.name} may be read unmasked by {flow.name}: "
                    f"{why_read(flow, key_mask.batch, key_mask.length)}")
        flows.append(flow)
    merged = _merge(flows)
    if isinstance(merged, str):
        return merged
    placeholders = [s for s in starts if s.op == "placeholder"]
    for s in placeholders:  # an input stays padded: it enters the region by a gather
        merged.carriers.pop(s)
    if not merged.carriers:
        return "no token-wise op reads the history"
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    inside = [s for s in starts if s.op != "placeholder"] or [
        min(merged.carriers, key=order.__getitem__)]
    return merged, inside


# ---- why a history stays padded ------------------------------------------------------------

_REDUCTIONS = {
    aten.sum.dim_IntList: "sum", aten.sum.default: "sum", aten.mean.dim: "mean",
    aten.mean.default: "mean", aten.var.correction: "var", aten.var.dim: "var",
    aten.std.correction: "std", aten.std.dim: "std", aten.amax.default: "amax",
    aten.amin.default: "amin", aten.max.dim: "max", aten.min.dim: "min",
    aten.logsumexp.default: "logsumexp", aten.prod.dim_int: "prod",
    aten.native_batch_norm.default: "batch_norm", aten._native_batch_norm_legit.default:
    "batch_norm", aten._native_batch_norm_legit_functional.default: "batch_norm",
}
_MIXING = {aten.cumsum.default: "cumsum", aten.cumprod.default: "cumprod",
           aten._softmax.default: "softmax", aten._log_softmax.default: "log_softmax"}


def _module_of(node: fx.Node) -> str:
    """``, from <module path> (<class>)`` of the innermost module ``node`` was traced in
    (the capture's ``nn_module_stack``), or nothing: for the message only, never matched."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, cls = list(stack.values())[-1]
    cls = getattr(cls, "__name__", str(cls)).rsplit(".", 1)[-1]
    return f", from {path} ({cls})" if path else f", from the model ({cls})"


def _reduced(node: fx.Node, rank: int) -> list[int]:
    """The dims ``node`` (a reduction) reduces; all of them when it names none."""
    dims = node.args[1] if len(node.args) > 1 and not isinstance(node.args[1], bool) \
        else node.kwargs.get("dim")
    if node.target in (aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
                       aten._native_batch_norm_legit_functional.default):
        return [d for d in range(rank) if d != 1]  # statistics per channel (dim 1)
    if dims is None:
        return list(range(rank))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted({d % rank for d in dims}) if rank else []


def why_read(reader: fx.Node, batch: int, length: int) -> str:
    """Why ``reader`` (the first node :func:`.jagged_patterns.follow_padding` found that may
    read padding rows) stops packing, in the user's terms: which op, over what, in which
    module. A reduction or scan over the token axis reads every padded token, so packing
    would change its result; any other op is one gemc has no token-wise rule for."""
    where = f"{reader.name}{_module_of(reader)}"
    if reader.op == "output":
        return "the graph returns them (a model output holds the padded tokens)"
    data = reader.args[0] if reader.args and isinstance(reader.args[0], fx.Node) else None
    shape = tuple(ir.shape_of(data) or ()) if data is not None else ()
    if reader.target in _REDUCTIONS or reader.target in _MIXING:
        op = _REDUCTIONS.get(reader.target) or _MIXING[reader.target]
        dims = _reduced(reader, len(shape)) if reader.target in _REDUCTIONS else \
            [int(reader.args[1]) % max(len(shape), 1)]
        sizes = [int(shape[d]) for d in dims if d < len(shape)]
        both = sizes.count(batch) >= 2 if batch == length else batch in sizes and length in sizes
        if batch * length in sizes or both:
            over = f"the B*L = {batch}*{length} rows"
        elif length in sizes:
            over = f"the L = {length} positions of each row"
        else:
            over = "dims " + ", ".join(map(str, dims))
        kind = "reduction" if reader.target in _REDUCTIONS else (
            "scan" if op.startswith("cum") else "softmax")
        return (f"a {kind} over the token axis ({op} over {over} in {where}) reads padded "
                "tokens; packing would change the result")
    op = getattr(reader.target, "__name__", str(reader.target))
    return (f"{op} in {where} has no rule proving it token-wise (it may mix or read padded "
            "tokens)")


def _multiplied_masks(gm: fx.GraphModule) -> list[tuple[fx.Node, list[fx.Node]]]:
    """Boolean ``[B, L]`` keep-masks (an input, ``arange(L) < lengths``, a mask computed
    from inputs) that the graph multiplies into values, each with those multiplies: the
    key-padding masks of histories no attention kernel reads (DIN's weights masked by the
    history's length). Found by what the mask is and does, not by name."""
    out = []
    for node in gm.graph.nodes:
        shape = tuple(ir.shape_of(node) or ())
        if ir.dtype_of(node) != torch.bool or len(shape) != 2 or keep_of(node) is not node:
            continue
        muls, stack, seen = [], [node], set()
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            for user in x.users:
                if user.op != "call_function":
                    continue
                if user.target in _CASTS or user.target in _VIEWS:
                    stack.append(user)
                elif user.target is aten.mul.Tensor:
                    muls.append(user)
        if muls:
            out.append((node, muls))
    return out


def _unattended_histories(gm: fx.GraphModule, first: int, ctx: PassContext) -> int:
    """Guarded regions of padded histories under a key-padding mask that no attention
    kernel reads (DIN: an MLP scores each behaviour, the scores are multiplied by the mask
    and sum-pooled), numbered from ``first``; returns how many. The mask is only known at
    run time here as around a guarded attention (the runner checks it once per call and
    runs the region padded when it is no prefix). Where only reductions over the token
    axis read the padded tokens (Dice's mean and variance over all B*L rows), the region
    carries padding representatives (:func:`_with_reps`); where a node may read them
    otherwise, the history stays padded and the warning says which node, which op and
    which module."""
    taken = {n for n in gm.graph.nodes if PACKED in n.meta}
    count = 0
    by_name = {n.name: n for n in gm.graph.nodes}
    attended = {keep_of(by_name[f["mask"]]) for n in gm.graph.nodes
                if (f := n.meta.get(ir.KERNEL) or {}).get("mask") in by_name}
    for mask, muls in _multiplied_masks(gm):
        if mask in attended or any(m in taken for m in muls):
            continue  # an attention's key mask: its region (or why not) is reported above
        batch, length = (int(x) for x in ir.shape_of(mask))
        starts = [s for s in _starts_among(ir.ancestors(muls), gm.graph, batch, length)
                  if s not in taken and s is not mask]
        if not starts or any(PACKED_SKIPPED in s.meta for s in starts):
            continue
        key_mask = KeyMask(mask, False, mask, batch, length, prefix=True)
        found = _flow_from(gm, starts, key_mask)
        extra: dict[str, Any] | str | None = None
        if isinstance(found, str) and found.startswith("padding rows"):
            # read by reductions over the token axis only: padding as one weighted token
            # per row, where the check finds each row's padded entries equal (pad_reps)
            extra, found = _with_reps(gm, starts, key_mask, found)
        if not isinstance(found, str) and (set(found[0].carriers) | set(found[0].zeroed)) \
                & taken:
            found = "overlap: the history meets another region's"
        if isinstance(found, str):
            for s in starts:
                s.meta[PACKED_SKIPPED] = found
            ctx.warn(f"pack-jagged-tokens: the history {', '.join(x.name for x in starts)} "
                     f"(masked by {mask.name}, [{batch}, {length}]) stays padded: "
                     f"{found}")
            continue
        flow, inside = found
        # a layout with representatives is a prefix's (each row's first padded position)
        compact = extra is None and _compact(
            flow, _flow_from(gm, starts, replace(key_mask, prefix=False)))
        rid = f"packed_tokens_{first + count}"
        count += 1
        taken |= set(_guarded_entry(gm, rid, flow, inside, key_mask, mask, compact, [], ctx,
                                    extra if isinstance(extra, dict) else None))
    return count


def _with_reps(gm: fx.GraphModule, starts: list[fx.Node], key_mask: KeyMask, why: str
               ) -> tuple[dict[str, Any] | None, tuple[PaddingFlow, list[fx.Node]] | str]:
    """The history's flow with weighted reductions over the token axis allowed, and its
    padding-representative facts (``pad_reps``); or, where that does not hold, why not:
    the first reader no weighting makes exact, else ``why`` the plain flow failed with the
    reason representatives do not apply (an operand varying by position, a dropout)."""
    found = _flow_from(gm, starts, key_mask, follow_weighted)
    if not isinstance(found, str):
        weighted = reductions(found[0])
        facts = rep_facts(gm, found[0], key_mask, weighted)
        if isinstance(facts, dict):
            return facts, found
        found = facts
    if found.startswith("padding rows"):
        # read by something no weighting makes exact: that reader (past the reductions a
        # weighting would handle, so the one to change), in the plain flow's terms
        return None, found
    return None, f"{why}; padding as one weighted token per row does not apply: {found}"


def _reps_around(gm: fx.GraphModule, attention: fx.Node, key_mask: KeyMask, why: str
                 ) -> tuple[dict[str, Any] | None, tuple[PaddingFlow, list[fx.Node]] | str]:
    """The flow around a guarded ``attention`` whose history some reader reads unmasked,
    with padding representatives laid out from the sources (``pad_reps.
    follow_around_attention``: such readers read the region value scattered, i.e. eager's
    padded value) and their facts; or ``why`` the plain flow failed, with the reason
    representatives do not apply (a causal attention, a mask varying by query, a
    position embedding, a dropout)."""
    starts = _history_starts(attention, key_mask.batch, key_mask.length)
    found = _flow_from(gm, starts, key_mask, follow_around_attention)
    if not isinstance(found, str):
        outside_readers(found[0])
        facts = rep_facts(gm, found[0], key_mask, reductions(found[0]), around=True)
        if isinstance(facts, dict):
            return facts, found
        found = facts
    return None, f"{why}; padding as one representative per row does not apply: {found}"
