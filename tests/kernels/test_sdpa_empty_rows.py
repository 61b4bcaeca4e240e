"""What eager SDPA gives a query row whose boolean mask keeps no key: 0, forward and backward.

Why: gemc's attention kernels give such a row 0 and no gradient (``varlen_key_attention``,
``key_padding_attention``'s kernels, the jagged kernels' empty histories) because eager
``scaled_dot_product_attention`` does under an all-False boolean mask on torch 2.13; the
compiled models are checked against eager on that assumption. PyTorch changed this once
(older releases gave NaN), and the GPU machine runs torch 2.11 with CUDA backends the CPU
never exercises, so this runs there too (``GEMC_TEST_DEVICE=cuda``): every backend that
accepts the call must give 0, or the kernels' empty-row convention no longer matches eager.
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


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name.lower())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
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
