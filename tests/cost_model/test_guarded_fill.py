"""A guarded packed region is priced at the fill its check finds on the entrypoint's example
batch (gemc.guard_sample), as the packed path that batch runs; fill 1 (padded), loudly,
without a real sample or when the sample fails the check. Issue 18: sasrec_bst's plan was
priced fully padded (+84% step time, +53% peak memory against its H200 run)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gemc.api import compile as gemc_compile
from gemc.guard_sample import SAMPLE, bucket, guard_flags, packs, sample_fill
from gemc.spec import ModelSpec

ENTRY = "tests/cost_model/test_guarded_fill.py:build"
B, L, E, H = 1024, 256, 128, 4


class Tower(nn.Module):
    """One self-attention block over a padded history under a boolean keep-mask input
    (the mask is data: the region around it is guarded), pooled under the mask."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(E)
        self.qkv = nn.Linear(E, 3 * E)
        self.out = nn.Linear(E, E)
        self.ffn = nn.Linear(E, E)
        self.head = nn.Linear(E, 1)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = self.qkv(h).view(x.shape[0], L, 3, H, E // H).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        o = self.out(o.transpose(1, 2).reshape(x.shape[0], L, E))
        y = (x + F.gelu(self.ffn(F.gelu(o)))) * keep.unsqueeze(-1).to(x.dtype)
        pooled = y.sum(1) / keep.sum(1, keepdim=True).clamp(min=1)
        return self.head(pooled).square().mean()


def _keep(lengths: torch.Tensor) -> torch.Tensor:
    return torch.arange(L, device=lengths.device)[None, :] < lengths[:, None]


def build(sample: str = "half") -> ModelSpec:
    """``sample``: the example batch's lengths: ``half`` (1..L, about half the tokens),
    ``full`` (every token real), ``meta`` (no data: the example on the meta device)."""
    def make(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        # on the CPU explicitly: gemc builds the model under torch.device("meta")
        g = torch.Generator().manual_seed(step)
        lengths = torch.randint(1, L + 1, (B,), generator=g, device="cpu") \
            if sample != "full" else torch.full((B,), L, device="cpu")
        x = torch.randn(B, L, E, generator=g, device="cpu")
        return x.to(device), _keep(lengths).to(device)

    example = make(0, "meta" if sample == "meta" else "cpu")
    return ModelSpec(model=Tower(), example_inputs=example, make_batch=make, batch_size=B)


@functools.cache
def _plan(sample: str) -> dict:
    return gemc_compile(ENTRY, {"sample": sample}, topology="h200:1x1", planner="default")


def _region(plan: dict) -> dict:
    (region,) = [k for k in plan["kernels"]
                 if k["kind"] == "packed_tokens" and k.get("guard") is not None]
    return region


def test_half_filled_sample_prices_the_packed_path_below_the_padded_one():
    half, padded = _plan("half"), _plan("meta")
    region = _region(half)
    tokens = int(_keep(torch.randint(1, L + 1, (B,),
                                     generator=torch.Generator().manual_seed(0))).sum())
    assert region["fill_source"] == SAMPLE and region["sample_tokens"] == tokens
    # the compiled graph's token count: rounded up to a bucket of B * L
    assert region["fill"] == pytest.approx(bucket(tokens, B * L) / (B * L))
    assert 0.4 < region["fill"] < 0.7 and region["attention_fill"] < region["fill"]
    assert half["predicted"]["packed_fill"][region["name"]]["fill_source"] == SAMPLE
    assert _region(padded)["fill"] == 1.0
    # the device step (what the solver ranks); this small step is launch-bound on the host,
    # so the whole step may not drop, and never rises
    assert half["predicted"]["device_step_ms"] < 0.85 * padded["predicted"]["device_step_ms"]
    assert half["predicted"]["step_ms"] <= padded["predicted"]["step_ms"] + 1e-9
    assert half["predicted"]["max_memory_gb"] < padded["predicted"]["max_memory_gb"]
    assert (half["predicted"]["activations"]["saved_bytes"]
            < 0.75 * padded["predicted"]["activations"]["saved_bytes"])


def test_full_sample_prices_exactly_the_padded_step():
    full, padded = _plan("full"), _plan("meta")
    assert _region(full)["fill_source"] == SAMPLE and _region(full)["fill"] == 1.0
    assert full["predicted"]["device_step_ms"] == pytest.approx(
        padded["predicted"]["device_step_ms"])
    assert full["predicted"]["step_ms"] == pytest.approx(padded["predicted"]["step_ms"])
    assert full["predicted"]["max_memory_gb"] == pytest.approx(
        padded["predicted"]["max_memory_gb"])


def test_no_real_sample_prices_padded_and_says_why():
    plan = _plan("meta")
    region = _region(plan)
    assert region["fill"] == 1.0 and region["fill_source"].startswith("padded: ")
    assert "not real data" in region["fill_source"]
    assert any(f"guarded-region fill: {region['name']}" in w and "priced padded" in w
               for w in plan["warnings"])


def test_the_check_on_a_sample_follows_the_runners_rule():
    keep = _keep(torch.tensor([3, 0, L, 5]))
    lengths, flags = guard_flags(keep, additive=False)
    assert lengths.tolist() == [3, 0, L, 5] and flags == [0, 0, L + 8, 1, 0]
    assert packs(flags) and not packs(flags, every_row=True)
    scrambled = keep.flip(1)
    assert guard_flags(scrambled, False)[1][0] > 0
    assert not packs(guard_flags(scrambled, False)[1]) \
        and packs(guard_flags(scrambled, False)[1], compact=True)
    additive = torch.zeros(4, L).masked_fill(~keep, float("-inf"))
    assert guard_flags(additive, True)[1] == flags
    weak = additive.masked_fill(~keep, -1.0)  # masked entries above -1e4: no key mask
    assert guard_flags(weak, True)[1][1] > 0
    # a one-token reader per row (x[arange(B), lengths - 1]): the rows it reads off the
    # kept tokens (the empty row's -1, a position past a length) count, and fail the check
    last = torch.tensor([2, -1, L - 1, 5])
    assert guard_flags(keep, False, [last])[1][4] == 2
    assert not packs(guard_flags(keep, False, [last])[1])
    # the empty row has no token to read: any position misses there
    assert guard_flags(keep, False, [torch.tensor([2, 0, L - 1, 4])])[1][4] == 1
    assert packs(guard_flags(keep[[0, 2, 3]], False, [torch.tensor([2, L - 1, 4])])[1])


def test_a_sample_failing_the_check_prices_padded_and_says_so():
    from gemc.api import annotate_model
    from gemc.entrypoint import load_model

    spec = load_model(ENTRY, {"sample": "half"}, device="cpu")
    gm = annotate_model(spec, entrypoint=ENTRY)  # parameters marked (classify-ops)
    mask = next(n.name for n in gm.graph.nodes
                if n.op == "placeholder" and n.meta["val"].dtype == torch.bool)
    region = {"mask": mask, "additive": False, "every_row": True, "compact": False}
    x, keep = spec.example_inputs
    ok = sample_fill(gm, region, (x, keep))
    assert ok["fill_source"] == SAMPLE and ok["fill"] < 1.0
    empty_row = keep.clone()
    empty_row[0] = False
    failed = sample_fill(gm, region, (x, empty_row))
    assert failed["fill"] == 1.0 and "fails the region's check" in failed["fill_source"]
    assert "keeps no token" in failed["fill_source"]
    assert sample_fill(gm, region, (x,))["fill"] == 1.0  # another arity
    assert "reads parameter" in sample_fill(
        gm, {**region, "mask": next(n.name for n in gm.graph.nodes if n.op == "placeholder")},
        (x, keep))["fill_source"]
