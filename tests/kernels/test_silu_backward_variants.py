"""The silu attention's speed variants (``benchmarks/kernels.py --cases silu_variants``
times them on the H200) compute what the default kernels compute: the one-kernel backward
(``FUSED_SILU_BACKWARD``: dq added with atomics by the dk/dv kernel) equals the two-kernel
one and the padded formula in fp32, on packed values and on the padded op, with HSTU's
bias and its gradient, over several key blocks, with an empty and a full row; the fast
sigmoid (``FAST_SIGMOID``: inline PTX) is never asked of the interpreter or of fp32."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from gemc.backends.triton import jagged_attention, jagged_to_padded
from gemc.backends.triton import ops as _ops  # noqa: F401  (registers the gemc:: ops)
from kernel_helpers import silu_padded_reference

from tests.benchmark_module import load_benchmark

kernel = importlib.import_module("gemc.backends.triton.jagged_attention")
B, L, H, D = 4, 40, 2, 16  # 40 rows: three 16-row blocks (the interpreter's config)


def _run(q, k, v, bias, g, offsets, causal, fused, padded):  # noqa: ANN001, ANN202
    kernel.FUSED_SILU_BACKWARD = fused
    try:
        if padded:  # the graph's op: q, k, v padded [B, L, H, D], read in place
            x = [jagged_to_padded(t, offsets, L).requires_grad_() for t in (q, k, v)]
            b = bias.clone().requires_grad_()
            out = torch.ops.gemc.padded_silu_attention(*x, offsets, b, L, D ** -0.5, causal)
            grads = torch.autograd.grad(out, (*x, b), jagged_to_padded(g, offsets, L))
            return [out, *grads]
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        b = bias.clone().requires_grad_()
        out = jagged_attention(*x, offsets, L, scale=D ** -0.5, causal=causal, kind="silu",
                               bias=b)
        grads = torch.autograd.grad(out, (*x, b), g)
        return [jagged_to_padded(t, offsets, L) for t in (out, *grads[:3])] + [grads[3]]
    finally:
        kernel.FUSED_SILU_BACKWARD = False


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_fused_backward_equals_the_two_kernels_and_the_formula(causal, padded, monkeypatch):
    gen = torch.Generator().manual_seed(7 + causal + 2 * padded)
    lengths = torch.tensor([0, L, 17, 33])  # empty, full, ragged blocks
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    q, k, v, g = (torch.randn(int(lengths.sum()), H, D, generator=gen) for _ in range(4))
    bias = 0.1 * torch.randn(B, 1, L, L, generator=gen)
    two = _run(q, k, v, bias, g, offsets, causal, False, padded)

    class Refused:  # stands in for the dq kernel: launching it fails the test
        def __getitem__(self, grid: object) -> object:
            raise AssertionError("the fused backward launched the dq kernel")

    monkeypatch.setattr(kernel, "_bwd_dq_kernel", Refused())
    one = _run(q, k, v, bias, g, offsets, causal, True, padded)
    ref = silu_padded_reference(q, k, v, bias, g, offsets, L, causal)
    for name, a, b, r in zip(("out", "dq", "dk", "dv", "dbias"), one, two, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(a.float(), r, rtol=1e-4, atol=1e-4, msg=name)
    # an empty row gets no gradient; the dq of a real row is not zero
    assert one[1][0].abs().max() == 0 and one[1][1].abs().max() > 0


def test_fast_sigmoid_is_never_asked_of_the_interpreter_or_fp32(monkeypatch):
    monkeypatch.setattr(kernel, "FAST_SIGMOID", True)
    for dtype in (torch.float32, torch.bfloat16):
        meta = kernel._meta(torch.zeros(2, 1, 16, dtype=dtype), True, "silu", "max_len", 2)
        assert meta["FAST_SIGMOID"] is False  # this machine interprets; fp32 never
    monkeypatch.setattr(kernel, "is_interpreted", lambda: False)
    assert kernel._meta(torch.zeros(2, 1, 16, dtype=torch.bfloat16), True, "silu",
                        "max_len", 2)["FAST_SIGMOID"] is True
    assert kernel._meta(torch.zeros(2, 1, 16), True, "silu", "max_len",
                        2)["FAST_SIGMOID"] is False
    assert kernel._meta(torch.zeros(2, 1, 16, dtype=torch.bfloat16), True, "softmax",
                        "max_len", 2)["FAST_SIGMOID"] is False


def test_silu_variants_case_checks_every_variant_against_the_formula(tmp_path, monkeypatch):
    """``--cases silu_variants`` at the zoo's tiny HSTU shape: each variant timed and
    checked (output and every gradient) against the padded formula, the masked SDPA
    baselines timed, and the module flags restored after. Under the interpreter every
    flag value is run once (sigmoid, fused dq, autotuning, bias, key-block backward): six
    of the seventeen rows (each of the others combines flags tested here and in the kernel
    tests; all seventeen took ~80 s of CI)."""
    out = tmp_path / "silu.json"
    defaults = kernel.FAST_SIGMOID, kernel.FUSED_SILU_BACKWARD, kernel.SILU_KEY_BLOCK_BACKWARD
    bench = load_benchmark("kernels")
    every = [v[0] for v in bench.SILU_VARIANTS]
    assert len(every) == len(set(every)) == 17
    picked = (0, 7, 8, 11, 15, 16)
    monkeypatch.setattr(bench, "SILU_VARIANTS", tuple(bench.SILU_VARIANTS[i] for i in picked))
    for flag in range(1, 6):  # every flag is on in one picked row and off in another
        assert {v[flag] for v in bench.SILU_VARIANTS} == {True, False}, flag
    bench.main(["--smoke", "--no-compile", "--cases", "silu_variants", "--out", str(out)])
    report = json.loads(out.read_text())
    rows = report["results"]
    assert not [r for r in rows if r["error"]], [r for r in rows if r["error"]]
    summary = report["silu_variants"]
    assert summary["shape"]["causal"] is True and summary["shape"]["max_len"] == 8
    names = [v[0] for v in bench.SILU_VARIANTS]
    for name in names:
        cell = summary[name]
        assert cell["fwd_ms"] > 0 and cell["fwd_bwd_ms"] > 0
        assert cell["max_abs_err"] < 0.05 * max(1.0, summary["reference_max_abs"]), name
    assert summary["fastest_masked_sdpa_ms"] > 0
    assert (kernel.FAST_SIGMOID, kernel.FUSED_SILU_BACKWARD,
            kernel.SILU_KEY_BLOCK_BACKWARD) == defaults
