"""A causal softmax written out over ``-inf`` (``nn.MultiheadAttention(x, x, x,
attn_mask=causal, key_padding_mask=pad)`` with its default ``need_weights=True``;
``s.masked_fill(~causal, -inf).masked_fill(~keep, -inf)``; ``(s + float_causal)
.masked_fill(~keep, -inf)``) as the guarded causal attention with its NaN semantics.

Why this file: these forms were refused (``causal-softmax-formula``) because eager's
softmax is NaN on each query row that sees no kept key. Over a right-padded (prefix) mask
those are only the rows that keep no key (every query sees key 0 otherwise): the jagged
path with ``nan_where_no_key``, its gradients NaN on the operands eager's are
(``nan_gradient_operands``). Over any other mask (front-padded, holes) the queries ahead
of a row's first kept key are NaN too: the exact padded formula, counted as a fallback,
with the causal mask applied as the model applies it (added or filled: that decides which
of q and k get NaN gradients). A packed region holding such an attention packs only
over a prefix with a key on every row. Compiled = eager, loss and every gradient, NaN
where eager is NaN, in the interpreter and in graph mode."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.triton import key_padding_attention as kpa
from gemc.backends.triton import packed_tokens as pt
from gemc.passes.match_softmax_attention import SKIPPED
from torch import nn

from gemc.spec import ModelSpec
from tests.fusion.helpers import (
    compiled,
    cpu_graph_executor,
    eager_step,
    entries_of,
    fresh_seed,
    item_history,
    params_of,
    train_against_eager,
)

ENTRY = "tests/fusion/test_causal_softmax_nan.py:build"

B, L, ITEMS, E, HEADS = 4, 5, 30, 8, 2


class Model(nn.Module):
    """Item embeddings + positions, one causal self-attention: ``attn="mha"``
    (``nn.MultiheadAttention``'s default call; ``form``: its ``attn_mask`` boolean or
    ``generate_square_subsequent_mask``), ``"fill2"`` (two masked fills; ``form="finite"``:
    the causal one at ``-1e9``), ``"addfill"`` (the causal mask added, the keys filled),
    ``"or"`` (one fill of ``~tril | ~keep``), ``"onefill"`` (one fill of ``~(keep & tril)``),
    ``"oneadd"`` (one additive mask, the keys' plus the causal one); pooled under the mask (``read="pool"``) or
    summed over every position (``"sum"``); BCE."""

    def __init__(self, attn: str, form: str = "bool", read: str = "pool") -> None:
        super().__init__()
        self.attn, self.form, self.read = attn, form, read
        self.item = nn.Embedding(ITEMS, E, padding_idx=0)
        self.pos = nn.Embedding(L, E)
        if attn == "mha":
            self.mha = nn.MultiheadAttention(E, HEADS, batch_first=True)
        else:
            self.qkv, self.out = nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.head = nn.Linear(E, 1)

    def forward(self, seq: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        keep = seq != 0
        b, n = seq.shape
        x = self.item(seq) + self.pos(torch.arange(n, device=seq.device))[None]
        tril = torch.tril(torch.ones(n, n, dtype=torch.bool, device=seq.device))
        if self.attn == "mha":
            c = ~tril if self.form == "bool" else \
                nn.Transformer.generate_square_subsequent_mask(n, device=seq.device)
            o, _ = self.mha(x, x, x, attn_mask=c, key_padding_mask=~keep)
        else:
            q, k, v = self.qkv(x).view(b, n, 3, HEADS, E // HEADS).permute(2, 0, 3, 1, 4)
            s = q @ k.transpose(-1, -2) / math.sqrt(E // HEADS)
            key = keep[:, None, None, :]
            if self.attn == "fill2":  # the causal mask filled, then the keys
                s = s.masked_fill(~tril, -1e9 if self.form == "finite" else float("-inf"))
                s = s.masked_fill(~key, float("-inf"))
            elif self.attn == "or":  # one fill of both drop masks
                s = s.masked_fill(~tril | ~key, float("-inf"))
            elif self.attn == "onefill":  # one fill of the combined keep-mask
                s = s.masked_fill(~(key & tril), float("-inf"))
            elif self.attn == "oneadd":  # one additive mask, keys + causal
                keys = torch.zeros(b, n, device=seq.device).masked_fill(~keep, float("-inf"))
                s = s + (keys[:, None, None, :] + nn.Transformer.generate_square_subsequent_mask(
                    n, device=seq.device))
            else:  # the causal mask added, then the keys filled
                s = s + nn.Transformer.generate_square_subsequent_mask(n, device=seq.device)
                s = s.masked_fill(~key, float("-inf"))
            o = self.out((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, E))
        y = x + o
        if self.read == "sum":  # padding rows read unmasked
            h = y.sum(1)
        else:
            w = keep[..., None].to(y.dtype)
            h = (y * w).sum(1) / w.sum(1).clamp(min=1)
        return F.binary_cross_entropy_with_logits(self.head(h).squeeze(-1), target)


def batch(lengths: list[int], gen: torch.Generator, layout: str = "right"
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Item ids (0 = padding) of these lengths, padded at the end (``"right"``: a prefix),
    at the front (``"front"``), or kept at position 0 with holes after it (``"holes"``: no
    prefix, yet every query sees key 0, so eager is finite), and BCE targets."""
    return item_history(lengths, gen, L, ITEMS, "end" if layout == "right" else layout)


def build(attn: str = "mha", form: str = "bool", read: str = "pool") -> ModelSpec:
    torch.manual_seed(0)

    def make(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(step)
        return tuple(t.to(device) for t in batch([2, 1, L, 3], gen))

    return ModelSpec(model=Model(attn, form, read), example_inputs=make(0), make_batch=make)


@functools.cache
def _graph(attn: str, form: str = "bool", read: str = "pool"):  # noqa: ANN202
    gm, ctx, spec = compiled(ENTRY, {"attn": attn, "form": form, "read": read},
                             priced=False)
    return gm, ctx, entries_of(gm, ctx), spec


FORMS = [("mha", "bool"), ("mha", "float"), ("fill2", "bool"), ("addfill", "bool"),
         ("onefill", "bool"), ("oneadd", "bool")]
"""The covered forms, and how each applies its causal mask (``causal_added``)."""
ADDED = {"mha": True, "fill2": False, "addfill": True, "onefill": False, "oneadd": True}


# ---- intent ------------------------------------------------------------------------------


@pytest.mark.parametrize("attn,form", FORMS)
def test_the_form_is_the_guarded_causal_attention_with_its_nan_flag(attn: str, form: str):
    """One guarded causal key-padding attention, written out over ``-inf`` (``nan_if_empty``
    and ``nan_if_unseen``, the causal mask applied as the model does), its padding query
    rows unread; a packed region around it packs only over a prefix with a key on every
    row (``every_row``, not ``compact``); no refusal, no warning from the attention
    passes."""
    gm, ctx, entries, _ = _graph(attn, form)
    (entry,) = [e for e in entries if e["kind"] == "key_padding_attention"]
    assert entry["causal"] and entry["nan_if_empty"] and entry["nan_if_unseen"]
    assert entry["causal_added"] is ADDED[attn]
    assert entry["additive"] is (attn in ("mha", "oneadd"))
    assert entry["merged_heads"] is (attn == "mha")
    assert entry["zero_padding_queries"] is True
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    assert region["every_row"] is True and region["compact"] is False
    assert not [n for n in gm.graph.nodes if SKIPPED in n.meta]
    assert not [w for w in ctx.warnings if "attention" in w], ctx.warnings


@pytest.mark.parametrize("attn,form,read,why", [
    ("fill2", "finite", "pool", "causal-softmax-formula"),
    ("or", "bool", "pool", "causal-softmax-formula"),
    ("fill2", "bool", "sum", "padding-rows-read-by:sum_1"),
    ("mha", "bool", "sum", "padding-rows-read-by:sum_1")])
def test_what_it_does_not_cover_keeps_its_named_reason(attn: str, form: str, read: str,
                                                       why: str):
    """A finite causal drop under ``-inf`` keys (a query with no kept key then attends over
    its future keys), one fill of ``~tril | ~keep``, and padding query rows read unmasked
    (the kernel leaves them zero) stay padded, named."""
    gm, ctx, entries, _ = _graph(attn, form, read)
    assert not [e for e in entries if e["kind"] == "key_padding_attention"]
    assert [n.meta[SKIPPED] for n in gm.graph.nodes if SKIPPED in n.meta] == [why]
    assert any(f"({why})" in w for w in ctx.warnings), ctx.warnings


# ---- compiled = eager --------------------------------------------------------------------


def _against_eager(gm, entries, model: nn.Module, b: tuple[torch.Tensor, ...]) -> bool:  # noqa: ANN001
    """The interpreter's loss and every gradient equal eager's, NaN where eager's is NaN
    (and only there); returns whether eager's loss was NaN."""
    from gemc.backends.triton.graph_runner import GraphRunner

    ref, grads = eager_step(model, b)
    loss = GraphRunner(gm, entries, params_of(model))(*b)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5, equal_nan=True)
    loss.backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[k], atol=1e-5, rtol=1e-4, equal_nan=True,
                                   msg=k)
    model.zero_grad()
    return bool(ref.isnan())


