"""fold-transposed-linear: golden dump, what matches, and the runner's batched GEMM against
eager (fp32, and under CPU autocast in bf16), forward and backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gemc.backends.triton.transposed_linear import transposed_linear

from tests.conftest import check_golden
from tests.fusion.helpers import compiled, dump_after, entries_of, fresh_seed, run_against_eager

MIX = "tests/fusion/models.py:build_token_mix"


def test_fold_transposed_linear_golden_dump():
    check_golden("fold_transposed_linear.txt", dump_after(MIX, "fold-transposed-linear"))


def test_both_token_axis_linears_match_and_run_as_eager():
    gm, ctx, spec = compiled(MIX)
    entries = entries_of(gm, ctx)
    folded = [e for e in entries if e["kind"] == "transposed_linear"]
    assert len(folded) == 2 and {e["bias"] is None for e in folded} == {True, False}
    assert all(0 < e["predicted"]["after_ms"] < e["predicted"]["before_ms"] for e in folded)
    run_against_eager(gm, entries, spec.model, spec.make_batch(fresh_seed(), "cpu"))


def test_gem_wukong_layers_fold():
    gm, ctx, _ = compiled("examples/gem/model.py:build", {"preset": "tiny", "batch_size": 4})
    folded = [e for e in entries_of(gm, ctx) if e["kind"] == "transposed_linear"]
    # fm_proj and lcb in each of the tiny preset's Wukong layers, res_proj where n changes
    assert len(folded) >= 2 * 2 and all(e["replaces"] for e in folded)


def test_transposed_linear_values_and_gradients_under_autocast():
    gen = torch.Generator().manual_seed(fresh_seed())
    x = torch.randn(3, 2, 7, 5, generator=gen, requires_grad=True)  # [..., n, d]
    w = torch.randn(4, 7, generator=gen, requires_grad=True)
    b = torch.randn(4, generator=gen, requires_grad=True)
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got = transposed_linear(x.transpose(-1, -2), w, b)
            want = F.linear(x.transpose(-1, -2), w, b)
        assert got.shape == want.shape and got.dtype == want.dtype
        tol = {"atol": 2e-2, "rtol": 2e-2} if autocast else {}
        torch.testing.assert_close(got, want, **tol)
        g = torch.randn(want.shape, generator=gen).to(want.dtype)
        grads = torch.autograd.grad(got, (x, w, b), g)
        expected = torch.autograd.grad(want, (x, w, b), g)
        for a, e in zip(grads, expected):
            torch.testing.assert_close(a, e, **({"atol": 5e-2, "rtol": 2e-2} if autocast else {}))
