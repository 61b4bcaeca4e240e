"""RecBole's SASRec attention mask, ``where(tril(keep[:, None, None, :].expand(-1, -1, L,
-1)), 0.0, -10000.0)`` added to written-out scores (``passes/jagged_patterns.
causal_keep_drop``): causal and-ed with the key mask, dropped with a finite value. It was
no key-padding mask (``mask-varies-over-queries``: the history stayed padded); now it is the
causal key-padding attention over the boolean keep-mask, its fallback the model's own
formula (a query row with no kept key attends over every key in eager, which only that
formula keeps). Also ``tril`` of the broadcast keys as a boolean SDPA mask. Compiled =
eager, loss and every gradient, on fresh random batches: packed, and a step whose reader
reads a padding query row with no kept key (a fallback, counted)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.triton import key_padding_attention as kpa
from gemc.backends.triton import packed_tokens as pt
from torch import nn

from gemc.spec import ModelSpec
from tests.fusion.helpers import (
    compiled,
    cpu_graph_executor,
    entries_of,
    fresh_seed,
    guarded_step_against_eager,
    train_against_eager,
)

ENTRY = "tests/fusion/test_recbole_causal_mask.py:build"
B, L, ITEMS, H, HEADS, LAYERS = 4, 6, 30, 8, 2, 2


class MultiHeadAttention(nn.Module):
    """RecBole's ``MultiHeadAttention`` (``recbole/model/layers.py``), as written there:
    the keys permuted to ``[B, H, d, L]``, scores divided by ``sqrt(d)``, the mask added,
    softmax, dropout (0 here, so eager and compiled see the same weights), the values."""

    def __init__(self) -> None:
        super().__init__()
        self.num_attention_heads = HEADS
        self.attention_head_size = H // HEADS
        self.sqrt_attention_head_size = math.sqrt(self.attention_head_size)
        self.query, self.key, self.value = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)
        self.softmax = nn.Softmax(dim=-1)
        self.attn_dropout = nn.Dropout(0.0)
        self.dense = nn.Linear(H, H)
        self.LayerNorm = nn.LayerNorm(H, eps=1e-12)

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.size()[:-1], self.num_attention_heads, self.attention_head_size)

    def forward(self, input_tensor: torch.Tensor, attention_mask: torch.Tensor
                ) -> torch.Tensor:
        query_layer = self.transpose_for_scores(self.query(input_tensor)).permute(0, 2, 1, 3)
        key_layer = self.transpose_for_scores(self.key(input_tensor)).permute(0, 2, 3, 1)
        value_layer = self.transpose_for_scores(self.value(input_tensor)).permute(0, 2, 1, 3)
        scores = torch.matmul(query_layer, key_layer)
        scores = scores / self.sqrt_attention_head_size
        scores = scores + attention_mask
        probs = self.attn_dropout(self.softmax(scores))
        context = torch.matmul(probs, value_layer).permute(0, 2, 1, 3).contiguous()
        context = context.view(*context.size()[:-2], H)
        return self.LayerNorm(self.dense(context) + input_tensor)


class SASRec(nn.Module):
    """RecBole's SASRec forward, tiny. ``mask``: ``"recbole"`` (its ``get_attention_mask``
    and written-out attention) or ``"sdpa_tril"`` (``tril`` of the broadcast keys as a
    boolean SDPA mask, the same attention with ``-inf`` semantics)."""

    def __init__(self, mask: str) -> None:
        super().__init__()
        self.mask = mask
        self.item_embedding = nn.Embedding(ITEMS, H, padding_idx=0)
        self.position_embedding = nn.Embedding(L, H)
        self.LayerNorm = nn.LayerNorm(H, eps=1e-12)
        self.layers = nn.ModuleList(MultiHeadAttention() for _ in range(LAYERS))
        self.ffn = nn.ModuleList(nn.Linear(H, H) for _ in range(LAYERS))

    def get_attention_mask(self, item_seq: torch.Tensor) -> torch.Tensor:
        attention_mask = item_seq != 0
        extended = attention_mask.unsqueeze(1).unsqueeze(2)
        extended = torch.tril(extended.expand((-1, -1, item_seq.size(-1), -1)))
        if self.mask == "sdpa_tril":
            return extended
        return torch.where(extended, 0.0, -10000.0)

    def forward(self, item_seq: torch.Tensor, item_seq_len: torch.Tensor,
                pos_items: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(L, device=item_seq.device).unsqueeze(0).expand_as(item_seq)
        x = self.LayerNorm(self.item_embedding(item_seq) + self.position_embedding(positions))
        mask = self.get_attention_mask(item_seq)
        for attention, ffn in zip(self.layers, self.ffn):
            if self.mask == "sdpa_tril":
                q, k, v = (t.view(B, L, HEADS, H // HEADS).transpose(1, 2)
                           for t in (attention.query(x), attention.key(x), attention.value(x)))
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                x = attention.LayerNorm(attention.dense(o.transpose(1, 2).reshape(B, L, H)) + x)
            else:
                x = attention(x, mask)
            x = x + F.gelu(ffn(x))
        index = (item_seq_len - 1).view(-1, 1, 1).expand(-1, -1, H)
        seq_output = x.gather(dim=1, index=index).squeeze(1)  # RecBole's gather_indexes
        logits = seq_output @ self.item_embedding.weight.t()
        return F.cross_entropy(logits, pos_items)


def batch(lengths: list[int], gen: torch.Generator, left: list[bool] | None = None,
          read: list[int] | None = None) -> tuple[torch.Tensor, ...]:
    """Item ids (0 = padding: each row's first ``lengths`` positions, its last where
    ``left``), the lengths the model reads at (``read``, or ``lengths``) and targets."""
    n = torch.tensor(lengths)
    real = torch.arange(L)[None, :] < n[:, None]
    for row, flip in enumerate(left or []):
        if flip:
            real[row] = real[row].flip(0)
    seq = torch.randint(1, ITEMS, (B, L), generator=gen) * real
    return seq, torch.tensor(read) if read is not None else n, \
        torch.randint(1, ITEMS, (B,), generator=gen)


def build(mask: str = "recbole") -> ModelSpec:
    torch.manual_seed(0)

    def make(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(step)
        return tuple(t.to(device) for t in batch([2, 1, 6, 4], gen))

    return ModelSpec(model=SASRec(mask), example_inputs=make(0), make_batch=make)


@functools.cache
def _graph(mask: str):  # noqa: ANN202
    gm, ctx, spec = compiled(ENTRY, {"mask": mask})
    return gm, ctx, entries_of(gm, ctx), spec


@pytest.mark.parametrize("mask", ["recbole", "sdpa_tril"])
def test_the_causal_key_mask_is_recognised(mask: str):
    """Intent: each layer is the causal key-padding attention over the boolean keep-mask
    (``item_seq != 0``), leaving its padding query rows zero, the gather checked with it;
    RecBole's where-form carries its finite drop (the fallback's formula) and is never NaN
    on an empty row; the history is one packed region; no warning from the jagged passes."""
    gm, ctx, entries, _ = _graph(mask)
    attentions = [e for e in entries if e["kind"] == "key_padding_attention"]
    assert len(attentions) == LAYERS
    by_name = {n.name: n for n in gm.graph.nodes}
    for attn in attentions:
        keep = by_name[attn["mask"]]
        assert keep.target is torch.ops.aten.ne.Scalar and attn["additive"] is False
        assert attn["causal"] is True and attn["zero_padding_queries"] is True
        if mask == "recbole":
            assert attn["finite_drop"] == -10000.0 and attn["nan_if_empty"] is False
            key = by_name[attn["k"]]  # the [B, H, L, d] keys the pass made a node of
            assert tuple(key.meta["val"].shape) == (B, HEADS, L, H // HEADS)
        else:
            assert "finite_drop" not in attn
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    assert region["mask"] == attentions[0]["mask"] and region["every_row"] is False
    assert [r["reader"] for r in region["reads"]] == ["gather"]
    assert not [w for w in ctx.warnings if "jagged" in w or "softmax" in w], ctx.warnings


def _hit(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Fresh random lengths 1..L, right-padded as RecBole pads: every read is kept."""
    return batch(torch.randint(1, L + 1, (B,), generator=gen).tolist(), gen)