def _lengths(gen: torch.Generator, empty: bool) -> list[int]:
    """Fresh lengths 1..L (a full row among them), with an empty row where ``empty``."""
    lengths = torch.randint(1, L + 1, (B,), generator=gen).tolist()
    lengths[int(torch.randint(0, B, (1,), generator=gen))] = L
    if empty:
        lengths[(lengths.index(L) + 1) % B] = 0
    return lengths


@pytest.mark.parametrize("attn,form", FORMS)
@pytest.mark.parametrize("layout,empty", [("right", False), ("right", True),
                                          ("front", False), ("holes", False)])
def test_interpreter_equals_eager(attn: str, form: str, layout: str, empty: bool):
    """Right-padded: the jagged path (the region packed when no row is empty), NaN exactly
    on the empty rows and their gradients; front-padded (NaN on each query ahead of a
    row's first kept key) and with holes (finite): the exact padded formula, counted as a
    fallback, the region padded."""
    gm, _, entries, spec = _graph(attn, form)
    gen = torch.Generator().manual_seed(fresh_seed())
    lengths = _lengths(gen, empty)
    b = batch(lengths, gen, layout)
    keep = b[0] != 0
    prefix = bool((keep == (torch.arange(L) < keep.sum(1, keepdim=True))).all())
    kpa.STATS.reset()
    pt.GUARD_STATS.reset()
    nan = _against_eager(gm, entries, spec.model, b)
    assert nan == (empty or (layout == "front" and min(lengths) < L)), (lengths, layout)
    assert kpa.STATS.as_dict() == {"calls": 1, "jagged": int(prefix), "compacted": 0,
                                   "fallback": int(not prefix)}, (lengths, layout)
    assert pt.GUARD_STATS.packed == int(prefix and not empty), pt.GUARD_STATS.as_dict()


