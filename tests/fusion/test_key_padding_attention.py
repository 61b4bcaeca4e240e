"""Key-padding masks from any source (bool / additive input, lengths, offsets, MHA's
key_padding_mask, causal and-ed with padding): what the pass recognises (intent, on the dump
text), why it leaves an attention padded (named reasons), the run-time prefix check (the op
against SDPA, forward and backward, and its counter), and compiled = eager on every form
with prefix and non-prefix masks: a non-prefix mask takes the compacted path, an additive
mask that is no key mask the padded fallback, each exactly then (on the counter)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.triton import key_padding_attention as kpa
from gemc.passes.match_jagged_attention import SKIPPED
from gemc.passes.pack_jagged_tokens import PACKED, PACKED_SKIPPED
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import FileCheck

from gemc import ir
from gemc.dump import format_graph
from gemc.spec import ModelSpec
from tests.fusion import key_padding_models as km
from tests.fusion.helpers import compiled, entries_of, run_against_eager

ENTRY = "tests/fusion/key_padding_models.py:build"


@functools.cache
def _graph(form: str):
    gm, ctx, spec = compiled(ENTRY, {"form": form})
    return gm, ctx, entries_of(gm, ctx, ["key_padding_attention"]), spec


# ---- intent --------------------------------------------------------------------------------

# the mask node the op checks, per form: the input itself, arange < lengths, MHA's additive
# conversion of its key_padding_mask
_MASK = {"bool": ("m", False, False), "additive": ("m", True, False),
         "lengths": ("lt", False, False), "offsets": ("lt", False, False),
         "mha": ("masked_fill_", True, False), "causal": ("m", False, True),
         "target": ("m", False, False), "summary": ("lt", False, False),
         "mha_weights": ("masked_fill_", True, False), "formula": ("m", False, False)}


@pytest.mark.parametrize("form", km.FORMS)
def test_every_mask_form_becomes_a_guarded_attention(form: str):
    gm, ctx, entries, _ = _graph(form)
    mask, additive, causal = _MASK[form]
    text = format_graph(gm, "after match-jagged-attention")
    computed = form in ("lengths", "offsets", "mha", "summary", "mha_weights")
    (entry,) = entries
    # SDPA, or the output matmul of a written-out formula (its scores and softmax grouped)
    written_out = form in ("mha_weights", "formula")
    FileCheck().check(f"%{mask} =" if computed else "") \
        .check("aten.softmax.int" if written_out else "") \
        .check(f"%{entry['output']} = aten." + ("" if written_out else "scaled_dot")) \
        .check_same("kind:key_padding_attention") \
        .check_same(f"mask:{mask},additive:{additive},causal:{causal}").run(text)
    assert entry["mask"] == mask
    # self-attention runs jagged; a dense query (target item, summary queries) over the history
    # and MultiheadAttention's merged-heads formula compute every query row, over the real keys
    assert entry["zero_padding_queries"] is (form not in ("target", "summary", "mha_weights"))
    assert entry["merged_heads"] is (form == "mha_weights")
    # token packing follows the run-time-checked mask (a guarded region) where nothing
    # reads the padding rows unmasked; else it names the reader
    out = next(n for n in gm.graph.nodes if n.name == entry["output"])
    regions = {n.meta[PACKED]["id"] for n in gm.graph.nodes if PACKED in n.meta}
    if form in km.PACKED_FORMS:
        assert len(regions) == 1 and PACKED_SKIPPED not in out.meta
    elif form == "target":
        # the candidate's query sliced off the history (q[:, :, -1:]) reads one token per
        # row, a position checked with the mask at run time (passes/row_reads): it packs
        (head,) = [n for n in gm.graph.nodes if ir.PACKED_REGION in n.meta]
        (read,) = head.meta[ir.PACKED_REGION]["reads"]
        assert len(regions) == 1 and (read["at"], read["keepdim"]) == (km.L - 1, True)
    else:
        assert not regions and "may be read unmasked by" in out.meta[PACKED_SKIPPED]
    assert not [w for w in ctx.warnings if "match-jagged-attention" in w]


class _Attn(nn.Module):
    """One SDPA over a padded input, with variations the pass must refuse (each for a named
    reason) or take differently."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.proj = nn.Linear(km.E, 3 * km.E)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q, k, v = self.proj(x).view(b, km.L, 3, km.H, km.E // km.H).permute(2, 0, 3, 1, 4)
        mask = keep[:, None, None, :]
        if self.variant == "dropout":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.5)
        elif self.variant == "no-mask":
            o = F.scaled_dot_product_attention(q, k, v)
        elif self.variant == "query-causal":  # a query mask and-ed with the causal one
            tril = torch.ones(km.L, km.L, dtype=torch.bool).tril()
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, :, None] & tril)
        elif self.variant == "causal-leak":
            tril = torch.ones(km.L, km.L, dtype=torch.bool).tril()
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask & tril)
        elif self.variant == "per-query":
            full = keep[:, None, :, None] & keep[:, None, None, :]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=full)
        elif self.variant.startswith("add-causal"):  # MHA's merge: causal + key mask, added
            keys = torch.zeros(keep.shape).masked_fill(~keep, -math.inf)[:, None, None, :]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=_additive_causal(
                self.variant.removeprefix("add-causal-")) + keys)
            return (o * keep[:, None, :, None]).mean()
        else:  # "leak": the padding query rows are read by an unmasked mean
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return o.mean()


