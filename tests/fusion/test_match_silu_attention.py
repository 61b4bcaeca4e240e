"""match-silu-attention: HSTU's formula (matmul, silu, / n or * 1/n, a causal & length mask
by multiply or where, matmul) becomes the guarded jagged SiLU kernel; what it refuses and
why; compiled = eager forward and backward, the fallback taken exactly on non-prefix masks."""

from __future__ import annotations

import functools

import pytest
import torch
from gemc.backends.triton import key_padding_attention as kpa
from gemc.passes.match_silu_attention import SKIPPED
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.testing import FileCheck

from gemc import ir
from gemc.dump import format_graph
from tests.fusion import key_padding_models as km
from tests.fusion.helpers import compiled, entries_of, run_against_eager

HSTU = "tests/fusion/key_padding_models.py:build_hstu"
JAGGED = "tests/fusion/key_padding_models.py:build_jagged_hstu"
ZOO_HSTU = "examples/zoo/hstu.py:build"
VARIANTS = [{}, {"query_mask": False}, {"norm": "mul", "where": True}, {"mask_input": True},
            {"bias": True}, {"bias": True, "mask_input": True, "divisor": 2 * km.L},
            {"bias": True, "einsum": True},
            {"causal": False, "query_mask": False},  # a bare [B, 1, 1, L] key mask
            {"causal": False, "query_mask": False, "mask_input": True}]


@functools.cache
def _graph(key: tuple[tuple[str, object], ...]):
    gm, ctx, spec = compiled(HSTU, dict(key))
    return gm, ctx, entries_of(gm, ctx, ["jagged_silu_attention"]), spec


@pytest.mark.parametrize("args", VARIANTS, ids=str)
def test_formula_becomes_one_guarded_kernel(args: dict):
    gm, _, entries, _ = _graph(tuple(sorted(args.items())))
    (entry,) = entries
    aten = torch.ops.aten
    by_name = {n.name: n for n in gm.graph.nodes}
    # the scores, their silu, the normaliser, the mask and both matmuls: nothing [L, L] left
    targets = [by_name[n].target for n in entry["nodes"]]
    contraction = aten.einsum.default if args.get("einsum") else aten.matmul.default
    assert targets.count(contraction) == 2 and aten.silu.default in targets
    assert entry["norm"] == args.get("divisor", km.L)
    assert entry["causal"] is args.get("causal", True) and entry["scale"] == 1.0
    # the relative bias is the kernel's operand (its gradient reaches the parameter)
    assert (entry["bias"] is not None) is args.get("bias", False)
    if args.get("bias"):
        assert by_name[entry["bias"]].target is aten.index.Tensor
    assert entry["query_mask"] is args.get("query_mask", True)
    assert entry["mask"] == ("m" if args.get("mask_input") else "lt")
    text = format_graph(gm, "after match-silu-attention")
    FileCheck().check("aten.silu.default").check_same("group=jagged_silu_attention_0") \
        .check(str(contraction)).check_same("kind:jagged_silu_attention").run(text)


@pytest.mark.parametrize("entry,args,reason", [
    (HSTU, {"divisor": km.L - 2}, "normaliser-below-length"),
    # no key mask and v padded with ones: the padded keys add to every row
    (JAGGED, {"pad": "ones"}, "no-key-padding-mask"),
    # the padded output pooled over every position, padding query rows included
    (JAGGED, {"read": "mean"}, "padding-rows-read-by:mean"),
], ids=str)
def test_refusal_names_its_reason(entry: str, args: dict, reason: str):
    gm, ctx, _ = compiled(entry, args, priced=False, upto="match-silu-attention")
    assert not [n for n in gm.graph.nodes if ir.KERNEL in n.meta]
    out = [n for n in gm.graph.nodes if SKIPPED in n.meta]
    assert [n.meta[SKIPPED] for n in out] == [reason]
    assert any(f"({reason})" in w for w in ctx.warnings), ctx.warnings


@pytest.mark.parametrize("args", VARIANTS, ids=str)
def test_compiled_matches_eager_and_counts_the_fallback(args: dict):
    gm, _, entries, spec = _graph(tuple(sorted(args.items())))
    form = "bool" if args.get("mask_input") else "lengths"
    for scramble in (False, True):
        x, m = km.batch(form, [2, 0, 6, 3], torch.Generator().manual_seed(7), scramble)
        kpa.STATS.reset()
        run_against_eager(gm, entries, spec.model, (x, m))
        fallback = scramble and form == "bool"  # lengths always give a prefix
        assert kpa.STATS.as_dict() == {"calls": 1, "jagged": int(not fallback),
                                       "compacted": 0, "fallback": int(fallback)}


