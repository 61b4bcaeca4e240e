"""Guarded packed token regions in graph mode (the rewritten graph through torch.compile):
the mask is checked ahead of the compiled graph, which runs packed at a bucketed token count
when every row is a prefix (any kept positions, in order, in a compact region) and padded
(the model's computation) when not; either way loss
and gradients equal eager over several training steps, each outcome is counted, and the
token count is an input's size, so one compiled graph serves every bucket (Dynamo traces it
as a dynamic size: no recompile when the count changes)."""

from __future__ import annotations

import functools

import pytest
import torch
from gemc.backends.torch.graph_mode import GraphExecutor
from gemc.backends.torch.sparse_optim import EmbeddingOptimConfig, EmbeddingOptimizer
from gemc.backends.triton import key_padding_attention as kpa
from gemc.backends.triton import packed_tokens as pt
from gemc.backends.triton.inductor_graph import runner_for
from gemc.backends.triton.region_guard import BUCKETS_ENV
from torch._dynamo.utils import counters

from gemc.errors import GemcUserError
from gemc.spec import ModelSpec
from tests.fusion import key_padding_models as km
from tests.fusion.helpers import compiled, entries_of, params_of, train_against_eager

ENTRY = "tests/fusion/key_padding_models.py:build"
TWO = "tests/fusion/test_guarded_regions_compiled.py:build_two_towers"
CAUSAL = "tests/fusion/test_guarded_packed_tokens.py:build_causal_tower"


class TwoTowers(torch.nn.Module):
    """Two histories, each with its own bool mask: two guarded regions, checked apart."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = km.History("bool"), km.History("bool")

    def forward(self, x: torch.Tensor, m: torch.Tensor, y: torch.Tensor, n: torch.Tensor
                ) -> torch.Tensor:
        return self.a(x, m) + self.b(y, n)


def build_two_towers() -> ModelSpec:
    def make(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(step)
        return tuple(t.to(device) for t in (*km.batch("bool", [2, 0, 6, 3], g),
                                            *km.batch("bool", [1, 4, 6, 3], g)))

    return ModelSpec(model=TwoTowers(), example_inputs=make(0), make_batch=make)


@functools.cache
def _graph(form: str):  # noqa: ANN202
    if form == "causal_tower":
        gm, ctx, spec = compiled(CAUSAL, {"mask_input": True})
    else:
        gm, ctx, spec = compiled(TWO, {}) if form == "two" else compiled(ENTRY, {"form": form})
    return gm, entries_of(gm, ctx), spec


def _executor(form: str) -> tuple[GraphExecutor, torch.nn.Module]:
    gm, entries, spec = _graph(form)
    emb_opt = EmbeddingOptimizer({}, EmbeddingOptimConfig(), world_size=1)
    executor = GraphExecutor(gm, {}, spec.model, entries, tables={}, emb_opt=emb_opt,
                             device=torch.device("cpu"))
    regions = ["packed_tokens_0", "packed_tokens_1"] if form == "two" else ["packed_tokens_0"]
    assert executor.guard is not None and executor.guard.names == regions
    assert executor.not_applied == []
    return executor, spec.model


@pytest.mark.parametrize("form", ["bool", "causal"])
def test_prefix_masks_run_packed_and_train_as_eager(form: str):
    executor, model = _executor(form)
    lengths = [[2, 0, 6, 3], [1, 2, 5, 3], [3, 3, 1, 4]]  # 11, 11, 11 tokens: one bucket
    batches = [km.batch(form, n, torch.Generator().manual_seed(i)) for i, n in
               enumerate(lengths)]
    pt.GUARD_STATS.reset()
    kpa.STATS.reset()
    train_against_eager(executor, model, batches)
    assert pt.GUARD_STATS.as_dict() == {"calls": 3, "packed": 3, "padded": 0, "missed_reads": 0}
    # one compiled graph, its region at 12 of the 24 padded tokens (granule 24 / 16 -> 2)
    assert executor.variants == [{"autocast": None, "packed_regions": {"packed_tokens_0": 12}}]
    code = executor.module.code
    # the attention runs jagged on the region's values, its check the region's: no island
    assert "_p_attention(" in code and "_call_key_padding_attention(" not in code
    assert "_p_gather(" in code and kpa.STATS.calls == 0


def test_a_mask_that_is_no_prefix_packs_compacted_and_trains_as_eager():
    """A scrambled mask: the region is compact (nothing in it needs a prefix), so its kept
    tokens run packed in order, their positions an input next to the offsets; no padded
    graph is built and the attention's own check never runs."""
    executor, model = _executor("bool")
    gen = torch.Generator().manual_seed(3)
    batches = [km.batch("bool", [2, 0, 6, 3], gen, scramble=True),
               km.batch("bool", [2, 0, 6, 3], gen),
               km.batch("bool", [4, 1, 5, 3], gen, scramble=True)]
    pt.GUARD_STATS.reset()
    kpa.STATS.reset()
    train_against_eager(executor, model, batches)
    assert pt.GUARD_STATS.as_dict() == {"calls": 3, "packed": 3, "padded": 0, "missed_reads": 0}
    # one graph for both counts (12, then 14 kept tokens of the scrambled rows)
    assert [v["packed_regions"] for v in executor.variants] == [{"packed_tokens_0": 12}]
    assert executor.token_counts == {"packed_tokens_0": {12, 14}}
    assert "packed_tokens_0_positions" in executor.module.code and kpa.STATS.calls == 0