def _additive_causal(form: str) -> torch.Tensor:
    """The causal ``[L, L]`` mask as users add it: ``generate_square_subsequent_mask``'s
    ``triu(full(-inf), 1)``, ``F._canonical_mask`` of a boolean one, ``where(tril, 0, v)``,
    and a finite ``-1e4`` above the diagonal (no ``-inf``)."""
    tril = torch.ones(km.L, km.L, dtype=torch.bool).tril()
    if form == "triu":
        return nn.Transformer.generate_square_subsequent_mask(km.L)
    if form == "filled":
        upper = torch.triu(torch.ones(km.L, km.L, dtype=torch.bool), diagonal=1)
        return torch.zeros(km.L, km.L).masked_fill(upper, -math.inf)
    return torch.where(tril, 0.0, -math.inf if form == "where" else -1e4)


def build_variant(variant: str) -> ModelSpec:
    x, keep = km.batch("bool", [2, 0, 6, 3], torch.Generator().manual_seed(0))
    return ModelSpec(model=_Attn(variant), example_inputs=(x, keep),
                     make_batch=lambda step, device="cpu": (x.to(device), keep.to(device)))


VARIANT = "tests/fusion/test_key_padding_attention.py:build_variant"


@pytest.mark.parametrize("variant,reason", [
    ("dropout", "dropout"), ("no-mask", "no-key-padding-mask"),
    ("per-query", "mask-varies-over-queries"), ("query-causal", "mask-varies-over-queries"),
    ("causal-leak", "padding-rows-read-by:mean"), ("add-causal-finite", "causal-mask-finite"),
])
def test_refusals_name_their_reason(variant: str, reason: str):
    gm, ctx, _ = compiled(VARIANT, {"variant": variant}, priced=False,
                          upto="match-jagged-attention")
    sdpa = next(n for n in gm.graph.nodes
                if n.target is torch.ops.aten.scaled_dot_product_attention.default)
    assert ir.KERNEL not in sdpa.meta
    assert sdpa.meta[SKIPPED] == reason
    assert any(f"({reason})" in w for w in ctx.warnings), ctx.warnings
    FileCheck().check(f"jagged_skipped={reason}").run(format_graph(gm, "x"))


@pytest.mark.parametrize("form", ["triu", "filled", "where"])
def test_a_causal_mask_added_to_an_additive_key_mask_is_the_causal_kernel(form: str):
    """``nn.MultiheadAttention`` adds its causal ``attn_mask`` and its key_padding_mask (each
    made ``-inf`` / 0) into one ``[B, H, L, L]`` mask: it stayed padded SDPA
    (``mask-varies-over-queries``). A causal term that is ``-inf`` above the diagonal, in any
    of its spellings, is now the causal key-padding kernel over the key mask it was added to
    (its fallback adds the same ``-inf`` mask, so it is exact; a finite one is refused, above)."""
    gm, _, _ = compiled(VARIANT, {"variant": f"add-causal-{form}"}, priced=False,
                        upto="match-jagged-attention")
    sdpa = next(n for n in gm.graph.nodes
                if n.target is torch.ops.aten.scaled_dot_product_attention.default)
    facts = sdpa.meta[ir.KERNEL]
    assert facts["kind"] == "key_padding_attention" and facts["causal"] is True
    assert facts["additive"] is True and facts["zero_padding_queries"] is True
    mask = next(n for n in gm.graph.nodes if n.name == facts["mask"])
    assert tuple(ir.shape_of(mask)) == (4, km.L)  # the [B, L] key mask, not the sum


