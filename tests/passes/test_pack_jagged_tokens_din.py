"""pack-jagged-tokens on DIN (examples/zoo/din.py): a padded history under a length mask that
no attention kernel reads (an MLP scores each behaviour, the scores are masked and
sum-pooled). Dice's batch statistics (mean and variance over all B*L rows) read the padded
tokens: eager's own loss changes when only the padded positions' ids change, so packing over
the real tokens alone would be wrong; DIN now packs with one weighted representative per
row instead, checked per call (tests/fusion/test_padding_representatives.py). A Dice whose
statistic has no weighted form (an ``amax`` over the rows) keeps the history padded, and the
pass says so, naming the reduction and where it is. A DIN written with masked statistics (mean and variance
over the real tokens only) reads no padding: its loss is the same whatever the padded ids,
the pass follows every padded token to a mask and makes the history a region checked at
run time (the mask is a graph value), which the runner runs packed, equal to eager."""

from __future__ import annotations

import torch
from gemc.passes.match_jagged_attention import MatchJaggedAttention
from gemc.passes.pack_jagged_tokens import PackJaggedTokens
from torch import nn

from examples.zoo import din
from gemc import ir
from gemc.spec import ModelSpec
from tests.fusion.helpers import MaxDice, din_with
from tests.passes.helpers import annotated, graph_of

PASSES = (MatchJaggedAttention(), PackJaggedTokens())


def _padded_ids_changed(batch: tuple[torch.Tensor, ...], seed: int) -> tuple[torch.Tensor, ...]:
    """``batch`` with every padded position of both histories given other (valid) ids."""
    goods, cates, lengths = batch[:3]
    pad = torch.arange(goods.size(1))[None, :] >= lengths[:, None]
    g = torch.Generator().manual_seed(seed)
    goods = torch.where(pad, torch.randint(1, 200, goods.shape, generator=g), goods)
    cates = torch.where(pad, torch.randint(1, 20, cates.shape, generator=g), cates)
    assert pad.any()
    return (goods, cates, *batch[2:])


def _history_warnings(ctx) -> list[str]:
    return [w for w in ctx.warnings if w.startswith("pack-jagged-tokens: the history")]


def test_dice_statistics_read_the_padding_so_the_loss_depends_on_padded_ids():
    spec = din.build("tiny")
    model = spec.model.double()  # the preset's 1e-4 embeddings move the loss by ~3e-9
    batch = tuple(t.double() if t.is_floating_point() else t for t in spec.example_inputs)
    with torch.no_grad():
        before = model(*batch)
        after = model(*_padded_ids_changed(batch, 1))
        # only padded positions changed, yet the loss moved (float64 rounds at ~1e-16):
        # Dice's mean/var over the B*L rows read them, so running the history on real
        # tokens only would change the result
        assert abs(float(before - after)) > 1e-12
        for table in (model.goods_emb, model.cate_emb):  # at a trained model's scale
            nn.init.normal_(table.weight)
        moved = abs(float(model(*batch) - model(*_padded_ids_changed(batch, 1))))
    assert moved > 1e-6, moved


def test_a_dice_without_weighted_form_stays_padded_and_the_pass_names_it():
    spec = din.build("tiny")
    gm, ctx = graph_of(din_with(MaxDice), spec.example_inputs, annotated(*PASSES))
    assert not [n for n in gm.graph.nodes if ir.PACKED in n.meta or ir.PACKED_REGION in n.meta]
    (warning,) = _history_warnings(ctx)
    assert "the history embedding, embedding_1 (masked by lt, [8, 8]) stays padded: padding " \
           "rows of embedding may be read unmasked by amax" in warning
    assert "a reduction over the token axis (amax over the B*L = 8*8 rows in amax" in warning
    assert "(MaxDice)) reads padded tokens; packing would change the result" in warning
    # the same reason on the history's starts, for the plan's readers
    starts = [n for n in gm.graph.nodes if ir.PACKED_SKIPPED in n.meta]
    assert [n.name for n in starts] == ["embedding", "embedding_1"]


class MaskedDice(nn.Module):
    """Dice whose statistics are the mean and variance over the real tokens only (what a
    user writes when padding must not move them): ``mask`` is ``[B, L, 1]``, 1.0 on real
    tokens."""

    def __init__(self, num_features: int, eps: float = 1e-8) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(num_features))
        self.eps = eps

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        count = mask.sum()
        mean = (x * mask).sum(dim=(0, 1)) / count
        var = ((x - mean) ** 2 * mask).sum(dim=(0, 1)) / count
        p = torch.sigmoid((x - mean) / torch.sqrt(var + self.eps))
        return p * x + (1 - p) * self.alpha * x


