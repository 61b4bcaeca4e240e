"""The priced choice between gemc's attention kernel and the model's own attention
(passes/attention_choice): a TransAct-shaped guarded attention at a short length keeps SDPA,
loudly (both prices, the host sync); a long, partly filled history keeps the kernel; the
switch GEMC_ATTENTION_KERNEL forces either way; a model whose attention kept SDPA compiles
and equals eager (loss and gradients). Priced on an h200 topology with the example batch as
the sample (the guarded fill), on the kernel passes' pipeline (tests/fusion/helpers)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gemc.cost_model.attention_choice import attention_prices
from gemc.cost_model.attention_fit import GEMC_GUARDED_CALL_HOST_S
from gemc.cost_model.launches import GRAPH_LAUNCH_HOST_S
from gemc.passes.attention_choice import ENV, KEPT_PADDED
from gemc.passes.match_jagged_attention import SKIPPED
from torch import nn

from gemc import ir
from gemc.errors import GemcUserError
from gemc.spec import ModelSpec
from tests.fusion.helpers import compiled, entries_of, fresh_seed, run_against_eager

ENTRY = "tests/passes/test_attention_choice.py:build"
SHAPES = {  # batch, length, heads, head dim, longest history / length
    "transact": (4096, 100, 2, 48, 1.0),  # TransAct's h200 attention: S=100, 2 x 48
    "long": (512, 1024, 4, 64, 0.5),      # a long history, a quarter of it filled
    "tiny": (6, 8, 2, 8, 1.0),
    "pooled": (512, 512, 4, 64, 1.0),     # a masked pool: the tower packs around it
}


class Tower(nn.Module):
    """Self-attention over a history under a boolean keep-mask input (data: the guarded
    attention), every position read by a max pool (as TransAct's, every query row
    computed). Unpooled, a learned position embedding keeps the tower padded: an un-masked
    max pool alone now packs over padding representatives (pad_reps), so without it the
    region, not the choice, would decide."""

    def __init__(self, items: int, heads: int, head_dim: int, pooled: bool = False) -> None:
        super().__init__()
        e = heads * head_dim
        self.heads, self.pooled = heads, pooled
        self.emb = nn.Embedding(items, e)
        self.pos = None if pooled else nn.Parameter(0.02 * torch.randn(1024, e))
        self.qkv = nn.Linear(e, 3 * e)
        self.out = nn.Linear(e, e)
        self.head = nn.Linear(e, 1)

    def forward(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, length = ids.shape
        x = self.emb(ids)
        if self.pos is not None:
            x = x + self.pos[:length]
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        o = self.out(o.transpose(1, 2).reshape(b, length, -1))
        if self.pooled:  # read under the mask only: a guarded packed region
            kept = keep.unsqueeze(-1).to(o.dtype)
            return self.head((o * kept).sum(1) / kept.sum(1).clamp(min=1)).square().mean()
        return self.head(o.amax(1)).square().mean()


def _batch(shape: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, length, _, _, longest = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    # every row keeps a key (a row keeping none is NaN under SDPA's boolean mask)
    lengths = torch.randint(1, int(longest * length) + 1, (b,), generator=g)
    ids = torch.randint(0, 50, (b, length), generator=g)
    return ids, torch.arange(length)[None, :] < lengths[:, None]


def build(shape: str = "tiny") -> ModelSpec:
    _, _, heads, head_dim, _ = SHAPES[shape]
    torch.manual_seed(0)
    return ModelSpec(model=Tower(50, heads, head_dim, shape == "pooled"),
                     example_inputs=_batch(shape, 0),
                     make_batch=lambda step, device="cpu": tuple(
                         t.to(device) for t in _batch(shape, step)))


def _attention(gm):
    (node,) = [n for n in gm.graph.nodes
               if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    return node


def _compiled(shape: str, monkeypatch: pytest.MonkeyPatch, mode: str = "priced"):
    monkeypatch.setenv(ENV, mode)
    return compiled(ENTRY, {"shape": shape})


def test_transact_shaped_attention_keeps_sdpa_loudly(monkeypatch):
    gm, ctx, _ = _compiled("transact", monkeypatch)
    node = _attention(gm)
    assert not entries_of(gm, ctx, ["key_padding_attention"])
    assert node.meta[SKIPPED].startswith(KEPT_PADDED)
    (warning,) = [w for w in ctx.warnings if KEPT_PADDED in w]
    assert f"{node.name} stays padded SDPA" in warning
    assert "gemc's guarded attention priced" in warning and "host sync" in warning
    assert "the sample batch's kept tokens" in warning and f"{ENV}=always" in warning
    gemc_ms, padded_ms = (float(x) for x in
                          warning.split("priced ", 1)[1].split(" ms for", 1)[0].split(" ms vs "))
    # slower by the host cost its sync exposes, not by the kernel's work
    assert padded_ms < gemc_ms and gemc_ms - 1e3 * GEMC_GUARDED_CALL_HOST_S < padded_ms


def test_long_partly_filled_history_keeps_the_kernel(monkeypatch):
    gm, ctx, _ = _compiled("long", monkeypatch)
    (entry,) = entries_of(gm, ctx, ["key_padding_attention"])
    prices = _attention(gm).meta["gemc.kernel"]["attention_prices"]
    assert prices["guarded"] and prices["fill_source"] == "the sample batch's kept tokens"
    assert 0.15 < prices["fill"] < 0.35
    assert prices["gemc_ms"] < prices["padded_ms"]
    assert entry["predicted"]["attention"] == prices  # in the plan's kernel entry
    assert not any(KEPT_PADDED in w for w in ctx.warnings)


def test_slower_for_its_sync_alone_keeps_the_kernel_a_packed_region_runs(monkeypatch):
    # priced slower only with its own per-call sync, which the region's one check ahead
    # of the graph replaces: settled after pack-jagged-tokens, kept, repriced without it
    gm, ctx, _ = _compiled("pooled", monkeypatch)
    node = _attention(gm)
    (region,) = [f for n in gm.graph.nodes if (f := n.meta.get("gemc.packed_region"))]
    assert node.name in region["in_place"]
    prices = node.meta["gemc.kernel"]["attention_prices"]
    assert not prices["guarded"]
    # its own launches' host time added, at the step model's per-launch price (issue 17)
    assert prices["gemc_ms"] == pytest.approx(prices["kernel_ms"] + prices["launch_ms"])
    assert prices["launch_ms"] == pytest.approx(3 * 1e3 * GRAPH_LAUNCH_HOST_S)
    assert prices["padded_ms"] == pytest.approx(prices["padded_kernel_ms"]
                                                + prices["padded_launch_ms"])
    assert prices["kernel_ms"] < prices["padded_kernel_ms"] \
        < prices["kernel_ms"] + prices["host_ms"]
    assert "gemc.attention_choice_pending" not in node.meta
    assert not any(KEPT_PADDED in w for w in ctx.warnings)


def test_the_switch_forces_either_way(monkeypatch):
    gm, ctx, _ = _compiled("transact", monkeypatch, "always")
    assert entries_of(gm, ctx, ["key_padding_attention"])
    gm, ctx, _ = _compiled("long", monkeypatch, "never")
    assert not entries_of(gm, ctx, ["key_padding_attention"])
    assert _attention(gm).meta[SKIPPED] == f"{KEPT_PADDED}: {ENV}=never"
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(GemcUserError, match=ENV):
        compiled(ENTRY, {"shape": "tiny"})


def test_prices_add_the_host_only_after_a_sync_and_copies_only_off_tokens():
    synced = attention_prices(2e-4, 5e-4, guarded=True, fill=0.5, fill_source="sample")
    assert synced.gemc_s == pytest.approx(2e-4 + GEMC_GUARDED_CALL_HOST_S)
    assert synced.gemc_slower and not synced.kernel_slower
    assert not synced.on_tokens().gemc_slower
    copied = attention_prices(2e-4, 5e-4, guarded=False, fill=0.5, fill_source="offsets",
                              copies_s=4e-4)
    assert copied.gemc_s == pytest.approx(6e-4) and copied.gemc_slower
    assert copied.on_tokens().gemc_s == pytest.approx(2e-4)
    with pytest.raises(ValueError, match="negative"):
        attention_prices(-1.0, 1.0, guarded=False, fill=1.0, fill_source="x")


def test_attention_kept_as_sdpa_compiles_and_equals_eager(monkeypatch):
    gm, ctx, spec = _compiled("tiny", monkeypatch)
    assert _attention(gm).meta[SKIPPED].startswith(KEPT_PADDED)
    assert not entries_of(gm, ctx, ["key_padding_attention"])
    run_against_eager(gm, entries_of(gm, ctx), spec.model, _batch("tiny", fresh_seed()))


def test_settle_keeps_a_match_a_packed_region_runs_and_ungroups_the_rest():
    """A match priced slower only for its copies or its sync (pending): kept where a packed
    region runs it on its tokens (``gemc.packed`` on it, as GEM's two self-attentions over
    offsets), repriced without copies and sync; ungrouped, loudly, elsewhere."""
    from gemc.passes.attention_choice import PENDING, settle

    from gemc.context import PassContext

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    kept, dropped = (graph.call_function(torch.relu, (x,)) for _ in range(2))
    graph.output((kept, dropped))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    prices = {"gemc_ms": 6.45, "kernel_ms": 5.19, "copies_ms": 1.26, "host_ms": 1.64,
              "padded_ms": 5.43, "guarded": False}
    for i, node in enumerate((kept, dropped)):
        node.meta[ir.GROUP] = f"jagged_attention_{i}"
        node.meta[ir.KERNEL] = {"id": f"jagged_attention_{i}", "kind": "jagged_attention",
                                "attention_prices": dict(prices)}
        node.meta[PENDING] = (SKIPPED, "{node} stays padded SDPA ({why})", "kept-padded: x")
    kept.meta[ir.PACKED] = {"id": "packed_tokens_0"}
    ctx = PassContext()
    assert settle(gm, ctx) == 1
    choice = kept.meta[ir.KERNEL]["attention_prices"]
    # the kernel and its 3 launches' host, against SDPA's kernels and its 4 launches'
    launch = 1e3 * GRAPH_LAUNCH_HOST_S
    assert choice["gemc_ms"] == pytest.approx(5.19 + 3 * launch) and choice["copies_ms"] == 0.0
    assert choice["padded_ms"] == pytest.approx(5.43 + 4 * launch)
    assert (choice["launches"], choice["padded_launches"]) == (3, 4)
    assert kept.meta[ir.GROUP] == "jagged_attention_0" and PENDING not in kept.meta
    assert ir.KERNEL not in dropped.meta and ir.GROUP not in dropped.meta
    assert dropped.meta[SKIPPED] == "kept-padded: x"
    assert ctx.warnings == [f"{dropped.name} stays padded SDPA (kept-padded: x)"]


def _pending_in_region(prices: dict[str, float], region: dict | None = None
                       ) -> tuple[torch.fx.GraphModule, torch.fx.Node]:
    """A guarded key-padding match left pending (priced at fill 1, no sample) with
    ``prices``, in a packed region over padding representatives that runs it in place: the
    region's facts ``region`` on a node after it, or on the match itself."""
    from gemc.passes.attention_choice import PENDING

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    attn = graph.call_function(torch.relu, (x,))
    last = graph.call_function(torch.neg, (attn,)) if region is not None else attn
    graph.output(last)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    attn.meta[ir.GROUP] = "key_padding_attention_0"
    attn.meta[ir.KERNEL] = {"id": "key_padding_attention_0", "kind": "key_padding_attention",
                            "attention_prices": {**prices, "copies_ms": 0.0, "host_ms": 1.64,
                                                 "guarded": True, "fill": 1.0,
                                                 "fill_source": "padded: x"}}
    attn.meta[PENDING] = (SKIPPED, "{node} stays padded SDPA ({why})", "kept-padded: x")
    last.meta[ir.PACKED_REGION] = {"id": "packed_tokens_0", "in_place": [attn.name],
                                   "rep_attentions": [attn.name], **(region or {})}
    return gm, attn


