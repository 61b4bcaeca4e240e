"""HSTU's pointwise (SiLU) attention as a member of a packed token region: it reads q, k, v
as the region's tokens and writes its output as one (``gemc::jagged_silu_attention_values``
over the region's offsets), so nothing around it is padded: the model's own ``index_put``
of q, k, v over the offsets becomes the region's source and its gather at the jagged
positions (``dense_to_jagged``) reads the tokens (the region's ``exits``). Where the mask is
data (a bool input), the region is guarded: packed when its check finds a prefix on every
row, padded (the attention's own check then takes its exact fallback) when not, counted.

Checked: what the regions of the zoo's HSTU (tiny) hold, and compiled = eager forward and
backward at random lengths 0..L with the attention on the region's tokens (no padded path,
no scatter), the guarded fallback taken exactly when the mask is not a prefix."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from gemc.backends.torch.graph_mode import GraphExecutor
from gemc.backends.torch.sparse_optim import EmbeddingOptimConfig, EmbeddingOptimizer
from gemc.backends.triton import key_padding_attention as kpa
from gemc.backends.triton import packed_tokens as pt
from gemc.backends.triton.kinds import attention as attention_kinds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.testing import FileCheck

from gemc import ir
from gemc.dump import format_graph
from tests.fusion import key_padding_models as km
from tests.fusion.helpers import compiled, entries_of, run_against_eager, train_against_eager

ZOO_HSTU = "examples/zoo/hstu.py:build"
JAGGED = "tests/fusion/key_padding_models.py:build_jagged_hstu"
MASKED = "tests/fusion/key_padding_models.py:build_hstu"
aten = torch.ops.aten


@functools.cache
def _graph(entry: str, key: tuple[tuple[str, Any], ...] = ()):  # noqa: ANN202
    gm, ctx, spec = compiled(entry, dict(key))
    return gm, ctx, entries_of(gm, ctx, ["jagged_silu_attention", "packed_tokens"]), spec


def test_zoo_hstu_attention_reads_and_writes_the_region_tokens():
    """Tiny HSTU: per layer one region whose sources are q, k and v, each written into
    zeros over the history's offsets (unclamped) at its jagged positions (so in order: the
    values are the tokens); the attention's output and its reshape are in it, the kernel's
    own [L, L] nodes are not; the model's gather at the jagged positions is its exit."""
    gm, ctx, entries, _ = _graph(ZOO_HSTU, (("preset", "tiny"),))
    by_name = {n.name: n for n in gm.graph.nodes}
    silu = [e for e in entries if e["kind"] == "jagged_silu_attention"]
    regions = [e for e in entries if e["kind"] == "packed_tokens"]
    assert len(silu) == 2 and len(regions) == 2, [e["name"] for e in entries]
    in_region = {n: r for r in regions for n in r["nodes"]}
    for attn in silu:
        region = in_region[attn["output"]]
        assert all(in_region[attn[x]] is region for x in ("q", "k", "v"))
        assert region["offsets"] == "seq_offsets" and region["clamp_min"] == 0
        assert region["max_len"] == attn["max_len"] and region.get("guard") is None
        sources = [by_name[s["padded_from"]] for s in region["sources"]]
        assert len(set(sources)) == 3 and region["padded_from"] == sources[0].name
        assert all(s.target is aten.index_put.default for s in sources)
        assert all(s["in_order"] for s in region["sources"])  # values viewed: no copy in
        # the kernel's own nodes (scores, bias add, silu, / n, causal multiply) stay out
        assert not set(attn["nodes"]) - {attn["output"]} & set(in_region)
        (exit_name,) = region["exits"]
        gather = by_name[exit_name]
        assert gather.target is aten.index.Tensor and exit_name not in in_region
        assert gather.args[0].name in region["nodes"]
    assert not [w for w in ctx.warnings if "pack-jagged-tokens" in w], ctx.warnings
    text = format_graph(gm, "after pack-jagged-tokens")
    FileCheck().check("packed_region={id:packed_tokens_0,kind:packed_tokens") \
        .check("aten.einsum.default('bhnm,bmhd->bnhd'").check_same("kind:jagged_silu_attention") \
        .check_same("packed={id:packed_tokens_0").check("aten.index.Tensor") \
        .check_not("packed={id:packed_tokens_0").run(text)


