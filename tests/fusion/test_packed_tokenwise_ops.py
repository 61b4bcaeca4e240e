"""pack-jagged-tokens follows the padding through every token-wise op, recognised by what
it does: activations by ATen's ``pointwise`` tag (LeakyReLU, ELU: outside the fusion
vocabulary), dropout (one draw per element), and ``select`` over a dim that is not a token
dim (q, k, v indexed out of one projection). A BST-style post-LN block over a bool mask
input (tests/fusion/tokenwise_tower.py) is one guarded region; compiled = eager forward
and backward, interpreted and in graph mode, packed whenever the mask keeps a token (the
region is compact: a mask that is not a prefix packs its kept tokens in order)."""

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
from tests.fusion.helpers import (
    compiled,
    eager_step,
    entries_of,
    params_of,
    run_against_eager,
    train_against_eager,
)

ENTRY = "tests/fusion/tokenwise_tower.py:build"
aten = torch.ops.aten


@functools.cache
def _graph():  # noqa: ANN202
    gm, ctx, spec = compiled(ENTRY)
    return gm, ctx, entries_of(gm, ctx), spec


def _executor(gm: fx.GraphModule, entries: list, model: torch.nn.Module) -> GraphExecutor:
    """The graph-mode executor of a model without sharded tables, on the CPU."""
    emb_opt = EmbeddingOptimizer({}, EmbeddingOptimConfig(), world_size=1)
    return GraphExecutor(gm, {}, model, entries, tables={}, emb_opt=emb_opt,
                         device=torch.device("cpu"))


def _packs(keep: torch.Tensor) -> bool:
    """The (compact) region's rule: some token kept, a prefix or not."""
    return bool(keep.any())


def test_the_whole_tower_is_one_guarded_region():
    gm, ctx, entries, _ = _graph()
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    assert region["guard"] == "prefix-check" and region["mask"] == "keep"
    assert region["compact"] is True and region["every_row"] is False
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
    assert pt.GUARD_STATS.as_dict() == {"calls": 1, "packed": 1, "padded": 0, "missed_reads": 0}
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
def test_random_masks_match_eager_and_pack_whenever_a_token_is_kept(lengths, scramble, seed):
    gm, _, entries, spec = _graph()
    x, m = km.batch("bool", lengths, torch.Generator().manual_seed(seed), scramble)
    pt.GUARD_STATS.reset()
    run_against_eager(gm, entries, spec.model, (x, m))
    packed = _packs(m)
    assert pt.GUARD_STATS.as_dict() == {"calls": 1, "packed": int(packed),
                                        "padded": int(not packed), "missed_reads": 0}


def test_graph_mode_trains_as_eager_packed_on_prefixes_padded_otherwise():
    """The rewritten graph through torch.compile (the CPU backend, aot_eager): prefix and
    scrambled masks run the packed variant (the scrambled one's kept positions an input),
    a batch with no token the padded one; loss and every gradient equal eager's over four
    SGD steps."""
    gm, _, entries, spec = _graph()
    executor = _executor(gm, entries, spec.model)
    assert executor.guard is not None and executor.not_applied == []
    gen = torch.Generator().manual_seed(7)
    batches = [km.batch("bool", [2, 0, 6, 3], gen), km.batch("bool", [2, 1, 5, 3], gen, True),
               km.batch("bool", [0, 0, 0, 0], gen), km.batch("bool", [1, 2, 5, 3], gen)]
    pt.GUARD_STATS.reset()
    train_against_eager(executor, spec.model, batches)
    assert pt.GUARD_STATS.as_dict() == {"calls": 4, "packed": 3, "padded": 1, "missed_reads": 0}
    assert [v["packed_regions"] for v in executor.variants] == [{"packed_tokens_0": 12}, {}]


MHA = "tests/fusion/key_padding_models.py:build"


