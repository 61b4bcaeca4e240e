"""Guarded packed token regions in the compiled graph: the check ahead of it, one compiled
variant per outcome.

A ``packed_tokens`` region with ``guard: "prefix-check"`` runs packed only on a call whose
key mask keeps a prefix on every row (``passes/pack_jagged_tokens``). The interpreter
decides that mid-graph (``GraphRunner._guard``); the graph Inductor compiles cannot: its
shapes are fixed when it is compiled, and both the outcome and the packed token count are
data. So the decision is taken at the compiled graph's boundary, on its inputs:

* a *prelude* computes each region's mask from the batch: the mask's own ops copied from
  the captured graph (a mask given as input is the input itself; one built from lengths or
  offsets, the few ops that build it), and the positions its readers of one token per row
  read (``lengths - 1``: the region's ``reads``). A region whose mask or positions need
  more (a parameter, a sharded lookup) is left out of the compiled graph, loudly
  (:func:`why_not_ahead`);
* ``packed_tokens.region_check`` checks each mask on the device, and **one host read per
  step** (all regions' flags at once: prefix violations, invalid additive values, the
  token total, readers on a dropped position, and, for a region with padding
  representatives, rows whose padded source entries differ and rows with padding) decides
  the key: per region its token count (real tokens, plus one per row with padding where
  it has representatives) rounded up to a bucket
  (``packed_tokens.bucket``: at most ``BUCKETS`` counts) when it packs, ``None`` when it
  does not (the model's padded computation, the exact fallback), each counted in
  ``packed_tokens.GUARD_STATS`` as the interpreter counts it;
* the caller runs the graph built for that outcome (``inductor_graph.build(guards=...)``:
  which regions pack, not at which count), whose packed regions
  take their offsets as leading inputs and their token counts as the sizes of further
  inputs (``inductor_graph.token_count_input``): the first count compiles a static graph,
  a second one recompiles it once with the count a dynamic size (Dynamo's automatic
  dynamic shapes), which then serves every bucket (with the count part of the key, MMoE
  on the H200 compiled a new 20-s graph for each new bucket); the check is not repeated
  inside, and the compiled code reads nothing on the host.

The same read decides the **key-padding attentions outside packed regions** whose mask the
prelude can compute (:func:`guarded_attentions`: cross-attention of queries over a padded
history, not causal): each is checked with ``key_padding_attention.prefix_lengths`` and
its outcome joins the key: ``"prefix"`` or ``"compact"`` (a boolean-valid mask; its kept
keys moved to the front in order) run ``gemc::key_lengths_attention`` on the keys' lengths
passed as leading inputs, ``"padded"`` (an additive row that is no mask) the exact padded
attention, all in the compiled graph. Without this each such attention is an eager island
with a host read of its own, and Dynamo compiles the graph in pieces around it (GEM's two
history cross-attentions split its forward into three frames).

Why one read and not none: the read picks which compiled graph runs and at which token
count; every alternative without it either runs every region padded (no saving) or sizes
the packed buffer at ``B * L`` (no saving either). It is the read the interpreter and the
guarded attention already make, once per step instead of once per region and layer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gemc.errors import GemcUserError
from gemc.guard_sample import (
    guard_inputs,
    mask_prelude,
    mask_rows,
    padding_reps,
    reader_positions,
    source_reps,
    why_not_ahead,
)

from . import packed_tokens
from .graph_runner import GraphRunner

__all__ = ["BUCKETS_ENV", "Decision", "RegionGuard", "bucket_count", "guarded_attentions",
           "why_not_ahead"]

BUCKETS_ENV = "GEMC_PACKED_BUCKETS"
"""Overrides ``packed_tokens.BUCKETS`` (how many token counts, so compiled graphs, a guarded
region may get): more wastes fewer spare tokens and may compile more graphs."""


def bucket_count() -> int:
    """The bucket count: ``GEMC_PACKED_BUCKETS`` if set, else ``packed_tokens.BUCKETS``."""
    raw = os.environ.get(BUCKETS_ENV)
    if raw is None:
        return packed_tokens.BUCKETS
    value = int(raw) if raw.strip().isdigit() else 0
    if value < 1:
        raise GemcUserError(f"{BUCKETS_ENV}={raw!r} is not a positive integer",
                            where=f"the environment variable {BUCKETS_ENV}",
                            fix="set it to how many token counts a guarded packed region may "
                                f"be compiled for (default {packed_tokens.BUCKETS}), or unset it")
    return value


def guarded_attentions(runner: GraphRunner) -> list[dict[str, Any]]:
    """The ``key_padding_attention`` entries the check ahead of the graph decides: not
    causal, queries not the keys' own padded rows (so the attention's shapes do not depend
    on the kept-token count), outside any packed region (those the region's check decides),
    with a mask the prelude can compute from the batch."""
    out = []
    for e in runner.entries:
        if e["kind"] != "key_padding_attention" or e.get("causal") or not e.get("mask"):
            continue
        if e.get("zero_padding_queries") and e.get("queries") == e.get("max_len"):
            continue  # self-attention on jagged queries: its token count is data
        node = runner.by_name.get(str(e.get("output", e["nodes"][0])))
        if node is None or runner.region_of.get(node) is not None:
            continue
        if why_not_ahead(runner.gm, str(e["mask"]), runner.calls) is None:
            out.append(e)
    return out


@dataclass(frozen=True)
class Decision:
    """One step's outcome: ``key`` per region (its bucketed token count, or None: padded),
    then per guarded attention (``"prefix"``, ``"compact"`` or ``"padded"``), and the
    leading inputs: the offsets of the packed regions (each followed by its kept positions
    in a ``compact`` region), then the key lengths of the attentions that run on them."""

    key: tuple[int | str | None, ...]
    offsets: tuple[torch.Tensor, ...]


class RegionGuard:
    """The guarded regions of a runner, checked ahead of the compiled graph (module doc)."""

    def __init__(self, runner: GraphRunner, regions: Sequence[dict[str, Any]],
                 buckets: int | None = None,
                 attentions: Sequence[dict[str, Any]] = ()) -> None:
        self.names = [str(r["name"]) for r in regions]
        self.additive = [bool(r.get("additive", False)) for r in regions]
        self.every_row = [bool(r.get("every_row", False)) for r in regions]
        self.compact = [bool(r.get("compact", False)) for r in regions]
        # padding representatives: the sources whose padded entries the check compares
        self.rep_sources = [list(r.get("rep_sources") or ()) if r.get("pad_rep") else None
                            for r in regions]
        # laid out from the sources' trailing runs (``rep_layout: "sources"``): no mask
        # check, the "mask" being the first source
        self.from_sources = [r.get("rep_layout") == "sources" for r in regions]
        self.attentions = [str(e["name"]) for e in attentions]
        self.attention_additive = [bool(e.get("additive", False)) for e in attentions]
        self.buckets = buckets or bucket_count()
        self.masks = [str(r["mask"]) for r in regions] + [str(e["mask"]) for e in attentions]
        # each region's one-token readers, checked with its mask (their positions' index
        # nodes: computed by the prelude after the masks)
        self.reads = [list(r.get("reads") or ()) for r in regions]
        self.indices = list(dict.fromkeys(n for r in regions for n in guard_inputs(r)[1:]))
        self.prelude = mask_prelude(runner.gm, self.masks + self.indices, runner.device)

    def warm(self, gm: Any) -> None:
        """The checks' host code on ``meta`` masks shaped as the captured graph's mask nodes
        (the warm-up's derivation of the prefix check's launches, ahead of the first
        batch: the kernel's specialisation depends on the mask's width and layout, which
        the capture fixes, not on the batch)."""
        from .key_padding_attention import prefix_lengths
        from .warm import meta_like

        vals = {n.name: n.meta.get("val") for n in gm.graph.nodes}
        masks = [meta_like(vals[name]) for name in self.masks]
        count = len(self.names)
        for mask, additive, sources in zip(masks[:count], self.additive, self.from_sources):
            if not sources:  # a region laid out from its sources launches no mask check
                packed_tokens.region_check(mask, additive)
        for mask, additive in zip(masks[count:], self.attention_additive):
            prefix_lengths(mask, additive)

    @classmethod
    def of(cls, runner: GraphRunner) -> RegionGuard | None:
        """The guard of the runner's guarded regions and attentions, or None without any."""
        regions = [e for e in runner.entries
                   if e["kind"] == "packed_tokens" and e.get("guard") is not None]
        attentions = guarded_attentions(runner)
        return cls(runner, regions, attentions=attentions) if regions or attentions else None

    def check(self, batch: Sequence[Any]) -> Decision:
        """Check every region's and guarded attention's mask on ``batch`` (one host read for
        all of them), count each outcome (``packed_tokens.GUARD_STATS``,
        ``key_padding_attention.STATS``) and say which variant runs."""
        from .key_padding_attention import STATS, prefix_lengths

        computed = self.prelude(*batch)
        masks = [mask_rows(m) for m in computed[:len(self.masks)]]
        indices = dict(zip(self.indices, computed[len(self.masks):]))
        count = len(self.names)
        checked = [source_reps([{self.masks[i]: computed[i], **indices}[n]
                                for n in self.rep_sources[i] or ()],
                               int(m.shape[0]), int(m.shape[1]))
                   if self.from_sources[i] else
                   self._region_check(m, a, reader_positions(
                       reads, indices, int(m.shape[0]), int(m.shape[1]), m.device),
                       reps, indices)
                   for i, (m, a, reads, reps) in enumerate(zip(
                       masks[:count], self.additive, self.reads, self.rep_sources))]
        checked = [(packed_tokens.rep_offsets(offs, int(masks[i].shape[1])), flags)
                   if self.from_sources[i] else (offs, flags)
                   for i, (offs, flags) in enumerate(checked)]
        lengths = [prefix_lengths(m, a) for m, a in zip(masks[count:], self.attention_additive)]
        flat = torch.cat([c for _, c in checked]
                         + [bad.sum(0).to(torch.int64) for _, bad in lengths])
        values = flat.tolist()  # the step's one host read
        per = checked[0][1].numel() if checked else 0  # each region's flags
        width = per * count
        flags = [values[i * per:(i + 1) * per] for i in range(count)]
        key: list[int | str | None] = []
        offsets = []
        for i, ((offs, _), f, mask, additive, every_row, compact) in enumerate(zip(
                checked, flags, masks, self.additive, self.every_row, self.compact)):
            # a source that needs its own gradient per position: padded (GuardStats)
            grad = self.from_sources[i] and any(
                {self.masks[i]: computed[i], **indices}[n].requires_grad
                for n in self.rep_sources[i] or ())
            capacity = int(mask.shape[0]) * int(mask.shape[1])  # B * L: the padded tokens
            # a layout from the sources as large as the padded tensor (no trailing run
            # longer than one position): the padded computation, without the conversions
            whole = self.from_sources[i] and int(f[2]) + int(f[6]) >= capacity
            ok = packed_tokens.packs(f, every_row, compact) and not grad and not whole
            packed_tokens.GUARD_STATS.count(ok, f, grad)
            # with padding representatives, one more token on each row with padding
            total = packed_tokens.bucket(int(f[2]) + int(f[6]), capacity, self.buckets) \
                if ok else None
            key.append(total)
            if total is not None:
                offsets.append(offs)
                if compact:  # its kept positions, in the room the graph has for tokens
                    offsets.append(packed_tokens.kept_positions(mask, additive, total))
        for i, (offs, _) in enumerate(lengths):
            not_prefix, invalid = values[width + 2 * i: width + 2 * i + 2]
            STATS.calls += 1
            if invalid:
                STATS.fallback += 1
                key.append("padded")
                continue
            if not_prefix:
                STATS.compacted += 1
            else:
                STATS.jagged += 1
            key.append("compact" if not_prefix else "prefix")
            offsets.append((offs[1:] - offs[:-1]).to(torch.int32))
        return Decision(tuple(key), tuple(offsets))

    @staticmethod
    def _region_check(mask: torch.Tensor, additive: bool, reads: list[torch.Tensor],
                      reps: list[str] | None, indices: dict[str, torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """``packed_tokens.region_check`` and two more flags (every region's, so each has
        as many): a region with padding representatives' ``padding_reps`` (rows whose
        padded source entries differ, rows with padding), its offsets those of the layout
        with representatives (``rep_offsets``); zeros for any other region."""
        offsets, flags = packed_tokens.region_check(mask, additive, reads)
        if reps is None:
            return offsets, torch.cat([flags, flags.new_zeros(2)])
        lengths = offsets[1:] - offsets[:-1]
        extra = padding_reps(lengths, [indices[n] for n in reps], int(mask.shape[1]))
        return packed_tokens.rep_offsets(lengths, int(mask.shape[1])), \
            torch.cat([flags, extra])

    def guards(self, key: Sequence[int | str | None]) -> dict[str, int]:
        """``build(guards=...)``'s argument for ``key``: the packed regions' token counts,
        in the order their offsets come."""
        return {name: total for name, total in zip(self.names, key)
                if isinstance(total, int)}

    def attention_guards(self, key: Sequence[int | str | None]) -> dict[str, str]:
        """``build(attention_guards=...)``'s argument for ``key``: each guarded attention's
        outcome, in the order their key lengths come (after the regions' offsets)."""
        return dict(zip(self.attentions, (str(k) for k in key[len(self.names):])))
