"""What eager SDPA gives a query row whose boolean mask keeps no key: 0, forward and backward.

Why: gemc's attention kernels give such a row 0 and no gradient (``varlen_key_attention``,
``key_padding_attention``'s kernels, the jagged kernels' empty histories) because eager
``scaled_dot_product_attention`` does under an all-False boolean mask on torch 2.13; the
compiled models are checked against eager on that assumption. PyTorch changed this once
(older releases gave NaN), and the GPU machine runs torch 2.11 with CUDA backends the CPU
never exercises, so this runs there too (``GEMC_TEST_DEVICE=cuda``): every backend that
accepts the call must give 0, or the kernels' empty-row convention no longer matches eager.

One backend does not, measured on an H100 (torch 2.11, CUDA 13, session 26,
``benchmarks/h200_session24.sh 7``): cuDNN's attention in bf16 gives such a row non-zero
values (math and memory-efficient give 0; cuDNN refuses fp32). Eager's answer on that row
there depends on which backend PyTorch picks; gemc's kernels keep math's 0, the answer
every backend but cuDNN gives. That case is an expected failure, strict: the day cuDNN
gives 0 the mark must go.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import fresh_generator
from torch.nn.attention import SDPBackend, sdpa_kernel

DEVICE = os.environ.get("GEMC_TEST_DEVICE", "cpu")  # as tests/kernels/conftest.py reads it
# The CPU has one backend that takes a mask; on a GPU each that PyTorch may pick for it.
BACKENDS = [SDPBackend.MATH] + ([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
                                if DEVICE == "cuda" else [])
REFUSED = ("No viable backend", "No available kernel")


CUDNN_EMPTY_ROWS = pytest.mark.xfail(
    strict=True, reason="cuDNN's bf16 attention gives a row with no kept key non-zero "
    "values (H100, torch 2.11, session 26); gemc keeps math's 0")


def _cases() -> list:
    return [pytest.param(dtype, backend, id=f"{dtype}-{backend.name.lower()}",
                         marks=CUDNN_EMPTY_ROWS if (backend == SDPBackend.CUDNN_ATTENTION
                                                    and dtype == torch.bfloat16) else ())
            for backend in BACKENDS for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize(("dtype", "backend"), _cases())
def test_a_row_keeping_no_key_gives_zero_and_no_gradient(backend, dtype):
    gen = fresh_generator()
    q, k, v = (torch.randn(3, 2, 5, 16, generator=gen).to(dtype).requires_grad_()
               for _ in range(3))
    keep = torch.ones(3, 1, 1, 5, dtype=torch.bool)
    keep[1] = False  # row 1 keeps no key
    keep[2, ..., 3:] = False
    try:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
            grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    except RuntimeError as err:  # a GPU backend refusing the call is never picked for it
        assert backend != SDPBackend.MATH and any(r in str(err) for r in REFUSED), err
        return
    assert torch.equal(out[1].float(), torch.zeros_like(out[1].float())), out[1]
    assert not out.isnan().any()
    for g in grads:
        assert torch.equal(g[1].float(), torch.zeros_like(g[1].float()))
        assert not g.isnan().any()