@pytest.mark.parametrize("attn,form", [("mha", "bool"), ("addfill", "bool")])
def test_graph_mode_trains_as_eager(attn: str, form: str):
    """Graph mode (the region's check ahead of the graph; the attention in place on the
    packed tokens, or its own op in the padded variant): SGD steps equal eager's on
    right-padded batches and on one with holes (no prefix: the op's padded formula,
    counted), where eager is finite."""
    gm, _, entries, spec = _graph(attn, form)
    model = Model(attn, form)
    model.load_state_dict(spec.model.state_dict())
    gen = torch.Generator().manual_seed(fresh_seed())
    batches = [batch(_lengths(gen, False), gen, layout)
               for layout in ("right", "holes", "right")]
    kpa.STATS.reset()
    train_against_eager(cpu_graph_executor(gm, model, entries), model, batches)
    assert kpa.STATS.fallback >= 1 and kpa.STATS.compacted == 0, kpa.STATS.as_dict()


# ---- the op against each form's formula --------------------------------------------------


def _formula(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
             additive: bool, causal_added: bool, causal_first: bool) -> torch.Tensor:
    """A written-out causal softmax: the keys added (an additive ``[B, L]`` mask) or
    filled, the causal mask added or filled, in either order."""
    n = q.shape[2]
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    keys = torch.zeros(keep.shape).masked_fill(~keep, -math.inf)[:, None, None, :]

    def key_term(s: torch.Tensor) -> torch.Tensor:
        return s + keys if additive else s.masked_fill(~keep[:, None, None, :], -math.inf)

    def causal_term(s: torch.Tensor) -> torch.Tensor:
        return s + torch.zeros(n, n).masked_fill(~tril, -math.inf) if causal_added \
            else s.masked_fill(~tril, -math.inf)

    s = q @ k.transpose(-1, -2) * 0.5
    s = key_term(causal_term(s)) if causal_first else causal_term(key_term(s))
    return s.softmax(-1) @ v


