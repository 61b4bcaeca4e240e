"""Readers of one token per row after HSTU's pointwise attention over offsets: q, k and v
padded by ``index_put`` over the history's offsets (no mask: the keys' padding is v's
zeros), the attention's output run through more token-wise work, then one token per row
scored, as HSTU-style retrieval takes the user embedding at the last real position.

Such a reader was a reader of the attention's padding rows (the model's are nonzero where
a row has tokens, the kernel's 0), so the attention stayed the padded formula and nothing
was packed. Now (``passes/row_reads.kept_by_offsets`` with ``empty_rows``):

- every position of an empty row is 0 in the model's attention as in the kernel's, so a
  reader of a real token or of an empty row's position reads what the kernel gives:
  ``y[arange(B), lengths.clamp(min=1) - 1]``, ``y[:, 0]`` and the unclamped
  ``y[arange(B), lengths - 1]`` keep the kernel (listed in its ``reads``);
- the first two read slot 0 of an empty row, which a region laid out over the lengths
  clamped to 1 holds exactly: the region packs offset-proven (no check), the reader
  ``proven`` and read from the tokens (``packed_tokens.read_rows``);
- the unclamped ``lengths - 1`` reads position ``L - 1`` of an empty row (eager's ``-1``),
  which the same layout holds when that slot stands for position ``L - 1`` (``empty_last``;
  with a position embedding: ``test_silu_last_read.py``): packed as well, no check;
- the rows flattened (``y.reshape(B * L, E)[(lengths - 1) + arange(B) * L]``) read the
  previous row's last position on an empty row, padding the kernel gives as 0: refused.

Compiled = eager, loss and every gradient, on fresh random lengths with empty and full
rows, in the interpreter and in graph mode."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.triton import packed_tokens as pt
from gemc.backends.triton.kinds import attention as attention_kinds
from torch import nn

from gemc.spec import ModelSpec
from tests.fusion.helpers import (
    compiled,
    cpu_graph_executor,
    entries_of,
    fresh_seed,
    lengths_of_total,
    run_against_eager,
    train_against_eager,
    values_batch,
)

ENTRY = "tests/fusion/test_silu_row_readers.py:build"
B, L, E, H = 4, 6, 8, 2
TOKENS = 12  # the captured batch's token count (the graph's static shapes hold it)
PROVEN = ("last", "first")
PACKED = (*PROVEN, "last_unclamped")
aten = torch.ops.aten


class HstuLastToken(nn.Module):
    """Values + offsets; u, v, q, k from one projection; q, k, v padded by ``index_put``
    over the offsets (HSTU's ``jagged_to_padded_dense``); ``silu(q k^T + rab) / L`` under
    a float ``tril``; ``u * layer_norm(attn)`` projected, plus the padded input; the user
    embedding read at ``read``: ``last`` (``lengths.clamp(min=1) - 1``), ``last_unclamped``
    (``lengths - 1``), ``first`` (position 0), ``flat`` (generative-recommenders'
    ``get_current_embeddings``: the rows flattened, ``(lengths - 1) + arange(B) * L``)."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.read = read
        self.uvqk = nn.Linear(E, 4 * E)
        self.rel = nn.Parameter(torch.randn(2 * L - 1) * 0.1)
        self.o = nn.Linear(E, E)
        self.head = nn.Linear(E, 1)

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, labels: torch.Tensor
                ) -> torch.Tensor:
        b, n = offsets.numel() - 1, values.shape[0]
        lengths = offsets[1:] - offsets[:-1]
        row = torch.repeat_interleave(torch.arange(b, device=values.device), lengths,
                                      output_size=n)
        col = torch.arange(n, device=values.device) - offsets[:-1][row]
        u, v, q, k = F.silu(self.uvqk(values)).split(E, -1)

        def padded(t: torch.Tensor) -> torch.Tensor:
            return t.new_zeros(b, L, t.shape[-1]).index_put((row, col), t)

        pq, pk, pv = (padded(t).view(b, L, H, E // H) for t in (q, k, v))
        s = torch.einsum("bnhd,bmhd->bhnm", pq, pk)
        pos = torch.arange(L, device=values.device)
        s = s + self.rel[pos[None, :] - pos[:, None] + L - 1]
        a = F.silu(s) / L * torch.tril(torch.ones(L, L, device=values.device))[None, None]
        o = torch.einsum("bhnm,bmhd->bnhd", a, pv).reshape(b, L, E)
        y = self.o(padded(u) * F.layer_norm(o, (E,))) + padded(values)
        rows = torch.arange(b, device=values.device)
        if self.read == "last":
            user = y[rows, lengths.clamp(min=1) - 1]
        elif self.read == "last_unclamped":
            user = y[rows, lengths - 1]
        elif self.read == "flat":
            user = y.reshape(b * L, E)[(lengths - 1) + rows * L]
        else:
            user = y[:, 0]
        return F.mse_loss(self.head(user).squeeze(-1), labels)


def batch(lengths: list[int], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return values_batch(lengths, E, gen)


def build(read: str = "last") -> ModelSpec:
    def make(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        return tuple(t.to(device) for t in batch([2, 1, 6, 3],
                                                 torch.Generator().manual_seed(step)))

    return ModelSpec(model=HstuLastToken(read), example_inputs=make(0), make_batch=make)


def lengths_with(gen: torch.Generator, empty: bool) -> list[int]:
    return lengths_of_total(gen, B, L, TOKENS, empty)


@functools.cache
def _graph(read: str):  # noqa: ANN202
    gm, ctx, spec = compiled(ENTRY, {"read": read})
    return gm, ctx, entries_of(gm, ctx), spec


@pytest.mark.parametrize("read", PROVEN)
def test_a_reader_of_a_real_token_or_slot_0_packs_the_tower_unchecked(read: str):
    """Intent: the silu kernel is kept, listing the reader; the region (sources q, k, v)
    is offset-proven (no guard) over the lengths clamped to 1 (an empty row keeps slot
    0), the reader ``proven``, outside the region, reading a region value; no warning."""
    gm, ctx, entries, _ = _graph(read)
    (attn,) = [e for e in entries if e["kind"] == "jagged_silu_attention"]
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    assert attn["offsets"] == "offsets" and attn["mask"] is None
    assert region.get("guard") is None and region["offsets"] == "offsets"
    assert region["clamp_min"] == 1 and len(region["sources"]) == 3
    assert not any(s["in_order"] for s in region["sources"])  # slot 0 of an empty row
    (spec,) = region["reads"]
    assert spec["proven"] is True and attn["reads"] == [spec]
    assert spec["reader"] not in region["nodes"] and spec["source"] in region["nodes"]
    assert attn["output"] in region["nodes"]
    by_name = {n.name: n for n in gm.graph.nodes}
    reader = by_name[spec["reader"]]
    if read == "first":
        assert reader.target is aten.select.int and spec["at"] == 0 and spec["index"] is None
    else:  # lengths.clamp(min=1) - 1
        index = by_name[spec["index"]]
        assert reader.target is aten.index.Tensor and index.target is aten.sub.Tensor
        assert index.args[0].target is aten.clamp.default
    assert not [w for w in ctx.warnings if "silu" in w or "jagged" in w], ctx.warnings


def test_unclamped_last_token_packs_with_empty_rows_at_their_last_position():
    """Intent: ``lengths - 1`` reads a real token or position ``L - 1`` of an empty row
    (where the model's attention is 0, as the kernel's): the kernel is kept, listing the
    reader; the tower packs offset-proven over the lengths clamped to 1, each empty row's
    slot standing for position ``L - 1`` (``empty_last``), the reader ``proven``; no
    warning."""
    _, ctx, entries, _ = _graph("last_unclamped")
    (attn,) = [e for e in entries if e["kind"] == "jagged_silu_attention"]
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    (spec,) = attn["reads"]
    assert spec["reader"] == "index_2" and spec["index"] is not None
    assert region["clamp_min"] == 1 and region["empty_last"] is True
    assert region.get("guard") is None and region["reads"] == [spec]
    assert not [w for w in ctx.warnings if "pack-jagged-tokens" in w], ctx.warnings


def test_flattened_rows_reading_another_row_stay_the_padded_formula():
    """Intent: over the rows flattened, an empty row's ``lengths - 1`` reads the previous
    row's last position (padding, nonzero in the model, 0 in the kernel): refused,
    named."""
    _, ctx, entries, _ = _graph("flat")
    assert not [e for e in entries if e["kind"] in ("jagged_silu_attention", "packed_tokens")]
    assert any("match-silu-attention" in w and "padding-rows-read-by:index_2" in w
               for w in ctx.warnings), ctx.warnings


def _on_tokens(mp: pytest.MonkeyPatch) -> list[str]:
    """Record each call of the silu attention on a region's tokens."""
    ran: list[str] = []
    on_tokens = attention_kinds.silu_attention_of_tokens

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        ran.append("tokens")
        return on_tokens(*args, **kwargs)

    mp.setattr(attention_kinds, "silu_attention_of_tokens", spy)
    return ran


@pytest.mark.parametrize("read", PACKED)
def test_readers_after_the_silu_attention_match_eager(read: str):
    """The interpreter on fresh random lengths (an empty row, a full one): loss and every
    gradient equal to eager's; a proven reader's region runs on the tokens unchecked and
    reads them (its source never scattered back)."""
    gm, _, entries, spec = _graph(read)
    gen = torch.Generator().manual_seed(fresh_seed())
    source = next((e["reads"][0]["source"] for e in entries if e["kind"] == "packed_tokens"),
                  None)
    for empty in (True, False, True):
        pt.GUARD_STATS.reset()
        with pytest.MonkeyPatch.context() as mp:
            ran = _on_tokens(mp)
            runner = run_against_eager(gm, entries, spec.model,
                                       batch(lengths_with(gen, empty), gen), release=False)
        spec.model.zero_grad()
        assert pt.GUARD_STATS.calls == 0  # nothing checked
        assert ran == ["tokens"]
        if source is not None:
            assert source not in {n.name for n in runner._unpacked}


def test_the_compiled_graph_trains_as_eager():
    """Graph mode: no check ahead of the graph; the proven reader reads the region's
    tokens (``_p_read_rows``, no scatter), the attention on them; SGD steps on fresh
    random lengths with empty and full rows equal eager's. (The unclamped reader's graph
    mode, with a position embedding that tells the empty rows' slot position apart:
    ``test_silu_last_read.py``.)"""
    gm, _, entries, spec = _graph("last")
    executor = cpu_graph_executor(gm, spec.model, entries)
    assert executor.guard is None and executor.not_applied == []
    gen = torch.Generator().manual_seed(fresh_seed())
    pt.GUARD_STATS.reset()
    train_against_eager(executor, spec.model,
                        [batch(lengths_with(gen, e), gen) for e in (True, False)])
    assert pt.GUARD_STATS.calls == 0
    code = executor.module.code
    assert "_p_read_rows(" in code and "_p_scatter(" not in code
    assert "silu_attention_of_tokens(" in code