def test_padding_rows_read_unmasked_compute_every_query_row():
    """An unmasked mean reads the padding query rows: the attention still skips padding keys
    but computes every query row (the varlen-key kernel), so the loss is eager's."""
    gm, ctx, spec = compiled(VARIANT, {"variant": "leak"})
    (entry,) = entries_of(gm, ctx, ["key_padding_attention"])
    assert entry["zero_padding_queries"] is False
    sdpa = next(n for n in gm.graph.nodes if n.name in entry["nodes"])
    assert sdpa.meta[ir.KERNEL]["padding_rows_read_by"] == "mean"
    kpa.STATS.reset()
    run_against_eager(gm, [entry], spec.model,
                      km.batch("bool", [2, 0, 6, 3], torch.Generator().manual_seed(5)))
    assert kpa.STATS.as_dict() == {"calls": 1, "jagged": 1, "compacted": 0, "fallback": 0}


# ---- the op and its run-time check ---------------------------------------------------------


def _is_prefix(keep: torch.Tensor) -> bool:
    return bool((keep == (torch.arange(keep.shape[1]) < keep.sum(1, keepdim=True))).all())


def test_prefix_check_rules():
    keep = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 0], [1, 1, 1, 1]]).bool()
    offsets, bad = kpa.prefix_lengths(keep)
    assert offsets.tolist() == [0, 2, 2, 4, 8]
    assert (bad > 0).tolist() == [[False, False], [False, False], [True, False], [False, False]]
    inf = float("-inf")
    additive = torch.tensor([
        [0.0, 0.0, -1e9, -1e9],  # a large negative is masked
        [inf, inf, inf, inf],  # nothing kept, all -inf: eager gives 0, as jagged does
        [-1e9, -1e9, -1e9, -1e9],  # every fp32 score rounds to -1e9: eager averages
        [0.0, -100.0, inf, inf],  # -100 is a soft bias, not a mask
        [0.0, 0.5, inf, inf],  # a bias on the keys, not a key-padding mask
        [inf, 0.0, inf, 0.0],  # a mask, not a prefix
        [-1e4, -1e4, -1e4, -1e4],  # BERT's empty history: a constant, every key kept
        [-5.0, -5.0, -5.0 - 1e4, inf],  # a shifted mask: the row's constant cancels
    ])
    offsets, bad = kpa.prefix_lengths(additive, additive=True)
    assert offsets.tolist() == [0, 2, 2, 6, 7, 8, 10, 14, 16]
    assert (bad[:, 0] > 0).tolist() == [False, False, False, False, True, True, False, False]
    assert (bad[:, 1] > 0).tolist() == [False, False, True, True, True, False, False, False]
    assert kpa.kept_keys(additive, True).sum(1).tolist() == [2, 0, 4, 1, 1, 2, 4, 2]
    # the compiler's copy of the rule (the guarded region's sample fill) agrees, per row
    from gemc.guard_sample import guard_flags

    for row in range(additive.shape[0]):
        lengths, flags = guard_flags(additive[row:row + 1], True)
        assert int(lengths[0]) == int(offsets[row + 1] - offsets[row])
        assert (flags[0] > 0, flags[1] > 0) == tuple((bad[row] > 0).tolist()), row