def test_settle_prices_a_kept_match_at_its_regions_sampled_share():
    """A match priced at fill 1 for want of a sample (TransAct's mask reads a buffer the
    capture on meta has no values of) is pending too; kept in a packed region whose sample
    gives its attentions' share of the padded scores, its kernel is repriced at that share."""
    from gemc.passes.attention_choice import settle

    from gemc.context import PassContext

    gm, attn = _pending_in_region({"gemc_ms": 2.67, "kernel_ms": 1.03, "padded_ms": 0.697},
                                  {"attention_fill": 0.35})
    assert settle(gm, PassContext()) == 0
    choice = attn.meta[ir.KERNEL]["attention_prices"]
    assert choice["kernel_ms"] == pytest.approx(1.03 * 0.35)
    # over padding representatives: its key bias kernel and the attention's three
    launch = 1e3 * GRAPH_LAUNCH_HOST_S
    assert choice["launches"] == 4 and choice["launch_ms"] == pytest.approx(4 * launch)
    assert choice["gemc_ms"] == pytest.approx(1.03 * 0.35 + 4 * launch)
    assert choice["padded_ms"] == pytest.approx(0.697 + 4 * launch)
    assert choice["fill"] == 0.35 and "region" in choice["fill_source"]
    assert not choice["guarded"] and choice["gemc_ms"] < choice["padded_ms"]
    assert "slower" not in choice["note"]


