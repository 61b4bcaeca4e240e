"""A guarded packed region's check, as rules the compiler and the runner share, and its fill
read from a sample batch.

A ``packed_tokens`` region with ``guard: "prefix-check"`` (``passes/pack_jagged_tokens``)
runs packed only on a batch whose key mask passes the check, and then over that batch's real
tokens: both are data. The runner checks the mask ahead of the compiled graph
(``backends/triton/region_guard``): it computes the mask from the batch with the mask's own
ops (:func:`mask_prelude`, possible where :func:`why_not_ahead` finds nothing in the way),
reads five flags per region (:func:`guard_flags` is their reference), decides with
:func:`packs`, and sizes the packed layout at the token count rounded up by :func:`bucket`.

The compiler has one batch in hand: the entrypoint's own ``example_inputs``, real tensors
wherever the author built them on the CPU (the bundled models do: ``make_batch(0, "cpu")``).
:func:`sample_fill` runs that same check on it, so the cost model prices the packed path
that batch would run (the token-wise work at the bucketed token count, an attention over
the kept keys at its rows' squared lengths) instead of the padded one. Why: sasrec_bst's
plan priced its guarded region fully padded (42.5 ms predicted, 23.0 ms measured on an
H200, BENCHMARKS.md) where its runs pack ~50% of the tokens (231,552 of 411,648 slots in
the run report's ``compiled_variants``). One example batch is one sample: a model whose
real batches differ in fill is priced at its example's, and the plan says so
(``fill_source``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from gemc import ir

BUCKETS = 16
"""How many token counts a guarded region's packed layout is rounded up to (multiples of
``ceil(B * L / BUCKETS)``), in the compiled graph: see :func:`bucket` (``GEMC_PACKED_BUCKETS``
overrides it at run time: ``backends/triton/region_guard.bucket_count``)."""

SAMPLE = "sample batch"  # a fill_source: the fill the example batch's check found


def bucket(total: int, capacity: int, buckets: int = BUCKETS) -> int:
    """``total`` real tokens (of ``capacity = B * L``) rounded up to a multiple of the
    granule ``ceil(capacity / buckets)``, at most ``capacity``. Why: the token count is
    data. The compiled graph takes it as an input's size, static for the first count and
    dynamic from the second on (``inductor_graph.token_count_input``), but the kernels
    launched with it still specialise on it (Triton on an int's divisibility by 16, which
    a bucketed count at the h200 presets always has) and a graph whose code fixes the count
    compiles once per count; rounding to the granule bounds both at ``buckets`` counts and
    wastes at most ``capacity / buckets`` spare tokens (6% of the padded work at 16).
    Powers of two would bound the variants at ``log2(capacity)`` but waste up to half the
    buffer, the whole saving at 50% fill. The spare tokens read position 0 where a value enters the
    region (``TokenLayout.index``), so they compute what eager computes there, never
    reach a real token, and get zero gradients."""
    if total <= 0 or capacity <= 0:
        raise ValueError(f"bucket: total {total} and capacity {capacity} must be > 0")
    granule = -(-capacity // buckets)
    return min(capacity, -(-total // granule) * granule)


def packs(flags: Sequence[int], every_row: bool = False, compact: bool = False) -> bool:
    """Whether a region runs packed on the call whose check read ``flags`` (rows that break
    the prefix, invalid additive values, kept tokens, rows keeping none, rows whose
    one-token readers read a position the mask drops: :func:`missed_reads`): every row a
    prefix, every additive value a key mask, every reader on a kept token (else a value
    the region leaves zero would be read), and some token kept (a region of 0 tokens
    would leave the gradients of its weights None where eager's are zero, which
    optimizers tell apart); with ``every_row`` (the region holds an attention whose rows
    with no kept key are NaN in eager, as ``nn.MultiheadAttention``'s softmax makes them,
    and so is everything the row reaches, masked or not) also a token on every row, so a
    batch with an empty row runs padded and returns eager's NaN. With ``compact`` (nothing
    in the region depends on the kept positions being a prefix: the pass's ``compact``)
    rows that are not prefixes pack too, their kept tokens in order. A sixth flag (a region
    with padding representatives: :func:`padding_reps`) counts rows whose padded entries
    differ: such a call runs padded too."""
    return (flags[0] == 0 or compact) and flags[1] == 0 and flags[2] > 0 and \
        not (every_row and flags[3] > 0) and (len(flags) < 5 or flags[4] == 0) and \
        (len(flags) < 6 or flags[5] == 0)


def padding_reps(lengths: torch.Tensor, sources: Sequence[torch.Tensor], length: int
                 ) -> torch.Tensor:
    """``[2]`` int64 on the device, no sync: the rows where some ``[B, L, ...]`` source of
    a region with padding representatives (``pad_rep``: ``passes/pad_reps``) holds padded
    entries that differ within the row, and the rows that have padding (each gets one
    representative token). ``lengths`` ``[B]``: the kept prefix of each row.

    Why per row and against the row's first padded entry: the packed layout keeps that
    entry as the row's one representative, weighted by its row's padding count, which is
    exact only when every padded copy is that same value (DIN's padded history ids are
    all 0; any other data runs the region padded, counted). Exact comparison: a NaN
    padding entry never equals itself, so such a row runs padded too."""
    lengths = lengths.to(torch.int64)
    batch = int(lengths.shape[0])
    device = lengths.device
    padded_rows = lengths < length
    unequal = torch.zeros(batch, dtype=torch.bool, device=device)
    first = lengths.clamp(max=max(length - 1, 0))
    pad = torch.arange(length, device=device)[None, :] >= lengths[:, None]  # [B, L]
    for src in sources:
        flat = src.reshape(batch, length, -1)
        rep = flat.gather(1, first[:, None, None].expand(-1, 1, flat.shape[2]))
        differs = (flat != rep).any(-1)  # [B, L]
        unequal = unequal | (differs & pad).any(1)
    return torch.stack([unequal.sum(), padded_rows.sum()]).to(torch.int64)


def trailing_lengths(sources: Sequence[torch.Tensor], batch: int, length: int
                     ) -> torch.Tensor:
    """``[B]`` int64 on the device, no sync: per row, one past the last position where some
    ``[B, L, ...]`` source differs from the row's last position (0 where none does). The
    layout of a region with padding representatives laid out from its sources
    (``rep_layout: "sources"``, ``passes/pad_reps``): positions from there on hold one
    token per source, so one representative stands for them. Exact comparison: a NaN
    never equals itself, so a row with a NaN keeps every position up to it as real."""
    device = sources[0].device if sources else None
    pos = torch.arange(length, device=device)
    differs = torch.zeros(batch, length, dtype=torch.bool, device=device)
    for src in sources:
        flat = src.reshape(batch, length, -1)
        differs = differs | (flat != flat[:, -1:]).any(-1)
    return (torch.where(differs, pos[None, :], -1).amax(1) + 1).to(torch.int64) \
        if length else torch.zeros(batch, dtype=torch.int64, device=device)


def source_reps(sources: Sequence[torch.Tensor], batch: int, length: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A region laid out from its sources' trailing runs (:func:`trailing_lengths`): its
    real lengths ``[B]`` and its seven flags in the order of a mask's check with
    :func:`padding_reps`' two after them (no prefix to break, no additive value, the
    tokens before each run, no empty-row rule, no one-token reader, no unequal padding,
    the rows with a run that gets a representative), so :func:`packs` and the counters
    read them alike. On the device, no sync."""
    lengths = trailing_lengths(sources, batch, length)
    zero = torch.zeros(1, dtype=torch.int64, device=lengths.device)
    flags = torch.cat([zero, zero, lengths.sum().reshape(1), zero, zero, zero,
                       (lengths < length).sum().reshape(1)])
    return lengths, flags