def _sdpa(q, k, v, keep, causal):
    mask = keep[:, None, None, :]
    if causal:
        mask = mask & torch.ones(keep.shape[1], keep.shape[1], dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(lengths=st.lists(st.integers(0, km.L), min_size=1, max_size=3),
       scramble=st.booleans(), causal=st.booleans(), additive=st.booleans(),
       queries=st.sampled_from([0, 1, 3, km.L]), seed=st.integers(0, 2**16))
def test_op_matches_sdpa_and_falls_back_exactly_on_non_prefix_masks(
        lengths, scramble, causal, additive, queries, seed):
    """``queries``: 0 for self-attention (jagged, padding query rows zero), else that many
    dense queries over the keys (every row computed; L: self-attention whose padding rows
    someone reads)."""
    gen = torch.Generator().manual_seed(seed)
    keep = km.keep_masks(lengths, gen, scramble)
    causal = causal and not queries
    q = torch.randn(len(lengths), 2, queries or km.L, 4, generator=gen).requires_grad_()
    k, v = (torch.randn(len(lengths), 2, km.L, 4, generator=gen).requires_grad_()
            for _ in range(2))
    mask = torch.zeros(keep.shape).masked_fill(~keep, -math.inf) if additive else keep
    kpa.STATS.reset()
    out = kpa.key_padding_attention(q, k, v, mask, None, causal, additive, not queries)
    prefix = _is_prefix(keep)
    assert kpa.STATS.as_dict() == {"calls": 1, "jagged": int(prefix),
                                   "compacted": int(not prefix), "fallback": 0}
    ref = _sdpa(q, k, v, keep, causal)
    # the jagged path defines real query rows only; the others, every row
    rows = keep[:, None, :, None].float() if not queries else torch.ones(1)
    torch.testing.assert_close(out * rows, ref * rows)
    got = torch.autograd.grad((out * rows).square().sum(), (q, k, v))
    want = torch.autograd.grad((ref * rows).square().sum(), (q, k, v))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("causal", [False, True])
def test_op_checks_the_positions_one_token_readers_read(causal: bool):
    """``read_rows``: the positions readers of one token per row read (the output's only
    readers of its padding query rows, ``out[arange(B), lengths - 1]``). All kept: the
    jagged path (padding rows zero, unread); one on a dropped key: those rows are needed,
    so every query row is computed (varlen keys), or under a causal mask the exact padded
    attention (a fallback). The rows read, forward and backward, are SDPA's either way."""
    from gemc.guard_sample import read_positions

    gen = torch.Generator().manual_seed(11)
    keep = km.keep_masks([2, 1, 6, 3], gen, False)
    q, k, v = (torch.randn(4, 2, km.L, 4, generator=gen).requires_grad_() for _ in range(3))
    rows = torch.arange(4)
    for lengths, path in (([2, 1, 6, 3], "jagged"), ([2, 2, 6, 3], "missed")):
        pos = read_positions(torch.tensor(lengths) - 1, None, 4, km.L, True)
        kpa.STATS.reset()
        out = kpa.key_padding_attention(q, k, v, keep, None, causal, False, True,
                                        read_rows=[pos])
        want = {"calls": 1, "jagged": 1, "compacted": 0, "fallback": 0}
        if path == "missed" and causal:
            want = {**want, "jagged": 0, "fallback": 1}
        assert kpa.STATS.as_dict() == want
        ref = _sdpa(q, k, v, keep, causal)
        if path == "missed":  # every row computed (or padded): SDPA's, padding rows too
            torch.testing.assert_close(out, ref)
        else:  # the rows past each length left zero: the reader never reads them
            assert not out[1, :, 1:].any()
        read, read_ref = out[rows, :, pos], ref[rows, :, pos]
        torch.testing.assert_close(read, read_ref)
        got = torch.autograd.grad(read.square().sum(), (q, k, v))
        expected = torch.autograd.grad(read_ref.square().sum(), (q, k, v))
        for g, w in zip(got, expected):
            torch.testing.assert_close(g, w)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(lengths=st.lists(st.integers(0, km.L), min_size=1, max_size=3),
       soft=st.floats(-9e3, 1.0), seed=st.integers(0, 2**16))
@example(lengths=[0], soft=1.0, seed=0)  # the row's only finite entry: its one kept key
def test_op_falls_back_exactly_when_an_additive_mask_is_no_key_mask(lengths, soft, seed):
    """One masked entry raised to ``soft`` (> -1e4: a bias, not a mask) where a row has one:
    the exact padded attention over the float mask, else the jagged path. In a row with no
    kept key the raised entry is the row's only finite one, so the rule keeps it (a row's
    kept keys are those at its largest value) and the row is a mask of one key."""
    gen = torch.Generator().manual_seed(seed)
    keep = km.keep_masks(lengths, gen, False)
    mask = torch.zeros(keep.shape).masked_fill(~keep, -math.inf)
    rows = [b for b, n in enumerate(lengths) if n < km.L]
    if rows:
        mask[rows[0], km.L - 1] = soft
    # what fp32 holds: a tiny soft value rounds to 0, a kept key (then a non-prefix mask)
    invalid = bool(rows) and float(mask[rows[0], km.L - 1]) != 0.0 and lengths[rows[0]] > 0
    q, k, v = (torch.randn(len(lengths), 2, km.L, 4, generator=gen) for _ in range(3))
    kpa.STATS.reset()
    out = kpa.key_padding_attention(q, k, v, mask, None, False, True)
    assert kpa.STATS.fallback == int(invalid)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
    real = (mask == 0)[:, None, :, None].float()
    torch.testing.assert_close(out * real if not invalid else out, ref * real
                               if not invalid else ref)


def test_op_falls_back_on_a_finite_mask_of_an_empty_row():
    gen = torch.Generator().manual_seed(3)
    keep = km.keep_masks([3, 0], gen, False)
    mask = torch.zeros(keep.shape).masked_fill(~keep, -1e9)
    q, k, v = (torch.randn(2, 2, km.L, 4, generator=gen) for _ in range(3))
    kpa.STATS.reset()
    out = kpa.key_padding_attention(q, k, v, mask, None, False, True)
    assert kpa.STATS.fallback == 1
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
    torch.testing.assert_close(out, ref)  # every row, the empty one's average included


def test_a_bert_style_empty_row_attends_over_every_key_without_fallback():
    """``(1 - mask) * -1e4``: an empty history's row is -1e4 everywhere, a constant softmax
    ignores, so the row keeps every key (no fallback) and equals eager's attention."""
    gen = torch.Generator().manual_seed(4)
    keep = km.keep_masks([3, 0, km.L], gen, False)
    mask = (1.0 - keep.float()) * -10000.0
    q, k, v = (torch.randn(3, 2, km.L, 4, generator=gen) for _ in range(3))
    kpa.STATS.reset()
    out = kpa.key_padding_attention(q, k, v, mask, None, False, True,
                                    zero_padding_queries=False)
    assert kpa.STATS.fallback == 0 and kpa.STATS.jagged == 1
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-4)  # eager rounds s - 1e4


