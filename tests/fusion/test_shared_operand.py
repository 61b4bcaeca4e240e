"""A GEMM group whose epilogue reads the GEMM's own operand (``n + proj(n)``) under autocast:
the kernel would see the operand rounded to bf16 in the epilogue too, so graph mode runs the
group's ATen ops instead, with a warning that names it; without autocast the kernel runs."""

from __future__ import annotations

import warnings

import pytest
import torch
from gemc.backends.triton.graph_runner import GraphRunner, gemm_operand_in_epilogue

from tests.fusion.helpers import compiled, eager_step, entries_of, fresh_seed, params_of

MODEL = "tests/fusion/models.py:build_self_residual"


def test_shared_operand_group_falls_back_loudly_under_autocast() -> None:
    gm, ctx, spec = compiled(MODEL)
    entries = entries_of(gm, ctx)
    shared = [e for e in entries if e["kind"] == "gemm_epilogue"
              and gemm_operand_in_epilogue(e["structure"])]
    assert len(shared) == 1, [e["nodes"] for e in entries]
    model = spec.model
    batch = spec.make_batch(fresh_seed(), "cpu")
    ref, expected = eager_step(model, batch, torch.bfloat16)

    runner = GraphRunner(gm, entries, params_of(model))
    with pytest.warns(RuntimeWarning, match=f"kernel {shared[0]['name']} runs as its ATen ops"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = runner(*batch)
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    loss.backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[k], atol=1e-6, rtol=1e-6, msg=k)

    # no autocast: the generated kernel runs, silently, and matches eager fp32
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = runner(*batch)
    torch.testing.assert_close(got, model(*batch), atol=1e-5, rtol=1e-5)