ADDITIVE_MASKED_GAP = 1.0e4
"""An additive entry is masked when it lies this far or more below its row's kept value
(``exp`` of the gap underflows to exactly 0 in fp32); the kept value itself must be within
this of 0 (beyond it, eager's own rounding of ``score + value`` moves the scores:
``backends/triton/key_padding_attention``'s module doc)."""


def mask_rows(mask: torch.Tensor) -> torch.Tensor:
    """A key mask as its ``[B, L]`` rows: ``mask`` itself, or a ``[B, 1, ..., 1, L]`` one
    viewed (size-1 dims only: nothing moves). Why such masks reach the kernels: Hugging
    Face's extended mask, ``(1.0 - m[:, None, None, :].to(dtype)) * -10000.0`` (or
    ``torch.finfo(dtype).min``, or RecBole's ``torch.where(m4, 0.0, -10000.0)``), does its
    arithmetic after the unsqueezes, so the graph holds its values only at that shape
    (``passes/jagged_patterns.attention_key_mask``)."""
    if mask.dim() > 2 and all(int(s) == 1 for s in mask.shape[1:-1]):
        return mask.reshape(mask.shape[0], mask.shape[-1])
    return mask


def read_positions(index: torch.Tensor | None, at: int | None, batch: int, length: int,
                   wrap: bool, device: torch.device | str | None = None,
                   stride: int | None = None) -> torch.Tensor:
    """``[B]`` int64: the position each row's one-token reader reads (``passes/row_reads``:
    ``index`` flattened in row order, or the constant ``at``), a negative one counted from
    the row's end where the reader wraps (indexing, ``select``), and -1 where it lands
    outside the row: the check then fails and the padded computation does what eager does
    with it (wraps, or raises as a gather does). ``stride``: ``index`` is a position in the
    rows flattened to ``[B * length]`` (``x.reshape(B * L, D).index_select(0, arange(B) * L
    + pos)``), row ``b``'s position being ``index[b] - b * stride``; a flat index landing in
    another row (or outside all of them, where eager wraps or raises) is -1. On the device,
    no sync."""
    if index is None:
        pos = torch.full((batch,), int(at or 0), dtype=torch.int64, device=device)
    else:
        pos = index.reshape(batch).to(torch.int64)
    if stride is not None:
        pos = pos - torch.arange(batch, dtype=torch.int64, device=pos.device) * int(stride)
    elif wrap:
        pos = torch.where(pos < 0, pos + length, pos)
    return torch.where((pos >= 0) & (pos < length), pos, -1)