def test_multihead_attention_heads_views_stay_in_the_region():
    """nn.MultiheadAttention as torch.export writes it (need_weights: in-projection, views
    into ``[L, B * heads, d]``, scale, baddbmm / softmax / bmm, back to ``[L * B, E]``, the
    out-projection): the views and projections are in the region, followed by where the
    batch sits in each shape, not by a module name; the attention runs as one unit."""
    gm, ctx, spec = compiled(MHA, {"form": "mha_weights"})
    entries = entries_of(gm, ctx)
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    (attn,) = [e for e in entries if e["kind"] == "key_padding_attention"]
    assert region["every_row"] is True and attn["merged_heads"] is True
    by_name = {n.name: n for n in gm.graph.nodes}
    shapes = {n: tuple(by_name[n].meta["val"].shape) for n in region["nodes"]}
    merged_heads = [n for n, s in shapes.items() if (km.L, km.B * km.H, km.E // km.H) == s]
    assert len(merged_heads) >= 3  # q, k, v in [L, B * heads, d]
    assert region["dims"][merged_heads[0]] == [1, 0]
    tokens = [n for n, s in shapes.items() if s == (km.L * km.B, km.E)]
    assert tokens and all(region["dims"][n] == [~0, ~0] for n in tokens)  # [L * B, E]
    assert attn["output"] in region["nodes"]
    linears = [n for n in region["nodes"] if by_name[n].target is aten.linear.default]
    assert len(linears) == 2  # the in- and out-projections (the head reads the pooled rows)
    assert not [w for w in ctx.warnings if "pack-jagged-tokens" in w], ctx.warnings


def test_multihead_attention_region_matches_eager_and_needs_every_row():
    """Packed with a token on every row (prefix or not: compact), equal to eager; a row with
    no kept key
    (eager's softmax is NaN there, and the loss with it) runs padded: NaN as eager."""
    gm, ctx, spec = compiled(MHA, {"form": "mha_weights"})
    entries = entries_of(gm, ctx)
    for lengths, scramble, packed in (([2, 1, 6, 3], False, 1), ([2, 1, 6, 3], True, 1),
                                      ([6, 6, 6, 6], False, 1)):
        x, m = km.batch("mha_weights", lengths, torch.Generator().manual_seed(3), scramble)
        pt.GUARD_STATS.reset()
        run_against_eager(gm, entries, spec.model, (x, m))
        assert pt.GUARD_STATS.as_dict() == {"calls": 1, "packed": packed,
                                            "padded": 1 - packed, "missed_reads": 0}
    x, m = km.batch("mha_weights", [2, 0, 6, 3], torch.Generator().manual_seed(3))
    ref, _ = eager_step(spec.model, (x, m))
    pt.GUARD_STATS.reset()
    loss = GraphRunner(gm, entries, params_of(spec.model))(x, m)
    assert ref.isnan() and loss.isnan()
    assert pt.GUARD_STATS.as_dict() == {"calls": 1, "packed": 0, "padded": 1, "missed_reads": 0}


BST = "examples/zoo/sasrec_bst.py:build"


def test_bst_history_tower_packs_its_never_prefix_mask_compacted():
    """The zoo's BST (nn.MultiheadAttention with key_padding_mask, post-LN, LeakyReLU FFN;
    its target item appended after the history's padding, so no row is a prefix): the
    whole tower is one compact region from the embedding lookups to the masked output, and
    its own batches run packed, equal to eager forward and backward."""
    gm, ctx, spec = compiled(BST, {"preset": "tiny"})
    entries = entries_of(gm, ctx)
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    assert region["compact"] is True and region["every_row"] is True
    by_name = {n.name: n for n in gm.graph.nodes}
    targets = [by_name[n].target for n in region["nodes"]]
    assert targets.count(aten.linear.default) == 4 and aten.leaky_relu.default in targets
    assert targets.count(aten.layer_norm.default) == 2
    assert not [w for w in ctx.warnings if "pack-jagged-tokens" in w], ctx.warnings
    for step in (1, 2):
        batch = spec.make_batch(step, "cpu")
        pt.GUARD_STATS.reset()
        run_against_eager(gm, entries, spec.model, batch)
        assert pt.GUARD_STATS.as_dict() == {"calls": 1, "packed": 1, "padded": 0, "missed_reads": 0}


def test_bst_in_graph_mode_runs_its_attention_on_the_region_tokens():
    """The compiled graph (aot_eager on the CPU): BST's region packed at a bucketed count on
    its own batches, its attentions (an additive mask MultiheadAttention fills from the
    region's keep-mask, heads in the batch dim) on the region's tokens in place: no eager
    island, no second check; three SGD steps equal eager's."""
    gm, ctx, spec = compiled(BST, {"preset": "tiny"})
    entries = entries_of(gm, ctx)
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    attn = [e for e in entries if e["kind"] == "key_padding_attention"]
    assert [a["output"] for a in attn] == region["in_place"] and attn[0]["additive"]
    executor = _executor(gm, entries, spec.model)
    pt.GUARD_STATS.reset()
    train_against_eager(executor, spec.model, [spec.make_batch(s, "cpu") for s in (1, 2, 3)])
    assert pt.GUARD_STATS.as_dict() == {"calls": 3, "packed": 3, "padded": 0, "missed_reads": 0}
    # 8 rows x (4 history tokens on average + the target) of 72: a bucket of 40
    assert [v["packed_regions"] for v in executor.variants] == [{"packed_tokens_0": 40}]
    code = executor.module.code
    assert code.count("_p_attention(") == 1 and "_call_key_padding_attention(" not in code
