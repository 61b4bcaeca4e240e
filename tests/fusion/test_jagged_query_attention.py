"""Padded history queries over dense keys (no key mask): each history item attends to a few
dense candidate tokens, the output zeroed by the history's mask and pooled. What the pass
recognises (intent: lengths from offsets, from a lengths input, a bool mask input), that a
model reading the padding query rows stays padded, the kernel op against SDPA, the per-row
run-time guard (fallback exactly on the rows whose mask is no prefix, counted), and the
compiled graph (interpreter and Inductor) against eager, forward and backward, alone and in
a history tower (jagged self-attention and a packed region; a bool-masked one whose region
is guarded by the same mask)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.triton import jagged_query_attention as jqa
from gemc.passes import match_jagged_attention as mja
from gemc.passes.match_jagged_attention import SKIPPED
from torch import nn
from torch.testing import FileCheck

from gemc import ir
from gemc.dump import format_graph
from gemc.spec import ModelSpec
from tests.fusion.helpers import (
    compiled,
    eager_step,
    entries_of,
    fresh_seed,
    params_of,
    run_against_eager,
)

B, L, C, E, H = 4, 7, 3, 8, 2
FORMS = ("offsets", "lengths", "bool")
ENTRY = "tests/fusion/test_jagged_query_attention.py:build"


class HistoryOverCandidates(nn.Module):
    """History ``[B, L, E]`` (padded past each row's length) as queries over ``C`` dense
    candidate tokens; ``form``: how the padding is described (offsets, lengths, a bool
    mask); ``leak``: the padding query rows are read by an unmasked mean."""

    def __init__(self, form: str, leak: bool = False) -> None:
        super().__init__()
        self.form, self.leak = form, leak
        self.q = nn.Linear(E, E)
        self.kv = nn.Linear(E, 2 * E)
        self.out = nn.Linear(E, E)
        self.head = nn.Linear(E, 1)

    def forward(self, x: torch.Tensor, cand: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(L, device=x.device)[None, :]
        if self.form == "offsets":
            keep = pos < (m[1:] - m[:-1])[:, None]
        elif self.form == "lengths":
            keep = pos < m[:, None]
        else:
            keep = m
        b = x.shape[0]
        q = self.q(x).view(b, L, H, E // H).transpose(1, 2)
        k, v = self.kv(cand).view(b, C, 2, H, E // H).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)
        o = self.out(o.transpose(1, 2).reshape(b, L, E))
        if self.leak:
            return self.head(o.mean(1)).square().mean()
        y = (x + F.gelu(o)) * keep.unsqueeze(-1).to(x.dtype)
        pooled = y.sum(1) / keep.sum(1, keepdim=True).clamp(min=1)
        return self.head(pooled).square().mean()


def batch(form: str, lengths: list[int], gen: torch.Generator, scramble: bool = False
          ) -> tuple[torch.Tensor, ...]:
    x = torch.randn(len(lengths), L, E, generator=gen)
    cand = torch.randn(len(lengths), C, E, generator=gen)
    keep = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    if scramble:  # every row with 0 < len < L a non-prefix (a shuffled prefix is flipped)
        shuffled = [row[torch.randperm(L, generator=gen)] for row in keep]
        keep = torch.stack([r.flip(0) if torch.equal(r, p) else r for r, p in zip(shuffled, keep)])
    x = x * keep[..., None]
    if form == "offsets":
        m = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    elif form == "lengths":
        m = torch.tensor(lengths)
    else:
        m = keep
    return x, cand, m


def build(form: str = "bool", leak: bool = False) -> ModelSpec:
    lengths = [2, 0, 7, 3]

    def make(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        return tuple(t.to(device) for t in batch(form, lengths,
                                                 torch.Generator().manual_seed(step)))

    example = batch(form, lengths, torch.Generator().manual_seed(0))
    return ModelSpec(model=HistoryOverCandidates(form, leak), example_inputs=example,
                     make_batch=make)


class JaggedTower(nn.Module):
    """A jagged history (values + offsets, padded by ``index_put``) through jagged
    self-attention, then its items as queries over ``C`` dense candidate tokens, pooled
    under the clamped lengths mask: both attentions and a packed token region in one graph."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.q = nn.Linear(E, E)
        self.kv = nn.Linear(E, 2 * E)
        self.out = nn.Linear(E, E)
        self.head = nn.Linear(E, 1)

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, cand: torch.Tensor
                ) -> torch.Tensor:
        b, n = offsets.shape[0] - 1, values.shape[0]
        lengths = offsets[1:] - offsets[:-1]
        row = torch.repeat_interleave(torch.arange(b), lengths, output_size=n)
        pos = torch.arange(n) - offsets[row]
        seq = values.new_zeros(b, L, E).index_put((row, pos), values)
        mask = torch.arange(L)[None, :] < lengths.clamp(min=1)[:, None]
        q, k, v = self.qkv(seq).view(b, L, 3, H, E // H).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        seq = seq + a.transpose(1, 2).reshape(b, L, E)
        qh = self.q(seq).view(b, L, H, E // H).transpose(1, 2)
        kc, vc = self.kv(cand).view(b, C, 2, H, E // H).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(qh, kc, vc)
        seq = seq + F.gelu(self.out(o.transpose(1, 2).reshape(b, L, E)))
        return self.head((seq * mask[..., None].to(seq.dtype)).sum(1)).square().mean()


def tower_batch(lengths: list[int], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return (torch.randn(int(offsets[-1]), E, generator=gen), offsets,
            torch.randn(len(lengths), C, E, generator=gen))


def build_tower(lengths: tuple[int, ...] = (2, 0, 7, 3)) -> ModelSpec:
    return ModelSpec(model=JaggedTower(),
                     example_inputs=tower_batch(list(lengths), torch.Generator().manual_seed(0)),
                     make_batch=lambda step, device="cpu": tuple(
                         t.to(device) for t in tower_batch(list(lengths),
                                                           torch.Generator().manual_seed(step))))


class MaskedTower(nn.Module):
    """A padded history with a bool mask input: self-attention under the mask, then its
    items as queries over ``C`` dense candidate tokens, pooled under the mask (a region
    pack-jagged-tokens guards with the same mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.q = nn.Linear(E, E)
        self.kv = nn.Linear(E, 2 * E)
        self.head = nn.Linear(E, 1)

    def forward(self, x: torch.Tensor, cand: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q, k, v = self.qkv(x).view(b, L, 3, H, E // H).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        x = x + a.transpose(1, 2).reshape(b, L, E)
        qh = self.q(x).view(b, L, H, E // H).transpose(1, 2)
        kc, vc = self.kv(cand).view(b, C, 2, H, E // H).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(qh, kc, vc).transpose(1, 2).reshape(b, L, E)
        return self.head((x * keep[..., None].to(x.dtype)).sum(1)).square().mean()


def build_masked_tower() -> ModelSpec:
    return ModelSpec(model=MaskedTower(),
                     example_inputs=batch("bool", [2, 0, 7, 3], torch.Generator().manual_seed(0)),
                     make_batch=lambda step, device="cpu": tuple(
                         t.to(device) for t in batch("bool", [2, 0, 7, 3],
                                                     torch.Generator().manual_seed(step))))


@pytest.fixture(autouse=True)
def _query_kernel_always(monkeypatch):  # noqa: ANN202
    """The kernel's own tests apply it wherever it matches (its measured price keeps it off
    at these fills, tested below with the switch cleared)."""
    monkeypatch.setenv(mja.QUERY_KERNEL_ENV, "always")


@functools.cache
def _graph(form: str):  # noqa: ANN202
    gm, ctx, spec = compiled(ENTRY, {"form": form})
    return gm, ctx, entries_of(gm, ctx, ["jagged_query_attention"]), spec


# ---- intent --------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_history_queries_over_dense_keys_become_jagged_query_attention(form: str):
    gm, ctx, entries, _ = _graph(form)
    (entry,) = entries
    sdpa = next(n for n in gm.graph.nodes
                if n.target is torch.ops.aten.scaled_dot_product_attention.default)
    assert sdpa.meta[ir.KERNEL]["kind"] == "jagged_query_attention"
    assert (entry["queries"], entry["keys"], entry["heads"]) == (L, C, H)
    assert entry["output"] == sdpa.name and entry["q"] == sdpa.args[0].name
    if form == "offsets":  # a prefix by construction: no run-time check
        assert entry["mask"] is None and entry["offsets"] == "m" and entry["clamp_min"] == 0
    else:  # the keep mask the op checks: the input, or arange < lengths
        assert entry["offsets"] is None
        assert entry["mask"] == ("m" if form == "bool" else "lt")
    # priced: a guarded mask's fill is data (no saving claimed), never more than padded
    assert 0 < entry["predicted"]["after_ms"]
    assert entry["predicted"]["after_ms"] >= entry["predicted"]["before_ms"] * entry["fill"]
    FileCheck().check("scaled_dot_product_attention").check("jagged_query_attention") \
        .run(format_graph(gm, "after match-jagged-attention"))


def test_padding_query_rows_read_unmasked_stay_padded():
    gm, ctx, _ = compiled(ENTRY, {"form": "bool", "leak": True}, priced=False,
                          upto="match-jagged-attention")
    sdpa = next(n for n in gm.graph.nodes
                if n.target is torch.ops.aten.scaled_dot_product_attention.default)
    assert ir.KERNEL not in sdpa.meta
    assert sdpa.meta[SKIPPED] == "no-key-padding-mask"


# ---- the op and its guard ------------------------------------------------------------------


def test_op_equals_sdpa_on_real_rows_and_falls_back_per_row():
    n = 150  # three query blocks of 64: whole blocks past a row's length are skipped
    gen = torch.Generator().manual_seed(fresh_seed())
    q = torch.randn(4, H, n, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(4, H, 5, 16, generator=gen, requires_grad=True) for _ in range(2))
    keep = torch.arange(n)[None, :] < torch.tensor([0, 20, n, 70])[:, None]
    keep[0, 3] = True  # row 0 is no prefix: it falls back to every query row
    jqa.STATS.reset()
    lengths = jqa.mask_query_lengths(keep)
    assert lengths.tolist() == [n, 20, n, 70]
    assert jqa.STATS.as_dict() == {"calls": 1, "fallback_calls": 1, "fallback_rows": 1}
    out = jqa.jagged_query_attention(q, k, v, lengths)
    rows = (torch.arange(n)[None, :] < lengths[:, None])[:, None, :, None]
    ref = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, ref * rows)  # padding rows exactly zero
    grad = torch.randn(ref.shape, generator=gen) * rows
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad),
                    torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b)


# ---- compiled = eager ----------------------------------------------------------------------


@pytest.mark.parametrize("form,scramble", [("offsets", False), ("lengths", False),
                                           ("bool", False), ("bool", True)])
def test_compiled_matches_eager_and_falls_back_exactly_on_non_prefix_rows(form: str,
                                                                          scramble: bool):
    gm, _, entries, spec = _graph(form)
    lengths = [5, 0, 7, 1]
    x, cand, m = batch(form, lengths, torch.Generator().manual_seed(fresh_seed()), scramble)
    jqa.STATS.reset()
    run_against_eager(gm, entries, spec.model, (x, cand, m))
    stats = jqa.STATS.as_dict()
    if form == "offsets":
        assert stats["calls"] == 0  # proven: no check
        return
    keep = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    expected = int((m != keep).any(1).sum()) if form == "bool" else 0
    assert stats == {"calls": 1, "fallback_calls": int(expected > 0),
                     "fallback_rows": expected}
    assert (expected > 0) == scramble


def test_jagged_tower_queries_over_candidates_match_eager():
    """Offsets prove the prefix (clamped: an empty history keeps its row 0); the query
    attention sits inside the tower's packed token region and reads it padded."""
    gm, ctx, spec = compiled("tests/fusion/test_jagged_query_attention.py:build_tower")
    entries = entries_of(gm, ctx)
    kinds = sorted(e["kind"] for e in entries if "attention" in e["kind"])
    assert kinds == ["jagged_attention", "jagged_query_attention"], kinds
    (query,) = [e for e in entries if e["kind"] == "jagged_query_attention"]
    assert (query["offsets"], query["clamp_min"], query["fill"]) == ("offsets", 1, round(12 / (4 * L), 6))
    # priced at the kernel's measured cost per unit of fill: here above padded's (applied
    # only under the switch, see the tests at the end)
    after, before = query["predicted"]["after_ms"], query["predicted"]["before_ms"]
    assert after >= before * query["fill"] * mja.QUERY_KERNEL_TIME_PER_FILL > before
    run_against_eager(gm, entries, spec.model,
                      tower_batch([3, 0, 6, 3], torch.Generator().manual_seed(4)))


def test_masked_tower_in_a_guarded_region_matches_eager_on_both_paths():
    from gemc.backends.triton import packed_tokens

    gm, ctx, spec = compiled("tests/fusion/test_jagged_query_attention.py:build_masked_tower")
    entries = entries_of(gm, ctx)
    kinds = sorted(e["kind"] for e in entries)
    assert "jagged_query_attention" in kinds and "packed_tokens" in kinds, kinds
    assert [e["compact"] for e in entries if e["kind"] == "packed_tokens"] == [True]
    for scramble in (False, True):
        jqa.STATS.reset()
        packed_tokens.GUARD_STATS.reset()
        run_against_eager(gm, entries, spec.model,
                          batch("bool", [5, 0, 7, 1], torch.Generator().manual_seed(3), scramble))
        assert (jqa.STATS.as_dict()["fallback_rows"] > 0) == scramble
        # the region is compact (nothing in it needs a prefix): a scrambled mask packs too,
        # its kept tokens in order, while the query attention's own check falls back
        assert packed_tokens.GUARD_STATS.as_dict() == {"calls": 1, "packed": 1, "padded": 0,
                                                       "missed_reads": 0}


@pytest.mark.parametrize("scramble", [False, True])
def test_inductor_graph_calls_the_custom_op_and_matches_eager(scramble: bool):
    from gemc.backends.triton.inductor_graph import build as build_graph
    from gemc.backends.triton.inductor_graph import runner_for

    gm, _, entries, spec = _graph("bool")
    model = spec.model
    inputs = batch("bool", [5, 0, 7, 1], torch.Generator().manual_seed(fresh_seed()), scramble)
    ref, grads = eager_step(model, inputs)
    runner, _ = runner_for(gm, entries, params_of(model))
    jqa.STATS._counts.clear()  # none from earlier tests
    built = build_graph(runner)
    assert "query_attention(" in built.module.code
    # the guard's counts are made when the graph is built, not in its first run (under CUDA
    # graphs a tensor made there and kept is refused), and a reset keeps them
    made = {device: id(counts) for device, counts in jqa.STATS._counts.items()}
    assert made, "no counts made at build time"
    jqa.STATS.reset()
    loss = torch.compile(built.module, dynamic=False, backend="inductor")(*inputs)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    loss.backward()
    assert {device: id(counts) for device, counts in jqa.STATS._counts.items()} == made
    assert jqa.STATS.as_dict()["calls"] == 1  # the guard ran inside the compiled graph
    assert (jqa.STATS.as_dict()["fallback_rows"] > 0) == scramble
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[k], atol=2e-5, rtol=1e-4, msg=k)


# ---- where the kernel is used without the switch: its measured price -----------------------


def _query_sdpa(gm):  # noqa: ANN001, ANN202 - the SDPA whose queries are the history items
    return [n for n in gm.graph.nodes
            if n.target is torch.ops.aten.scaled_dot_product_attention.default][-1]


@pytest.mark.parametrize("form", FORMS)
def test_history_queries_stay_padded_where_the_kernel_is_measured_slower(form, monkeypatch):
    """At fill 1 (a mask given as data, or offsets over an already padded history) the
    kernel's measured cost (3.57 x the fill of padded SDPA's) loses: the SDPA stays padded,
    the reason on the node and in a warning."""
    monkeypatch.delenv(mja.QUERY_KERNEL_ENV)
    gm, ctx, _ = compiled(ENTRY, {"form": form}, upto="match-jagged-attention")
    sdpa = _query_sdpa(gm)
    assert ir.KERNEL not in sdpa.meta and ir.GROUP not in sdpa.meta
    assert sdpa.meta[mja.SKIPPED].startswith("query-kernel-slower: fill 1 x 3.57")
    assert any("query-kernel-slower" in w and sdpa.name in w for w in ctx.warnings)


def test_the_kernel_is_used_where_the_fill_makes_it_faster(monkeypatch):
    """A jagged tower: at fill 0.43 (12 of 28 slots) the query attention stays padded while
    the self-attention goes jagged; at fill 0.11 (3 of 28) the kernel is priced faster and
    applied, and trains as eager."""
    monkeypatch.delenv(mja.QUERY_KERNEL_ENV)
    entry = "tests/fusion/test_jagged_query_attention.py:build_tower"
    gm, ctx, _ = compiled(entry)
    kinds = sorted(e["kind"] for e in entries_of(gm, ctx) if "attention" in e["kind"])
    assert kinds == ["jagged_attention"], kinds
    assert _query_sdpa(gm).meta[mja.SKIPPED].startswith("query-kernel-slower: fill 0.428571")
    gm, ctx, spec = compiled(entry, {"lengths": [1, 0, 1, 1]})
    entries = entries_of(gm, ctx)
    (query,) = [e for e in entries if e["kind"] == "jagged_query_attention"]
    assert query["fill"] == round(3 / (4 * L), 6)
    assert query["predicted"]["after_ms"] < query["predicted"]["before_ms"]
    run_against_eager(gm, entries, spec.model,
                      tower_batch([1, 0, 1, 1], torch.Generator().manual_seed(fresh_seed())))
