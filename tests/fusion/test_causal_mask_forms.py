"""The causal mask in the spellings users write, recognised by its values
(``passes/causal_masks``), over left- and right-padded histories.

Before: only ``tril(ones)``, ``~triu(ones, 1)``, ``arange[:, None] >= arange[None, :]`` and
three additive spellings were causal; ``(i - j) >= 0``, ``~(j > i)``, ``triu(ones, 1) ==
0``, ``tril(ones) == 1``, ``log(tril(ones))`` and ``where(tril > 0, 0, -inf)`` left the
attention padded SDPA (``mask-varies-over-queries``). Now each is the causal key-padding
attention, through ``F.scaled_dot_product_attention`` (the key mask and-ed with or added to
the causal one) and ``nn.MultiheadAttention(attn_mask=causal, key_padding_mask=~keep)``
alike; a mask that is almost causal (the diagonal dropped, or one more diagonal kept) is
not. The histories are padded at the end or, as many sequential recommenders pad them, at
the front (the latest item at ``L - 1``, read by ``out[:, -1]``): a front-padded mask is
a suffix, so the guarded attention compacts it (order kept: the causal mask keeps its
meaning), and a row with no item is read at a padding position, checked at run time (the
exact padded attention, counted). Compiled = eager, loss and every gradient, on fresh
random batches of lengths 0..L. Written-out causal softmaxes over ``-inf`` are the guarded
causal attention with their NaN semantics (``nan_if_unseen``:
tests/fusion/test_causal_softmax_nan.py)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.triton import key_padding_attention as kpa
from gemc.passes.causal_masks import causal_form
from gemc.passes.match_jagged_attention import SKIPPED
from gemc.passes.match_softmax_attention import SKIPPED as SOFTMAX_SKIPPED
from torch import nn

from gemc import ir
from gemc.spec import ModelSpec
from tests.fusion.helpers import compiled, entries_of, fresh_seed, item_history, run_against_eager

ENTRY = "tests/fusion/test_causal_mask_forms.py:build"
B, L, ITEMS, E, HEADS = 4, 5, 30, 8, 2
KEEP_FORMS = ("tril", "not_triu", "ge", "diff", "not_gt", "triu_eq0", "tril_eq1")
"""Boolean causal keep-masks (True: the query sees the key)."""
ADDITIVE_FORMS = ("subsequent", "log_tril", "where")
"""Additive causal masks, 0 / -inf."""
NEAR_FORMS = ("tril_minus1", "tril_plus1")
"""Almost causal: ``tril(diagonal=-1)`` (a query does not see itself) and
``tril(diagonal=1)`` (it sees the next key): no causal mask."""


def causal_mask(form: str, n: int, device: torch.device) -> torch.Tensor:
    """The ``[n, n]`` causal mask as ``form`` writes it: a keep-mask, or an additive one."""
    pos = torch.arange(n, device=device)
    ones = torch.ones(n, n, device=device)
    return {
        "tril": lambda: torch.tril(torch.ones(n, n, dtype=torch.bool, device=device)),
        "not_triu": lambda: ~torch.triu(torch.ones(n, n, dtype=torch.bool, device=device), 1),
        "ge": lambda: pos[:, None] >= pos[None, :],
        "diff": lambda: (pos[:, None] - pos[None, :]) >= 0,
        "not_gt": lambda: ~(pos[None, :] > pos[:, None]),
        "triu_eq0": lambda: torch.triu(ones, diagonal=1) == 0,
        "tril_eq1": lambda: torch.tril(ones) == 1,
        "subsequent": lambda: nn.Transformer.generate_square_subsequent_mask(n, device=device),
        "log_tril": lambda: torch.log(torch.tril(ones)),
        "where": lambda: torch.where(torch.tril(ones) > 0, 0.0, float("-inf")),
        "tril_minus1": lambda: torch.tril(ones, diagonal=-1) > 0,
        "tril_plus1": lambda: torch.tril(ones, diagonal=1) > 0,
    }[form]()


class Model(nn.Module):
    """Item embeddings + positions, one causal attention over the history (``attn``:
    ``"sdpa"``, ``"mha"``: ``nn.MultiheadAttention`` with ``need_weights=False``,
    ``"mha_weights"``: its default ``need_weights=True``, ``"formula"``: the softmax written
    out with masked fills), read at the last position (``read="last"``, a front-padded
    history's latest item) or pooled under the mask (``"pool"``); a BCE loss."""

    def __init__(self, attn: str, form: str, read: str) -> None:
        super().__init__()
        self.attn, self.form, self.read = attn, form, read
        self.item = nn.Embedding(ITEMS, E, padding_idx=0)
        self.pos = nn.Embedding(L, E)
        if attn.startswith("mha"):
            self.mha = nn.MultiheadAttention(E, HEADS, batch_first=True)
        else:
            self.qkv, self.out = nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.head = nn.Linear(E, 1)

    def forward(self, seq: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        keep = seq != 0
        b, n = seq.shape
        x = self.item(seq) + self.pos(torch.arange(n, device=seq.device))[None]
        c = causal_mask(self.form, n, seq.device)
        additive = c.dtype.is_floating_point
        if self.attn.startswith("mha"):
            # MultiheadAttention's bool attn_mask is True where a key is *not* seen
            o, _ = self.mha(x, x, x, attn_mask=c if additive else ~c, key_padding_mask=~keep,
                            need_weights=self.attn == "mha_weights")
        else:
            q, k, v = self.qkv(x).view(b, n, 3, HEADS, E // HEADS).permute(2, 0, 3, 1, 4)
            key = keep[:, None, None, :]
            if self.attn == "formula":
                s = q @ k.transpose(-1, -2) / math.sqrt(E // HEADS)
                s = s + c if additive else s.masked_fill(~c, float("-inf"))
                o = s.masked_fill(~key, float("-inf")).softmax(-1) @ v
            elif additive:
                keys = torch.zeros(b, n, device=seq.device).masked_fill(~keep, float("-inf"))
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=keys[:, None, None] + c)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=key & c)
            o = self.out(o.transpose(1, 2).reshape(b, n, E))
        y = x + o
        if self.read == "last":
            h = y[:, -1]
        else:
            w = keep[..., None].to(y.dtype)
            h = (y * w).sum(1) / w.sum(1).clamp(min=1)
        return F.binary_cross_entropy_with_logits(self.head(h).squeeze(-1), target)


def batch(lengths: list[int], gen: torch.Generator, front: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Item ids (0 = padding) of these lengths, padded at the front (``front``: the items
    at the last positions) or at the end, and BCE targets."""
    return item_history(lengths, gen, L, ITEMS, "front" if front else "end")


def build(attn: str = "sdpa", form: str = "tril", read: str = "pool") -> ModelSpec:
    torch.manual_seed(0)

    def make(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(step)
        return tuple(t.to(device) for t in batch([2, 1, L, 3], gen, read == "last"))

    return ModelSpec(model=Model(attn, form, read), example_inputs=make(0), make_batch=make)


@functools.cache
def _graph(attn: str, form: str, read: str):  # noqa: ANN202
    gm, ctx, spec = compiled(ENTRY, {"attn": attn, "form": form, "read": read},
                             priced=False)
    return gm, ctx, entries_of(gm, ctx), spec


# ---- intent ------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "mha"])
@pytest.mark.parametrize("form", KEEP_FORMS + ADDITIVE_FORMS)
def test_every_causal_spelling_is_the_causal_key_padding_attention(attn: str, form: str):
    """One guarded causal attention over the keep-mask ``seq != 0`` (MultiheadAttention's:
    the additive mask it fills from it), its padding query rows left zero, no warning from
    the attention passes; the causal ``[L, L]`` node is recognised by its values."""
    gm, ctx, entries, _ = _graph(attn, form, "pool")
    (entry,) = [e for e in entries if e["kind"] == "key_padding_attention"]
    assert entry["causal"] is True and entry["zero_padding_queries"] is True
    by_name = {n.name: n for n in gm.graph.nodes}
    keep = by_name[entry["mask"]]
    if attn == "sdpa" and form in KEEP_FORMS:
        assert keep.target is torch.ops.aten.ne.Scalar and entry["additive"] is False
    else:  # an additive [B, L] key mask (made from ~keep), added to the causal one
        assert entry["additive"] is True and tuple(ir.shape_of(keep)) == (B, L)
    forms = {causal_form(n, L) for n in gm.graph.nodes} - {None}
    assert forms & {"keep", "drop", "add-inf"}, forms
    assert not [w for w in ctx.warnings if "attention" in w], ctx.warnings


@pytest.mark.parametrize("form", NEAR_FORMS)
def test_an_almost_causal_mask_is_no_causal_mask(form: str):
    """``tril(diagonal=-1)`` and ``tril(diagonal=1)`` differ from the causal mask on one
    diagonal: not causal, so the mask varies over the queries and the SDPA stays padded."""
    gm, ctx, entries, _ = _graph("sdpa", form, "pool")
    assert not [e for e in entries if e["kind"] == "key_padding_attention"]
    sdpa = next(n for n in gm.graph.nodes
                if n.target is torch.ops.aten.scaled_dot_product_attention.default)
    assert sdpa.meta[SKIPPED] == "mask-varies-over-queries"
    assert all(causal_form(n, L) is None for n in gm.graph.nodes)


@pytest.mark.parametrize("attn,form", [("formula", "tril"), ("formula", "subsequent"),
                                       ("formula", "not_gt"), ("mha_weights", "tril"),
                                       ("mha_weights", "subsequent")])
def test_a_written_out_causal_softmax_is_the_guarded_causal_attention(attn: str, form: str):
    """A softmax written out under a ``-inf`` causal mask (two masked fills, the causal mask
    added then the keys filled, MultiheadAttention's default ``need_weights=True``) is NaN
    on each query row that sees no kept key: recognised as causal whatever the spelling,
    and the guarded causal attention carrying that (``nan_if_unseen``; it was refused,
    ``causal-softmax-formula``: tests/fusion/test_causal_softmax_nan.py has its numerics)."""
    gm, ctx, entries, _ = _graph(attn, form, "pool")
    (entry,) = [e for e in entries if e["kind"] == "key_padding_attention"]
    assert entry["causal"] and entry["nan_if_empty"] and entry["nan_if_unseen"]
    assert entry["causal_added"] is (attn == "mha_weights" or form in ADDITIVE_FORMS)
    assert not [n for n in gm.graph.nodes if SOFTMAX_SKIPPED in n.meta]
    assert not [w for w in ctx.warnings if "attention" in w], ctx.warnings


# ---- compiled = eager ----------------------------------------------------------------------


def _lengths(gen: torch.Generator) -> list[int]:
    """Fresh random lengths 0..L, with an empty row and a full one among them."""
    lengths = torch.randint(0, L + 1, (B,), generator=gen).tolist()
    lengths[int(torch.randint(0, B, (1,), generator=gen))] = 0
    lengths[(lengths.index(0) + 1) % B] = L
    return lengths


@pytest.mark.parametrize("attn,form", [("sdpa", "tril"), ("sdpa", "diff"),
                                       ("sdpa", "triu_eq0"), ("sdpa", "log_tril"),
                                       ("mha", "not_gt"), ("mha", "subsequent"),
                                       ("mha", "where")])
@pytest.mark.parametrize("read", ["last", "pool"])
@pytest.mark.parametrize("front", [True, False])
def test_compiled_matches_eager_front_and_end_padded(attn: str, form: str, read: str,
                                                     front: bool):
    """Loss and every gradient equal eager's on fresh random batches, and the path is the
    one the data asks for: an end-padded mask is a prefix (jagged), a front-padded one a
    suffix (compacted: each row's kept keys moved to the front in order); a readout at
    ``L - 1`` of a row it does not keep (an empty front-padded row, or an end-padded row
    shorter than L) needs a padding query row the kernel leaves zero: the exact padded
    attention, counted as a fallback. Eager's rows with no visible key are 0 (SDPA), as
    the kernel's."""
    gm, _, entries, spec = _graph(attn, form, read)
    gen = torch.Generator().manual_seed(fresh_seed())
    for _ in range(2):
        lengths = _lengths(gen)
        seq, target = batch(lengths, gen, front)
        kpa.STATS.reset()
        run_against_eager(gm, entries, spec.model, (seq, target))
        spec.model.zero_grad()
        keep = seq != 0
        missed = read == "last" and not bool(keep[:, -1].all())
        prefix = bool((keep == (torch.arange(L) < keep.sum(1, keepdim=True))).all())
        assert kpa.STATS.as_dict() == {
            "calls": 1, "fallback": int(missed), "jagged": int(not missed and prefix),
            "compacted": int(not missed and not prefix)}, (lengths, front)
