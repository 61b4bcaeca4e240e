"""Readers of one token per row (``passes/row_reads``) over a guarded history: RecBole's
``gather_indexes(out, lengths - 1)``, Hugging Face's ``out[arange(B), lengths - 1]`` and
``out[arange(B), keep.sum(1) - 1]``, ``out[:, 0]`` / ``out[:, -1]``. Each was a reader of
the padding (the history stayed padded, a causal attention stayed padded SDPA); now the
positions are checked with the key mask at run time: the region packs and the causal
kernel runs when every position is a kept one, and the padded computation runs, counted
(``GUARD_STATS.missed_reads``, the attention's fallback), when one is not. Compiled =
eager, loss and every gradient, on batches of fresh random padding, both outcomes."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.triton import key_padding_attention as kpa
from gemc.backends.triton import packed_tokens as pt
from torch import nn

from gemc.guard_sample import missed_reads, read_positions
from gemc.spec import ModelSpec
from tests.fusion.helpers import (
    compiled,
    cpu_graph_executor,
    entries_of,
    fresh_seed,
    packs_on_hits_against_eager,
    train_against_eager,
)

ENTRY = "tests/fusion/test_row_readers.py:build"
B, L, E, H = 4, 6, 8, 2
READS = ("gather", "index", "mask_sum", "first", "last")


class Readout(nn.Module):
    """One attention block over a padded history ``x`` under its keep mask (``causal``:
    and-ed with the causal mask), then one token per row scored, read as ``read`` says
    (:meth:`readout`; ``test_row_reader_forms`` reads it its own ways)."""

    def __init__(self, read: str, causal: bool) -> None:
        super().__init__()
        self.read, self.causal = read, causal
        self.norm = nn.LayerNorm(E)
        self.qkv = nn.Linear(E, 3 * E)
        self.out = nn.Linear(E, E)
        self.head = nn.Linear(E, 1)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, keep: torch.Tensor
                ) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).view(B, L, 3, H, E // H).permute(2, 0, 3, 1, 4)
        mask = keep[:, None, None, :]
        if self.causal:
            mask = mask & torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = x + F.gelu(self.out(o.transpose(1, 2).reshape(B, L, E)))
        return self.head(self.readout(y, lengths, keep)).square().mean()

    def readout(self, y: torch.Tensor, lengths: torch.Tensor, keep: torch.Tensor
                ) -> torch.Tensor:
        rows = torch.arange(B, device=y.device)
        if self.read == "gather":  # RecBole's gather_indexes
            index = (lengths - 1).view(-1, 1, 1).expand(-1, -1, y.shape[-1])
            return y.gather(dim=1, index=index).squeeze(1)
        if self.read == "index":
            return y[rows, lengths - 1]
        if self.read == "mask_sum":
            return y[rows, keep.sum(1) - 1]
        if self.read == "from_output":  # positions after the values: L - 1, computed late
            return y[rows, torch.ones_like(y[..., 0]).long().sum(1) - 1]
        return y[:, 0] if self.read == "first" else y[:, -1]


def batch(lengths: list[int], gen: torch.Generator, left: bool = False,
          keep: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """``x``, the lengths and the keep mask (each row's first ``lengths`` positions, its
    last with ``left``, or ``keep`` as given)."""
    n = torch.tensor(lengths)
    if keep is None:
        keep = torch.arange(L)[None, :] < n[:, None]
        keep = keep.flip(1) if left else keep
    return torch.randn(B, L, E, generator=gen), n, keep


def build(read: str = "gather", causal: bool = False) -> ModelSpec:
    def make(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        return tuple(t.to(device) for t in batch([2, 1, 6, 3],
                                                 torch.Generator().manual_seed(step)))

    return ModelSpec(model=Readout(read, causal), example_inputs=make(0), make_batch=make)


@functools.cache
def _graph(read: str, causal: bool):  # noqa: ANN202
    gm, ctx, spec = compiled(ENTRY, {"read": read, "causal": causal})
    return gm, ctx, entries_of(gm, ctx), spec


# (read, causal): the forms the numeric tests run (a causal attention with left padding
# has no key for its first queries: eager's NaN, not the reader, would be at stake)
CASES = [("gather", True), ("index", True), ("mask_sum", False), ("first", False),
         ("last", False)]


@pytest.mark.parametrize(("read", "causal"), [(r, c) for r in READS for c in (False, True)])
def test_a_one_token_reader_is_checked_not_refused(read: str, causal: bool):
    """Intent: the region holds the history (the reader outside it, listed in its
    ``reads`` with its positions: an index node, or a constant), the attention is the
    guarded kernel, causal too, leaving its padding query rows zero (``read_rows``: the
    op checks the same positions), and no pass warns."""
    gm, ctx, entries, _ = _graph(read, causal)
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    (attn,) = [e for e in entries if e["kind"] == "key_padding_attention"]
    assert attn["causal"] is causal and attn["zero_padding_queries"] is True
    (spec,) = region["reads"]
    assert attn["read_rows"] == [spec]
    by_name = {n.name: n for n in gm.graph.nodes}
    reader = by_name[spec["reader"]]
    aten = torch.ops.aten
    assert reader.target == {"gather": aten.gather.default, "first": aten.select.int,
                             "last": aten.select.int}.get(read, aten.index.Tensor)
    assert spec["reader"] not in region["nodes"] and spec["source"] in region["nodes"]
    assert spec["keepdim"] is (read == "gather") and spec["wrap"] is (read != "gather")
    if read in ("first", "last"):
        assert spec["index"] is None and spec["at"] == (0 if read == "first" else -1)
    else:  # the B positions in row order: lengths - 1 (under the gather's view and expand)
        index = by_name[spec["index"]]
        assert tuple(index.meta["val"].shape) == (B,) and index.target is aten.sub.Tensor
    assert region["compact"] is True  # (the kept positions' order kept, causal too)
    assert not [w for w in ctx.warnings if "jagged" in w or "pack-jagged" in w], ctx.warnings


def _miss(read: str, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A batch whose reader reads a padding token on some row: lengths one too long on a
    row, a mask that is no prefix (its kept count's last position dropped), the first
    position of a left-padded row, the last of a right-padded one."""
    if read in ("gather", "index"):
        x, n, keep = batch([2, 1, 6, 3], gen)
        return x, n + torch.tensor([0, 1, 0, 0]), keep
    if read == "mask_sum":
        keep = torch.arange(L)[None, :] < torch.tensor([2, 1, 6, 3])[:, None]
        keep[0] = torch.tensor([True, False, True, False, False, False])
        return batch([2, 1, 6, 3], gen, keep=keep)
    return batch([2, 1, 6, 3], gen, left=read == "first")