@contextlib.contextmanager
def _no_padded_path() -> Iterator[list[str]]:
    """Within it, the padded silu call and any scatter out of a region fail the test;
    yields the list each call of the attention on a region's tokens appends to."""
    ran: list[str] = []
    on_tokens = attention_kinds.silu_attention_of_tokens

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        ran.append("tokens")
        return on_tokens(*args, **kwargs)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the silu attention or a region value ran padded")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention_kinds, "silu_attention_of_tokens", spy)
        mp.setattr(attention_kinds, "silu_attention_of_entry", refuse)
        mp.setattr(pt, "scatter", refuse)
        yield ran


def test_zoo_hstu_runs_on_tokens_and_matches_eager():
    gm, _, entries, spec = _graph(ZOO_HSTU, (("preset", "tiny"),))
    with _no_padded_path() as ran:
        kpa.STATS.reset()
        run_against_eager(gm, entries, spec.model, spec.make_batch(3, "cpu"))
    assert ran == ["tokens", "tokens"]
    assert kpa.STATS.as_dict() == {"calls": 2, "jagged": 2, "compacted": 0, "fallback": 0}


TOKENS = 11  # the captured values' count: the graph's shapes are static


def _lengths(draw: st.DrawFn) -> list[int]:
    """``B`` lengths in 0..L summing to :data:`TOKENS`, with an empty and a full row."""
    rest = draw(st.integers(0, TOKENS - km.L))
    lengths = [0, km.L, rest, TOKENS - km.L - rest]
    return draw(st.permutations(lengths))


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(args=st.sampled_from([(), (("layout", "bhld"),), (("bias", False),)]),
       lengths=st.composite(_lengths)(), seed=st.integers(0, 2**16))
def test_jagged_lengths_on_tokens_match_eager(args, lengths, seed):
    """Random lengths 0..L (an empty and a full row every time): compiled = eager forward
    and backward, the attention on the region's tokens (never padded, no scatter)."""
    gm, _, entries, spec = _graph(JAGGED, args)
    assert any(e["kind"] == "packed_tokens" for e in entries)
    with _no_padded_path() as ran:
        kpa.STATS.reset()
        run_against_eager(gm, entries, spec.model,
                          km.jagged_batch(lengths, torch.Generator().manual_seed(seed)))
    assert ran == ["tokens"]
    assert kpa.STATS.as_dict() == {"calls": 1, "jagged": 1, "compacted": 0, "fallback": 0}


def _is_prefix(keep: torch.Tensor) -> bool:
    return bool((keep == (torch.arange(keep.shape[1]) < keep.sum(1, keepdim=True))).all())


def test_a_data_mask_makes_a_guarded_region_that_is_never_compact():
    """A bool mask input: the region is guarded by the mask's check and not compact (the
    attention's bias, normaliser and causal rule read positions, not ranks)."""
    gm, ctx, entries, _ = _graph(MASKED, (("bias", True), ("mask_input", True)))
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    (attn,) = [e for e in entries if e["kind"] == "jagged_silu_attention"]
    assert region["guard"] == "prefix-check" and region["mask"] == attn["mask"] == "m"
    assert region["compact"] is False
    assert {attn["q"], attn["k"], attn["v"], attn["output"]} <= set(region["nodes"])
    by_name = {n.name: n for n in gm.graph.nodes}
    assert [n for n in region["nodes"] if by_name[n].meta.get(ir.GROUP) == attn["name"]] \
        == [attn["output"]]  # the kernel's [L, L] nodes are no carriers
    assert not [w for w in ctx.warnings if "pack-jagged-tokens" in w], ctx.warnings


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(args=st.sampled_from([(("bias", True), ("mask_input", True)),
                             (("mask_input", True), ("query_mask", False))]),
       lengths=st.lists(st.integers(0, km.L), min_size=km.B, max_size=km.B),
       scramble=st.booleans(), seed=st.integers(0, 2**16))
