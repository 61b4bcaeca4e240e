"""Readers of one token per row in an offset-proven region: a jagged history padded by
``index_put`` over its offsets, one attention block under ``arange(L) < lengths.clamp(min=1)``
over those offsets, then one token per row scored, as SASRec-style models take the last
real position as the user embedding.

Such a reader was a reader of the padding: the attention stayed the guarded kernel and the
history padded ("no-history-input"). Now (``passes/row_reads.kept_by_offsets``):

- ``out[arange(B), attn_len - 1]`` (the mask's own clamped lengths) and ``out[:, 0]`` read a
  real token on every row, which the graph proves: the region stays offset-proven (no
  check, the jagged attention kept) and lists the reader (``proven``); the runners read
  it from the packed tokens (``packed_tokens.read_rows``), never scattering the output
  back;
- ``out[arange(B), lengths - 1]`` (unclamped: ``-1`` on an empty row, which eager reads at
  position ``L - 1``, a padding token) and ``out[:, -1]`` are data: the region is a
  guarded one started at the ``index_put``, its mask and the reader's positions checked
  per call; a call where a row reads padding runs padded, counted
  (``GUARD_STATS.missed_reads``).

Compiled = eager, loss and every gradient, on fresh random lengths with empty and full
rows, in the interpreter and in graph mode."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.triton import packed_tokens as pt
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

ENTRY = "tests/fusion/test_offset_row_readers.py:build"
B, L, D, H = 4, 6, 8, 2
TOKENS = 12  # the captured batch's token count (the graph's static shapes hold it)
PROVEN = ("last", "first")
CHECKED = ("last_unclamped", "final")
aten = torch.ops.aten


class LastToken(nn.Module):
    """Values + offsets padded to ``[B, L, D]``, one post-LN attention block under the key
    mask of the clamped lengths (``causal``: and-ed with the causal mask), and the token
    ``read`` names scored: ``last`` the row's last real one by the mask's lengths,
    ``last_unclamped`` by the raw lengths, ``first`` position 0, ``final`` position
    ``L - 1``."""

    def __init__(self, read: str, causal: bool) -> None:
        super().__init__()
        self.read, self.causal = read, causal
        self.item = nn.Linear(D, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 1)

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, labels: torch.Tensor
                ) -> torch.Tensor:
        b, n = offsets.shape[0] - 1, values.shape[0]
        lengths = offsets[1:] - offsets[:-1]
        row = torch.repeat_interleave(torch.arange(b, device=values.device), lengths,
                                      output_size=n)
        pos = torch.arange(n, device=values.device) - offsets[row]
        seq = values.new_zeros(b, L, D).index_put((row, pos), self.item(values))
        attn_len = lengths.clamp(min=1)
        mask = torch.arange(L, device=values.device)[None, :] < attn_len[:, None]
        mask = mask[:, None, None, :]
        if self.causal:
            mask = mask & torch.ones(L, L, dtype=torch.bool, device=values.device).tril()
        q, k, v = self.qkv(seq).view(b, L, 3, H, D // H).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = self.norm(seq + F.gelu(self.out(a.transpose(1, 2).reshape(b, L, D))))
        rows = torch.arange(b, device=values.device)
        if self.read == "last":
            user = y[rows, attn_len - 1]
        elif self.read == "last_unclamped":
            user = y[rows, lengths - 1]
        else:
            user = y[:, 0] if self.read == "first" else y[:, -1]
        return F.mse_loss(self.head(user).squeeze(-1), labels)


def batch(lengths: list[int], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return values_batch(lengths, D, gen)


def build(read: str = "last", causal: bool = False) -> ModelSpec:
    def make(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        return tuple(t.to(device) for t in batch([2, 1, 6, 3],
                                                 torch.Generator().manual_seed(step)))

    return ModelSpec(model=LastToken(read, causal), example_inputs=make(0), make_batch=make)


def lengths_with(gen: torch.Generator, empty: bool) -> list[int]:
    return lengths_of_total(gen, B, L, TOKENS, empty)


@functools.cache
def _graph(read: str, causal: bool = False):  # noqa: ANN202
    gm, ctx, spec = compiled(ENTRY, {"read": read, "causal": causal})
    return gm, ctx, entries_of(gm, ctx), spec


@pytest.mark.parametrize("read", PROVEN)
def test_a_reader_the_offsets_prove_real_keeps_the_region_unchecked(read: str):
    """Intent: the jagged attention is kept, the region is offset-proven (no guard) and
    lists the reader, ``proven``, its positions the mask's clamped lengths minus one (or
    position 0); the reader is outside the region and reads a region value; no warning."""
    gm, ctx, entries, _ = _graph(read)
    kinds = [e["kind"] for e in entries]
    assert "jagged_attention" in kinds and "key_padding_attention" not in kinds, kinds
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    assert region.get("guard") is None and region["offsets"] == "offsets"
    assert region["clamp_min"] == 1
    (spec,) = region["reads"]
    assert spec["proven"] is True
    assert spec["reader"] not in region["nodes"] and spec["source"] in region["nodes"]
    by_name = {n.name: n for n in gm.graph.nodes}
    reader = by_name[spec["reader"]]
    if read == "first":
        assert reader.target is aten.select.int and spec["at"] == 0 and spec["index"] is None
    else:  # attn_len - 1, attn_len the clamp that builds the mask
        index = by_name[spec["index"]]
        assert reader.target is aten.index.Tensor and index.target is aten.sub.Tensor
        assert index.args[0].target is aten.clamp.default
    assert not [w for w in ctx.warnings if "jagged" in w], ctx.warnings


@pytest.mark.parametrize("read", CHECKED)
def test_a_reader_the_offsets_do_not_prove_real_is_checked(read: str):
    """Intent: ``lengths - 1`` of a possibly empty row, and position ``L - 1``, may read
    padding: the attention is the guarded kernel listing the reader (``read_rows``), the
    region a guarded one from the padded history's ``index_put``, checking the mask
    built over the offsets and the reader's positions (listed, not ``proven``)."""
    gm, ctx, entries, _ = _graph(read)
    (attn,) = [e for e in entries if e["kind"] == "key_padding_attention"]
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    assert region["guard"] == "prefix-check"
    by_name = {n.name: n for n in gm.graph.nodes}
    assert by_name[region["padded_from"]].target is aten.index_put.default
    assert by_name[region["mask"]].target is aten.lt.Tensor
    (spec,) = region["reads"]
    assert "proven" not in spec and attn["read_rows"] == [spec]
    assert spec["source"] in region["nodes"]
    if read == "final":
        assert spec["at"] == -1 and spec["index"] is None
    assert not [w for w in ctx.warnings if "pack-jagged-tokens" in w], ctx.warnings
    # the attention's warning names the reader as checked, not as reading padding unmasked
    (why,) = [w for w in ctx.warnings if "match-jagged-attention" in w]
    assert f"{spec['reader']} reads one token per row" in why and "unmasked" not in why


