"""Padding as one weighted token per row (``passes/pad_reps``): a history no attention reads
whose padded tokens only reductions over the token axis read (DIN's Dice: mean and biased
variance over all B*L rows) packs over its real tokens plus one representative per row
with padding, weighted by the row's padding count, wherever each row's padded source
entries are equal (checked per call; a miss runs padded, counted).

The embeddings are re-drawn at a trained model's scale (N(0, 1)): at DIN's own 1e-4 init
the statistics barely move the loss, and unweighted statistics (every representative
counted once) would pass eager's tolerances (checked while writing this: the loss is off
by 1.5e-4 at N(0, 1), within 1e-5 at 1e-4)."""

from __future__ import annotations

import torch
from gemc.passes.match_jagged_attention import MatchJaggedAttention
from gemc.passes.pack_jagged_tokens import PackJaggedTokens
from torch import nn

from examples.zoo import din
from gemc import ir
from gemc.guard_sample import padding_reps
from gemc.spec import ModelSpec
from tests.fusion.helpers import (
    MaxDice,
    RowDice,
    compiled,
    cpu_graph_executor,
    din_with,
    entries_of,
    fresh_seed,
    run_against_eager,
    train_against_eager,
)
from tests.passes.helpers import annotated, graph_of

PASSES = (MatchJaggedAttention(), PackJaggedTokens())
B, L, D, ROWS = 6, 5, 4, 30


def _region(entries: list[dict]) -> dict:
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    return region


def _stats():
    from gemc.backends.triton import packed_tokens as pt

    pt.GUARD_STATS.reset()
    return pt.GUARD_STATS


def _trained_scale(model: nn.Module) -> None:
    for table in (model.goods_emb, model.cate_emb):
        nn.init.normal_(table.weight)


