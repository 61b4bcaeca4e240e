"""More spellings of the one-token-per-row readout (``passes/row_reads``): the slices that
keep the sequence dim (``y[:, -1:]``, ``y[:, c:c + 1]``, ``y.narrow(1, c, 1)``,
``y.narrow(1, -1, 1)``) and the readout over the batch flattened
(``y.reshape(B * L, E).index_select(0, arange(B) * L + lengths - 1)``, ``y.view(-1,
E)[arange(B) * L + lengths - 1]``, ``arange(0, B * L, L)`` as the row starts). Each was a
reader of the padding (the history stayed padded); now each is a checked reader: the region
packs when every row's position is a kept one and runs padded, counted, when one is not.
Compiled = eager, loss and every gradient, on fresh random batches, both outcomes."""

from __future__ import annotations

import functools

import pytest
import torch
from gemc.backends.triton import packed_tokens as pt

from gemc.guard_sample import read_positions
from gemc.spec import ModelSpec
from tests.fusion import test_row_readers as readers
from tests.fusion.helpers import (
    compiled,
    cpu_graph_executor,
    entries_of,
    fresh_seed,
    guarded_step_against_eager,
    packs_on_hits_against_eager,
    train_against_eager,
)

ENTRY = "tests/fusion/test_row_reader_forms.py:build"
B, L, E, C = readers.B, readers.L, readers.E, 2
aten = torch.ops.aten
# form -> (the reader's op, the position it reads: a constant, or None for lengths - 1,
# whether the history is left-padded: the last real token at L - 1)
FORMS = {
    "slice_last": (aten.slice.Tensor, L - 1, True),
    "slice_at": (aten.slice.Tensor, C, False),
    "slice_step": (aten.slice.Tensor, C, False),
    "narrow_at": (aten.narrow.default, C, False),
    "narrow_last": (aten.narrow.default, L - 1, True),
    "flat_index_select": (aten.index_select.default, None, False),
    "flat_index": (aten.index.Tensor, None, False),
    "flat_arange_step": (aten.index.Tensor, None, False),
}


class Readout(readers.Readout):
    """``test_row_readers``'s attention block, its token read in one of :data:`FORMS`."""

    def readout(self, y: torch.Tensor, lengths: torch.Tensor, keep: torch.Tensor
                ) -> torch.Tensor:
        rows = torch.arange(B, device=y.device)
        read = self.read
        if read == "slice_last":
            return y[:, -1:].squeeze(1)
        if read == "slice_at":
            return y[:, C:C + 1].squeeze(1)
        if read == "slice_step":  # one position kept by a step longer than the row
            return y[:, C::L].squeeze(1)
        if read == "narrow_at":
            return y.narrow(1, C, 1).squeeze(1)
        if read == "narrow_last":
            return y.narrow(1, -1, 1).squeeze(1)
        if read == "flat_index_select":
            return y.reshape(B * L, E).index_select(0, rows * L + (lengths - 1))
        if read == "flat_index":
            return y.view(-1, E)[rows * L + lengths - 1]
        if read == "flat_arange_step":
            starts = torch.arange(0, B * L, L, device=y.device)
            return y.reshape(-1, E)[lengths - 1 + starts]
        if read == "flat_no_row_starts":  # a flat index with no row term: not a readout
            return y.reshape(B * L, E)[lengths + L]
        # "flat_wrong_stride": rows * (L - 1): not each row's start
        return y.reshape(B * L, E)[rows * (L - 1) + lengths]


def batch(lengths: list[int], gen: torch.Generator, left: bool = False
          ) -> tuple[torch.Tensor, ...]:
    """``x``, the lengths and the keep mask (each row's first ``lengths`` positions, its
    last with ``left``)."""
    n = torch.tensor(lengths)
    keep = torch.arange(L)[None, :] < n[:, None]
    return torch.randn(B, L, E, generator=gen), n, keep.flip(1) if left else keep


