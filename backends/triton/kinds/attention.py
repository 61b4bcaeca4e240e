"""The attention kinds: jagged softmax attention, key-padding attention (SDPA or a written-out
formula with a key mask), HSTU's pointwise (silu) attention and padded-query attention over
dense keys.

Each entry names the graph values its kernel reads (q, k, v, the mask or offsets the
lengths come from) and the attention's constants. The three guarded attentions (key
padding, silu, padded queries: each checks at run time what the graph cannot prove and
falls back exactly) are whole here: their entry, the interpreter's call (``run``) and the
emitter's (``emit``), which read and store values through ``runner.operand`` /
``runner.output`` and ``emitter.operand`` / ``emitter.output`` as any kind does. The
jagged attention's run and emit stay the interpreter's and the emitter's methods: inside a
packed token region it reads the region's values in place, which is their packed-region
state. The silu attention, when its q, k, v and output are a packed region's values, runs
on the region's tokens too (``runner.packed_operands`` / ``emitter.packed_operands``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from gemc.guard_sample import mask_rows, reader_positions
from gemc.kernel_kinds import KINDS

from ..packed_tokens import one_dtype
from .implementation import Entry, Env, KindImplementation, Unit, named

if TYPE_CHECKING:
    from ..graph_runner import GraphRunner
    from ..inductor_graph import Emitter


def jagged_entry(facts: dict[str, Any], nodes: list[fx.Node]) -> dict[str, Any]:
    q, k, v = (a.name for a in nodes[0].args[:3])
    keep = ("offsets", "clamp_min", "max_len", "heads", "head_dim", "scale", "causal",
            "fill", "padded_from")
    return dict(q=q, k=k, v=v, **{key: facts[key] for key in keep})


def key_padding_entry(facts: dict[str, Any], nodes: list[fx.Node]) -> dict[str, Any]:
    # an SDPA node (q, k, v its arguments), or a written-out formula (named in facts)
    q, k, v = (facts["q"], facts["k"], facts["v"]) if "q" in facts \
        else (a.name for a in nodes[0].args[:3])
    keep = ("mask", "additive", "causal", "zero_padding_queries", "queries",
            "max_len", "heads", "head_dim", "scale", "fill")
    return dict(q=q, k=k, v=v, output=facts.get("output", nodes[0].name),
                merged_heads=bool(facts.get("merged_heads", False)),
                nan_if_empty=bool(facts.get("nan_if_empty", False)),
                **({"finite_drop": facts["finite_drop"]}
                   if facts.get("finite_drop") is not None else {}),
                **({"fill_value": facts["fill_value"]}
                   if facts.get("fill_value") is not None else {}),
                **({"nan_if_unseen": True, "causal_added": bool(facts["causal_added"])}
                   if facts.get("nan_if_unseen") else {}),
                **({"read_rows": facts["read_rows"]} if facts.get("read_rows") else {}),
                **{key: facts[key] for key in keep})


def silu_entry(facts: dict[str, Any], nodes: list[fx.Node]) -> dict[str, Any]:
    keep = ("q", "k", "v", "output", "mask", "offsets", "q_perm", "k_perm", "v_perm",
            "out_perm", "bias", "norm", "scale", "causal", "query_mask", "max_len",
            "heads", "head_dim", "fill")
    stored = ("causal_mask", "causal_mask_of", "visible", "visible_where")
    # ``reads``: readers of one token per row of the output, exact as they are (each
    # reads a real token or one of an empty row: passes/row_reads.kept_by_offsets)
    return {**{key: facts.get(key) for key in keep},
            **{key: facts[key] for key in stored if facts.get("causal_mask")},
            **({"reads": facts["reads"]} if facts.get("reads") else {})}


def query_entry(facts: dict[str, Any], nodes: list[fx.Node]) -> dict[str, Any]:
    q, k, v = (a.name for a in nodes[0].args[:3])
    keep = ("mask", "offsets", "clamp_min", "queries", "keys", "heads", "head_dim", "scale",
            "fill")
    return dict(q=q, k=k, v=v, output=nodes[0].name, **{key: facts.get(key) for key in keep})


def _operands(entry: Entry) -> tuple[str, str, str, str]:
    """The node names of a guarded attention's q, k, v and its key mask (or, where the
    keys' padding is implicit in values zero-padded over offsets, those offsets)."""
    return (entry["q"], entry["k"], entry["v"], entry["mask"] if entry.get("mask")
            else entry["offsets"])