@pytest.mark.parametrize("switch, max_len, head_dim, launches", [
    (None, 100, 48, 3), ("1", 128, 64, 3), ("0", 100, 48, 4), (None, 129, 48, 4),
    (None, 100, 65, 4)])
def test_settle_prices_a_short_row_softmax_backward_as_one_launch(
        switch, max_len, head_dim, launches, monkeypatch):
    """The runner's rule (``gemc.softmax_backward_rule``): a softmax region attention at
    short rows and a head dim padding to <= 64 (TransAct's 100 and 48) runs its backward as
    one kernel, so it is priced at the key bias, the forward and that one; at longer rows,
    a wider head or with the switch off, at the two-kernel backward's four."""
    from gemc.passes.attention_choice import settle

    from gemc import softmax_backward_rule as rule
    from gemc.context import PassContext

    if switch is None:
        monkeypatch.delenv(rule.ENV, raising=False)
    else:
        monkeypatch.setenv(rule.ENV, switch)
    gm, attn = _pending_in_region({"gemc_ms": 2.67, "kernel_ms": 1.03, "padded_ms": 0.697},
                                  {"attention_fill": 0.35})
    attn.meta[ir.KERNEL].update(max_len=max_len, head_dim=head_dim)
    settle(gm, PassContext())
    choice = attn.meta[ir.KERNEL]["attention_prices"]
    launch = 1e3 * GRAPH_LAUNCH_HOST_S
    assert choice["launches"] == launches
    assert choice["gemc_ms"] == pytest.approx(1.03 * 0.35 + launches * launch)


