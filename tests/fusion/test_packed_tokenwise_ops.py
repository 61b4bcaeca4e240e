"""pack-jagged-tokens follows the padding through every token-wise op, recognised by what
it does: activations by ATen's ``pointwise`` tag (LeakyReLU, ELU: outside the fusion
vocabulary), dropout (one draw per element), and ``select`` over a dim that is not a token
dim (q, k, v indexed out of one projection). A BST-style post-LN block over a bool mask
input (tests/fusion/tokenwise_tower.py) is one guarded region; compiled = eager forward
and backward, interpreted and in graph mode, packed exactly when the mask is a prefix."""

from __future__ import annotations

import functools

import torch
from gemc.backends.torch.graph_mode import GraphExecutor
from gemc.backends.torch.sparse_optim import EmbeddingOptimConfig, EmbeddingOptimizer
from gemc.backends.triton import packed_tokens as pt
from gemc.backends.triton.graph_runner import GraphRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import fx

from gemc.fusion_spec import elementwise
from tests.fusion import key_padding_models as km
from tests.fusion.helpers import compiled, eager_step, entries_of, params_of, run_against_eager

ENTRY = "tests/fusion/tokenwise_tower.py:build"
aten = torch.ops.aten


@functools.cache
def _graph():  # noqa: ANN202
    gm, ctx, spec = compiled(ENTRY)
    return gm, ctx, entries_of(gm, ctx), spec


def _packs(keep: torch.Tensor) -> bool:
    """The region's rule: every row a prefix, and some token kept."""
    prefix = (keep == (torch.arange(keep.shape[1]) < keep.sum(1, keepdim=True))).all()
    return bool(prefix) and bool(keep.any())


def test_the_whole_tower_is_one_guarded_region():
    gm, ctx, entries, _ = _graph()
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    assert region["guard"] == "prefix-check" and region["mask"] == "keep"
    by_name = {n.name: n for n in gm.graph.nodes}
    targets = [by_name[n].target for n in region["nodes"]]
    for op in (aten.leaky_relu.default, aten.elu.default, aten.dropout.default,
               aten.select.int, aten.layer_norm.default, aten.linear.default):
        assert op in targets, op
    assert targets.count(aten.layer_norm.default) == 2 and targets.count(aten.select.int) == 3
    assert targets.count(aten.dropout.default) == 2
    assert not [w for w in ctx.warnings if "pack-jagged-tokens" in w], ctx.warnings


def test_the_runner_runs_the_new_ops_on_packed_tokens():
    """LeakyReLU, ELU, dropout and select run on the packed values (no scatter, no
    padded op and gather back): the region's values stay at the real-token count."""
    gm, _, entries, spec = _graph()
    runner = GraphRunner(gm, entries, params_of(spec.model))
    seen: dict[str, tuple[int, ...]] = {}
    padded: list[str] = []
    new_ops = {aten.leaky_relu.default, aten.elu.default, aten.dropout.default,
               aten.select.int}
    compute, fallback = runner._call_packed, runner._padded_then_packed

    def on_tokens(node: fx.Node, env):  # noqa: ANN001, ANN202
        out = compute(node, env)
        if node.target in new_ops:
            seen[node.name] = tuple(out.shape)
        return out

    def padded_op(node: fx.Node, *args):  # noqa: ANN001, ANN202
        padded.append(node.name)
        return fallback(node, *args)

    runner._call_packed = on_tokens  # type: ignore[method-assign]
    runner._padded_then_packed = padded_op  # type: ignore[method-assign]
    x, m = km.batch("bool", [2, 0, 6, 3], torch.Generator().manual_seed(1))
    pt.GUARD_STATS.reset()
    runner(x, m).backward()
    assert pt.GUARD_STATS.as_dict() == {"calls": 1, "packed": 1, "padded": 0}
    assert len(seen) == 7 and not [n for n in padded if n in seen], padded
    # 11 real tokens: the batch dim 1, the sequence dim 11 (select: [1, H, 11, d])
    assert all(11 in s and km.B * km.L not in s and km.L not in s[:3] for s in seen.values()), seen


def test_elementwise_reads_the_pointwise_tag_not_a_list():
    graph = fx.Graph()
    x = graph.placeholder("x")
    for op, args in ((aten.leaky_relu.default, (x, 0.2)), (aten.hardtanh.default, (x,)),
                     (aten.mish.default, (x,))):
        assert elementwise(graph.call_function(op, args)), op
    # not per element: a softmax reads the row; a mutating op is not functional
    assert not elementwise(graph.call_function(aten._softmax.default, (x, -1, False)))
    assert not elementwise(graph.call_function(aten.relu_.default, (x,)))
    assert not elementwise(graph.call_function(aten.leaky_relu.default, (1.0,)))


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@example(lengths=[0] * km.B, scramble=False, seed=0)
@example(lengths=[km.L] * km.B, scramble=True, seed=1)
@given(lengths=st.lists(st.integers(0, km.L), min_size=km.B, max_size=km.B),
       scramble=st.booleans(), seed=st.integers(0, 2**16))
def test_random_masks_match_eager_and_pack_exactly_on_prefixes(lengths, scramble, seed):
    gm, _, entries, spec = _graph()
    x, m = km.batch("bool", lengths, torch.Generator().manual_seed(seed), scramble)
    pt.GUARD_STATS.reset()
    run_against_eager(gm, entries, spec.model, (x, m))
    packed = _packs(m)
    assert pt.GUARD_STATS.as_dict() == {"calls": 1, "packed": int(packed),
                                        "padded": int(not packed)}


def test_graph_mode_trains_as_eager_packed_on_prefixes_padded_otherwise():
    """The rewritten graph through torch.compile (the CPU backend, aot_eager): a prefix
    step runs the packed variant, a scrambled one the padded variant; loss and every
    gradient equal eager's over three SGD steps."""
    gm, _, entries, spec = _graph()
    model = spec.model
    emb_opt = EmbeddingOptimizer({}, EmbeddingOptimConfig(), world_size=1)
    executor = GraphExecutor(gm, {}, model, entries, tables={}, emb_opt=emb_opt,
                             device=torch.device("cpu"))
    assert executor.guard is not None and executor.not_applied == []
    gen = torch.Generator().manual_seed(7)
    batches = [km.batch("bool", [2, 0, 6, 3], gen), km.batch("bool", [2, 1, 5, 3], gen, True),
               km.batch("bool", [1, 2, 5, 3], gen)]
    pt.GUARD_STATS.reset()
    for i, batch in enumerate(batches):
        ref, grads = eager_step(model, batch)
        loss = executor(*batch)
        loss.backward()
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5, msg=f"step {i}")
        with torch.no_grad():
            for k, p in model.named_parameters():
                torch.testing.assert_close(p.grad, grads[k], atol=1e-5, rtol=1e-4,
                                           msg=f"step {i}: {k}")
                p -= 0.1 * p.grad
                p.grad = None
    assert pt.GUARD_STATS.as_dict() == {"calls": 3, "packed": 2, "padded": 1}
    assert [v["packed_regions"] for v in executor.variants] == [{"packed_tokens_0": 12}, {}]