# ---- key-padding attention --------------------------------------------------------------

def key_padding_of_entry(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor, entry: Mapping[str, Any],
                         indices: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """A ``key_padding_attention`` entry's call (both runners). The op is self-contained:
    it checks that the mask keeps a prefix of every row and picks the jagged, compacted or
    padded path itself (the exact fallback, counted in its ``STATS``); with the entry's
    ``read_rows`` (readers of one token per row of its output, their index values by node
    name in ``indices``), that every one reads a kept position too."""
    from ..key_padding_attention import key_padding_attention

    mask = mask_rows(mask)  # a [B, 1, 1, L] mask's rows (HF's extended mask)
    reads = reader_positions(entry.get("read_rows") or (), indices or {}, int(mask.shape[0]),
                             int(mask.shape[1]), mask.device)
    merged = bool(entry.get("merged_heads"))
    if merged:  # [B*H, L, d] operands (nn.MultiheadAttention's layout)
        q, k, v = (x.unflatten(0, (mask.shape[0], -1)) for x in (q, k, v))
    q, k, v = one_dtype(q, k, v)
    out = key_padding_attention(q, k, v, mask, entry["scale"], entry["causal"],
                                entry["additive"], entry["zero_padding_queries"],
                                entry.get("nan_if_empty", False), reads,
                                entry.get("finite_drop"), entry.get("fill_value"),
                                entry.get("causal_added"))
    return out.flatten(0, 1) if merged else out


def _read_indices(entry: Entry) -> list[str]:
    """The index nodes of an entry's one-token readers (``read_rows``)."""
    return list(dict.fromkeys(r["index"] for r in entry.get("read_rows") or ()
                              if r.get("index")))


def _key_padding_reads(entry: Entry) -> list[str]:
    return _READS(entry) + _read_indices(entry)


def _call_key_padding_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                mask: torch.Tensor, entry: dict[str, Any],
                                indices: dict[str, torch.Tensor] | None = None
                                ) -> torch.Tensor:
    """The emitted call, an eager island (``Emitter.eager``). Why outside Inductor's
    graph: the check reads three integers on the host and the paths' kernels differ in
    shape, so Dynamo would break the graph inside it anyway; as one eager island the rest
    compiles whole."""
    return key_padding_of_entry(q, k, v, mask, entry, indices)


def key_padding_checked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor, key_lengths: torch.Tensor | None, outcome: str,
                        entry: Mapping[str, Any]) -> torch.Tensor:
    """A ``key_padding_attention`` entry whose mask the check ahead of the compiled graph
    decided (``region_guard``): the path :func:`key_padding_of_entry` would take for that
    outcome, with no check and no host read, so it traces into the compiled graph.
    ``"prefix"``: queries over each row's first ``key_lengths`` keys; ``"compact"``: the
    kept keys moved to the front in order first (a stable sort of the mask, as the op's
    compacted path); ``"padded"``: the exact padded attention."""
    from .. import ops  # noqa: F401  (registers the gemc:: ops)
    from ..key_padding_attention import (
        kept_first,
        nan_gradient_operands,
        nan_where_no_key,
        padded_attention,
        permute_keys,
        uniform_where_no_key,
    )

    mask = mask_rows(mask)  # a [B, 1, 1, L] mask's rows (HF's extended mask)
    merged = bool(entry.get("merged_heads"))
    if merged:  # [B*H, L, d] operands (nn.MultiheadAttention's layout)
        q, k, v = (x.unflatten(0, (mask.shape[0], -1)) for x in (q, k, v))
    q, k, v = one_dtype(q, k, v)
    additive = bool(entry["additive"])
    scale = entry["scale"]
    if outcome == "padded":
        out = padded_attention(q, k, v, mask, scale, False, additive,
                               written_out=bool(entry.get("nan_if_empty", False))
                               or entry.get("fill_value") is not None,
                               fill_value=entry.get("fill_value"))
    else:
        if outcome == "compact":
            order = kept_first(mask, additive)
            k, v = (permute_keys(x, order) for x in (k, v))
        if scale is None:
            scale = q.shape[-1] ** -0.5
        out, _ = torch.ops.gemc.key_lengths_attention(q, k, v, key_lengths, float(scale))
    if entry.get("fill_value") is not None:
        out = uniform_where_no_key(out, v, mask, additive)
    elif entry.get("nan_if_empty"):
        out = nan_where_no_key(out, mask, additive,
                               nan_gradient_operands(q, k, v, additive))
    return out.flatten(0, 1) if merged else out