def test_a_causal_history_padded_over_offsets_packs_as_a_guarded_region():
    """Intent: a causal attention is never ``jagged_attention``; its history padded over
    offsets (it stayed padded: "no-history-input") is now a guarded region around the
    causal guarded kernel, its reader (proven by the offsets, checked with the mask
    all the same) listed."""
    _, ctx, entries, _ = _graph("last", True)
    (attn,) = [e for e in entries if e["kind"] == "key_padding_attention"]
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    assert attn["causal"] is True and region["guard"] == "prefix-check"
    assert region["in_place"] and region["reads"] == attn["read_rows"]
    assert not [w for w in ctx.warnings if "pack-jagged-tokens" in w], ctx.warnings


def _proven_steps(read: str) -> None:
    gm, _, entries, spec = _graph(read)
    gen = torch.Generator().manual_seed(fresh_seed())
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    source = region["reads"][0]["source"]
    for empty in (True, False, True):
        pt.GUARD_STATS.reset()
        runner = run_against_eager(gm, entries, spec.model, batch(lengths_with(gen, empty), gen),
                                   release=False)
        spec.model.zero_grad()
        assert source not in {n.name for n in runner._unpacked}  # read from the tokens
        assert pt.GUARD_STATS.calls == 0  # nothing checked


@pytest.mark.parametrize("read", PROVEN)
def test_proven_readers_read_the_tokens_and_match_eager(read: str):
    """The interpreter on fresh random lengths (an empty row, a full one): the region runs
    packed unchecked, the reader reads the region's tokens (its source is never scattered
    back), loss and every gradient equal to eager's."""
    _proven_steps(read)


@pytest.mark.parametrize("read", CHECKED)
def test_checked_readers_pack_on_real_tokens_and_fall_back_on_padding(read: str):
    """The interpreter: a batch whose every read position is a real token runs packed
    (the reader from the tokens: its source never scattered back); one with an empty row
    (``lengths - 1`` reads its position ``L - 1``) or, for ``out[:, -1]``, any row shorter
    than ``L`` (every batch of the captured total has one) runs padded, counted as a missed
    read; loss and every gradient equal to eager's either way."""
    gm, _, entries, spec = _graph(read)
    gen = torch.Generator().manual_seed(fresh_seed())
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    source = region["reads"][0]["source"]
    for empty in (True, False, True):
        packs = not empty and read == "last_unclamped"
        pt.GUARD_STATS.reset()
        runner = run_against_eager(gm, entries, spec.model, batch(lengths_with(gen, empty), gen),
                                   release=False)
        spec.model.zero_grad()
        assert pt.GUARD_STATS.as_dict() == {"calls": 1, "packed": int(packs),
                                            "padded": int(not packs),
                                            "missed_reads": int(not packs)}
        assert not packs or source not in {n.name for n in runner._unpacked}


def test_the_compiled_graph_reads_proven_tokens_unchecked():
    """Graph mode: no check ahead of the graph (the region is offset-proven), the reader
    reads the tokens (``_p_read_rows``, no scatter of the output); SGD steps on fresh
    random lengths with empty and full rows equal eager's."""
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


def test_the_compiled_graph_checks_unproven_positions_and_falls_back_counted():
    """Graph mode: the mask over the offsets and ``lengths - 1`` are computed ahead of the
    graph by the region's check; a step with an empty row runs the padded graph, counted
    as a missed read, a step without one the packed graph reading the tokens; SGD steps
    equal eager's."""
    gm, _, entries, spec = _graph("last_unclamped")
    executor = cpu_graph_executor(gm, spec.model, entries)
    assert executor.guard is not None and executor.not_applied == []
    gen = torch.Generator().manual_seed(fresh_seed())
    pt.GUARD_STATS.reset()
    train_against_eager(executor, spec.model,
                        [batch(lengths_with(gen, e), gen) for e in (True, False)])
    assert pt.GUARD_STATS.as_dict() == {"calls": 2, "packed": 1, "padded": 1,
                                        "missed_reads": 1}
    code = executor.module.code  # the last graph built: the packed one
    assert "_p_read_rows(" in code