def _hit(read: str, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A batch of fresh random lengths (1..L) whose reader reads kept tokens only."""
    lengths = torch.randint(1, L + 1, (B,), generator=gen).tolist()
    return batch(lengths, gen, left=read == "last")


@pytest.mark.parametrize(("read", "causal"), CASES)
def test_packed_where_every_position_is_kept_padded_where_not(read: str, causal: bool):
    """The interpreter on fresh random batches: packed when every reader's position is
    kept (the reader then reads the region's tokens: its source is never scattered back),
    padded when one is not, counted as a missed read (a causal attention falls back with
    it); loss and every gradient equal to eager's either way."""
    gm, _, entries, spec = _graph(read, causal)
    gen = torch.Generator().manual_seed(fresh_seed())
    packs_on_hits_against_eager(gm, entries, spec.model,
                                [(True, _hit(read, gen)), (False, _miss(read, gen)),
                                 (True, _hit(read, gen))], causal)


def test_an_index_computed_from_the_history_reads_over_representatives():
    """Positions computed from values the padding reaches (here ``ones_like`` of the
    output, summed: its shape only, but after the values) could not be checked before the
    region: no checked reader, so the history packs over padding representatives laid out
    from its source (``passes/pad_reps``), the sum and the indexing outside the region
    reading the value scattered back (eager's padded one). The compiled graph trains as
    eager: packed where each row's padded rows are one value, padded where they are
    random (every row keeps all its positions)."""
    gm, ctx, entries, spec = _graph("from_output", False)
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    assert (region["pad_rep"], region["rep_layout"], region["reads"]) == \
        (True, "sources", [])
    (attn,) = [e for e in entries if e["kind"] == "key_padding_attention"]
    assert "read_rows" not in attn and attn["zero_padding_queries"] is False
    assert attn["nodes"][0] in region["rep_attentions"]
    assert not [w for w in ctx.warnings if "pack-jagged" in w], ctx.warnings
    gen = torch.Generator().manual_seed(fresh_seed())
    x, lengths, keep = batch([1, 6, 2, 3], gen)  # no empty row: eager's NaN there
    equal = (torch.where(keep[..., None], x, torch.randn(B, 1, E, generator=gen)),
             lengths, keep)
    pt.GUARD_STATS.reset()
    train_against_eager(cpu_graph_executor(gm, spec.model, entries), spec.model,
                        [equal, batch([3, 4, 6, 5], gen)])
    assert pt.GUARD_STATS.as_dict() == {"calls": 2, "packed": 1, "padded": 1,
                                        "missed_reads": 0}


def test_the_compiled_graph_reads_the_tokens_and_falls_back_on_a_miss():
    """Graph mode (the rewritten graph through torch.compile): the positions are computed
    ahead of the graph with the mask, by the region's check; a step that packs reads the
    token of each row from the region's tokens (``_p_read_rows``, no scatter of the
    output), a step whose lengths are one too long on a row runs the padded graph (the
    causal attention's own check falls back with it); SGD steps equal eager's."""
    gm, _, entries, spec = _graph("gather", True)
    executor = cpu_graph_executor(gm, spec.model, entries)
    assert executor.guard is not None and executor.not_applied == []
    gen = torch.Generator().manual_seed(fresh_seed())
    batches = [_miss("gather", gen), _hit("gather", gen), batch([2, 1, 6, 3], gen)]
    pt.GUARD_STATS.reset()
    kpa.STATS.reset()
    train_against_eager(executor, spec.model, batches)
    assert pt.GUARD_STATS.as_dict() == {"calls": 3, "packed": 2, "padded": 1,
                                        "missed_reads": 1}
    assert kpa.STATS.as_dict() == {"calls": 1, "jagged": 0, "compacted": 0, "fallback": 1}
    code = executor.module.code  # the last graph built: the packed one
    assert "_p_read_rows(" in code and "_p_scatter(" not in code


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("keepdim", [False, True])
def test_read_rows_is_the_padded_read_with_its_gradient(compact: bool, keepdim: bool):
    """``packed_tokens.read_rows`` on a region value equals reading the scattered value at
    each row's position, forward and backward, in a prefix layout (``offsets[b] + pos``)
    and in a compact one (kept positions in any order: the slot holding that position),
    with spare slots past the real tokens."""
    keep = torch.tensor([[1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1], [1, 0, 1, 0, 1, 1],
                         [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    if not compact:
        keep = torch.arange(L)[None, :] < keep.sum(1, keepdim=True)
    counts = keep.sum(1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    total = int(offsets[-1]) + 3  # spare slots
    positions = pt.kept_positions(keep, False, total) if compact else None
    layout = pt.TokenLayout(offsets, total, B, L, positions)
    x = torch.randn(2, 1, total, 5, requires_grad=True)  # [H, 1, T, D]: dims (1, 2)
    pos = torch.stack([torch.nonzero(row)[-1, 0] for row in keep])  # each row's last kept
    got = pt.read_rows(x, (1, 2), layout, pos, keepdim)
    padded = pt.scatter(x, (1, 2), layout)  # [H, B, L, D]
    want = padded[:, torch.arange(B), pos]  # [H, B, D]
    if keepdim:
        want = want.unsqueeze(2)
    torch.testing.assert_close(got, want)
    weights = torch.randn(want.shape)
    (grad,) = torch.autograd.grad((got * weights).sum(), x)
    (expected,) = torch.autograd.grad((want * weights).sum(), x)
    torch.testing.assert_close(grad, expected)


def test_positions_and_misses_follow_eagers_indexing_rules():
    """A negative position counts from the row's end where the reader wraps (indexing,
    ``select``), never for a gather (eager raises: the check fails, the padded path runs
    and raises as eager does); outside the row it is -1, a miss; a miss is any row whose
    position the mask drops."""
    index = torch.tensor([0, -1, 5, 6])
    assert read_positions(index, None, 4, 6, True).tolist() == [0, 5, 5, -1]
    assert read_positions(index, None, 4, 6, False).tolist() == [0, -1, 5, -1]
    assert read_positions(None, -1, 4, 6, True).tolist() == [5, 5, 5, 5]
    keep = torch.arange(6)[None, :] < torch.tensor([1, 6, 6, 6])[:, None]
    assert missed_reads(keep, [torch.tensor([0, 5, 5, 0])]).tolist() == [0]
    assert missed_reads(keep, [torch.tensor([1, 5, -1, 0]),
                               torch.tensor([0, 0, 0, 0])]).tolist() == [2]