def key_padding_run(runner: GraphRunner, unit: Unit, env: Env) -> None:
    e = unit["entry"]
    if runner.packed_rep_attention(e, env):  # on a region's tokens, representative keys
        return
    q, k, v, mask = (runner.operand(name, env) for name in _operands(e))
    indices = {name: runner.operand(name, env) for name in _read_indices(e)}
    runner.output(e.get("output", e["nodes"][0]),
                  key_padding_of_entry(q, k, v, mask, e, indices), env)


def key_padding_emit(emitter: Emitter, unit: Unit) -> None:
    e = unit["entry"]
    if _checked_by_region(emitter, e):
        return
    q, k, v, mask = (emitter.operand(name) for name in _operands(e))
    decided = emitter.attention_guards.get(str(e["name"]))
    if decided is not None:  # the check ahead of the graph took the decision: in the graph
        outcome, lengths = decided
        emitter.output(e.get("output", e["nodes"][0]),
                       emitter.call(key_padding_checked, (q, k, v, mask, lengths, outcome, e)))
        return
    indices = {name: emitter.operand(name) for name in _read_indices(e)}
    emitter.output(e.get("output", e["nodes"][0]),
                   emitter.eager(_call_key_padding_attention, (q, k, v, mask, e, indices)))


def _checked_by_region(emitter: Emitter, entry: Entry) -> bool:
    """A key-padding attention inside a guarded region this graph runs packed, under the
    very mask the region's check read (same node, same additive rule), or one the pass
    proved keeps the same keys (the region's ``in_place``: e.g. the additive mask
    ``nn.MultiheadAttention`` fills from the keep-mask the region checks): that check, ahead
    of the graph, found the kept tokens' layout (a prefix, or in a compact region any kept
    positions, in order), so the attention's own check would take its jagged or compacted
    path over the same offsets. It runs that path here, on the region's values in place
    (``[1, H, T, D]``, or ``[H, T, D]`` with the heads in the batch dim): no scatter and
    gather around it, no second check, no host read (the region's check is counted in
    ``packed_tokens.GUARD_STATS``, not the attention's ``STATS``). An attention NaN on a
    row with no kept key (or, over a finite ``fill_value``, uniform on it) runs here only
    in an ``every_row`` region (packed only with a kept key on every row); a written-out
    causal softmax over ``-inf`` (``nan_if_unseen``: NaN on each query row that sees no
    kept key, which over a mask that is no prefix is more than the empty rows) only in one
    that is not ``compact`` either (packed only over a prefix). Returns whether it
    applied."""
    out = entry.get("output", entry["nodes"][0])
    region = emitter.packed_guarded_region(out)
    if region is None:
        return False
    if out in region.get("rep_attentions", ()):
        # a region with padding representatives: on its tokens, representative keys
        # biased by the count they stand for (``packed_tokens.rep_attention``)
        return emitter.packed_rep_attention(entry)
    same = (entry.get("mask") == region["mask"]
            and bool(entry.get("additive")) == bool(region.get("additive"))) \
        or out in region.get("in_place", ())
    empty_rows_differ = entry.get("nan_if_empty") or entry.get("fill_value") is not None
    if not same or (empty_rows_differ and not region.get("every_row")) \
            or (entry.get("nan_if_unseen") and region.get("compact")):
        return False
    return emitter.packed_attention((entry["q"], entry["k"], entry["v"]), out,
                                    entry["scale"], bool(entry.get("causal")))


# ---- HSTU's pointwise (silu) attention ----------------------------------------------------