def missed_reads(kept: torch.Tensor, positions: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[1]`` int64 on the device: how many rows, over the readers whose
    :func:`read_positions` are given, read a position the ``[B, L]`` bool ``kept``
    (:func:`kept_keys`) does not keep. Zero: every reader reads real tokens only, so what
    the check guards may leave the padding rows unread (zero, or not there at all)."""
    missed = torch.zeros(1, dtype=torch.int64, device=kept.device)
    for pos in positions:
        hit = kept.gather(1, pos.clamp(min=0)[:, None])[:, 0] & (pos >= 0)
        missed = missed + (~hit).sum().reshape(1)
    return missed


def reader_positions(specs: Sequence[Mapping[str, Any]],
                     indices: Mapping[str, torch.Tensor], batch: int, length: int,
                     device: torch.device | str) -> list[torch.Tensor]:
    """:func:`read_positions` of each reader's facts (a plan entry's ``reads`` /
    ``read_rows``), their index values by node name (the runner's environment)."""
    return [read_positions(indices[s["index"]] if s.get("index") else None, s.get("at"),
                           batch, length, bool(s.get("wrap")), device, s.get("stride"))
            for s in specs]


def kept_keys(mask: torch.Tensor, additive: bool) -> torch.Tensor:
    """``[B, L]`` bool, True where a key is kept: the mask itself, or where an additive
    row has its largest finite value (softmax ignores a row's constant, so a row of one
    finite value, e.g. a BERT-style ``-1e4`` for an empty history, keeps every key, as
    eager's uniform row does). The check kernel's rule
    (``key_padding_attention._prefix_kernel``) in plain torch. A ``[B, 1, ..., 1, L]``
    mask: its rows (:func:`mask_rows`)."""
    mask = mask_rows(mask)
    if not additive:
        return mask.to(torch.bool)
    if mask.shape[-1] == 0:
        return torch.zeros(mask.shape, dtype=torch.bool, device=mask.device)
    top = mask.amax(-1, keepdim=True)
    return (mask == top) & (top > float("-inf"))


def guard_flags(mask: torch.Tensor, additive: bool, reads: Sequence[torch.Tensor] = ()
                ) -> tuple[torch.Tensor, list[int]]:
    """``(kept keys per row [B], flags)`` of a ``[B, L]`` key mask, by the rule of the
    runner's check kernel (``key_padding_attention._prefix_kernel``) in plain torch: the
    flags are the positions breaking a prefix, the additive values that are no key mask
    (a masked entry less than ``ADDITIVE_MASKED_GAP`` below its row's kept value; a kept
    value farther than that from 0), the kept tokens in all, the rows keeping none, and
    the rows whose one-token readers (their ``reads`` positions) miss a kept token."""
    mask = mask_rows(mask)
    kept = kept_keys(mask, additive)
    lengths = kept.sum(1)
    prefix = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    invalid = 0
    if additive and mask.shape[1]:
        top = mask.amax(1, keepdim=True)
        finite = top > float("-inf")
        invalid = int((~kept & (mask > top - ADDITIVE_MASKED_GAP)).sum()) + \
            int((finite & (top.abs() > ADDITIVE_MASKED_GAP)).sum())
    return lengths, [int((kept != prefix).sum()), invalid, int(lengths.sum()),
                     int((lengths == 0).sum()), int(missed_reads(kept, reads))]


def why_not_ahead(gm: fx.GraphModule, mask: str, calls: Mapping[str, Any]) -> str | None:
    """Why the mask node ``mask`` cannot be computed from the batch ahead of the graph (a
    parameter, a lookup the runner answers itself, a node that is not an op), or None."""
    by_name = {n.name: n for n in gm.graph.nodes}
    if mask not in by_name:
        return f"its mask {mask} is not in the captured graph"
    needed = ir.ancestors([by_name[mask]])
    for n in (n for n in gm.graph.nodes if n in needed):
        if n.op == "placeholder" and ir.PARAM in n.meta:
            return f"its mask {mask} reads parameter {n.meta[ir.PARAM]}"
        if n.name in calls:
            return f"its mask {mask} reads {n.name}, which the runner computes itself"
        if n.op not in ("placeholder", "call_function"):
            return f"its mask {mask} reads {n.name} ({n.op})"
    return None


def guard_inputs(region: Mapping[str, Any]) -> list[str]:
    """The graph nodes a guarded region's check reads: its mask, then the index of each
    of its one-token readers (``reads``) that has one, then the sources whose padded
    entries a region with padding representatives compares (``rep_sources``), each once,
    in that order."""
    out = [str(region["mask"])]
    for spec in region.get("reads") or ():
        if spec.get("index") and spec["index"] not in out:
            out.append(str(spec["index"]))
    for name in region.get("rep_sources") or ():
        if name not in out:
            out.append(str(name))
    return out


def why_not_ahead_all(gm: fx.GraphModule, names: Sequence[str], calls: Mapping[str, Any]
                      ) -> str | None:
    """:func:`why_not_ahead` of the first of ``names`` that cannot be computed from the
    batch ahead of the graph, or None."""
    for name in names:
        why = why_not_ahead(gm, name, calls)
        if why is not None:
            return why.replace("its mask", "its check's input") if name != names[0] else why
    return None


def mask_prelude(gm: fx.GraphModule, masks: Sequence[str],
                 device: torch.device | str) -> fx.GraphModule:
    """``prelude(*batch) -> masks``: the masks' ops copied from the captured graph, one
    placeholder per batch input (those it does not read are ignored), run on ``device``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    by_name = {n.name: n for n in gm.graph.nodes}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and ir.PARAM not in n.meta:
            env[n] = graph.placeholder(n.name)
    needed = ir.ancestors([by_name[m] for m in masks])
    for n in gm.graph.nodes:
        if n in needed and n.op == "call_function":
            new = graph.node_copy(n, env.__getitem__)
            if "device" in new.kwargs:  # captured on meta: run where the batch is
                new.kwargs = {**new.kwargs, "device": torch.device(device)}
            env[n] = new
    graph.output(tuple(env[by_name[m]] for m in masks))
    return fx.GraphModule(torch.nn.Module(), graph, class_name="GemcRegionMasks")


def sample_fill(gm: fx.GraphModule, region: Mapping[str, Any],
                sample: Sequence[Any] | None) -> dict[str, Any]:
    """The fill a guarded region (its ``packed_region`` facts: ``mask``, ``additive``,
    ``every_row``, ``compact``) is priced at, from ``sample`` (the entrypoint's example
    batch): ``{"fill", "attention_fill", "fill_source", "sample_tokens"}`` (and
    ``sample_reps``, its rows with padding, in a region with padding representatives).

    When the sample passes the check: ``fill`` is its real tokens rounded up as the
    compiled graph rounds them (:func:`bucket`) over ``B * L``; ``attention_fill`` is
    ``sum(len^2) / (B * L^2)``, the share of the padded score matrix an attention over the
    kept keys computes. Otherwise both are 1 (the padded computation that runs) and
    ``fill_source`` says why: no sample, a sample on meta or of another arity, a mask the
    runner cannot compute ahead of the graph, or the check failing on the sample."""
    def padded(why: str) -> dict[str, Any]:
        return {"fill": 1.0, "attention_fill": 1.0, "fill_source": f"padded: {why}"}

    mask_name = str(region["mask"])
    blocked = why_not_ahead_all(gm, guard_inputs(region), {})
    if blocked is not None:
        return padded(f"{blocked}, so the region runs padded")
    tensors = list(sample or ())
    if not tensors:
        return padded("no sample batch (the entrypoint gave no example_inputs)")
    if any(not isinstance(t, torch.Tensor) or t.device.type == "meta" for t in tensors):
        return padded("the example batch is not real data (a tensor on meta, or not a "
                      "tensor); build example_inputs with make_batch(0, 'cpu')")
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and ir.PARAM not in n.meta]
    if len(inputs) != len(tensors):
        return padded(f"the example batch has {len(tensors)} tensors where the graph takes "
                      f"{len(inputs)} inputs")
    names = guard_inputs(region)
    try:
        with torch.no_grad():
            mask, *index = mask_prelude(gm, names, "cpu")(*[t.cpu() for t in tensors])
    except Exception as exc:  # the mask's ops on the sample: any failure prices padded
        return padded(f"computing the mask {mask_name} on the example batch failed "
                      f"({type(exc).__name__}: {exc})")
    raw, mask = mask, mask_rows(mask)
    additive = bool(region.get("additive", False))
    batch, length = int(mask.shape[0]), int(mask.shape[1])
    reads = reader_positions(region.get("reads") or (), dict(zip(names[1:], index)), batch,
                             length, "cpu")
    if region.get("rep_layout") == "sources":  # the layout from the sources themselves
        values = {names[0]: raw, **dict(zip(names[1:], index))}
        lengths, checked = source_reps([values[n] for n in region["rep_sources"]], batch,
                                       length)
        flags = checked.tolist()
    else:
        lengths, flags = guard_flags(mask, additive, reads)
    if region.get("pad_rep") and region.get("rep_layout") != "sources":
        values = dict(zip(names[1:], index))
        flags += padding_reps(lengths, [values[n] for n in region["rep_sources"]],
                              length).tolist()
    if not packs(flags, bool(region.get("every_row")), bool(region.get("compact"))):
        why = ("rows that keep no prefix" if flags[0] and not region.get("compact") else
               "additive values that are no key mask" if flags[1] else
               "a reader of one token per row reading a padding token" if flags[4] else
               "padded entries that differ within a row" if len(flags) > 5 and flags[5]
               else "no kept token" if flags[2] == 0 else "a row that keeps no token")
        return padded(f"the example batch fails the region's check ({why}), so it would "
                      "run padded")
    capacity = batch * length
    # a layout from its sources: each row's attention over its slots, the representative
    # included (``min(len + 1, L)`` of them)
    width = (lengths + 1).clamp(max=length) if region.get("rep_layout") == "sources" \
        else lengths
    squares = float((width.double() ** 2).sum())
    # padding representatives: one more token on each row with padding
    tokens = flags[2] + (flags[6] if region.get("pad_rep") else 0)
    return {"fill": bucket(tokens, capacity) / capacity,
            "attention_fill": min(1.0, squares / (batch * length * length)),
            "fill_source": SAMPLE, "sample_tokens": tokens,
            # rows that keep no prefix (a guarded attention compacts them: its price)
            "sample_not_prefix": int(flags[0]),
            # the rows with padding (each one representative, a padding id in a gathered
            # lookup: the table gradient's hot-row chain, cost_model.kernels)
            **({"sample_reps": int(flags[6])} if region.get("pad_rep") else {})}
