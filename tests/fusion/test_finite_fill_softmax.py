"""A written-out softmax whose padding keys are set to a finite value
(``scores.masked_fill(~keep, -1e9)``; ``-1e4``; DIN's ``-2 ** 32 + 1``; and TensorFlow's
idiom as ported, ``torch.where(keep, scores, paddings)`` with ``paddings`` a
``full_like``, a number, or DIN's ``ones_like(scores) * (-2 ** 32 + 1)``), over histories
with empty rows.

Why this is not the ``-inf`` case: a row that keeps no key has that one finite value on
every score, so eager's softmax is uniform over all ``L`` keys (the row's output is the
mean of its values), where ``-inf`` gives NaN and the jagged kernels 0. Before this file the
pass marked such an attention ``nan_if_empty`` and the compiled model returned NaN where
eager returned a number (found by a helper's review, s24). Now the entry carries the value
(``fill_value``), the op gives such rows the mean of their values
(``uniform_where_no_key``), its padded fallback fills with the value, and a packed region
holding it packs only when every row keeps a key (``every_row``). The ``where`` forms were
not matched at all before (``weights-read-by:full_like``: the filler reads the scores'
shape), so they stayed padded; they are now the same guarded attention. Compiled = eager,
loss and every gradient, in the interpreter and in graph mode, with and without empty
rows."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.triton import key_padding_attention as kpa
from torch import nn

from gemc.spec import ModelSpec
from tests.fusion.helpers import (
    compiled,
    cpu_graph_executor,
    entries_of,
    fresh_seed,
    item_history,
    run_against_eager,
    train_against_eager,
)

ENTRY = "tests/fusion/test_finite_fill_softmax.py:build"
B, L, ITEMS, E, HEADS = 4, 6, 30, 8, 2
FILLS = (-1e9, -1e4, -2.0 ** 32 + 1)
FORMS = ("masked_fill", "where_full_like", "where_number", "where_ones_like")


class Model(nn.Module):
    """Item embeddings, one self-attention written out with ``masked_fill(~keep, fill)``,
    read over every position (``read="sum"``: padding rows included, so the op computes
    every query row) or pooled under the mask (``"pool"``: a packed region); BCE."""

    def __init__(self, fill: float, read: str, form: str = "masked_fill") -> None:
        super().__init__()
        self.fill, self.read, self.form = fill, read, form
        self.item = nn.Embedding(ITEMS, E, padding_idx=0)
        self.qkv, self.out, self.head = nn.Linear(E, 3 * E), nn.Linear(E, E), nn.Linear(E, 1)

    def forward(self, seq: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        keep = seq != 0
        b, n = seq.shape
        x = self.item(seq)
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, E // HEADS).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(E // HEADS)
        key = keep[:, None, None, :]
        if self.form == "masked_fill":
            scores = scores.masked_fill(~key, self.fill)
        elif self.form == "where_full_like":
            scores = torch.where(key, scores, torch.full_like(scores, self.fill))
        elif self.form == "where_number":
            scores = torch.where(key, scores, self.fill)
        else:  # DIN as ported from TensorFlow: paddings = ones_like(scores) * (-2 ** 32 + 1)
            scores = torch.where(key, scores, torch.ones_like(scores) * self.fill)
        weights = scores.softmax(-1)
        y = x + self.out((weights @ v).transpose(1, 2).reshape(b, n, E))
        if self.read == "sum":
            h = y.sum(1)
        else:
            w = keep[..., None].to(y.dtype)
            h = (y * w).sum(1) / w.sum(1).clamp(min=1)
        return F.binary_cross_entropy_with_logits(self.head(h).squeeze(-1), target)


def batch(lengths: list[int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return item_history(lengths, gen, L, ITEMS)


def build(fill: float = -1e9, read: str = "sum", form: str = "masked_fill") -> ModelSpec:
    torch.manual_seed(0)

    def make(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(step)
        return tuple(t.to(device) for t in batch([2, 1, L, 3], gen))

    return ModelSpec(model=Model(fill, read, form), example_inputs=make(0), make_batch=make)


@functools.cache
def _graph(fill: float, read: str, form: str = "masked_fill"):  # noqa: ANN202
    gm, ctx, spec = compiled(ENTRY, {"fill": fill, "read": read, "form": form}, priced=False)
    return gm, entries_of(gm, ctx), spec


def _batches(seed: int) -> list[tuple[torch.Tensor, ...]]:
    """An empty row, then none, then two: each path of the op and the region."""
    gen = torch.Generator().manual_seed(seed)
    return [batch(lengths, gen) for lengths in ([2, 0, L, 3], [1, 4, L, 2], [0, 0, 5, L])]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("fill", FILLS)
def test_the_entry_carries_the_finite_fill(fill: float, form: str) -> None:
    """Intent: the guarded attention is no NaN-on-empty attention; it carries the value."""
    _, entries, _ = _graph(fill, "sum", form)
    (entry,) = [e for e in entries if e["kind"] == "key_padding_attention"]
    assert entry["fill_value"] == fill and not entry["nan_if_empty"]


@pytest.mark.parametrize("read", ["sum", "pool"])
@pytest.mark.parametrize("fill", FILLS)
def test_compiled_equals_eager_with_empty_rows(fill: float, read: str) -> None:
    """The interpreter's run: loss and every gradient equal eager's, empty rows included
    (they were NaN); a packed region with this attention runs padded on a batch with an
    empty row."""
    from gemc.backends.triton import packed_tokens as pt

    gm, entries, spec = _graph(fill, read)
    packed = [e for e in entries if e["kind"] == "packed_tokens"]
    if read == "pool":
        assert packed and packed[0]["every_row"]
    for b in _batches(fresh_seed()):
        pt.GUARD_STATS.reset()
        run_against_eager(gm, entries, spec.model, b)
        spec.model.zero_grad()
        if packed:
            empty = bool((b[0] != 0).sum(1).eq(0).any())
            assert pt.GUARD_STATS.packed == int(not empty), pt.GUARD_STATS.as_dict()


@pytest.mark.parametrize("form", FORMS[1:])
def test_where_forms_equal_eager_with_empty_rows(form: str) -> None:
    """The ``where`` spellings, read over every row: compiled = eager with empty rows."""
    gm, entries, spec = _graph(-2.0 ** 32 + 1, "sum", form)
    for b in _batches(fresh_seed()):
        run_against_eager(gm, entries, spec.model, b)
        spec.model.zero_grad()


@pytest.mark.parametrize("read", ["sum", "pool"])
def test_graph_mode_trains_as_eager_with_empty_rows(read: str) -> None:
    """Graph mode (the check ahead of the graph, the op or the region in it): SGD steps
    equal eager's on batches with and without empty rows."""
    gm, entries, spec = _graph(-1e9, read)
    model = Model(-1e9, read)
    model.load_state_dict(spec.model.state_dict())
    train_against_eager(cpu_graph_executor(gm, model, entries), model,
                        _batches(fresh_seed()))