def silu_attention_of_entry(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            keys: torch.Tensor, bias: torch.Tensor | None,
                            entry: Mapping[str, Any],
                            stored: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """A ``jagged_silu_attention`` entry's call (both runners): q, k, v permuted to
    ``[B, H, L, D]`` (the model's einsum may hold them ``[B, L, H, D]``); with the key mask
    the entry names, the checked kernel; when the keys' padding is implicit in values
    zero-padded over offsets (a prefix by construction), ``gemc::padded_silu_attention`` on
    those offsets' lengths; the result permuted back to the model's output layout.
    ``stored`` (an entry whose causal mask is read from the model's weights:
    :func:`_stored_operands`): ``(causal mask, visible, *its weights)``; when the check
    finds the mask is not the ``tril`` (``causal_mask.stored_mask_is_causal``, cached per
    change of the weights), the model's padded formula runs instead, counted as a
    fallback in ``key_padding_attention.STATS``."""
    from ..key_padding_attention import STATS, key_padding_silu_attention

    def canonical(x: torch.Tensor, name: str) -> torch.Tensor:
        perm = entry.get(name)
        return x.permute(*perm) if perm else x

    q, k, v = canonical(q, "q_perm"), canonical(k, "k_perm"), canonical(v, "v_perm")
    if stored:
        from ..causal_mask import silu_formula, stored_mask_is_causal

        mask, visible, *sources = stored
        if not stored_mask_is_causal(mask, sources, int(entry["max_len"])):
            STATS.calls += 1
            STATS.fallback += 1
            out = silu_formula(q, k, v, visible, bias, entry)
            perm = entry.get("out_perm")
            return out.permute(*perm) if perm else out
    if entry.get("mask"):  # a mask given as data: checked (one host read), exact fallback
        out = key_padding_silu_attention(q, k, v, keys, entry["norm"], entry["scale"],
                                         entry["causal"], entry["query_mask"], bias)
    else:  # the offsets' prefix, proved by the graph: one static-shaped op, no host read
        from .. import ops  # noqa: F401  (registers the gemc:: ops)
        out = torch.ops.gemc.padded_silu_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), keys, bias,
            int(entry["norm"]), float(entry["scale"]), bool(entry["causal"])).transpose(1, 2)
    perm = entry.get("out_perm")
    return out.permute(*perm) if perm else out


def silu_attention_of_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             offsets: torch.Tensor, bias: torch.Tensor | None,
                             entry: Mapping[str, Any]) -> torch.Tensor:
    """A ``jagged_silu_attention`` entry's call inside a packed token region (both runners):
    q, k, v are region values, ``[1, H, T, D]`` once permuted to the kernel's order (the
    batch dim 1, the sequence dim the region's ``T`` tokens), ``offsets`` the region's
    lengths; the kernel runs on the tokens in place and its result is a region value in the
    model's output layout. No check and no host read: the region's own layout (offsets
    proved by the graph, or a guarded region's mask found a prefix by its check) is the
    kernel's. Traceable (static shapes), so the emitter writes it into the compiled graph."""
    from .. import ops  # noqa: F401  (registers the gemc:: ops)

    def tokens(x: torch.Tensor, name: str) -> torch.Tensor:
        perm = entry.get(name)
        return (x.permute(*perm) if perm else x).movedim((0, 2), (0, 1)).flatten(0, 1)

    out = torch.ops.gemc.jagged_silu_attention_values(
        tokens(q, "q_perm"), tokens(k, "k_perm"), tokens(v, "v_perm"), offsets, bias,
        int(entry["norm"]), float(entry["scale"]), bool(entry["causal"]))
    canonical = out.unsqueeze(0).movedim((0, 1), (0, 2))  # [1, H, T, D]
    perm = entry.get("out_perm")
    return canonical.permute(*perm) if perm else canonical


def _qkv_out(entry: Entry) -> tuple[str, str, str, str]:
    return entry["q"], entry["k"], entry["v"], entry["output"]


def _stored_operands(entry: Entry) -> list[str]:
    """The node names of an entry's causal mask read from the model's weights, the whole
    visibility mask and those weights (``match-silu-attention``'s ``causal_mask``,
    ``visible``, ``causal_mask_of``); none without such a mask."""
    if not entry.get("causal_mask"):
        return []
    return [entry["causal_mask"], entry["visible"], *entry["causal_mask_of"]]


def _silu_reads(entry: Entry) -> list[str]:
    return _READS(entry) + _stored_operands(entry)


def _call_silu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor, bias: torch.Tensor | None,
                         entry: dict[str, Any], stored: tuple[torch.Tensor, ...] = ()
                         ) -> torch.Tensor:
    """The emitted call: an eager island for the key-padding attention's reason (and the
    stored causal mask's check, which reads the host on a change of the weights)."""
    return silu_attention_of_entry(q, k, v, mask, bias, entry, stored)


