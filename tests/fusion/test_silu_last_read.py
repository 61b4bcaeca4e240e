"""An HSTU-style tower read at the unclamped ``lengths - 1`` packs whole (issue 17).

HSTU's pointwise attention over offsets (q, k, v zero-padded by ``index_put``, no key
mask), then token-wise work over the padded ``[B, L, E]`` (a projection, a residual, a
position embedding added over all ``L`` positions, a LayerNorm and an MLP), then the user
embedding read at ``lengths - 1`` as independently written HSTU-like models read it:
``out[arange(B), lengths - 1]`` or RecBole's ``gather_indexes`` (a gather).

On an empty row eager reads ``-1``, i.e. position ``L - 1`` (indexing wraps; a gather
raises): the tower's value there, the attention being 0 on that row. So the region is laid
out over the lengths clamped to 1 with each empty row's slot standing for position
``L - 1`` (the plan's ``empty_last``, ``packed_tokens.with_empty_last``): the position
embedding is gathered there from row ``L - 1``, and the reader reads that slot. Where one
slot per empty row cannot be exact (a reader of position 0 beside it; an SDPA mixing the
row's padded positions into ``L - 1``) the tower stays padded, the warning naming the
reader and why.

Checked: the plan's region (intent), and compiled = eager, loss and the gradients of every
parameter and of the input values, on fresh random lengths with empty and full rows, in the
interpreter and in graph mode (Inductor on the CPU)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.triton import packed_tokens as pt
from gemc.backends.triton.graph_runner import GraphRunner
from gemc.backends.triton.kinds import attention as attention_kinds
from torch import nn

from gemc.spec import ModelSpec
from tests.fusion.helpers import (
    compiled,
    cpu_graph_executor,
    entries_of,
    fresh_seed,
    lengths_of_total,
    params_of,
    values_batch,
)

ENTRY = "tests/fusion/test_silu_last_read.py:build"
B, L, E, H = 4, 6, 8, 2
TOKENS = 12  # the captured batch's token count (the graph's static shapes hold it)
aten = torch.ops.aten


class HstuTower(nn.Module):
    """Values + offsets; u, v, q, k from one projection; q, k, v padded by ``index_put``
    over the offsets; ``silu(q k^T + rab) / L`` under a ``tril``; ``u * layer_norm(attn)``
    projected, plus the padded input and a position embedding over all ``L`` positions;
    a pre-norm MLP block; the user embedding read at ``read``: ``index``
    (``y[arange(B), lengths - 1]``), ``gather`` (RecBole's ``gather_indexes(y, lengths -
    1)``), ``both`` (``lengths - 1`` and position 0: two positions of an empty row),
    ``sdpa`` (a causal SDPA over the tower, then ``lengths - 1``)."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.read = read
        self.uvqk = nn.Linear(E, 4 * E)
        self.rel = nn.Parameter(torch.randn(2 * L - 1) * 0.1)
        self.o = nn.Linear(E, E)
        self.pos = nn.Embedding(L, E)
        self.norm = nn.LayerNorm(E)
        self.mlp = nn.Sequential(nn.Linear(E, 2 * E), nn.GELU(), nn.Linear(2 * E, E))
        self.head = nn.Linear(E, 1)

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, labels: torch.Tensor
                ) -> torch.Tensor:
        b, n, dev = offsets.numel() - 1, values.shape[0], values.device
        lengths = offsets[1:] - offsets[:-1]
        row = torch.repeat_interleave(torch.arange(b, device=dev), lengths, output_size=n)
        col = torch.arange(n, device=dev) - offsets[:-1][row]
        u, v, q, k = F.silu(self.uvqk(values)).split(E, -1)

        def padded(t: torch.Tensor) -> torch.Tensor:
            return t.new_zeros(b, L, t.shape[-1]).index_put((row, col), t)

        pq, pk, pv = (padded(t).view(b, L, H, E // H) for t in (q, k, v))
        s = torch.einsum("bnhd,bmhd->bhnm", pq, pk)
        pos = torch.arange(L, device=dev)
        s = s + self.rel[pos[None, :] - pos[:, None] + L - 1]
        a = F.silu(s) / L * torch.tril(torch.ones(L, L, device=dev))[None, None]
        o = torch.einsum("bhnm,bmhd->bnhd", a, pv).reshape(b, L, E)
        y = self.o(padded(u) * F.layer_norm(o, (E,))) + padded(values) + self.pos(pos)
        y = y + self.mlp(self.norm(y))
        rows = torch.arange(b, device=dev)
        last = lengths - 1
        if self.read == "gather":
            user = y.gather(1, last.view(-1, 1, 1).expand(-1, 1, E)).squeeze(1)
        elif self.read == "both":
            user = y[rows, last] + y[:, 0]
        elif self.read == "sdpa":
            h = y.view(b, L, H, E // H).transpose(1, 2)
            z = F.scaled_dot_product_attention(h, h, h, is_causal=True)
            user = z.transpose(1, 2).reshape(b, L, E)[rows, last]
        else:
            user = y[rows, last]
        return F.mse_loss(self.head(user).squeeze(-1), labels)


def batch(lengths: list[int], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return values_batch(lengths, E, gen)


def build(read: str = "index") -> ModelSpec:
    def make(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        return tuple(t.to(device) for t in batch([2, 0, 6, 4],
                                                 torch.Generator().manual_seed(step)))

    return ModelSpec(model=HstuTower(read), example_inputs=make(0), make_batch=make)


@functools.cache
def _graph(read: str):  # noqa: ANN202
    gm, ctx, spec = compiled(ENTRY, {"read": read})
    return gm, ctx, entries_of(gm, ctx), spec


def _region(entries: list[dict[str, Any]]) -> dict[str, Any]:
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    return region


@pytest.mark.parametrize("read", ("index", "gather"))
def test_the_tower_read_at_unclamped_lengths_minus_1_packs(read: str):
    """Intent: one offset-proven region (no guard) from q, k, v over the lengths clamped to
    1 with each empty row's slot at position ``L - 1`` (``empty_last``); it holds the
    attention's output, the position embedding's sum and the MLP (the whole tower); the
    reader at ``lengths - 1`` is ``proven``, outside the region, reading its last value;
    no warning that anything stays padded."""
    gm, ctx, entries, _ = _graph(read)
    (attn,) = [e for e in entries if e["kind"] == "jagged_silu_attention"]
    region = _region(entries)
    assert region.get("guard") is None and region["offsets"] == "offsets"
    assert region["clamp_min"] == 1 and region["empty_last"] is True
    assert len(region["sources"]) == 3 and region["exits"] == []
    assert not any(s["in_order"] for s in region["sources"])
    by_name = {n.name: n for n in gm.graph.nodes}
    members = [by_name[n] for n in region["nodes"]]
    assert attn["output"] in region["nodes"]
    assert sum(n.target is aten.linear.default for n in members) == 3  # o and the MLP
    assert any(n.target is aten.gelu.default for n in members)
    assert sum(n.target is aten.native_layer_norm.default or n.target is
               aten.layer_norm.default for n in members) >= 1
    (spec,) = region["reads"]
    assert spec["proven"] is True and spec["reader"] not in region["nodes"]
    assert spec["source"] in region["nodes"] and spec["wrap"] is (read == "index")
    reader = by_name[spec["reader"]]
    assert reader.target is (aten.index.Tensor if read == "index" else aten.gather.default)
    assert not [w for w in ctx.warnings if "stays padded" in w or "stay padded" in w], \
        ctx.warnings


def test_readers_of_two_positions_of_an_empty_row_keep_the_tower_padded():
    """Intent: ``lengths - 1`` and position 0 read two positions of an empty row, one slot
    holds one: no region, the attention kernel kept (exact padded), the warning naming both
    readers and why."""
    _, ctx, entries, _ = _graph("both")
    assert [e["kind"] for e in entries if e["kind"] == "jagged_silu_attention"]
    assert not [e for e in entries if e["kind"] == "packed_tokens"]
    (why,) = [w for w in ctx.warnings if w.startswith("pack-jagged-tokens")]
    assert "stays padded" in why and "index_2" in why and "select" in why
    assert "position L - 1 of an empty row" in why and "one slot" in why


def test_an_sdpa_over_the_tower_keeps_it_padded():
    """Intent: a causal SDPA in the tower makes eager's value at ``L - 1`` of an empty row
    read the row's other padded positions, which no single slot holds: no region, the
    warning naming the reader and the attention."""
    gm, ctx, entries, _ = _graph("sdpa")
    assert not [e for e in entries if e["kind"] == "packed_tokens"]
    sdpa = next(n.name for n in gm.graph.nodes
                if n.target is aten.scaled_dot_product_attention.default)
    (why,) = [w for w in ctx.warnings if w.startswith("pack-jagged-tokens")]
    assert "stays padded" in why and sdpa in why and "unclamped lengths - 1" in why


def _with_grad(values: torch.Tensor, rest: Sequence[torch.Tensor]
               ) -> tuple[torch.Tensor, ...]:
    return (values.detach().clone().requires_grad_(True), *rest)


def _against_eager(run: Callable[..., torch.Tensor], model: nn.Module,
                   data: tuple[torch.Tensor, ...]) -> None:
    """``run``'s loss, its parameters' gradients and the input values' gradient equal
    eager's on the same batch."""
    model.zero_grad()
    ref_in = _with_grad(data[0], data[1:])
    ref = model(*ref_in)
    ref.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    got_in = _with_grad(data[0], data[1:])
    loss = run(*got_in)
    loss.backward()
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_in[0].grad, ref_in[0].grad, atol=1e-5, rtol=1e-4)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[k], atol=1e-5, rtol=1e-4, msg=k)
    model.zero_grad()


def _spy(mp: pytest.MonkeyPatch) -> list[str]:
    """Record each call of the silu attention on a region's tokens."""
    ran: list[str] = []
    on_tokens = attention_kinds.silu_attention_of_tokens

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        ran.append("tokens")
        return on_tokens(*args, **kwargs)

    mp.setattr(attention_kinds, "silu_attention_of_tokens", spy)
    return ran


@pytest.mark.parametrize("read", ("index", "gather", "sdpa"))
def test_the_interpreter_matches_eager(read: str):
    """The interpreter on fresh random lengths (an empty row, a full one; a gather rejects
    an empty row's -1, so its rows are never empty): loss and every gradient, the input's
    too, equal eager's; the region runs on the tokens (the attention on them, the reader's
    source never scattered back); the SDPA's tower padded, exactly."""
    gm, _, entries, spec = _graph(read)
    gen = torch.Generator().manual_seed(fresh_seed())
    packs = read != "sdpa"
    source = _region(entries)["reads"][0]["source"] if packs else None
    for empty in ((False, False) if read == "gather" else (True, False)):
        with pytest.MonkeyPatch.context() as mp:
            ran = _spy(mp)
            runner = GraphRunner(gm, entries, params_of(spec.model), release=False)
            _against_eager(runner, spec.model, batch(lengths_of_total(gen, B, L, TOKENS,
                                                                      empty), gen))
        assert ran == (["tokens"] if packs else [])
        if source is not None:
            assert source not in {n.name for n in runner._unpacked}


def test_an_empty_row_read_by_a_gather_raises_as_eager():
    """A gather at ``-1`` (an empty row's ``lengths - 1``) raises in eager; the packed read
    of the same row reads past the tokens and raises too, never a silent value."""
    gm, _, entries, spec = _graph("gather")
    data = batch([2, 0, 6, 4], torch.Generator().manual_seed(fresh_seed()))
    with pytest.raises((RuntimeError, IndexError)):
        spec.model(*data)
    with pytest.raises((RuntimeError, IndexError)):
        GraphRunner(gm, entries, params_of(spec.model))(*data)


def test_the_compiled_graph_trains_as_eager():
    """Graph mode (Inductor on the CPU): the reader reads the region's tokens
    (``_p_read_rows``, no scatter), the attention on them; loss and every gradient, the
    input's too, equal eager's over steps on fresh random lengths with empty and full
    rows."""
    gm, _, entries, spec = _graph("index")
    executor = cpu_graph_executor(gm, spec.model, entries)
    assert executor.guard is None and executor.not_applied == []
    gen = torch.Generator().manual_seed(fresh_seed())
    pt.GUARD_STATS.reset()
    for empty in (True, False, True):
        _against_eager(executor, spec.model, batch(lengths_of_total(gen, B, L, TOKENS,
                                                                    empty), gen))
    assert pt.GUARD_STATS.calls == 0
    code = executor.module.code
    assert "_p_read_rows(" in code and "_p_scatter(" not in code
    assert "silu_attention_of_tokens(" in code