@pytest.mark.parametrize("args", [{}, {"layout": "bhld"}, {"bias": False}], ids=str)
def test_jagged_values_padded_into_zeros_need_no_key_mask(args: dict):
    """The keys' padding implicit in v written into zeros over offsets (HSTU's authors'
    spelling: einsum, a float causal tril, the output gathered at the jagged positions):
    one kernel over those offsets, the layouts carried as permutations; compiled = eager
    forward and backward at lengths 0..L, the offsets' mask always a prefix."""
    gm, ctx, spec = compiled(JAGGED, args)
    (entry,) = entries_of(gm, ctx, ["jagged_silu_attention"])
    assert entry["mask"] is None and entry["offsets"] == "offsets"
    assert entry["causal"] is True and entry["query_mask"] is False and entry["norm"] == km.L
    permuted = None if args.get("layout") == "bhld" else [0, 2, 1, 3]
    assert entry["q_perm"] == entry["k_perm"] == entry["v_perm"] == permuted
    assert entry["out_perm"] == [0, 2, 1, 3]  # the model's einsum writes "bnhd"
    assert entry["fill"] == round(11 / (km.B * km.L), 6)
    for lengths in ([2, 0, 6, 3], [0, 6, 5, 0], [1, 1, 3, 6]):
        kpa.STATS.reset()
        batch = km.jagged_batch(lengths, torch.Generator().manual_seed(sum(lengths) + 7))
        run_against_eager(gm, [entry], spec.model, batch)
        assert kpa.STATS.as_dict() == {"calls": 1, "jagged": 1, "compacted": 0, "fallback": 0}


def test_zoo_hstu_attention_becomes_the_jagged_silu_kernel():
    """The zoo's HSTU (tiny preset): each layer's attention is one kernel (both einsums,
    the relative/time bias add, silu, / n, the causal multiply) over the history's offsets,
    and the compiled graph equals eager forward and backward, every parameter's gradient
    (the bias tables' included)."""
    gm, ctx, spec = compiled(ZOO_HSTU, {"preset": "tiny"})
    entries = entries_of(gm, ctx, ["jagged_silu_attention"])
    assert len(entries) == 2, ctx.warnings
    by_name = {n.name: n for n in gm.graph.nodes}
    aten = torch.ops.aten
    for entry in entries:
        targets = [by_name[n].target for n in entry["nodes"]]
        assert targets.count(aten.einsum.default) == 2 and aten.silu.default in targets
        assert entry["offsets"] == "seq_offsets" and entry["bias"] is not None
        assert entry["causal"] and not entry["query_mask"] and entry["norm"] == 8
    assert not [w for w in ctx.warnings if "match-silu-attention" in w]
    kpa.STATS.reset()
    run_against_eager(gm, entries, spec.model, spec.make_batch(1, "cpu"))
    assert kpa.STATS.as_dict() == {"calls": 2, "jagged": 2, "compacted": 0, "fallback": 0}


def _is_prefix(keep: torch.Tensor) -> bool:
    return bool((keep == (torch.arange(keep.shape[1]) < keep.sum(1, keepdim=True))).all())


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(args=st.sampled_from(VARIANTS),
       lengths=st.lists(st.integers(0, km.L), min_size=km.B, max_size=km.B),
       scramble=st.booleans(), seed=st.integers(0, 2**16))
def test_any_mask_compiled_matches_eager_and_falls_back_exactly_off_prefix(
        args, lengths, scramble, seed):
    """Random lengths 0..L, prefix or scrambled masks, every formula variant (a bool mask
    input or one from lengths): compiled = eager forward and backward, and the padded
    fallback taken exactly when the mask is not a prefix (never for a lengths mask)."""
    gm, _, entries, spec = _graph(tuple(sorted(args.items())))
    form = "bool" if args.get("mask_input") else "lengths"
    x, m = km.batch(form, lengths, torch.Generator().manual_seed(seed), scramble)
    keep = m if form == "bool" else torch.arange(km.L)[None] < m[:, None]
    kpa.STATS.reset()
    run_against_eager(gm, entries, spec.model, (x, m))
    fallback = not _is_prefix(keep)
    assert kpa.STATS.as_dict() == {"calls": 1, "jagged": int(not fallback), "compacted": 0,
                                   "fallback": int(fallback)}


@functools.cache
def _jagged_graph():
    gm, ctx, spec = compiled(JAGGED, {})
    return gm, entries_of(gm, ctx, ["jagged_silu_attention"]), spec


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.lists(st.integers(0, km.B - 1), min_size=11, max_size=11),
       seed=st.integers(0, 2**16))
def test_any_jagged_lengths_compiled_match_eager(rows, seed):
    """Zero-padded jagged values, random lengths 0..L with the captured token count (11:
    the graph's shapes are static): compiled = eager, always on the jagged path (the
    offsets' lengths are prefixes by construction)."""
    lengths = [rows.count(b) for b in range(km.B)]
    assume(max(lengths) <= km.L)
    gm, entries, spec = _jagged_graph()
    kpa.STATS.reset()
    run_against_eager(gm, entries, spec.model,
                      km.jagged_batch(lengths, torch.Generator().manual_seed(seed)))
    assert kpa.STATS.as_dict() == {"calls": 1, "jagged": 1, "compacted": 0, "fallback": 0}