# ---- compiled = eager, every form, prefix and not ------------------------------------------

# a softmax written out gives NaN on a row with no kept key (SDPA gives 0): those forms are
# compared on non-empty rows here, and on an empty one by test_written_out_softmax_...
_WRITTEN_OUT = ("mha_weights", "formula")


def _lengths(form: str, lengths: list[int]) -> list[int]:
    return [max(n, 1) for n in lengths] if form in _WRITTEN_OUT else lengths


@pytest.mark.parametrize("form", _WRITTEN_OUT)
def test_written_out_softmax_keeps_eager_nan_on_an_empty_row(form: str):
    gm, _, entries, spec = _graph(form)
    from gemc.backends.triton.graph_runner import GraphRunner

    from tests.fusion.helpers import params_of

    batch = km.batch(form, [2, 0, 6, 3], torch.Generator().manual_seed(3))
    assert spec.model(*batch).isnan()
    assert GraphRunner(gm, entries, params_of(spec.model))(*batch).isnan()



@pytest.mark.parametrize("form", km.FORMS)
def test_compiled_matches_eager_and_counts_the_paths(form: str):
    gm, _, entries, spec = _graph(form)
    for scramble in (False, True):
        gen = torch.Generator().manual_seed(11)
        x, m = km.batch(form, _lengths(form, [2, 0, 6, 3]), gen, scramble)
        kpa.STATS.reset()
        run_against_eager(gm, entries, spec.model, (x, m))
        # masks built from lengths or offsets are prefixes: scrambling cannot apply
        compacted = scramble and form not in ("lengths", "offsets", "summary")
        assert kpa.STATS.as_dict() == {"calls": 1, "jagged": int(not compacted),
                                       "compacted": int(compacted), "fallback": 0}


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(form=st.sampled_from(km.FORMS),
       lengths=st.lists(st.integers(0, km.L), min_size=km.B, max_size=km.B),
       scramble=st.booleans(), seed=st.integers(0, 2**16))
def test_any_masks_compiled_match_eager(form, lengths, scramble, seed):
    gm, _, entries, spec = _graph(form)
    x, m = km.batch(form, _lengths(form, lengths), torch.Generator().manual_seed(seed),
                    scramble)
    keep = {"lengths": lambda: torch.arange(km.L)[None] < m[:, None],
            "summary": lambda: torch.arange(km.L)[None] < m[:, None],
            "offsets": lambda: torch.arange(km.L)[None] < (m[1:] - m[:-1])[:, None],
            "additive": lambda: m == 0}.get(form, lambda: m)()
    kpa.STATS.reset()
    run_against_eager(gm, entries, spec.model, (x, m))
    assert kpa.STATS.compacted == int(not _is_prefix(keep))
    assert kpa.STATS.calls == 1 and kpa.STATS.fallback == 0
