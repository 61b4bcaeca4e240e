"""match-silu-attention: HSTU's formula (matmul, silu, / n or * 1/n, a causal & length mask
by multiply or where, matmul) becomes the guarded jagged SiLU kernel; what it refuses and
why; compiled = eager forward and backward, the fallback taken exactly on non-prefix masks."""

from __future__ import annotations

import functools

import pytest
import torch
from gemc.backends.triton import key_padding_attention as kpa
from gemc.passes.match_silu_attention import SKIPPED
from torch.testing import FileCheck

from gemc import ir
from gemc.dump import format_graph
from tests.fusion import key_padding_models as km
from tests.fusion.helpers import compiled, entries_of, run_against_eager

HSTU = "tests/fusion/key_padding_models.py:build_hstu"
VARIANTS = [{}, {"query_mask": False}, {"norm": "mul", "where": True}, {"mask_input": True},
            {"bias": True}, {"bias": True, "mask_input": True, "divisor": 2 * km.L}]


@functools.cache
def _graph(key: tuple[tuple[str, object], ...]):
    gm, ctx, spec = compiled(HSTU, dict(key))
    return gm, ctx, entries_of(gm, ctx, ["jagged_silu_attention"]), spec


@pytest.mark.parametrize("args", VARIANTS, ids=str)
def test_formula_becomes_one_guarded_kernel(args: dict):
    gm, _, entries, _ = _graph(tuple(sorted(args.items())))
    (entry,) = entries
    aten = torch.ops.aten
    by_name = {n.name: n for n in gm.graph.nodes}
    # the scores, their silu, the normaliser, the mask and both matmuls: nothing [L, L] left
    targets = [by_name[n].target for n in entry["nodes"]]
    assert targets.count(aten.matmul.default) == 2 and aten.silu.default in targets
    assert entry["norm"] == args.get("divisor", km.L)
    assert entry["causal"] is True and entry["scale"] == 1.0
    # the relative bias is the kernel's operand (its gradient reaches the parameter)
    assert (entry["bias"] is not None) is args.get("bias", False)
    if args.get("bias"):
        assert by_name[entry["bias"]].target is aten.index.Tensor
    assert entry["query_mask"] is args.get("query_mask", True)
    assert entry["mask"] == ("m" if args.get("mask_input") else "lt")
    text = format_graph(gm, "after match-silu-attention")
    FileCheck().check("aten.silu.default").check_same("group=jagged_silu_attention_0") \
        .check("aten.matmul.default").check_same("kind:jagged_silu_attention").run(text)


@pytest.mark.parametrize("args,reason", [
    ({"divisor": km.L - 2}, "normaliser-below-length"),
    ({"bias": True, "einsum": True}, "einsum-spelling"),
], ids=str)
def test_refusal_names_its_reason(args: dict, reason: str):
    gm, ctx, _ = compiled(HSTU, args, priced=False, upto="match-silu-attention")
    assert not [n for n in gm.graph.nodes if ir.KERNEL in n.meta]
    out = [n for n in gm.graph.nodes if SKIPPED in n.meta]
    assert [n.meta[SKIPPED] for n in out] == [reason]
    assert any(f"({reason})" in w for w in ctx.warnings), ctx.warnings


@pytest.mark.parametrize("args", VARIANTS, ids=str)
def test_compiled_matches_eager_and_counts_the_fallback(args: dict):
    gm, _, entries, spec = _graph(tuple(sorted(args.items())))
    form = "bool" if args.get("mask_input") else "lengths"
    for scramble in (False, True):
        x, m = km.batch(form, [2, 0, 6, 3], torch.Generator().manual_seed(7), scramble)
        kpa.STATS.reset()
        run_against_eager(gm, entries, spec.model, (x, m))
        fallback = scramble and form == "bool"  # lengths always give a prefix
        assert kpa.STATS.as_dict() == {"calls": 1, "jagged": int(not fallback),
                                       "compacted": 0, "fallback": int(fallback)}
