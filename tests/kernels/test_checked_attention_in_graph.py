"""Key-padding attentions decided by the check ahead of the compiled graph
(``region_guard.guarded_attentions``): a cross-attention of queries over a padded history
whose mask the batch gives runs *inside* the graph Inductor compiles (no eager island, so
no graph break) on the keys' lengths the check found, and equals eager forward and
backward on prefix masks (``prefix``), scrambled ones (``compact``) and additive rows that
are no mask (``padded``, the exact fallback), each counted."""

from __future__ import annotations

import functools

import pytest
import torch
from gemc.backends.triton import key_padding_attention as kpa
from gemc.backends.triton.inductor_graph import build, runner_for
from gemc.backends.triton.kinds.attention import key_padding_checked
from gemc.backends.triton.region_guard import RegionGuard, guarded_attentions

from tests.fusion import key_padding_models as km
from tests.fusion.helpers import compiled, eager_step, entries_of, params_of


@functools.cache
def _graph(form: str):  # noqa: ANN202
    gm, ctx, spec = compiled("tests/fusion/key_padding_models.py:build", {"form": form})
    return gm, entries_of(gm, ctx), spec


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


@pytest.mark.parametrize("scramble", [False, True])
def test_target_attention_compiles_inside_the_graph_and_matches_eager(scramble: bool) -> None:
    gm, entries, spec = _graph("target")
    model = spec.model
    runner, _ = runner_for(gm, entries, params_of(model))
    decided = guarded_attentions(runner)
    assert [e["kind"] for e in decided] == ["key_padding_attention"]  # the target's one
    guard = RegionGuard.of(runner)
    assert guard is not None and guard.attentions == [decided[0]["name"]]
    batch = km.batch("target", [2, 0, 6, 3], torch.Generator().manual_seed(5), scramble)
    ref, grads = eager_step(model, batch)
    kpa.STATS.reset()
    decision = guard.check(batch)
    # first the history's region (a checked reader since s22: the target is the query
    # sliced off its last position, ``q[:, :, -1:]``), padded here: that position is padding
    # in these rows, a missed read; then the target's attention on the keys' own layout
    assert decision.key == (None, "compact" if scramble else "prefix")
    assert kpa.STATS.as_dict() == {"calls": 1, "jagged": int(not scramble),
                                   "compacted": int(scramble), "fallback": 0}
    built = build(runner, attention_guards=guard.attention_guards(decision.key))
    code = built.module.code
    assert "key_padding_checked(" in code and "_call_key_padding_attention(" not in code
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fn = torch.compile(built.module, dynamic=False, backend="aot_eager", fullgraph=True)
    loss = fn(*decision.offsets, *batch)
    assert _graph_breaks() == 0
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    loss.backward()
    for k, p in model.named_parameters():
        if k in grads:
            torch.testing.assert_close(p.grad, grads[k], atol=2e-5, rtol=1e-4, msg=k)