def test_guarded_region_packs_exactly_on_prefix_masks(args, lengths, scramble, seed):
    """Random lengths 0..L, prefix or scrambled bool masks: compiled = eager forward and
    backward; the region runs packed (the attention on its tokens) exactly when the mask is
    a prefix keeping some token, and on a mask that is no prefix the attention's own check
    takes the padded fallback, counted."""
    gm, _, entries, spec = _graph(MASKED, args)
    x, m = km.batch("bool", lengths, torch.Generator().manual_seed(seed), scramble)
    ran: list[str] = []
    on_tokens = attention_kinds.silu_attention_of_tokens
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention_kinds, "silu_attention_of_tokens",
                   lambda *a, **k: ran.append("tokens") or on_tokens(*a, **k))
        kpa.STATS.reset()
        pt.GUARD_STATS.reset()
        run_against_eager(gm, entries, spec.model, (x, m))
    prefix = _is_prefix(m)
    packed = prefix and bool(m.any())
    assert pt.GUARD_STATS.as_dict() == {"calls": 1, "packed": int(packed),
                                        "padded": int(not packed), "missed_reads": 0}
    assert ran == (["tokens"] if packed else [])
    assert kpa.STATS.as_dict() == {"calls": 1, "jagged": int(prefix), "compacted": 0,
                                   "fallback": int(not prefix)}


def _executor(entry: str, args: dict[str, Any]) -> tuple[GraphExecutor, torch.nn.Module]:
    gm, ctx, spec = compiled(entry, args)
    emb_opt = EmbeddingOptimizer({}, EmbeddingOptimConfig(), world_size=1)
    executor = GraphExecutor(gm, {}, spec.model, entries_of(gm, ctx), tables={},
                             emb_opt=emb_opt, device=torch.device("cpu"))
    assert executor.not_applied == []
    return executor, spec.model


def test_compiled_graph_runs_the_attention_on_tokens_and_trains_as_eager():
    """Through torch.compile (Inductor): the regions' sources, the attention on their
    tokens and the exits are in the compiled graph, no scatter; two steps equal eager."""
    executor, model = _executor(JAGGED, {})
    batches = [km.jagged_batch(n, torch.Generator().manual_seed(i))
               for i, n in enumerate([[2, 0, 6, 3], [0, 6, 5, 0]])]
    kpa.STATS.reset()
    train_against_eager(executor, model, batches)
    code = executor.module.code
    assert "silu_attention_of_tokens(" in code and "_p_exit(" in code
    assert "_p_scatter(" not in code and "_call_silu_attention(" not in code
    assert kpa.STATS.as_dict() == {"calls": 2, "jagged": 2, "compacted": 0, "fallback": 0}


def test_compiled_guarded_region_packs_on_prefix_masks_and_falls_back_off_them():
    """A bool mask input through torch.compile: the check ahead of the graph picks the
    packed graph (the attention on the region's tokens) for a prefix mask and the padded
    one for a scrambled mask, where the attention's own check falls back, counted."""
    executor, model = _executor(MASKED, {"mask_input": True, "bias": True})
    gen = torch.Generator().manual_seed(3)
    pt.GUARD_STATS.reset()
    kpa.STATS.reset()
    train_against_eager(executor, model, [km.batch("bool", [2, 0, 6, 3], gen)])
    assert "silu_attention_of_tokens(" in executor.module.code
    train_against_eager(executor, model, [km.batch("bool", [2, 0, 6, 3], gen, scramble=True)])
    assert "_call_silu_attention(" in executor.module.code
    assert pt.GUARD_STATS.as_dict() == {"calls": 2, "packed": 1, "padded": 1, "missed_reads": 0}
    assert kpa.STATS.as_dict() == {"calls": 2, "jagged": 1, "compacted": 0, "fallback": 1}