@pytest.mark.parametrize("queries", ["every row", "jagged"])
def test_op_rows_without_a_key_are_the_mean_of_their_values(queries: str) -> None:
    """``key_padding_attention(fill_value=...)`` against the formula, forward and the three
    gradients: on every query row of a row with a kept key (``every row``) or on its kept
    query rows (``jagged``), and on every row of an empty one; the padded fallback (a
    prefix here, so the jagged path) is not needed for it."""
    gen = torch.Generator().manual_seed(fresh_seed())
    q, k, v = (torch.randn(3, 2, 5, 4, generator=gen, requires_grad=True) for _ in range(3))
    keep = torch.arange(5)[None, :] < torch.tensor([3, 0, 5])[:, None]
    every = queries == "every row"
    kpa.STATS.reset()
    out = kpa.key_padding_attention(q, k, v, keep, scale=0.5, zero_padding_queries=not every,
                                    fill_value=-1e9)
    assert kpa.STATS.fallback == 0
    scores = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~keep[:, None, None, :], -1e9)
    want = scores.softmax(-1) @ v
    rows = torch.ones(3, 5, dtype=torch.bool) if every else keep | ~keep.any(1, keepdim=True)
    rows = rows[:, None, :, None].expand(out.shape)
    torch.testing.assert_close(out[rows], want[rows])
    g = torch.randn(out.shape, generator=gen) * rows
    got = torch.autograd.grad(out, (q, k, v), g)
    ref = torch.autograd.grad(want, (q, k, v), g)
    for a, b, name in zip(got, ref, "qkv"):
        torch.testing.assert_close(a, b, msg=name)


def test_op_refuses_a_fill_it_cannot_mean() -> None:
    q = torch.zeros(1, 1, 2, 4)
    keep = torch.ones(1, 2, dtype=torch.bool)
    for kwargs in ({"fill_value": -math.inf}, {"fill_value": -1e9, "nan_if_empty": True}):
        with pytest.raises(ValueError, match="fill_value"):
            kpa.key_padding_attention(q, q, q, keep, **kwargs)
