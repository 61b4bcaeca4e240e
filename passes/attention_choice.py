"""Whether a matched attention runs as gemc's kernel or stays the model's own attention: the
one priced rule that match-jagged-attention, match-softmax-attention and
match-silu-attention consult before they group a match.

Why: the project's rule is never to be slower than what users already have, and gemc's
attention kernels are not always faster: on the session-25 H100 TransAct's guarded
attention took 2.60 ms where padded cuDNN SDPA took 0.97 ms, the host's work per call and
the guard's sync, not the kernel's arithmetic (``cost_model.attention_choice``). So each
match is priced both ways (:func:`price`) and where gemc's call is priced slower the pass
leaves the model's SDPA or formula to Inductor, loudly: the node's skip reason and a
warning name both prices and why, and the kernel facts of every attention kept record
them (``attention_prices``).

The prices, at the runner's dtype (bf16 under the default autocast; another captured
half type as is), by ``cost_model.attention_fit`` (a law fitted to the session-25 H100
run; ``benchmarks/attention_price_check.py`` prints it beside the measurements):

* gemc's kernel: its work over the real tokens' tiles at the kernel family's measured rate
  (the jagged self-attention's rows, or every query row over the kept keys for the
  varlen-key path), plus what it moves around the kernel: the padded <-> jagged copies of
  a self-attention run on padded tensors, and a guarded call's compaction where the sample
  batch has rows that keep no prefix. The fill of an attention over offsets is the graph's;
  that of a guarded attention (a data mask, checked on every call) is the sample batch's
  kept tokens (``gemc.guard_sample.sample_fill``, the check the op runs, on the
  entrypoint's example batch); padded (fill 1) where there is no real sample or it fails
  the check (the op then runs the padded fallback);
* the model's attention: its nodes' ``op_cost.node_cost`` (masked SDPA at the padded shape
  by the fitted law, or the calibration's record of that very shape; a written-out formula
  op by op);
* a guarded attention (its own check, one host sync per call) adds the host time the sync
  exposes (``attention_fit.GEMC_GUARDED_CALL_HOST_S``, ``cost_model.attention_choice``).

Whether a match keeps its copies and its sync is known only after pack-jagged-tokens: a
packed region runs the attentions inside it on its tokens (no copies; a guarded region's
one check runs ahead of the graph). A match priced slower only for its copies or its sync
is grouped, and :func:`settle`, at the end of pack-jagged-tokens, keeps it where a region
runs it on its tokens (repriced so) and ungroups it (the model's attention, loudly)
elsewhere; a pipeline without pack-jagged-tokens keeps it grouped, as before this rule. So
is a guarded match priced at fill 1 only because no sample could be taken (its mask reads
a buffer the capture on meta holds no values of: TransAct's action-type lookup), since a
region laid out at run time may run it on half its tokens: where none does, the padded
price stands and it is ungrouped.

The switch ``GEMC_ATTENTION_KERNEL``: ``priced`` (the default), ``always`` (gemc's kernel
wherever a pass matches, as before this rule) or ``never`` (the model's attention wherever
a pass matches). Without a topology (an annotation-only pipeline) nothing is priced and
the kernel is kept, as before.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from gemc.cost_model import attention_fit, op_cost
from gemc.cost_model.attention_choice import (
    AttentionPrices,
    attention_prices,
    region_host_prices,
)
from torch import fx

from gemc import ir
from gemc.context import PassContext
from gemc.errors import GemcUserError
from gemc.guard_sample import SAMPLE, sample_fill

ENV = "GEMC_ATTENTION_KERNEL"
MODES = ("priced", "always", "never")
KEPT_PADDED = "kept-padded"  # the prefix of every reason this rule gives
PENDING = ir.PREFIX + "attention_choice_pending"  # see choose / settle
SAMPLED = "the sample batch's kept tokens"  # a guarded match's fill, sampled


def mode() -> str:
    """The switch's value (``priced`` when unset); a bad value is a user error."""
    value = os.environ.get(ENV, "priced").strip().lower() or "priced"
    if value not in MODES:
        raise GemcUserError(f"{ENV}={value!r} is not a choice of the attention kernel",
                            where="the environment of gemc compile",
                            fix=f"set {ENV} to one of {', '.join(MODES)} (or unset it)")
    return value


def choose(gm: fx.GraphModule, output: fx.Node, group: Sequence[fx.Node],
           facts: dict[str, Any], kind: str, ctx: PassContext, *, skip_key: str,
           warning: str) -> str | None:
    """None where ``output``'s match (its ``facts``, of kernel ``kind``, replacing the
    nodes ``group``) is grouped as gemc's kernel, its prices recorded in
    ``facts["attention_prices"]``; else the reason it stays the model's attention (for the pass's
    ``skip_key`` and warning). A match priced slower only for its copies or its per-call
    sync is grouped and left to :func:`settle` (after pack-jagged-tokens, which may run it
    on a packed region's tokens, without either): ``skip_key`` and ``warning`` (a format
    with ``{node}`` and ``{why}``) are what settle records if it keeps the model's."""
    chosen = mode()
    prices = price(gm, output, group, facts, kind, ctx)
    if prices is not None:
        facts["attention_prices"] = prices.as_dict()
    if chosen == "always":
        return None
    if chosen == "never":
        return f"{KEPT_PADDED}: {ENV}=never"
    if prices is None or not prices.gemc_slower:
        return None
    if not prices.kernel_slower or _fill_unknown(prices):
        # slower for its copies or its sync, which a region may drop; or priced padded for
        # want of a sample (a mask computed from a buffer the capture on meta has no values
        # of, as TransAct's), where a region may run it on far fewer tokens
        output.meta[PENDING] = (skip_key, warning, _reason(prices, output, facts))
        return None
    return _reason(prices, output, facts)


