"""The attention kinds: jagged softmax attention, key-padding attention (SDPA or a written-out
formula with a key mask), HSTU's pointwise (silu) attention and padded-query attention over
dense keys.

Each entry names the graph values its kernel reads (q, k, v, the mask or offsets the
lengths come from) and the attention's constants. The interpreter's calls and the
emitter's are the runner's and the emitter's methods, which share the packed-region state
(a jagged attention inside a packed region reads its values in place).
"""

from __future__ import annotations

from typing import Any

from torch import fx

from gemc.kernel_kinds import KINDS

from .implementation import KindImplementation, named


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
                **{key: facts[key] for key in keep})


def silu_entry(facts: dict[str, Any], nodes: list[fx.Node]) -> dict[str, Any]:
    keep = ("q", "k", "v", "output", "mask", "offsets", "q_perm", "k_perm", "v_perm",
            "out_perm", "bias", "norm", "scale", "causal", "query_mask", "max_len",
            "heads", "head_dim", "fill")
    return {key: facts.get(key) for key in keep}


def query_entry(facts: dict[str, Any], nodes: list[fx.Node]) -> dict[str, Any]:
    q, k, v = (a.name for a in nodes[0].args[:3])
    keep = ("mask", "offsets", "clamp_min", "queries", "keys", "heads", "head_dim", "scale",
            "fill")
    return dict(q=q, k=k, v=v, output=nodes[0].name, **{key: facts.get(key) for key in keep})


_READS = named("q", "k", "v", "mask", "offsets", "bias")

IMPLEMENTATIONS = (
    KindImplementation(
        KINDS["jagged_attention"], entry=jagged_entry, reads=named("q", "k", "v", "offsets"),
        run=lambda runner, unit, env: runner._run_jagged_attention(unit, env),
        emit=lambda emitter, unit: emitter.attention(unit)),
    KindImplementation(
        KINDS["key_padding_attention"], entry=key_padding_entry, reads=_READS,
        run=lambda runner, unit, env: runner._run_key_padding_attention(unit, env),
        emit=lambda emitter, unit: emitter.key_padding_attention(unit)),
    KindImplementation(
        KINDS["jagged_silu_attention"], entry=silu_entry, reads=_READS,
        run=lambda runner, unit, env: runner._run_silu_attention(unit, env),
        emit=lambda emitter, unit: emitter.silu_attention(unit)),
    KindImplementation(
        KINDS["jagged_query_attention"], entry=query_entry, reads=_READS,
        run=lambda runner, unit, env: runner._run_query_attention(unit, env),
        emit=lambda emitter, unit: emitter.query_attention(unit)),
)