def test_a_region_that_needs_a_prefix_falls_back_counted_and_trains_as_eager():
    """A causal attention with no mask needs the padding to be a suffix: a scrambled mask
    runs the padded graph (the attention's own check compacting it), counted."""
    executor, model = _executor("causal_tower")
    gen = torch.Generator().manual_seed(3)
    batches = [km.batch("bool", [2, 1, 6, 3], gen, scramble=True),
               km.batch("bool", [2, 1, 6, 3], gen),
               km.batch("bool", [4, 1, 5, 3], gen, scramble=True)]
    pt.GUARD_STATS.reset()
    train_against_eager(executor, model, batches)
    assert pt.GUARD_STATS.as_dict() == {"calls": 3, "packed": 1, "padded": 2, "missed_reads": 0}
    assert [v["packed_regions"] for v in executor.variants] == [{}, {"packed_tokens_0": 12}]


def test_causal_attention_with_no_mask_runs_jagged_on_the_packed_tokens():
    """The region's unmasked causal SDPA (right-padded rows, MMoE's and SASRec's spelling)
    runs as gemc's jagged causal attention on the region's values when the region runs
    packed: no padded SDPA in the graph, no scatter of q, k, v to the padded shape for it
    (the one scatter left is the summary queries' keys, which that attention reads padded
    under its checked lengths). Trains as eager."""
    executor, model = _executor("causal_tower")
    gen = torch.Generator().manual_seed(5)
    batches = [km.batch("bool", [2, 1, 6, 3], gen), km.batch("bool", [3, 1, 5, 3], gen)]
    pt.GUARD_STATS.reset()
    train_against_eager(executor, model, batches)
    assert pt.GUARD_STATS.as_dict() == {"calls": 2, "packed": 2, "padded": 0, "missed_reads": 0}
    assert [v["packed_regions"] for v in executor.variants] == [{"packed_tokens_0": 12}]
    code = executor.module.code
    assert "aten.scaled_dot_product_attention" not in code
    (call,) = [line for line in code.splitlines() if "_p_attention(" in line]
    assert ", True);" in call  # causal: its last argument
    assert code.count("_p_scatter(") == 1