def _fill_unknown(prices: AttentionPrices) -> bool:
    """A guarded match priced at fill 1 because no sample could be taken (not because the
    sample was full): its kernel price is an upper bound, not a price."""
    return prices.guarded and prices.fill_source != SAMPLED


def settle(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Decide the matches :func:`choose` left pending: one a packed region runs on its
    tokens (``gemc.packed`` on it, or in a guarded region's ``in_place``) makes no copies
    and has no sync of its own, and keeps gemc's kernel (``attention_prices`` repriced
    so); any other stays the model's attention, ungrouped, with the pass's skip reason and
    warning. Returns how many it ungrouped."""
    regions = ir.packed_regions(gm)
    in_place = {name: rid for rid, f in regions.items() for name in f.get("in_place") or ()}
    ungrouped = 0
    for node in list(gm.graph.nodes):
        pending = node.meta.pop(PENDING, None)
        facts = node.meta.get(ir.KERNEL)
        if pending is None or not isinstance(facts, dict):
            continue
        skip_key, warning, why = pending
        packed = node.meta.get(ir.PACKED)
        rid = in_place.get(node.name, packed.get("id") if isinstance(packed, dict) else None)
        if node.name in in_place or packed is not None:
            facts["attention_prices"] = _on_region(
                dict(facts.get("attention_prices") or {}), regions.get(rid), node.name,
                getattr(ctx.calibration, "graph_launch_s", None), facts)
            continue
        gid = facts.get("id")
        for n in gm.graph.nodes:
            if n.meta.get(ir.GROUP) == gid:
                del n.meta[ir.GROUP]
        del node.meta[ir.KERNEL]
        node.meta[skip_key] = why
        ctx.warn(warning.format(node=node.name, why=why))
        ungrouped += 1
    return ungrouped


def _on_region(choice: dict[str, Any], region: Mapping[str, Any] | None, name: str = "",
               per_launch_s: float | None = None,
               facts: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A kept match's recorded prices as its packed region runs it: no copies, no sync of
    its own, and, where the region's sample gives the share of the padded scores its
    attentions compute (``attention_fill``) and the match was priced at another fill, the
    kernel's time scaled to it (the kernel's work is its score tiles). Both sides then add
    their launches' host time at the step model's per-launch price
    (``attention_choice.region_host_prices``: the region's call, over padding
    representatives where the region lists ``name`` in its ``rep_attentions``, and the
    model's SDPA). Kept either way: the region runs it on its tokens (a region attention
    priced slower is recorded so, with ``slower`` in its note)."""
    kernel = choice.get("kernel_ms")
    note = "run on its packed region's tokens: no copies, no sync of its own"
    share = region.get("attention_fill") if region else None
    priced_at = choice.get("fill")
    if kernel is not None and share is not None and priced_at:
        kernel = float(kernel) * float(share) / float(priced_at)
        note += f"; its scores the region's sample share, {float(share):.3g} of the padded"
        choice.update(kernel_ms=kernel, fill=float(share),
                      fill_source="its packed region's sample (attention_fill)")
    rep = bool(region) and name in (region.get("rep_attentions") or ())
    host = region_host_prices(rep, per_launch_s, facts)
    padded = choice.get("padded_ms")
    choice.update(copies_ms=0.0, guarded=False, **host)
    choice["gemc_ms"] = None if kernel is None else \
        round(float(kernel) + float(host["launch_ms"]), 6)
    if padded is not None:
        choice["padded_kernel_ms"] = padded
        choice["padded_ms"] = round(float(padded) + float(host["padded_launch_ms"]), 6)
    note += (f"; host: {host['launches']} launches{' (its key bias, the attention)' if rep else ''}"
             f" against SDPA's {host['padded_launches']}, at {host['per_launch_us']:.3g} us "
             "a launch")
    if kernel is not None and padded is not None and choice["gemc_ms"] > choice["padded_ms"]:
        note += "; slower than the model's SDPA, kept: the region runs it on its tokens"
    choice["note"] = note
    return choice


def _reason(prices: AttentionPrices, output: fx.Node, facts: Mapping[str, Any]) -> str:
    what = "guarded attention" if prices.guarded else "attention kernel"
    return (f"{KEPT_PADDED}: gemc's {what} priced {1e3 * prices.gemc_s:.3g} ms vs "
            f"{1e3 * prices.padded_s:.3g} ms for the model's own at the padded shape "
            f"[B={_batch(output, facts)}, H={facts['heads']}, L={facts['max_len']}, "
            f"d={facts['head_dim']}] ({prices.why()}); {ENV}=always forces the kernel")


def run_dtype(node: fx.Node) -> str:
    """The dtype the runner computes an attention in: bf16 for an fp32 or bf16 capture
    (choose-precision's baseline, autocast), else the captured one."""
    dt = ir.dtype_of(node)
    return "bf16" if dt in (None, torch.float32, torch.bfloat16) else op_cost.dtype_name(dt)


def price(gm: fx.GraphModule, output: fx.Node, group: Sequence[fx.Node],
          facts: Mapping[str, Any], kind: str, ctx: PassContext) -> AttentionPrices | None:
    """Both prices of one match (see the module doc); None without a topology."""
    topology = ctx.topology
    if topology is None:
        return None
    gpu, calib = topology.gpu, ctx.calibration
    dtype = run_dtype(output)
    size = op_cost.element_size(dtype)
    guarded = bool(facts.get("mask"))
    fill, source, not_prefix = _fill(gm, facts, ctx) if guarded else \
        (float(facts.get("fill", 1.0)), "the graph's offsets", False)
    heads, length = int(facts["heads"]), int(facts["max_len"])
    head_dim, batch = int(facts["head_dim"]), _batch(output, facts)
    queries = int(facts.get("queries") or length)
    numel = float(batch) * heads * length * head_dim  # one padded [B, H, L, d] tensor
    every_row = queries != length or not facts.get("zero_padding_queries", True)
    if kind == "jagged_silu_attention":
        named = {n.name: n for n in gm.graph.nodes}
        kernel = op_cost.jagged_silu_kernel_time(
            {**facts, "fill": fill}, output, named, dtype,
            lambda n: size if (ir.dtype_of(n) or torch.float32).is_floating_point
            else (ir.dtype_of(n) or torch.int64).itemsize, gpu, calib, in_region=True)
    else:
        scores = attention_fit.varlen_tiles(batch, heads, queries, length, fill) \
            if every_row else attention_fit.jagged_tiles(batch, heads, length, fill,
                                                          bool(facts.get("causal")))
        kernel = attention_fit.gemc_kernel_s(scores, head_dim, "softmax", gpu, dtype)
        if guarded:  # the check's read of the mask
            kernel += op_cost.memory_time(float(ir.nbytes(_named(gm, str(facts["mask"])))),
                                          gpu, calib, "copy")[0]
    padded = sum(op_cost.node_cost(n, gpu, calib, dtype=dtype).total_s for n in group
                 if n.op == "call_function")
    moved = 0.0 if every_row else attention_fit.jagged_copy_bytes(numel, fill, size)
    if not_prefix and kind == "jagged_silu_attention":  # no compaction: the padded fallback
        kernel, moved = padded, 0.0
    elif not_prefix:  # compacted: k and v (every query row), or q, k, v and the output
        moved += attention_fit.compaction_bytes(numel, 2 if every_row else 4, size)
    copies = op_cost.memory_time(moved, gpu, calib, "copy")[0] if moved else 0.0
    return attention_prices(kernel, padded, copies_s=copies, guarded=guarded, fill=fill,
                            fill_source=source)


def _fill(gm: fx.GraphModule, facts: Mapping[str, Any], ctx: PassContext
          ) -> tuple[float, str, bool]:
    """A guarded attention's token fill, its source, and whether the sample has rows that
    keep no prefix (the call compacts them): the sample batch's, by the op's own check
    (``sample_fill``; non-prefix rows compacted unless the op takes them padded,
    ``nan_if_unseen``)."""
    check = {"mask": facts["mask"], "additive": bool(facts.get("additive")),
             "compact": not facts.get("nan_if_unseen"),
             "reads": list(facts.get("read_rows") or ())}
    sampled = sample_fill(gm, check, ctx.sample_inputs)
    if sampled["fill_source"] != SAMPLE:
        return 1.0, str(sampled["fill_source"]), False
    mask = _named(gm, str(facts["mask"]))
    shape = tuple(ir.shape_of(mask) or ())
    capacity = shape[0] * shape[-1] if len(shape) >= 2 else 0
    tokens = int(sampled.get("sample_tokens", 0))
    share = tokens / capacity if capacity else float(sampled["fill"])
    return min(1.0, share), SAMPLED, \
        bool(sampled.get("sample_not_prefix"))


def _named(gm: fx.GraphModule, name: str) -> fx.Node:
    for n in gm.graph.nodes:
        if n.name == name:
            return n
    raise KeyError(f"attention_choice: no node {name} in the graph")


def _numel(node: fx.Node) -> int:
    val = node.meta.get("val")
    return int(val.numel()) if isinstance(val, torch.Tensor) else 0


def _batch(output: fx.Node, facts: Mapping[str, Any]) -> int:
    """B of an attention: its output's elements over ``H * queries * d`` (a merged
    ``[B*H, L, d]`` output included)."""
    per = int(facts["heads"]) * int(facts.get("queries") or facts["max_len"]) \
        * int(facts["head_dim"])
    return max(1, _numel(output) // max(1, per))
