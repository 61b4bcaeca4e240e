"""The guarded attentions (key-padding softmax, HSTU's SiLU) inside the graph Inductor
compiles: they run as eager islands (their mask check reads the host and picks a path), the
rest of the graph compiles around them, and the result equals eager forward and backward,
on prefix masks (jagged path) and scrambled ones (compacted / padded fallback)."""

from __future__ import annotations

import functools

import pytest
import torch
from gemc.backends.triton import key_padding_attention as kpa
from gemc.backends.triton.inductor_graph import build, runner_for

from tests.fusion import key_padding_models as km
from tests.fusion.helpers import compiled, eager_step, entries_of, params_of

CASES = {
    "mha": ("tests/fusion/key_padding_models.py:build", {"form": "mha"}, "bool",
            "key_padding_attention"),
    "silu": ("tests/fusion/key_padding_models.py:build_hstu", {"mask_input": True}, "bool",
             "jagged_silu_attention"),
}


@functools.cache
def _graph(case: str):  # noqa: ANN202
    entry, args, _, kind = CASES[case]
    gm, ctx, spec = compiled(entry, args)
    entries = entries_of(gm, ctx)
    assert any(e["kind"] == kind for e in entries), [e["kind"] for e in entries]
    return gm, entries, spec


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("scramble", [False, True])
def test_guarded_attention_in_the_compiled_graph_matches_eager(case: str, scramble: bool):
    gm, entries, spec = _graph(case)
    model = spec.model
    form = CASES[case][2]
    batch = km.batch(form, [2, 0, 6, 3], torch.Generator().manual_seed(11), scramble)
    ref, grads = eager_step(model, batch)
    runner, _ = runner_for(gm, entries, params_of(model))
    built = build(runner)
    assert "_call_key_padding_attention(" in built.module.code or \
        "_call_silu_attention(" in built.module.code
    kpa.STATS.reset()
    loss = torch.compile(built.module, dynamic=False, backend="inductor")(*batch)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    loss.backward()
    stats = kpa.STATS.as_dict()
    assert stats["calls"] >= 1
    # a prefix mask runs jagged; a scrambled one compacts or falls back, never silently
    assert (stats["jagged"] == stats["calls"]) == (not scramble), stats
    for k, p in model.named_parameters():
        if k in grads:
            torch.testing.assert_close(p.grad, grads[k], atol=2e-5, rtol=1e-4, msg=k)


def test_a_causal_mask_in_a_buffer_is_checked_in_the_eager_island():
    """HSTU's causal mask a registered buffer (generative-recommenders' layout, probe
    hstu_gr): the silu attention's eager island receives the buffer and checks it, once
    per change of it; written in place after ``torch.compile`` (every key visible), the
    next call runs the model's padded formula (a counted fallback) with no recompile.
    Loss and gradients equal eager's on both sides of the write."""
    from gemc.backends.triton.causal_mask import CHECKS

    gm, ctx, spec = compiled("tests/models/probes_c/hstu_gr.py:build", {})
    entries = entries_of(gm, ctx)
    assert [e["causal_mask_of"] for e in entries if e["kind"] == "jagged_silu_attention"] \
        == [["b_layers_0__attn_mask"]]
    model = spec.model
    runner, _ = runner_for(gm, entries, params_of(model))
    built = build(runner)
    assert "_call_silu_attention(" in built.module.code
    step = torch.compile(built.module, dynamic=False, backend="inductor")
    kpa.STATS.reset()
    CHECKS.reset()
    for i, path in enumerate(("jagged", "jagged", "fallback")):
        if path == "fallback":
            with torch.no_grad():
                model.layers[0]._attn_mask.fill_(1.0)
        batch = spec.make_batch(i, "cpu")
        ref, grads = eager_step(model, batch)
        before = kpa.STATS.as_dict()[path]
        loss = step(*batch)
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
        loss.backward()
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[k], atol=2e-5, rtol=1e-4, msg=k)
        model.zero_grad()
        assert kpa.STATS.as_dict()[path] == before + 1, (i, kpa.STATS)
    assert CHECKS.as_dict() == {"checks": 2, "not_causal": 1}