def test_varying_token_totals_run_one_graph_at_bucketed_counts(monkeypatch):
    """Random lengths every step: each packed step runs at its total rounded up to a
    multiple of the granule (24 / 4 = 6 here), all through one built graph whose token
    count is an input's size (Dynamo compiles it static, then once dynamic), and every
    step equals eager."""
    monkeypatch.setenv(BUCKETS_ENV, "4")
    executor, model = _executor("bool")
    gen = torch.Generator().manual_seed(13)  # four buckets: 12, 6, 24, 18
    lengths = [torch.randint(0, km.L + 1, (km.B,), generator=gen).tolist() for _ in range(9)]
    lengths[0] = [0] * km.B  # no token at all: padded, counted
    batches = [km.batch("bool", n, gen) for n in lengths]
    pt.GUARD_STATS.reset()
    torch._dynamo.reset()
    counters.clear()
    train_against_eager(executor, model, batches)
    totals = [sum(n) for n in lengths]
    buckets = {-(-t // 6) * 6 for t in totals if t > 0}
    assert len(buckets) >= 2  # the counts moved: a graph per count would recompile
    assert [bool(v["packed_regions"]) for v in executor.variants] == [False, True]
    assert executor.token_counts == {"packed_tokens_0": buckets}
    assert buckets <= {6, 12, 18, 24}
    # Dynamo's graphs: the padded one two (its attention's own check is an eager island,
    # one break); the packed one static at the first count, then once with the count a
    # dynamic size, which serves every later count (a graph per count: one per bucket)
    assert sum(counters["graph_break"].values()) == 1, dict(counters["graph_break"])
    assert len(buckets) >= 3 and counters["stats"]["unique_graphs"] == 4, dict(counters["stats"])
    assert pt.GUARD_STATS.as_dict() == {"calls": 9, "packed": sum(t > 0 for t in totals),
                                        "padded": sum(t == 0 for t in totals), "missed_reads": 0}


def test_two_regions_are_checked_apart_and_their_offsets_reach_the_right_one():
    """One region packed and the other padded, then the other way round, then both: each
    outcome its own graph, each equal to eager, the offsets (and kept positions) of the
    packed one only."""
    executor, model = _executor("two")
    gen = torch.Generator().manual_seed(5)

    def towers(first: tuple[list[int], bool], second: tuple[list[int], bool]):  # noqa: ANN202
        return (*km.batch("bool", first[0], gen, first[1]),
                *km.batch("bool", second[0], gen, second[1]))

    # padded: a history with no token at all (a scrambled one packs: the regions are compact)
    batches = [towers(([2, 0, 6, 3], True), ([0, 0, 0, 0], False)),
               towers(([0, 0, 0, 0], False), ([6, 6, 6, 1], True)),
               towers(([1, 1, 1, 1], True), ([6, 6, 6, 6], False))]
    pt.GUARD_STATS.reset()
    train_against_eager(executor, model, batches)
    assert pt.GUARD_STATS.as_dict() == {"calls": 6, "packed": 4, "padded": 2, "missed_reads": 0}
    assert [v["packed_regions"] for v in executor.variants] == [
        {"packed_tokens_0": 12}, {"packed_tokens_1": 20},
        {"packed_tokens_0": 4, "packed_tokens_1": 24}]


def test_bucket_rounds_up_to_the_granule_and_never_past_the_padded_count():
    assert [pt.bucket(t, 24, 16) for t in (1, 2, 3, 23, 24)] == [2, 2, 4, 24, 24]
    assert [pt.bucket(t, 100, 16) for t in (1, 7, 8, 93, 100)] == [7, 7, 14, 98, 100]
    assert len({pt.bucket(t, 4096, 16) for t in range(1, 4097)}) == 16
    with pytest.raises(ValueError, match="must be > 0"):
        pt.bucket(0, 24)


@pytest.mark.parametrize("value", ["0", "many"])
def test_a_bad_bucket_count_is_one_named_error(monkeypatch, value: str):
    monkeypatch.setenv(BUCKETS_ENV, value)
    with pytest.raises(GemcUserError, match=rf"{BUCKETS_ENV}='{value}' is not a positive"):
        _executor("bool")


def test_a_mask_the_runner_computes_itself_leaves_its_region_out_loudly():
    """The check runs ahead of the graph on the batch: a mask that needs what only the
    graph has (here a node the runner answers with its own call) cannot be checked there,
    so its region runs padded, named in a warning and in the entries left out."""
    gm, entries, spec = _graph("lengths")
    (region,) = [e for e in entries if e["kind"] == "packed_tokens"]
    mask = region["mask"]
    with pytest.warns(UserWarning, match=rf"packed_tokens_0: its mask {mask} reads {mask}, "
                                         "which the runner computes itself"):
        runner, left = runner_for(gm, entries, params_of(spec.model),
                                  calls={mask: torch.lt})
    assert left == ["packed_tokens_0"] and not runner.guarded_nodes