def silu_run(runner: GraphRunner, unit: Unit, env: Env) -> None:
    e = unit["entry"]
    bias = runner.operand(e["bias"], env) if e.get("bias") else None
    # a stored causal mask is checked per call: never on a packed region's tokens (whose
    # fallback would need the padded layout; pack-jagged-tokens starts no region there)
    inside = None if e.get("causal_mask") else runner.packed_operands(_qkv_out(e), env)
    if inside is not None:  # a member of a packed region: on its tokens, in place
        (q, k, v), layout = inside
        runner.packed_output(e["output"], silu_attention_of_tokens(
            q, k, v, layout.offsets, bias, e), env)
        return
    q, k, v, keys = (runner.operand(name, env) for name in _operands(e))
    stored = tuple(runner.operand(name, env) for name in _stored_operands(e))
    runner.output(e["output"], silu_attention_of_entry(q, k, v, keys, bias, e, stored), env)


def silu_emit(emitter: Emitter, unit: Unit) -> None:
    e = unit["entry"]
    inside = None if e.get("causal_mask") else emitter.packed_operands(_qkv_out(e))
    if inside is not None:  # a member of a region this graph runs packed
        (q, k, v), offsets = inside
        bias = emitter.operand(e["bias"]) if e.get("bias") else None
        emitter.packed_output(e["output"], emitter.call(silu_attention_of_tokens,
                                                        (q, k, v, offsets, bias, e)))
        return
    q, k, v, keys = (emitter.operand(name) for name in _operands(e))
    bias = emitter.operand(e["bias"]) if e.get("bias") else None
    stored = tuple(emitter.operand(name) for name in _stored_operands(e))
    emitter.output(e["output"], emitter.eager(_call_silu_attention,
                                              (q, k, v, keys, bias, e, stored)))


# ---- padded queries over dense keys -------------------------------------------------------

def query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    lengths_from: torch.Tensor, from_mask: bool, clamp_min: int,
                    scale: float | None) -> torch.Tensor:
    """A ``jagged_query_attention`` entry's call (both runners): the query lengths from
    the entry's bool keep mask (checked per row on the device: ``gemc::query_prefix_lengths``)
    or its offsets (clamped as the model's mask clamps them), then the custom op. Traceable:
    no host read, static shapes (so the emitter writes it into the compiled graph)."""
    from .. import ops  # noqa: F401  (registers the gemc:: ops)
    from ..jagged_query_attention import offsets_query_lengths

    if from_mask:
        lengths = torch.ops.gemc.query_prefix_lengths(lengths_from)
    else:
        lengths = offsets_query_lengths(lengths_from, clamp_min, q.shape[2])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, _ = torch.ops.gemc.jagged_query_attention(q, k, v, lengths, scale)
    return out


def _query_args(entry: Entry) -> tuple[bool, int, float | None]:
    """``(from_mask, clamp_min, scale)`` of a padded-query entry (its lengths' source:
    :func:`_operands`' fourth name)."""
    return bool(entry.get("mask")), int(entry.get("clamp_min") or 0), entry.get("scale")


def query_run(runner: GraphRunner, unit: Unit, env: Env) -> None:
    e = unit["entry"]
    q, k, v, lengths_from = (runner.operand(name, env) for name in _operands(e))
    runner.output(e["output"], query_attention(q, k, v, lengths_from, *_query_args(e)), env)


def query_emit(emitter: Emitter, unit: Unit) -> None:
    from ..jagged_query_attention import STATS

    e = unit["entry"]
    if e.get("mask"):  # its per-row check counts on the device: counts made before the graph
        STATS.prepare(emitter.device)
    q, k, v, lengths_from = (emitter.operand(name) for name in _operands(e))
    emitter.output(e["output"], emitter.call(query_attention,
                                             (q, k, v, lengths_from, *_query_args(e))))


_READS = named("q", "k", "v", "mask", "offsets", "bias")

IMPLEMENTATIONS = (
    KindImplementation(
        KINDS["jagged_attention"], entry=jagged_entry, reads=named("q", "k", "v", "offsets"),
        run=lambda runner, unit, env: runner._run_jagged_attention(unit, env),
        emit=lambda emitter, unit: emitter.attention(unit)),
    KindImplementation(KINDS["key_padding_attention"], entry=key_padding_entry,
                       reads=_key_padding_reads, run=key_padding_run, emit=key_padding_emit),
    KindImplementation(KINDS["jagged_silu_attention"], entry=silu_entry, reads=_silu_reads,
                       run=silu_run, emit=silu_emit),
    KindImplementation(KINDS["jagged_query_attention"], entry=query_entry, reads=_READS,
                       run=query_run, emit=query_emit),
)
