"""TransAct's tower over padding representatives (``passes/pad_reps``, ``rep_layout:
"sources"``): ``nn.TransformerEncoder`` under an additive key mask that is no prefix
(padding OR a recent-time window, position 0 always kept), its output max-pooled over every
position and sliced to its first tokens. Each row keeps its tokens up to the last position
where a source (the action ids, the dense item embeddings) differs from its last position,
plus one representative for the trailing run; the attentions run on padded operands (each
row's representative on its padded positions) and the max pool and the slice read the
value scattered the same way: eager's padded values, forward and backward.

The window is drawn with ``torch.randint`` in training; both runs draw it from the same
seed (the interpreter draws it where eager does; the check ahead of the compiled graph
reads only the sources, no random op)."""

from __future__ import annotations

import torch

from examples.zoo import transact
from gemc import ir
from gemc.guard_sample import source_reps, trailing_lengths
from tests.fusion.helpers import (
    compiled,
    cpu_graph_executor,
    eager_step,
    entries_of,
    fresh_seed,
    params_of,
)

ENTRY = "examples/zoo/transact.py:build"
CFG = transact.PRESETS["tiny"]
# the multi-hot bags run as ATen ops here, so every parameter's gradient is compared
KINDS = ("packed_tokens", "key_padding_attention", "norm", "gemm_epilogue")


def _stats():
    from gemc.backends.triton import packed_tokens as pt

    pt.GUARD_STATS.reset()
    return pt.GUARD_STATS


def _batch(step: int, seed: int) -> tuple[torch.Tensor, ...]:
    """The model's own tiny batch: row 0 empty, row 1 full, the others uniform lengths."""
    return transact.synthetic_batch(CFG, step, seed)