def test_every_outcome_equals_the_checked_op_forward_and_backward() -> None:
    """``key_padding_checked`` against the op that checks for itself, on additive masks:
    prefix rows, scrambled rows, and a row that is no mask (a finite negative: padded)."""
    gen = torch.Generator().manual_seed(3)
    b, h, m, length, d = 3, 2, 2, 8, 16
    keep = torch.arange(length)[None, :] < torch.tensor([3, 8, 5])[:, None]
    scrambled = torch.stack([row[torch.randperm(length, generator=gen)] for row in keep])
    entry = {"additive": True, "scale": None, "merged_heads": False, "nan_if_empty": False}
    for outcome, keep_rows, junk in (("prefix", keep, False), ("compact", scrambled, False),
                                     ("padded", keep, True)):
        mask = torch.zeros(b, length).masked_fill(~keep_rows, float("-inf"))
        if junk:
            mask[1, 2] = -3.0  # neither 0 nor a mask: only the padded attention is exact
        leaves = [torch.randn(b, h, m if i == 0 else length, d, generator=gen,
                              requires_grad=True) for i in range(3)]
        offsets, bad = kpa.prefix_lengths(mask, additive=True)
        flags = bad.sum(0).tolist()
        assert (flags[1] > 0) == junk  # what the check ahead of the graph would decide
        assert junk or (flags[0] > 0) == (outcome == "compact")
        lengths = (offsets[1:] - offsets[:-1]).to(torch.int32)
        got = key_padding_checked(*leaves, mask, None if junk else lengths, outcome, entry)
        want = kpa.key_padding_attention(*(x.detach().requires_grad_() for x in leaves), mask,
                                         None, False, True, False)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        grad = torch.randn(got.shape, generator=gen)
        dgot = torch.autograd.grad(got, leaves, grad)
        ref = [x.detach().requires_grad_() for x in leaves]
        dwant = torch.autograd.grad(kpa.key_padding_attention(*ref, mask, None, False, True,
                                                              False), ref, grad)
        for a, w in zip(dgot, dwant):
            torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-4)


def test_self_attention_and_packed_attentions_are_not_decided_ahead() -> None:
    """A self-attention whose queries are the padded rows (``bool``: inside the packed
    region's tower) is left to its region's check; only cross-attentions outside regions
    are decided ahead."""
    gm, entries, spec = _graph("bool")
    runner, _ = runner_for(gm, entries, params_of(spec.model))
    assert guarded_attentions(runner) == []


def test_key_lengths_attention_op_passes_opcheck_and_is_sdpa_over_each_rows_keys() -> None:
    from tests.kernels.test_custom_ops import STATIC

    gen = torch.Generator().manual_seed(7)
    b, h, m, length, d = 3, 2, 3, 8, 16
    q = torch.randn(b, h, m, d, generator=gen, requires_grad=True)
    k, v = (torch.randn(b, h, length, d, generator=gen, requires_grad=True) for _ in range(2))
    lengths = torch.tensor([3, 8, 1], dtype=torch.int32)
    args = (q, k, v, lengths, d ** -0.5)
    torch.library.opcheck(torch.ops.gemc.key_lengths_attention.default, args,
                          test_utils=STATIC)
    out, _ = torch.ops.gemc.key_lengths_attention(*args)
    keep = torch.arange(length)[None, :] < lengths[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=keep[:, None, None, :])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    grad = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = torch.autograd.grad(want, (q, k, v), grad)
    for a, w in zip(got, ref):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-4)


def test_operands_of_mixed_dtypes_reach_the_kernel_in_the_autocast_dtype(monkeypatch) -> None:
    """MMoE h200 on the GPU: a candidate query in fp32 over a history's bf16 keys and values
    (autocast) reached the kernel mixed and did not compile (``tl.dot`` of bf16 and fp32).
    The operands now arrive in the autocast dtype, as eager's SDPA casts them, and the
    result is SDPA's under autocast."""
    import torch.nn.functional as F
    from gemc.backends.triton import ops

    seen = []
    forward = ops._varlen_forward

    def spy(q, k, v, *rest):  # noqa: ANN001, ANN002, ANN202
        seen.append({q.dtype, k.dtype, v.dtype})
        return forward(q, k, v, *rest)

    monkeypatch.setattr(ops, "_varlen_forward", spy)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 2, 1, 8, generator=gen)
    k, v = (torch.randn(2, 2, 6, 8, generator=gen).bfloat16() for _ in range(2))
    mask = torch.zeros(2, 6).masked_fill(torch.arange(6)[None] >= torch.tensor([[4], [6]]),
                                         -1e4)
    entry = {"merged_heads": False, "additive": True, "scale": None}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = key_padding_checked(q, k, v, mask, torch.tensor([4, 6]), "prefix", entry)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
    assert seen == [{torch.bfloat16}]
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