def _din_batches(count: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """DIN's own tiny batches (lengths 0..L, an empty and a full row each, padded ids 0)."""
    return [din._batch(din.PRESETS["tiny"], step, seed, "cpu") for step in range(count)]


def _unequal(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``batch`` with one padded id of the empty row changed: its padded ids now differ."""
    goods = batch[0].clone()
    assert int(batch[2][0]) == 0
    goods[0, -1] = 7
    return (goods, *batch[1:])


# ---- the pass ---------------------------------------------------------------------------------


def test_padding_reps_counts_rows_whose_padded_entries_differ():
    lengths = torch.tensor([0, 3, 5, 2])
    ids = torch.tensor([[4, 4, 4, 4, 4], [1, 2, 3, 0, 0], [1, 2, 3, 4, 5], [9, 8, 0, 1, 0]])
    feats = torch.zeros(4, 5, 2)
    feats[1, 3:] = torch.tensor([1.0, 2.0])  # equal within the row: fine
    # row 3's padded ids are 0, 1, 0 (differ); rows with padding: 0, 1, 3
    assert padding_reps(lengths, [ids, feats], 5).tolist() == [1, 3]
    feats[0, 4, 1] = float("nan")  # never equal to itself: row 0 differs too
    assert padding_reps(lengths, [ids, feats], 5).tolist() == [2, 3]


def test_representative_weights_follow_from_the_offsets():
    from gemc.backends.triton import packed_tokens as pt

    lengths = torch.tensor([0, 5, 2, 4])  # L = 5: empty, full, padded, one padded position
    offsets = pt.rep_offsets(lengths, 5)
    layout = pt.with_rep_weights(pt.TokenLayout(offsets, 12 + 2, 4, 5))  # 2 spare slots
    assert offsets.tolist() == [0, 1, 6, 9, 14]
    assert layout.weights.tolist() == [5, 1, 1, 1, 1, 1, 1, 1, 3, 1, 1, 1, 1, 1]
    room = pt.with_rep_weights(pt.TokenLayout(offsets, 16, 4, 5))
    assert room.weights[14:].tolist() == [0, 0]  # spare slots stand for nothing
    assert float(layout.weights.sum()) == 4 * 5


def test_din_packs_with_representatives_and_weighs_dice():
    spec = din.build("tiny")
    gm, ctx = graph_of(spec.model, spec.example_inputs, annotated(*PASSES))
    assert not [w for w in ctx.warnings if w.startswith("pack-jagged-tokens")], ctx.warnings
    (head,) = [n for n in gm.graph.nodes if ir.PACKED_REGION in n.meta]
    region = head.meta[ir.PACKED_REGION]
    assert (region["pad_rep"], region["rep_sources"], region["compact"], region["starts"]) == \
        (True, ["hist_goods", "hist_cates"], False, ["embedding", "embedding_1"])
    # Dice's batch statistics of both hidden layers, biased (correction 0), over the
    # merged B*L dim of x.reshape(-1, d)
    assert [(w["node"], w["op"], w["dims"], w["correction"]) for w in region["weighted"]] == \
        [("mean", "mean", [0], 0.0), ("var", "var", [0], 0.0),
         ("mean_1", "mean", [0], 0.0), ("var_1", "var", [0], 0.0)]
    marked = {n.name for n in gm.graph.nodes if ir.PACKED in n.meta}
    # the activation unit's three GEMMs run on the region's tokens; the statistics do not
    assert {"linear", "linear_1", "linear_2"} <= marked
    assert not {"mean", "var", "mean_1", "var_1"} & marked


# ---- numerics: the interpreter and the compiled graph -----------------------------------------


def test_zoo_din_runs_packed_with_representatives_as_eager():
    gm, ctx, spec = compiled("examples.zoo.din:build")
    _trained_scale(spec.model)
    region = _region(entries_of(gm, ctx))
    lengths = spec.example_inputs[2]
    # priced at its real tokens plus one per row with padding (the sample's)
    assert region["fill_source"] == "sample batch"
    assert region["sample_tokens"] == int(lengths.sum()) + int((lengths < 8).sum())
    stats = _stats()
    for batch in _din_batches(3, fresh_seed()):
        runner = run_against_eager(gm, entries_of(gm, ctx), spec.model, batch, release=False)
        spec.model.zero_grad()
        (layout,) = [v for k, v in runner._layouts.items() if k[3] == region["name"]]
        assert layout.total == int(batch[2].sum()) + int((batch[2] < 8).sum())
    assert stats.as_dict() == {"calls": 3, "packed": 3, "padded": 0, "missed_reads": 0}


def test_unequal_padded_ids_run_padded_counted_and_equal_eager():
    gm, ctx, spec = compiled("examples.zoo.din:build")
    _trained_scale(spec.model)
    batch = _unequal(_din_batches(1, fresh_seed())[0])
    stats = _stats()
    runner = run_against_eager(gm, entries_of(gm, ctx), spec.model, batch)
    assert stats.as_dict() == {"calls": 1, "packed": 0, "padded": 1, "missed_reads": 0,
                               "unequal_padding": 1}
    assert not runner.packed  # every region node ran padded


def test_zoo_din_compiled_graph_packs_and_falls_back_as_eager():
    """The compiled (Inductor) graph: the check ahead of it finds two batches equal within
    their rows (packed at real tokens + representatives, bucketed) and one not (padded,
    counted); every loss and gradient as eager's, over three SGD steps."""
    gm, ctx, spec = compiled("examples.zoo.din:build")
    _trained_scale(spec.model)
    executor = cpu_graph_executor(gm, spec.model, entries_of(gm, ctx))
    assert executor.guard is not None and executor.guard.names == ["packed_tokens_0"]
    assert executor.not_applied == []
    good = _din_batches(2, fresh_seed())
    stats = _stats()
    train_against_eager(executor, spec.model, [good[0], _unequal(good[1]), good[1]])
    assert stats.as_dict() == {"calls": 3, "packed": 2, "padded": 1, "missed_reads": 0,
                               "unequal_padding": 1}


class TokenStats(nn.Module):
    """A DIN-like scorer over an id history and a float feature history, normalised by
    statistics over every token: a plain sum over the B*L rows, an unbiased variance over
    the (B, L) dims kept, a biased std, and the mean of all elements; scores masked and
    sum-pooled. Each reads the padded tokens in eager."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, D)
        self.unit = nn.Linear(2 * D, 8)
        self.score = nn.Linear(8, 1)

    def forward(self, hist: torch.Tensor, feats: torch.Tensor, lengths: torch.Tensor,
                cand: torch.Tensor) -> torch.Tensor:
        length = hist.size(1)
        keep = (torch.arange(length)[None, :] < lengths[:, None]).float()
        x = torch.cat([self.emb(hist) + feats,
                       self.emb(cand).unsqueeze(1).expand(-1, length, -1)], -1)
        h = self.unit(x)
        flat = h.reshape(-1, h.size(-1))
        centre = flat.sum(0) / flat.shape[0]
        spread = h.var(dim=(0, 1), keepdim=True)  # unbiased
        scale = h.std(dim=(0, 1), correction=0)
        g = torch.tanh((h - centre) / (spread + 1e-3).sqrt()) * (1 + h.mean()) / (scale + 1)
        scores = self.score(g).squeeze(-1) * keep
        pooled = (scores.unsqueeze(-1) * feats).sum(1)
        return pooled.square().mean()


def _stats_batch(seed: int, equal: bool = True) -> tuple[torch.Tensor, ...]:
    """Lengths 0..L (an empty and a full row); each row's padded ids one random id and its
    padded features one random vector (equal within the row, not across rows); with
    ``equal`` False, one padded feature of the empty row differs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, L + 1, (B,), generator=g)
    lengths[0], lengths[1] = 0, L
    pad = torch.arange(L)[None, :] >= lengths[:, None]
    hist = torch.where(pad, torch.randint(0, ROWS, (B, 1), generator=g),
                       torch.randint(0, ROWS, (B, L), generator=g))
    feats = torch.where(pad[..., None], torch.randn(B, 1, D, generator=g),
                        torch.randn(B, L, D, generator=g))
    if not equal:
        feats[0, -1, 0] += 1.0
    return hist, feats, lengths, torch.randint(0, ROWS, (B,), generator=g)


def build_stats() -> ModelSpec:
    torch.manual_seed(0)
    batch = _stats_batch(0)
    return ModelSpec(model=TokenStats(), example_inputs=batch,
                     make_batch=lambda step, device: _stats_batch(step), batch_size=B)


def test_sum_unbiased_var_std_and_mean_are_weighted_exactly():
    gm, ctx, spec = compiled(f"{__file__}:build_stats")
    assert not [w for w in ctx.warnings if w.startswith("pack-jagged-tokens")], ctx.warnings
    region = _region(entries_of(gm, ctx))
    assert region["rep_sources"] == ["hist", "feats"]
    ops = [(w["op"], w["correction"], w["keepdim"]) for w in region["weighted"]]
    assert ops == [("sum", 0.0, False), ("var", 1.0, True), ("std", 0.0, False),
                   ("mean", 0.0, False)], ops
    seed = fresh_seed()
    stats = _stats()
    for step in range(2):
        run_against_eager(gm, entries_of(gm, ctx), spec.model, _stats_batch(seed + step))
        spec.model.zero_grad()
    assert stats.as_dict() == {"calls": 2, "packed": 2, "padded": 0, "missed_reads": 0}
    # a padded feature that differs within its row: padded, counted, still eager's
    run_against_eager(gm, entries_of(gm, ctx), spec.model, _stats_batch(seed, equal=False))
    assert stats.as_dict() == {"calls": 3, "packed": 2, "padded": 1, "missed_reads": 0,
                               "unequal_padding": 1}


# ---- what stays as it was ---------------------------------------------------------------------


def test_unsupported_token_reductions_keep_the_history_padded_and_say_why():
    batch = din.build("tiny").example_inputs
    # B == L == 8 here: the per-row mean reduces one dim of that size, the amax two
    for dice, op, over in ((MaxDice, "amax", "the B*L = 8*8 rows"),
                           (RowDice, "mean", "the L = 8 positions of each row")):
        gm, ctx = graph_of(din_with(dice), batch, annotated(*PASSES))
        assert not [n for n in gm.graph.nodes if ir.PACKED_REGION in n.meta], dice
        (warning,) = [w for w in ctx.warnings if w.startswith("pack-jagged-tokens")]
        assert f"a reduction over the token axis ({op} over {over}" in warning, warning
        assert f"({dice.__name__})) reads padded tokens; packing would change the result" \
            in warning
    # Dice's weighted statistics first, then an amax: the warning names the amax (the
    # reader to change), not the mean a weighting already handles
    mixed = din.build("tiny").model
    mixed.attention.dnn[3] = MaxDice(mixed.attention.dnn[3].alpha.numel())
    gm, ctx = graph_of(mixed, batch, annotated(*PASSES))
    (warning,) = [w for w in ctx.warnings if w.startswith("pack-jagged-tokens")]
    assert "may be read unmasked by amax: a reduction over the token axis (amax over the " \
           "B*L = 8*8 rows in amax, from attention.dnn.3 (MaxDice))" in warning, warning


class Positional(TokenStats):
    """TokenStats with a position embedding added: the padded tokens of a row differ by
    position, which no check of the batch can make equal."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(L, D))

    def forward(self, hist, feats, lengths, cand):
        return super().forward(hist, feats + self.pos, lengths, cand)


def test_a_per_position_operand_keeps_the_history_padded():
    gm, ctx = graph_of(Positional(), _stats_batch(0), annotated(*PASSES))
    assert not [n for n in gm.graph.nodes if ir.PACKED_REGION in n.meta]
    (warning,) = [w for w in ctx.warnings if w.startswith("pack-jagged-tokens")]
    assert "reads padded tokens; packing would change the result; padding as one weighted " \
           "token per row does not apply: p_pos varies along the token axis" in warning, warning


class NormTower(nn.Module):
    """A LayerNorm / MLP tower over a float history, masked and sum-pooled: no reduction
    over the token axis, so no representative."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, 8)
        self.down = nn.Linear(8, D)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        keep = (torch.arange(x.size(1))[None, :] < lengths[:, None]).float()
        h = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return ((h * keep.unsqueeze(-1)).sum(1)).square().mean()


def _tower_batch(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, L + 1, (B,), generator=g)
    lengths[0], lengths[1] = 0, L
    return torch.randn(B, L, D, generator=g), lengths  # padded rows random: never read


def build_tower() -> ModelSpec:
    torch.manual_seed(0)
    return ModelSpec(model=NormTower(), example_inputs=_tower_batch(0),
                     make_batch=lambda step, device: _tower_batch(step), batch_size=B)


def test_a_tower_without_token_reductions_is_unchanged():
    gm, ctx, spec = compiled(f"{__file__}:build_tower")
    region = _region(entries_of(gm, ctx))
    assert not {"pad_rep", "rep_sources", "weighted"} & set(region)
    assert region["compact"] is True  # kept positions in any order, as before
    assert region["sample_tokens"] == int(spec.example_inputs[1].sum())  # no representative
    stats = _stats()
    runner = run_against_eager(gm, entries_of(gm, ctx), spec.model, _tower_batch(fresh_seed()))
    assert stats.as_dict() == {"calls": 1, "packed": 1, "padded": 0, "missed_reads": 0}
    assert all(layout.weights is None for layout in runner._layouts.values())