def _window_masks_real(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``batch`` with the latest actions of rows 2 and 3 after the request time: masked as
    keys by any window (``request - time < w`` for every ``w >= 0``), rows 2's every real
    token but position 0 (which ``mask[:, 0] = 0`` keeps)."""
    types, items, times, request, *rest = batch
    times = times.clone()
    length = int((types[2] > 0).sum())
    times[2, :length] = request[2] + 1000
    times[3, :2] = request[3] + 1000
    return (types, items, times, request, *rest)


def _unequal_padding(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``batch`` with one padded item of the empty row 0 nonzero: its padded rows differ."""
    types, items, *rest = batch
    items = items.clone()
    assert int((types[0] > 0).sum()) == 0
    items[0, 4] = 1.0
    return (types, items, *rest)


def _expected_tokens(batch: tuple[torch.Tensor, ...]) -> int:
    types, items = batch[0], batch[1]
    lengths = trailing_lengths([types, items], types.shape[0], types.shape[1])
    return int((lengths + 1).clamp(max=types.shape[1]).sum())


def _step_against_eager(run, model: torch.nn.Module, batch: tuple[torch.Tensor, ...],
                        seed: int) -> None:
    """Loss and every parameter's gradient of ``run(*batch)`` against eager's, both drawing
    the window from ``seed``."""
    torch.manual_seed(seed)
    ref, grads = eager_step(model, batch)
    wants = [t for t in batch if t.requires_grad]
    expected = [t.grad.clone() for t in wants]
    for t in wants:
        t.grad = None
    torch.manual_seed(seed)
    loss = run(*batch)
    loss.backward()
    for t, g in zip(wants, expected):
        torch.testing.assert_close(t.grad, g, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[k], atol=1e-5, rtol=1e-4, msg=k)
    model.zero_grad()


def test_trailing_lengths_and_source_flags():
    ids = torch.tensor([[0, 0, 0, 0], [3, 4, 0, 0], [1, 2, 3, 4], [5, 0, 5, 0]])
    feats = torch.zeros(4, 4, 2)
    feats[1, 1] = 1.0  # real, differs from the last position
    # row 3: its id at position 2 differs from the last one, so positions 0..2 are real
    assert trailing_lengths([ids, feats], 4, 4).tolist() == [0, 2, 3, 3]
    lengths, flags = source_reps([ids, feats], 4, 4)
    assert flags.tolist() == [0, 0, 8, 0, 0, 0, 4]  # every row has a run (a full row too)
    feats[0, 3, 1] = float("nan")  # never equal to itself: the empty row keeps all 4
    assert trailing_lengths([ids, feats], 4, 4).tolist() == [4, 2, 3, 3]


def test_transact_packs_with_representatives_around_its_attentions():
    spec = transact.build("tiny")
    from gemc.passes.match_jagged_attention import MatchJaggedAttention
    from gemc.passes.pack_jagged_tokens import PackJaggedTokens

    from tests.passes.helpers import annotated, graph_of

    gm, ctx = graph_of(spec.model, spec.example_inputs,
                       annotated(MatchJaggedAttention(), PackJaggedTokens()))
    assert not [w for w in ctx.warnings if w.startswith("pack-jagged-tokens")], ctx.warnings
    (head,) = [n for n in gm.graph.nodes if ir.PACKED_REGION in n.meta]
    region = head.meta[ir.PACKED_REGION]
    assert (region["pad_rep"], region["rep_layout"], region["in_place"],
            region["compact"]) == (True, "sources", [], False)
    # the dense items and the raw ids (the buffer lookup's index: token-wise, checkable)
    assert region["rep_sources"] == ["action_items", "add"]
    assert sorted(region["rep_attentions"]) == ["scaled_dot_product_attention",
                                                   "scaled_dot_product_attention_1"]
    marked = {n.name for n in gm.graph.nodes if ir.PACKED in n.meta}
    # both layers' projections and FFNs run on the tokens; the max pool and the slice
    # read the scattered value outside the region
    assert {"linear", "linear_3", "linear_4", "linear_7", "layer_norm_3"} <= marked
    assert not {"max_1", "slice_1"} & marked


def test_transact_interpreter_matches_eager_packed():
    gm, ctx, spec = compiled(ENTRY)
    entries = entries_of(gm, ctx, KINDS)
    from gemc.backends.triton.graph_runner import GraphRunner

    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    # priced at the example batch's real tokens plus one per trailing run
    assert region["fill_source"] == "sample batch"
    assert region["sample_tokens"] == _expected_tokens(spec.example_inputs)
    # its attentions priced over each row's slots squared (the representative included)
    types, items = spec.example_inputs[:2]
    width = (trailing_lengths([types, items], CFG.batch_size, CFG.seq_len) + 1).clamp(
        max=CFG.seq_len)
    assert abs(region["attention_fill"] - float((width.double() ** 2).sum())
               / (CFG.batch_size * CFG.seq_len ** 2)) < 1e-9

    seed = fresh_seed()
    first = _batch(0, seed)
    batches = [first, _window_masks_real(_batch(1, seed)), _unequal_padding(first)]
    stats = _stats()
    for i, batch in enumerate(batches):
        runner = GraphRunner(gm, entries, params_of(spec.model), release=False)
        _step_against_eager(runner, spec.model, batch, seed + i)
        (layout,) = runner._layouts.values()
        assert layout.total == _expected_tokens(batch) < CFG.batch_size * CFG.seq_len
        # the attentions ran on the tokens (no operand scattered back): only the
        # encoder's output is, for the max pool and the slice
        assert {n.name for n in runner._unpacked} == {"layer_norm_3"}
    # the empty row whose padded item 4 differs keeps positions 0..4 as real tokens and
    # one representative for 5..11: six slots where it had one (no fallback, exact)
    assert _expected_tokens(batches[2]) == _expected_tokens(first) + 5
    assert stats.as_dict() == {"calls": 3, "packed": 3, "padded": 0, "missed_reads": 0}


def test_transact_compiled_graph_matches_eager_packed():
    gm, ctx, spec = compiled(ENTRY)
    executor = cpu_graph_executor(gm, spec.model, entries_of(gm, ctx, KINDS))
    assert executor.guard is not None and executor.guard.names == ["packed_tokens_0"]
    seed = fresh_seed()
    stats = _stats()
    first = _batch(0, seed)
    types, items, *rest = _unequal_padding(first)
    graded = (types, items.clone().requires_grad_(True), *rest)
    for i, batch in enumerate([first, _window_masks_real(_batch(1, seed)),
                               _unequal_padding(first)]):
        _step_against_eager(executor, spec.model, batch, seed + i)
    assert [bool(v["packed_regions"]) for v in executor.variants] == [True] * \
        len(executor.variants)
    code = executor.module.code
    # both layers' attentions on the region's tokens over representative keys, no island
    assert code.count("_p_rep_attention(") == 2, code
    assert "_call_key_padding_attention(" not in code
    # the items requiring a gradient of their own: padded, counted (their gradient as
    # eager's too: checked here)
    _step_against_eager(executor, spec.model, graded, seed + 3)
    assert stats.as_dict() == {"calls": 4, "packed": 3, "padded": 1, "missed_reads": 0,
                               "input_grad": 1}


class PositionedTower(torch.nn.Module):
    """TransAct's tower with a learned position embedding added to its tokens: the padded
    copies of a row then differ by position, so no representative stands for them."""

    def __init__(self, length: int = 6, dim: int = 8) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, dim, padding_idx=0)
        self.pos = torch.nn.Parameter(torch.randn(length, dim))
        layer = torch.nn.TransformerEncoderLayer(dim, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(ids.shape, dtype=torch.float).masked_fill(ids <= 0, float("-inf"))
        out = self.encoder(self.emb(ids) + self.pos, src_key_padding_mask=mask)
        return out.max(dim=1).values.sum()


def test_a_position_embedding_keeps_the_tower_padded_and_says_why():
    from gemc.passes.match_jagged_attention import MatchJaggedAttention
    from gemc.passes.pack_jagged_tokens import PackJaggedTokens

    from tests.passes.helpers import annotated, graph_of

    ids = torch.tensor([[1, 2, 0, 0, 0, 0], [3, 4, 5, 6, 7, 8], [9, 0, 0, 0, 0, 0]])
    gm, ctx = graph_of(PositionedTower(), (ids,),
                       annotated(MatchJaggedAttention(), PackJaggedTokens()))
    assert not any(ir.PACKED_REGION in n.meta for n in gm.graph.nodes)
    (why,) = [w for w in ctx.warnings if w.startswith("pack-jagged-tokens")]
    assert "max_1" in why and "padding as one representative per row does not apply" in why
    assert "p_pos" in why and "varies along the token axis" in why, why


def _history(seed: int, equal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[3, 4, 8]`` history with lengths 1, 4, 2 and its keep-mask; the padded rows of
    each row one value (``equal``) or random."""
    gen = torch.Generator().manual_seed(seed)
    keep = torch.arange(4)[None, :] < torch.tensor([1, 4, 2])[:, None]
    x = torch.randn(3, 4, 8, generator=gen)
    if equal:
        x = torch.where(keep[..., None], x, torch.randn(3, 1, 8, generator=gen))
    return x, keep


def test_generic_readers_after_a_guarded_attention_run_as_eager():
    """The scan and the additive-mask pooling of ``tests/passes/test_pack_jagged_tokens``
    (no TransAct idiom): packed over representatives, loss and gradients as eager's, with
    equal padded rows; with random ones every row keeps all its positions (each up to the
    last one that differs from its row's last): a layout as large as the padded tensor,
    which runs padded. A history input that itself requires a gradient runs padded,
    counted: eager gives each padded copy its own gradient, which one representative
    cannot."""
    from gemc.backends.triton.graph_runner import GraphRunner
    from gemc.passes.match_jagged_attention import MatchJaggedAttention
    from gemc.passes.pack_jagged_tokens import PackJaggedTokens

    from tests.passes.helpers import annotated, graph_of
    from tests.passes.test_pack_jagged_tokens import _PaddedHistory

    seed = fresh_seed()
    for kwargs in ({"mix": True}, {"mix": False, "pool_additive": True}):
        torch.manual_seed(seed)
        model = _PaddedHistory(**kwargs)
        gm, ctx = graph_of(model, _history(seed, True),
                           annotated(MatchJaggedAttention(), PackJaggedTokens()))
        entries = entries_of(gm, ctx)
        stats = _stats()
        for equal, grad in ((True, False), (False, False), (True, True)):
            x, keep = _history(seed + 1, equal)
            x.requires_grad_(grad)
            ref, grads = eager_step(model, (x, keep))
            ref_x = x.grad.clone() if grad else None
            x.grad = None
            runner = GraphRunner(gm, entries, params_of(model), release=False)
            loss = runner(x, keep)
            loss.backward()
            torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-5)
            if grad:  # (the additive pooling's -1e4: tolerances relative to the scale)
                torch.testing.assert_close(x.grad, ref_x, rtol=1e-4,
                                           atol=1e-6 * float(ref_x.abs().max()) + 1e-5)
            for k, p in model.named_parameters():
                # the additive pooling scales by -1e4: float32 summation order, relative
                # to the gradient's own scale
                scale = float(grads[k].abs().max())
                torch.testing.assert_close(p.grad, grads[k], atol=1e-6 * scale + 1e-5,
                                           rtol=1e-4, msg=k)
            model.zero_grad()
            if equal and not grad:
                (layout,) = runner._layouts.values()
                # widths min(len + 1, 4) over lengths 1, 3, 2 (the full row's last
                # position is its own run): 9 of 12 slots
                assert layout.total == 9, layout.total
            else:
                assert not runner._layouts  # padded: no layout
        assert stats.as_dict() == {"calls": 3, "packed": 1, "padded": 2, "missed_reads": 0,
                                   "input_grad": 1}


def test_representative_keys_biased_by_their_count_are_the_padded_attention():
    """``packed_tokens.rep_attention`` on a layout with representatives against SDPA on
    the padded values they scatter to, under an additive mask that is no prefix (a window
    on the latest positions, position 0 kept, an empty row's padding kept at 0): equal
    forward and in every packed operand's gradient."""
    from gemc.backends.triton import packed_tokens as pt

    gen = torch.Generator().manual_seed(fresh_seed())
    b, length, heads, dim = 4, 6, 2, 8
    lengths = torch.tensor([0, 6, 3, 5])
    layout = pt.with_rep_weights(pt.TokenLayout(pt.rep_offsets(lengths, length),
                                                int((lengths + 1).clamp(max=length).sum()),
                                                b, length))
    dims = ((0, 2),) * 4  # [1, H, T, D]
    q, k, v = (torch.randn(1, heads, layout.total, dim, generator=gen).requires_grad_(True)
               for _ in range(3))
    pad = torch.arange(length)[None, :] >= lengths[:, None]
    window = torch.zeros(b, length, dtype=torch.bool)
    window[2, :2] = window[3, :4] = True  # real tokens masked as keys (not as queries)
    drop = pad | window
    drop[:, 0] = False
    mask = torch.zeros(b, length).masked_fill(drop, float("-inf"))
    out = pt.rep_attention(q, k, v, dims, layout, mask, True, None)
    padded = [pt.scatter(x, (0, 2), layout) for x in (q, k, v)]
    ref = pt.gather(torch.nn.functional.scaled_dot_product_attention(
        *padded, attn_mask=mask[:, None, None, :]), (0, 2), 4, layout)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grad = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    # a row keeping no key is 0, as the SDPA it replaces makes it
    mask[3] = float("-inf")
    out = pt.rep_attention(q, k, v, dims, layout, mask, True, None)
    ref = pt.gather(torch.nn.functional.scaled_dot_product_attention(
        *padded, attn_mask=mask[:, None, None, :]), (0, 2), 4, layout)
    row = layout.index("row")
    assert (out[:, :, row == 3] == 0).all() and not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