def _miss(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Row 0 left-padded with two items (kept positions 4 and 5) read at its length - 1 =
    1: a padding query with no kept key at or before it, which eager attends over all L
    keys (the where-form's finite drop); row 2 empty (its gather reads position 0 of
    nothing kept); the rest fresh random lengths."""
    lengths = torch.randint(1, L + 1, (B,), generator=gen)
    lengths[0], lengths[2] = 2, 0
    read = lengths.clone()
    read[2] = 1
    return batch(lengths.tolist(), gen, left=[True, False, False, False],
                 read=read.tolist())


@pytest.mark.parametrize("mask", ["recbole", "sdpa_tril"])
def test_packed_on_kept_reads_the_models_formula_on_a_miss(mask: str):
    """The interpreter on fresh random batches: packed (the causal kernel on the region's
    tokens) when every read position is kept; the padded computation, counted as a missed
    read and the attentions' fallback, on a batch reading a padding query row that keeps
    no key; loss and every gradient equal to eager's either way."""
    gm, _, entries, spec = _graph(mask)
    gen = torch.Generator().manual_seed(fresh_seed())
    for packs, x in ((True, _hit(gen)), (False, _miss(gen))):
        guarded_step_against_eager(gm, entries, spec.model, x, packs)
        assert kpa.STATS.fallback == (0 if packs else LAYERS), kpa.STATS


def test_the_compiled_graph_packs_and_falls_back_to_the_formula():
    """Graph mode (the rewritten graph through torch.compile): a step that packs runs the
    causal kernel on the region's tokens, the missing step runs the padded graph whose
    attentions fall back to the model's where-formula; SGD steps equal eager's."""
    gm, _, entries, spec = _graph("recbole")
    executor = cpu_graph_executor(gm, spec.model, entries)
    assert executor.guard is not None and executor.not_applied == []
    gen = torch.Generator().manual_seed(fresh_seed())
    pt.GUARD_STATS.reset()
    kpa.STATS.reset()
    train_against_eager(executor, spec.model, [_hit(gen), _miss(gen)])
    assert pt.GUARD_STATS.as_dict() == {"calls": 2, "packed": 1, "padded": 1,
                                        "missed_reads": 1}
    assert kpa.STATS.fallback == LAYERS, kpa.STATS


def test_the_fallback_is_the_where_formula_not_a_causal_minus_inf():
    """The op's padded path with ``drop``: a query row with no kept key at or before it
    attends over all L keys (eager's ``where(keep & tril, 0, -1e4)``), which the ``-inf``
    causal formula does not (it attends over the keys up to the query); the rows with a
    kept key agree."""
    gen = torch.Generator().manual_seed(fresh_seed())
    q, k, v = (torch.randn(2, 1, L, 4, generator=gen) for _ in range(3))
    keep = torch.arange(L)[None, :] >= torch.tensor([[4], [0]])  # row 0 left-padded
    visible = keep[:, None, None, :] & torch.ones(L, L, dtype=torch.bool).tril()
    eager = torch.softmax(q @ k.transpose(-2, -1) * 0.5 + torch.where(visible, 0.0, -1e4),
                          -1) @ v
    got = kpa.padded_attention(q, k, v, keep, 0.5, True, False, True, drop=-1e4)
    torch.testing.assert_close(got, eager)
    minus_inf = kpa.padded_attention(q, k, v, keep, 0.5, True, False, True)
    assert not torch.allclose(minus_inf[0, :, 1:4].nan_to_num(), eager[0, :, 1:4])
    torch.testing.assert_close(minus_inf[:, :, 4:], eager[:, :, 4:])