def build(read: str = "slice_last", causal: bool = False) -> ModelSpec:
    left = FORMS.get(read, (None, None, False))[2]

    def make(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(step)
        return tuple(t.to(device) for t in batch([3, 4, 6, 5], gen, left))

    return ModelSpec(model=Readout(read, causal), example_inputs=make(0), make_batch=make)


@functools.cache
def _graph(read: str, causal: bool):  # noqa: ANN202
    gm, ctx, spec = compiled(ENTRY, {"read": read, "causal": causal})
    return gm, ctx, entries_of(gm, ctx), spec


@pytest.mark.parametrize("read", list(FORMS))
def test_each_form_is_a_checked_reader(read: str):
    """Intent: the region holds the history with the reader outside it, listed in its
    ``reads``: a slice or narrow at its one position resolved against ``L`` (keeping the
    dim), a flat read with the flat index and the row stride ``L`` over the merged dims;
    the attention is the guarded kernel leaving its padding query rows zero; no warning."""
    op, at, _ = FORMS[read]
    gm, ctx, entries, _ = _graph(read, False)
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    (attn,) = [e for e in entries if e["kind"] == "key_padding_attention"]
    (spec,) = region["reads"]
    assert attn["read_rows"] == [spec] and attn["zero_padding_queries"] is True
    by_name = {n.name: n for n in gm.graph.nodes}
    assert by_name[spec["reader"]].target is op
    assert spec["reader"] not in region["nodes"] and spec["source"] in region["nodes"]
    assert spec["wrap"] is False
    if at is not None:
        assert (spec["at"], spec["index"], spec["keepdim"]) == (at, None, True)
        assert spec["dims"] == [0, 1] and "stride" not in spec
    else:
        assert spec["at"] is None and spec["keepdim"] is False and spec["stride"] == L
        assert spec["dims"] == [0, 0]  # the batch and sequence dims merged, batch outer
        assert tuple(by_name[spec["index"]].meta["val"].shape) == (B,)
    assert not [w for w in ctx.warnings if "pack-jagged" in w], ctx.warnings


@pytest.mark.parametrize("read", ["flat_no_row_starts", "flat_wrong_stride"])
def test_a_flat_index_without_one_start_per_row_reads_over_representatives(read: str):
    """A flat index that is not ``arange(B) * L`` plus an offset (no row term; a stride
    other than ``L``) reads tokens of other rows by construction: no checked reader, so
    the history packs over padding representatives laid out from its source
    (``passes/pad_reps``: each row up to the last position that differs from its last),
    the reader outside the region reading the value scattered back (eager's padded one);
    the compiled graph trains as eager on fresh batches: packed where each row's padded
    rows are one value, padded where they are random (every row keeps all its positions:
    a layout as large as the padded tensor runs padded, without the conversions)."""
    gm, ctx, entries, spec = _graph(read, False)
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    assert (region["pad_rep"], region["rep_layout"], region["rep_sources"],
            region["reads"]) == (True, "sources", ["x"], [])
    assert not [w for w in ctx.warnings if "pack-jagged" in w], ctx.warnings
    gen = torch.Generator().manual_seed(fresh_seed())
    pt.GUARD_STATS.reset()
    x, lengths, keep = batch([1, 6, 2, 6], gen)
    equal = (torch.where(keep[..., None], x, torch.randn(B, 1, E, generator=gen)),
             lengths, keep)
    train_against_eager(cpu_graph_executor(gm, spec.model, entries), spec.model,
                        [batch([3, 4, 6, 5], gen), equal])
    assert pt.GUARD_STATS.as_dict() == {"calls": 2, "packed": 1, "padded": 1,
                                        "missed_reads": 0}


def _hit(read: str, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Fresh random lengths whose reader reads a kept token on every row: above ``C`` for
    a read at ``C``, 1..L otherwise (left-padded where the last position is read)."""
    _, at, left = FORMS[read]
    low = C + 1 if at == C else 1
    return batch(torch.randint(low, L + 1, (B,), generator=gen).tolist(), gen, left)


def _miss(read: str, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A batch with an empty history (row 2) and otherwise fresh random lengths 0..L: its
    reader reads a dropped position there (a flat read at ``2 * L - 1``: row 1's last slot,
    real in eager, which the check finds is not row 2's)."""
    _, _, left = FORMS[read]
    lengths = torch.randint(0, L + 1, (B,), generator=gen)
    lengths[0], lengths[2] = L, 0  # row 0 full: a flat read of row 0 stays in bounds
    return batch(lengths.tolist(), gen, left)


# (read, causal): a causal attention over left-padded rows has no key for their first
# queries (eager's NaN or zero, by torch version, is then at stake, not the reader)
CASES = [("slice_last", False), ("slice_at", True), ("slice_step", False),
         ("narrow_at", False), ("narrow_last", False), ("flat_index_select", True),
         ("flat_index", False), ("flat_arange_step", True)]


@pytest.mark.parametrize(("read", "causal"), CASES)
def test_packed_where_every_position_is_kept_padded_where_not(read: str, causal: bool):
    """The interpreter on fresh random batches: packed when every row's position is kept
    (read from the region's tokens: the source never scattered back), padded and counted
    as a missed read when one is not (a causal attention falls back with it); loss and
    every gradient equal to eager's either way."""
    gm, _, entries, spec = _graph(read, causal)
    gen = torch.Generator().manual_seed(fresh_seed())
    packs_on_hits_against_eager(gm, entries, spec.model,
                                [(True, _hit(read, gen)), (False, _miss(read, gen)),
                                 (True, _hit(read, gen))], causal)


@pytest.mark.parametrize("read", ["flat_index_select", "slice_at"])
def test_the_compiled_graph_reads_the_tokens_and_falls_back_on_a_miss(read: str):
    """Graph mode (the rewritten graph through torch.compile): a step that packs reads
    each row's token from the region's tokens (``_p_read_rows``: the flat index less each
    row's start, or the slice's one position), a step with an empty row runs the padded
    graph; SGD steps equal eager's."""
    gm, _, entries, spec = _graph(read, True)
    executor = cpu_graph_executor(gm, spec.model, entries)
    assert executor.guard is not None and executor.not_applied == []
    gen = torch.Generator().manual_seed(fresh_seed())
    pt.GUARD_STATS.reset()
    train_against_eager(executor, spec.model, [_miss(read, gen), _hit(read, gen),
                                               _hit(read, gen)])
    assert pt.GUARD_STATS.as_dict() == {"calls": 3, "packed": 2, "padded": 1,
                                        "missed_reads": 1}
    code = executor.module.code  # the last graph built: the packed one
    assert "_p_read_rows(" in code and "_p_scatter(" not in code


def test_a_flat_position_is_the_index_less_its_rows_start():
    """The flat form's positions: ``index[b] - b * L``; one landing in another row (an
    empty row's ``b * L - 1``, a length past ``L``) or outside every row is -1, a miss."""
    index = torch.tensor([5, 6 + 2, 12 - 1, 18 + 6])  # rows 0..3 of L = 6
    assert read_positions(index, None, 4, 6, False, stride=6).tolist() == [5, 2, -1, -1]
    assert read_positions(torch.tensor([-1, 6, 12, 18]), None, 4, 6, True,
                          stride=6).tolist() == [-1, 0, 0, 0]


def test_a_query_sliced_off_the_history_is_a_checked_reader():
    """``q[:, :, -1:]`` (a candidate's query taken from the history's last position, then
    attending over it: tests/fusion/key_padding_models.py's ``target``) reads position
    ``L - 1`` of each row: the history tower packs on a batch whose rows all keep it
    (left-padded, fresh random lengths 1..L) and runs padded, counted, on one that drops it
    on a row (right-padded); loss and every gradient equal to eager's."""
    from tests.fusion import key_padding_models as km

    gm, ctx, spec = compiled("tests/fusion/key_padding_models.py:build", {"form": "target"})
    entries = entries_of(gm, ctx)
    gen = torch.Generator().manual_seed(fresh_seed())
    for packs in (True, False):
        lengths = torch.randint(1, km.L + 1, (km.B,), generator=gen)
        lengths[0] = km.L - 2
        keep = torch.arange(km.L)[None, :] < lengths[:, None]
        x = (torch.randn(km.B, km.L, km.E, generator=gen), keep.flip(1) if packs else keep)
        guarded_step_against_eager(gm, entries, spec.model, x, packs)
