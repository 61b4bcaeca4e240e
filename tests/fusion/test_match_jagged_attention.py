"""match-jagged-attention: golden dump, what matches and what does not, and the substituted
graph against eager (length-0 and length-1 histories, full rows, all-empty batches)."""

from __future__ import annotations

import functools

import torch
from hypothesis import HealthCheck, given, settings

from gemc import ir
from tests.conftest import TOY, check_golden
from tests.fusion import models
from tests.fusion.helpers import compiled, dump_after, entries_of, fresh_seed, run_against_eager

JAGGED = "tests/fusion/models.py:build_jagged"


def test_match_jagged_attention_golden_dump():
    check_golden("match_jagged_attention.txt", dump_after(JAGGED, "match-jagged-attention"))


def _matched(entry: str, args: dict | None = None) -> list[dict]:
    gm, _, _ = compiled(entry, args, priced=False, upto="match-jagged-attention")
    return [n.meta[ir.KERNEL] for n in gm.graph.nodes
            if n.meta.get(ir.KERNEL, {}).get("kind") == "jagged_attention"]


def test_self_attention_matches_and_cross_attention_does_not():
    found = _matched(JAGGED)
    assert len(found) == 1  # the second SDPA has one dense query token: stays SDPA
    facts = found[0]
    assert facts["clamp_min"] == 1 and facts["max_len"] == models.L
    assert facts["offsets"] == "offsets" and facts["padded_from"].startswith("index_put")


def test_mask_without_clamp_is_recorded():
    assert _matched(JAGGED, {"clamp": False})[0]["clamp_min"] == 0


def test_attention_whose_padding_rows_are_read_is_not_jagged():
    """An unmasked mean over all positions reads the padding queries' rows, which jagged
    attention leaves zero: it is no jagged attention, but a guarded key-padding attention
    that computes every query row (over the real keys only), so the loss is eager's."""
    gm, ctx, spec = compiled(JAGGED, {"leak": True})
    kinds = [n.meta[ir.KERNEL]["kind"] for n in gm.graph.nodes if ir.KERNEL in n.meta
             and "attention" in n.meta[ir.KERNEL]["kind"]]
    assert kinds == ["key_padding_attention", "key_padding_attention"]  # self and cross
    assert all(not n.meta[ir.KERNEL]["zero_padding_queries"] for n in gm.graph.nodes
               if n.meta.get(ir.KERNEL, {}).get("kind") == "key_padding_attention")
    assert any("read unmasked by mean" in w for w in ctx.warnings), ctx.warnings
    batch = models.jagged_batch([3, 0, 8, 1], torch.Generator().manual_seed(fresh_seed()))
    run_against_eager(gm, entries_of(gm, ctx, ["key_padding_attention"]), spec.model, batch)


def test_padded_input_without_jagged_origin_is_not_matched():
    """The toy model masks a sequence that was never jagged: nothing to gain, no match."""
    assert _matched(f"{TOY}:build_attention") == []


@functools.cache
def _graph(clamp: bool = True):
    gm, ctx, spec = compiled(JAGGED, {"clamp": clamp})
    return gm, entries_of(gm, ctx, ["jagged_attention"]), spec


def _check(lengths: list[int], clamp: bool = True) -> None:
    gm, entries, spec = _graph(clamp)
    assert len(entries) == 1
    batch = models.jagged_batch(lengths, torch.Generator().manual_seed(fresh_seed()))
    run_against_eager(gm, entries, spec.model, batch)


def test_empty_and_full_histories_match_eager():
    _check([3, 0, 8, 1])


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(models.captured_lengths())
def test_any_lengths_with_the_captured_total_match_eager(lengths: list[int]):
    _check(lengths)


def test_unclamped_mask_matches_eager_on_nonempty_histories():
    _check([1, 5, 2, 4], clamp=False)
