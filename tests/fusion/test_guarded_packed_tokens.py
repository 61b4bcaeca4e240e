"""pack-jagged-tokens around a guarded attention (a mask only known at run time: a bool or
additive input, lengths, offsets, causal, summary queries over the history): the token-wise
ops around it form a region guarded by one check per call; compiled = eager forward
and backward on prefix masks (packed), on masks that are not prefixes (packed compacted
where nothing in the region needs a prefix, else the padded computation), the path counted
exactly; the compiled (Inductor) graph keeps them (checked ahead of it:
tests/fusion/test_guarded_regions_compiled.py)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.triton import key_padding_attention as kpa
from gemc.backends.triton import packed_tokens as pt
from gemc.backends.triton.graph_runner import GraphRunner
from gemc.backends.triton.inductor_graph import runner_for
from gemc.passes.pack_jagged_tokens import PACKED
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from gemc.spec import ModelSpec
from tests.fusion import key_padding_models as km
from tests.fusion.helpers import compiled, eager_step, entries_of, params_of, run_against_eager

ENTRY = "tests/fusion/key_padding_models.py:build"
HSTU = "tests/fusion/key_padding_models.py:build_hstu"
CAUSAL = "tests/fusion/test_guarded_packed_tokens.py:build_causal_tower"


@functools.cache
def _graph(entry: str, key: tuple[tuple[str, object], ...]):  # noqa: ANN202
    gm, ctx, spec = compiled(entry, dict(key))
    return gm, ctx, entries_of(gm, ctx), spec


def _keep(form: str, m: torch.Tensor) -> torch.Tensor:
    if form in ("lengths", "summary"):
        return torch.arange(km.L)[None] < m[:, None]
    if form == "offsets":
        return torch.arange(km.L)[None] < (m[1:] - m[:-1])[:, None]
    return m == 0 if form == "additive" else m


def _lengths(form: str, lengths: list[int]) -> list[int]:
    """No empty row for a form whose attention is NaN on one: eager's NaN gradients there
    are not the guarded op's (its fallback, not the region, is at stake; the region's rule
    for an empty row: tests/fusion/test_packed_tokenwise_ops.py)."""
    return [max(1, n) for n in lengths] if form in km.EVERY_ROW_FORMS else lengths


def _packs(keep: torch.Tensor, form: str = "", compact: bool = True) -> bool:
    """The region's rule: every row a prefix (any kept positions in a compact region), and
    some token kept (on every row where the attention is NaN on an empty one)."""
    prefix = (keep == (torch.arange(keep.shape[1]) < keep.sum(1, keepdim=True))).all()
    rows = bool(keep.any(1).all()) if form in km.EVERY_ROW_FORMS else True
    return (bool(prefix) or compact) and bool(keep.any()) and rows


@pytest.mark.parametrize("form", km.PACKED_FORMS)
def test_region_follows_the_run_time_mask(form: str):
    gm, ctx, entries, _ = _graph(ENTRY, (("form", form),))
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    (attn,) = [e for e in entries if e["kind"] == "key_padding_attention"]
    assert region["guard"] == "prefix-check" and region["compact"] is True
    assert region["every_row"] is (form in km.EVERY_ROW_FORMS)
    # the check reads the keep mask the attention's mask is (or an additive input itself)
    assert region["mask"] == {"additive": "m", "lengths": "lt", "offsets": "lt",
                              "summary": "lt"}.get(form, "m")
    assert region["additive"] is (form == "additive")
    by_name = {n.name: n for n in gm.graph.nodes}
    targets = {by_name[n].target for n in region["nodes"]}
    aten = torch.ops.aten
    # the history tower: LayerNorm, the qkv projection (and the output projection, GELU and
    # residual of a self-attention) run on real tokens; the input x enters by a gather
    assert {aten.layer_norm.default, aten.linear.default} <= targets
    assert "x" not in region["nodes"]
    if form != "summary":
        assert attn["output"] in region["nodes"] and aten.gelu.default in targets
    assert not [w for w in ctx.warnings if "pack-jagged-tokens" in w], ctx.warnings


@pytest.mark.parametrize("form", km.PACKED_FORMS)
def test_compiled_matches_eager_and_counts_the_region_path(form: str):
    gm, _, entries, spec = _graph(ENTRY, (("form", form),))
    for scramble in (False, True):
        x, m = km.batch(form, _lengths(form, [2, 0, 6, 3]), torch.Generator().manual_seed(5),
                        scramble)
        kpa.STATS.reset()
        pt.GUARD_STATS.reset()
        run_against_eager(gm, entries, spec.model, (x, m))
        packed = _packs(_keep(form, m), form)
        assert packed  # scrambled too: each row's kept tokens, in order (compact)
        assert pt.GUARD_STATS.as_dict() == {"calls": 1, "packed": int(packed),
                                            "padded": int(not packed), "missed_reads": 0}


def test_additive_mask_that_is_no_key_mask_runs_padded():
    """An additive row with a value neither 0 nor <= -1e4 (a soft bias, not padding): the
    attention reads those keys, so the region runs padded, as the attention falls back."""
    gm, _, entries, spec = _graph(ENTRY, (("form", "additive"),))
    x, m = km.batch("additive", [2, 0, 6, 3], torch.Generator().manual_seed(9))
    m[2, 1] = -0.5
    pt.GUARD_STATS.reset()
    run_against_eager(gm, entries, spec.model, (x, m))
    assert pt.GUARD_STATS.as_dict() == {"calls": 1, "packed": 0, "padded": 1, "missed_reads": 0}


def test_written_out_silu_attention_is_one_member_of_the_region():
    """A written-out SiLU formula over a bool mask input: the region takes the matched
    kernel as a whole (q's rows become its output's, k's and v's are masked by the same
    mask), so the sequence packs under the mask's guard, not compact (the formula reads
    positions); tests/fusion/test_silu_in_packed_region.py runs it."""
    gm, ctx, entries, _ = _graph(HSTU, (("mask_input", True),))
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    assert region["guard"] == "prefix-check" and region["compact"] is False
    assert not [w for w in ctx.warnings if "pack-jagged-tokens" in w], ctx.warnings


def test_compiled_graph_keeps_guarded_regions_for_the_check_ahead_of_it():
    gm, _, entries, spec = _graph(ENTRY, (("form", "bool"),))
    runner, left = runner_for(gm, entries, params_of(spec.model))
    assert left == [] and not runner.packed  # packed per call, by the check's outcome
    region = {n.name for n in runner.guarded_nodes}
    assert region == {n.name for n in gm.graph.nodes if PACKED in n.meta}


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@example(form="bool", lengths=[0] * km.B, scramble=False, seed=0)
@given(form=st.sampled_from(km.PACKED_FORMS),
       lengths=st.lists(st.integers(0, km.L), min_size=km.B, max_size=km.B),
       scramble=st.booleans(), seed=st.integers(0, 2**16))
def test_any_mask_region_matches_eager_packed_on_any_kept_tokens(form, lengths, scramble,
                                                                 seed):
    """Random lengths 0..L, prefix or scrambled, every form the region follows: compiled =
    eager forward and backward; the (compact) region packed whenever the mask keeps a token
    (with none every gradient must stay as eager's, zero, not absent), prefix or not."""
    gm, _, entries, spec = _graph(ENTRY, (("form", form),))
    x, m = km.batch(form, _lengths(form, lengths), torch.Generator().manual_seed(seed),
                    scramble)
    pt.GUARD_STATS.reset()
    run_against_eager(gm, entries, spec.model, (x, m))
    packed = _packs(_keep(form, m), form)
    assert pt.GUARD_STATS.as_dict() == {"calls": 1, "packed": int(packed),
                                        "padded": int(not packed), "missed_reads": 0}


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@example(lengths=[1, 2, 3, 4], scramble=True, seed=0)
@given(lengths=st.lists(st.integers(0, km.L), min_size=km.B, max_size=km.B),
       scramble=st.booleans(), seed=st.integers(0, 2**16))
def test_a_region_that_needs_a_prefix_falls_back_exactly_when_there_is_none(lengths,
                                                                            scramble, seed):
    """A region whose causal attention has no mask (its keys are clean only if the padding
    is a suffix): random masks, compiled = eager, packed exactly on prefixes."""
    gm, _, entries, spec = _graph(CAUSAL, (("mask_input", True),))
    x, m = km.batch("bool", lengths, torch.Generator().manual_seed(seed), scramble)
    pt.GUARD_STATS.reset()
    run_against_eager(gm, entries, spec.model, (x, m))
    packed = _packs(m, compact=False)
    assert pt.GUARD_STATS.as_dict() == {"calls": 1, "packed": int(packed),
                                        "padded": int(not packed), "missed_reads": 0}


class CausalTower(nn.Module):
    """A causal self-attention with no mask over right-padded rows (a real query never
    reaches the padding), then summary queries over the history under the key mask."""

    def __init__(self, mask_input: bool) -> None:
        super().__init__()
        self.mask_input = mask_input
        self.norm = nn.LayerNorm(km.E)
        self.qkv = nn.Linear(km.E, 3 * km.E)
        self.out = nn.Linear(km.E, km.E)
        self.summary = nn.Parameter(torch.randn(1, km.H, 2, km.E // km.H))
        self.head = nn.Linear(km.E, 1)

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        keep = m if self.mask_input else torch.arange(km.L)[None, :] < m[:, None]
        b = x.shape[0]
        h = self.norm(x)
        q, k, v = self.qkv(h).view(b, km.L, 3, km.H, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.out(o.transpose(1, 2).reshape(b, km.L, km.E))
        hk = h.view(b, km.L, km.H, -1).transpose(1, 2)
        s = F.scaled_dot_product_attention(self.summary.expand(b, -1, -1, -1), hk, hk,
                                           attn_mask=keep[:, None, None, :])
        return self.head(s.transpose(1, 2).flatten(2)).square().mean()


def build_causal_tower(mask_input: bool = False) -> ModelSpec:
    form = "bool" if mask_input else "lengths"

    def make(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        return tuple(t.to(device) for t in km.batch(form, [2, 1, 6, 3],
                                                    torch.Generator().manual_seed(step)))

    x, m = make(0)
    return ModelSpec(model=CausalTower(mask_input), example_inputs=(x, m), make_batch=make)


@pytest.mark.parametrize("mask_input", [False, True])
def test_causal_attention_over_right_padding_stays_in_the_region(mask_input: bool):
    """SDPA(is_causal=True) with no mask reads only real keys from a real query when the
    padding is a suffix, which the region's prefix check guarantees: its keys and values
    stay packed; compiled = eager, packed on a prefix, padded on a scrambled mask."""
    gm, ctx, entries, spec = _graph(CAUSAL, (("mask_input", mask_input),))
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    assert region["compact"] is False  # its causal rule needs the padding to be a suffix
    by_name = {n.name: n for n in gm.graph.nodes}
    assert any(by_name[n].target is torch.ops.aten.scaled_dot_product_attention.default
               and True in (*by_name[n].args[5:6], by_name[n].kwargs.get("is_causal"))
               for n in region["nodes"])
    for scramble in ([False, True] if mask_input else [False]):
        x, m = km.batch("bool" if mask_input else "lengths", [2, 1, 6, 3],
                        torch.Generator().manual_seed(13), scramble)
        pt.GUARD_STATS.reset()
        run_against_eager(gm, entries, spec.model, (x, m))
        assert pt.GUARD_STATS.as_dict() == {"calls": 1, "packed": int(not scramble),
                                            "padded": int(scramble), "missed_reads": 0}


def test_one_runner_switches_paths_between_calls():
    """The guard is decided per call: one runner over a region that needs a prefix (a
    causal attention with no mask: not compact), a prefix mask (packed), a scrambled one
    (padded), a prefix again (packed), each equal to eager."""
    gm, _, entries, spec = _graph(CAUSAL, (("mask_input", True),))
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    assert region["compact"] is False
    runner = GraphRunner(gm, entries, params_of(spec.model))
    for i, scramble in enumerate([False, True, False]):
        batch = km.batch("bool", [2, 1, 6, 3], torch.Generator().manual_seed(i), scramble)
        ref, grads = eager_step(spec.model, batch)
        pt.GUARD_STATS.reset()
        loss = runner(*batch)
        loss.backward()
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
        for k, p in spec.model.named_parameters():
            torch.testing.assert_close(p.grad, grads[k], atol=1e-5, rtol=1e-4, msg=k)
            p.grad = None
        assert pt.GUARD_STATS.as_dict() == {"calls": 1, "packed": int(not scramble),
                                            "padded": int(scramble), "missed_reads": 0}
        assert bool(runner.packed) is not scramble


def test_interpreter_runs_the_unmasked_causal_attention_jagged_on_a_prefix(monkeypatch):
    """The interpreter's rule is the compiled graph's: on a prefix mask the region's causal
    SDPA is one jagged causal attention over the region's tokens; on a scrambled mask the
    region runs padded and the model's SDPA with it. Both equal eager."""
    gm, _, entries, spec = _graph(CAUSAL, (("mask_input", True),))
    calls: list[bool] = []
    real = pt.attention

    def spy(*args, **kwargs):  # noqa: ANN202
        calls.append(bool(args[6] if len(args) > 6 else kwargs.get("causal")))
        return real(*args, **kwargs)

    monkeypatch.setattr(pt, "attention", spy)
    for scramble in (False, True):
        calls.clear()
        batch = km.batch("bool", [2, 1, 6, 3], torch.Generator().manual_seed(7), scramble)
        run_against_eager(gm, entries, spec.model, batch)
        assert calls == ([] if scramble else [True])