def test_the_softmax_backward_rule_is_the_kernels():
    """The core rule the cost model prices by is the one the kernels run by: the same short
    rows at every padded head dim, the same switch."""
    import importlib

    from gemc import softmax_backward_rule as rule

    kernel = importlib.import_module("gemc.backends.triton.jagged_attention")
    for max_len in (1, 64, 100, 128, 129, 400):
        for head_dim in (8, 24, 48, 64, 65, 128):
            block_d = kernel.next_pow2(head_dim, kernel.MIN_DOT)
            assert rule.padded_head_dim(head_dim) == block_d
            assert rule.short_rows(max_len, block_d) == kernel.short_rows(max_len, block_d)
            assert (rule.backward_kernels(max_len, head_dim, True) == 1) == \
                kernel.short_rows(max_len, block_d)
    assert kernel.FUSED_SOFTMAX_ENV == rule.ENV and kernel.SHORT_ROWS == rule.SHORT_ROWS


def test_settle_records_a_region_attention_priced_slower_and_keeps_it():
    """A region attention whose kernel and launches cost more than the model's SDPA is kept
    (the region runs it on its tokens), its note saying it is priced slower."""
    from gemc.passes.attention_choice import settle

    from gemc.context import PassContext

    gm, attn = _pending_in_region({"gemc_ms": 2.0, "kernel_ms": 0.5, "padded_ms": 0.45})
    assert settle(gm, PassContext()) == 0
    choice = attn.meta[ir.KERNEL]["attention_prices"]
    assert choice["gemc_ms"] > choice["padded_ms"] and "slower" in choice["note"]
    assert attn.meta[ir.GROUP] == "key_padding_attention_0"


def test_transact_packs_and_keeps_its_attentions_under_the_priced_choice(monkeypatch):
    """The zoo's TransAct at h200 shapes (batch 256: both prices scale with it), priced, built
    on meta as ``gemc compile`` builds it: its guarded attentions' fill cannot be sampled at
    compile (a buffer lookup on meta), so the choice waits for pack-jagged-tokens, whose
    region over padding representatives runs them on its tokens, and keeps them (without
    the wait both keep SDPA: checked)."""
    monkeypatch.setenv(ENV, "priced")
    gm, ctx, _ = compiled("examples/zoo/transact.py:build", {"preset": "h200", "batch_size": 256},
                          device="meta")
    entries = entries_of(gm, ctx, ["key_padding_attention"])
    assert len(entries) == 2
    regions = [f for n in gm.graph.nodes if (f := n.meta.get(ir.PACKED_REGION))]
    assert regions
    assert not any(KEPT_PADDED in w for w in ctx.warnings)