@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("causal_added", [False, True])
@pytest.mark.parametrize("layout", ["right", "front"])
def test_op_nan_rows_and_gradients_are_eager_formulas(additive: bool, causal_added: bool,
                                                      layout: str):
    """``key_padding_attention(causal=True, nan_if_empty=True, causal_added=...)`` against
    the formula, both orders of its terms: forward on every row eager computes (right
    padded: the kept query rows and every row of an empty one; front padded: every row,
    the padded path), and the q, k, v gradients, NaN exactly where eager's are (right
    padded: ``nan_gradient_operands``; front padded: the padded formula, whose q and k
    gradients are NaN where an added term lets the NaN score gradient through)."""
    gen = torch.Generator().manual_seed(fresh_seed())
    q, k, v = (torch.randn(3, 2, 5, 4, generator=gen, requires_grad=True) for _ in range(3))
    lengths = torch.tensor([3, 0, 5])
    pos = torch.arange(5)[None, :]
    keep = pos >= 5 - lengths[:, None] if layout == "front" else pos < lengths[:, None]
    mask = torch.zeros(keep.shape).masked_fill(~keep, -math.inf) if additive else keep
    kpa.STATS.reset()
    out = kpa.key_padding_attention(q, k, v, mask, scale=0.5, causal=True, additive=additive,
                                    nan_if_empty=True, causal_added=causal_added)
    assert kpa.STATS.as_dict() == {"calls": 1, "jagged": int(layout == "right"),
                                   "compacted": 0, "fallback": int(layout == "front")}
    rows = keep | ~keep.any(1, keepdim=True) if layout == "right" \
        else torch.ones_like(keep)
    rows = rows[:, None, :, None].expand(out.shape)
    g = torch.randn(out.shape, generator=gen) * rows
    got = torch.autograd.grad(out, (q, k, v), g)
    for causal_first in (False, True):
        want = _formula(q, k, v, keep, additive, causal_added, causal_first)
        torch.testing.assert_close(out[rows], want[rows], equal_nan=True)
        ref = torch.autograd.grad(want, (q, k, v), g)
        for a, b, name in zip(got, ref, "qkv"):
            torch.testing.assert_close(a, b, equal_nan=True, msg=name)
    nan = [bool(x.isnan().any()) for x in got]
    assert nan[2] and nan[:2] == [additive or (layout == "front" and causal_added)] * 2


def test_op_refuses_causal_added_without_its_form():
    q = torch.zeros(1, 1, 2, 4)
    keep = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="causal_added"):
        kpa.key_padding_attention(q, q, q, keep, causal=True, causal_added=True)
