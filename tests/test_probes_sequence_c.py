"""Sequence and attention recommenders in their authors' idioms, third set
(tests/models/probes_c), through gemc as written: compile at h200:1x1 and h200:1x8, three
training steps against eager PyTorch on the same batches (one rank in process with the
plan's kernels, Triton interpreted; two gloo ranks in one launch), or one named error.

What each probe found (the fix it holds in place):

* torch's ``nn.TransformerEncoderLayer(batch_first=True, norm_first=True)`` with its
  default dropout, called with ``src_key_padding_mask`` only (sdpa_masks, ``"layer"``):
  pack-jagged-tokens packs its feed-forward block, and the packed runner drew the dropout
  masks over the real tokens ``[1, T, d]``, so the same seeded generator gave them other
  numbers than eager's ``[B, L, d]`` draw: a silently different training run (loss 0.488
  vs eager's 0.554 at step 1). A random op (ATen's ``nondeterministic_seeded`` tag) now
  runs on the padded tensor, laid out with the strides eager gave its input (ATen draws
  in memory order: the attention block's output is a transposed view), so the masks are
  eager's exactly (gemc.packed_rules.draws, packed_tokens.with_strides).
* HSTU as generative-recommenders writes it (hstu_gr: values + ``x_offsets``, FBGEMM's
  jagged <-> padded as flat ``index_copy`` / ``index_select``, ``einsum``, the relative
  bias from ``torch.bucketize`` or log buckets plus the pad-repeat-reshape position trick,
  ``silu(qk + bias) / n * tril`` with the tril a registered float buffer, u-gating, int32
  offsets): trains as eager on one and two ranks, but the SiLU attention stays the padded
  formula (``mask-factor``: a buffer's values are not in the graph, and ``index_copy`` is
  not read as zero padding). Not fixed (see the report).
* TiSASRec (head-major ``cat(split(Q, d, 2), 0)``, three score terms with the time-
  interval keys, ``torch.where(mask, -2**32 + 1, w)``, the clamped ``|t_i - t_j|`` from the
  loader or the forward), the two-tower model (int32 ids and float16 features in a dict,
  ``u @ v.T / temperature`` minus logQ, ``arange(B)`` labels, collisions masked with
  ``finfo.min``), SDPA masks from lengths in five spellings: equal to eager as written.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # the plans' kernels run in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gemc.backends.torch.reference import reference_losses
from gemc.backends.torch.runner import RunOptions, run

from gemc.api import compile as gemc_compile
from gemc.api import load_model
from gemc.plan import validate_plan, write_plan
from tests.runner.harness import REPO, run_scenarios, variant

PROBES = REPO / "tests" / "models" / "probes_c"
STEPS = 3
RTOL = 1e-4
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "encoder_layer_dropout": ("sdpa_masks", {"mask": "layer", "dropout": 0.1}),
    "hstu_bucketize_int32": ("hstu_gr", {"bucket": "bucketize", "int32": True}),
    "tisasrec_forward_relation": ("tisasrec", {"relation": "forward"}),
    "hf_bert_finfo": ("hf_bert", {"mask_value": "finfo"}),
    "two_tower_logq_dedup": ("two_tower", {"logq": True, "dedup": True}),
}


def _entry(module: str) -> str:
    return f"{PROBES / module}.py:build"


@functools.cache
def _compiled(name: str, topology: str) -> dict[str, Any]:
    module, args = CASES[name]
    return gemc_compile(_entry(module), args, topology=topology)


def _reference(name: str, world_size: int) -> list[float]:
    module, args = CASES[name]
    return reference_losses(load_model(_entry(module), args), steps=STEPS,
                            world_size=world_size)


def _close(name: str, got: list[float], ref: list[float]) -> None:
    assert len(got) == len(ref) == STEPS
    bad = [(i + 1, g, r) for i, (g, r) in enumerate(zip(got, ref))
           if not (abs(g - r) <= RTOL * abs(r) or (math.isnan(g) and math.isnan(r)))]
    assert not bad, f"{name}: (step, gemc run, eager) off by more than rtol {RTOL}: {bad}"


def _one_rank(plan: dict[str, Any]) -> list[float]:
    res = run(variant(plan, kernels=True), RunOptions(steps=STEPS, device="cpu",
                                                      progress=False))
    return [loss for _, loss in res.losses]


# the encoder layer runs in test_dropout_in_a_packed_region_draws_eagers_masks
@pytest.mark.parametrize("name", [name for name in CASES if name != "encoder_layer_dropout"])
def test_compiles_and_one_rank_matches_eager(name: str) -> None:
    for topology in ("h200:1x1", "h200:1x8"):
        validate_plan(_compiled(name, topology))
    _close(name, _one_rank(_compiled(name, "h200:1x1")), _reference(name, 1))


def test_dropout_in_a_packed_region_draws_eagers_masks() -> None:
    """The encoder layer's feed-forward block is one packed region (its dropouts in it):
    each dropout runs on the padded tensor with eager's strides, so its masks, and the
    losses, are eager's. Before: 0.488 at step 1 where eager has 0.554."""
    validate_plan(_compiled("encoder_layer_dropout", "h200:1x8"))
    plan = _compiled("encoder_layer_dropout", "h200:1x1")
    (region,) = [k for k in plan["kernels"] if k["kind"] == "packed_tokens"]
    assert region["guard"] == "prefix-check"
    _close("encoder_layer_dropout", _one_rank(plan), _reference("encoder_layer_dropout", 1))


def test_two_gloo_ranks_match_eager(tmp_path: Path) -> None:
    """The dropout model in module and graph mode, HSTU's jagged batch in module mode
    (its tables sharded as planned for two ranks). TiSASRec, the BERT blocks and the two
    towers matched eager on two ranks too when probed, left out for time."""
    names = ("encoder_layer_dropout", "hstu_bucketize_int32")
    scenarios = []
    for name in names:
        path = tmp_path / f"{name}.json"
        graph = name == "encoder_layer_dropout"
        write_plan(path, variant(_compiled(name, "h200:1x2"), kernels=graph))
        phases = [{"steps": STEPS, "kernels": False}]
        if graph:
            phases.append({"steps": STEPS, "kernels": True})
        scenarios.append({"name": name, "plan": str(path), "phases": phases})
    results = run_scenarios(2, scenarios, tmp_path / "results.json")
    for name in names:
        ref = _reference(name, 2)
        for phase in results[name]:
            _close(name, [loss for _, loss in phase], ref)