class MaskedDIN(din.DIN):
    """DIN whose activation unit's Dice statistics skip the padded behaviours."""

    def __init__(self, cfg: din.Config) -> None:
        super().__init__(cfg)
        del self.attention  # replaced by ``unit`` + ``score``
        self.unit = nn.ModuleList()
        prev = 4 * 2 * cfg.emb_dim
        for h in cfg.att_hidden:
            self.unit.append(nn.ModuleList([nn.Linear(prev, h), MaskedDice(h)]))
            prev = h
        self.score = nn.Linear(prev, 1)

    def forward(self, hist_goods, hist_cates, hist_len, cand_goods, cand_cate, *rest):
        label = rest[-1]
        keys = torch.cat([self.goods_emb(hist_goods), self.cate_emb(hist_cates)], dim=-1)
        query = torch.cat([self.goods_emb(cand_goods), self.cate_emb(cand_cate)], dim=-1)
        mask = (torch.arange(hist_goods.size(1))[None, :] < hist_len[:, None]).float()
        queries = query.unsqueeze(1).expand(-1, keys.size(1), -1)
        h = torch.cat([keys, queries, keys - queries, keys * queries], dim=-1)
        for linear, dice in self.unit:
            h = dice(linear(h), mask.unsqueeze(-1))
        scores = self.score(h).squeeze(-1) * mask
        interest = torch.sum(scores.unsqueeze(-1) * keys, dim=1)
        profile = [bag(rest[3 * f], rest[3 * f + 1], per_sample_weights=rest[3 * f + 2])
                   for f, bag in enumerate(self.profile)]
        logit = self.mlp(torch.cat([interest, query, *profile], dim=-1)).squeeze(-1)
        return self.loss(logit, label)


def _masked(dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = MaskedDIN(din.PRESETS["tiny"]).to(dtype)
    for table in (model.goods_emb, model.cate_emb):  # at a trained model's scale
        nn.init.normal_(table.weight)
    batch = din.build("tiny").example_inputs
    return model, tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)


def test_masked_dice_reads_no_padding():
    model, batch = _masked(torch.float64)  # equal to rounding, where DIN moves by 1e-9
    changed = _padded_ids_changed(batch, 1)
    loss = model(*batch)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    other = model(*changed)
    other.backward()
    torch.testing.assert_close(other, loss)
    # the weights' gradients too, except the rows the changed padded ids look up
    for (name, p), g in zip(model.named_parameters(), grads):
        if not name.endswith("_emb.weight"):
            torch.testing.assert_close(p.grad, g, msg=name)


def test_masked_dice_packs_as_a_region_checked_at_run_time():
    model, batch = _masked()
    gm, ctx = graph_of(model, batch, annotated(*PASSES))
    # no reader of the padding: the masked mean/var and the masked sum pooling are followed
    assert not [w for w in ctx.warnings if w.startswith("pack-jagged-tokens")], ctx.warnings
    (head,) = [n for n in gm.graph.nodes if ir.PACKED_REGION in n.meta]
    region = head.meta[ir.PACKED_REGION]
    assert (region["guard"], region["starts"], region["mask"], region["compact"]) == \
        ("prefix-check", ["embedding", "embedding_1"], "lt", True)
    marked = {n.name: n.meta[ir.PACKED] for n in gm.graph.nodes if ir.PACKED in n.meta}
    # the activation unit's GEMMs run on the region's tokens; the statistics' and the
    # pooling's masked products end it (zeroed), their sums over B*L read it outside
    linears = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default
               and n.name in marked]
    assert len(linears) == 3  # two hidden layers and the score
    zeroed = [k for k, v in marked.items() if v["zeroed"]]
    assert len(zeroed) == 6, zeroed  # 2 x (mean, var) of Dice, the score mask, the pooling


def test_masked_dice_region_runs_packed_and_matches_eager():
    from gemc.backends.triton import packed_tokens as pt

    from tests.fusion.helpers import compiled, entries_of, run_against_eager

    gm, ctx, spec = compiled(f"{__file__}:build_masked")
    before = pt.GUARD_STATS.packed
    # loss and every parameter's gradient against eager (the batch has an empty and a full
    # history); the region ran packed, its check passed
    run_against_eager(gm, entries_of(gm, ctx), spec.model, spec.example_inputs)
    assert pt.GUARD_STATS.packed == before + 1


def test_masked_dice_region_trains_as_eager_in_the_compiled_graph():
    """The compiled (Inductor) graph checks the mask ahead of it and runs a graph compiled
    for the step's token count: three steps of other lengths, each packed, each loss and
    gradient as eager's."""
    from gemc.backends.triton import packed_tokens as pt

    from tests.fusion.helpers import (
        compiled,
        cpu_graph_executor,
        entries_of,
        train_against_eager,
    )

    gm, ctx, spec = compiled(f"{__file__}:build_masked")
    executor = cpu_graph_executor(gm, spec.model, entries_of(gm, ctx))
    assert executor.guard is not None and executor.guard.names == ["packed_tokens_0"]
    assert executor.not_applied == []
    batches = [din._batch(din.PRESETS["tiny"], step, 0, "cpu") for step in range(3)]
    pt.GUARD_STATS.reset()
    train_against_eager(executor, spec.model, batches)
    assert pt.GUARD_STATS.as_dict() == {"calls": 3, "packed": 3, "padded": 0, "missed_reads": 0}
    assert all(v["packed_regions"]["packed_tokens_0"] < 64 for v in executor.variants)


def build_masked(dtype: str = "float32") -> ModelSpec:
    """The masked-Dice DIN as an entrypoint (its tiny batches)."""
    model, batch = _masked(getattr(torch, dtype))
    return ModelSpec(model=model, example_inputs=batch,
                     make_batch=lambda step, device: batch, batch_size=8)
