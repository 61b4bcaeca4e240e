"""The additive score bias of the jagged attention kernels (softmax and SiLU: forward, and
the gradients of q, k, v and the bias, for each way it broadcasts) and the varlen-key
kernel (dense queries over the first len_b padded keys), against padded PyTorch."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.triton.jagged import jagged_to_padded, padded_to_jagged
from gemc.backends.triton.jagged_attention import (
    bias_grad_buffer,
    bias_grad_sum,
    broadcast_bias,
    jagged_attention,
)
from gemc.backends.triton.varlen_key_attention import varlen_key_attention

jagged_attention_module = importlib.import_module("gemc.backends.triton.jagged_attention")
B, H, L, D = 3, 2, 6, 4
LENGTHS = [2, 0, 6]


def _inputs(seed: int, m: int = L):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, m, D, generator=gen).requires_grad_()
    k, v = (torch.randn(B, H, L, D, generator=gen).requires_grad_() for _ in range(2))
    keep = torch.arange(L)[None] < torch.tensor(LENGTHS)[:, None]
    return q, k, v, keep, gen


def _grads(out, inputs):
    return torch.autograd.grad(out.square().sum(), inputs)


@pytest.mark.parametrize("kind", ["softmax", "silu"])
@pytest.mark.parametrize("shape", [(L, L), (B, 1, L, L), (1, H, L, L)], ids=str)
def test_bias_matches_padded(kind: str, shape: tuple[int, ...]):
    q, k, v, keep, gen = _inputs(1)
    bias = torch.randn(*shape, generator=gen).requires_grad_()
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    total = int(offsets[-1])
    qj, kj, vj = (padded_to_jagged(x.transpose(1, 2), offsets, total) for x in (q, k, v))
    out = jagged_attention(qj, kj, vj, offsets, L, scale=0.5, causal=True, kind=kind,
                           bias=bias)
    got = jagged_to_padded(out, offsets, L).transpose(1, 2)
    visible = keep[:, None, None, :] & torch.ones(L, L, dtype=torch.bool).tril()
    s = 0.5 * q @ k.transpose(-1, -2) + bias
    if kind == "silu":
        ref = (F.silu(s) / L * visible) @ v
    else:
        ref = torch.softmax(s.masked_fill(~visible, float("-inf")), -1).nan_to_num() @ v
    rows = keep[:, None, :, None].float()  # the kernel defines real query rows only
    torch.testing.assert_close(got * rows, ref * rows)
    for g, w in zip(_grads(got * rows, (q, k, v, bias)), _grads(ref * rows, (q, k, v, bias))):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("m", [1, 3, 17])
def test_varlen_keys_match_masked_sdpa(m: int):
    q, k, v, keep, _ = _inputs(2, m)
    got = varlen_key_attention(q, k, v, keep.sum(1).to(torch.int32))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
    torch.testing.assert_close(got, ref)
    for g, w in zip(_grads(got, (q, k, v)), _grads(ref, (q, k, v))):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("shape, shared", [((L, L), True), ((B, 1, L, L), True),
                                           ((1, H, L, L), False)], ids=str)
def test_heads_add_into_one_gradient_block_where_the_bias_has_no_heads(shape, shared):
    """The gradient buffer is ``[B, 1, Lb, Lb]`` for a bias shared by the heads (they add
    into it with atomics, and autotuning zeroes it before each timed run) and per head
    otherwise; the gradients themselves are checked by ``test_bias_matches_padded``."""
    bias4 = broadcast_bias(torch.zeros(shape), B, H)
    meta, buffer, view = bias_grad_buffer(bias4, {"BIAS_GRAD": True, "BIAS_GRAD_ADD": False})
    assert meta["BIAS_GRAD_ADD"] is shared
    assert buffer.shape == (B, 1 if shared else H, L, L) and view.shape == (B, H, L, L)
    assert ("DBIAS" in jagged_attention_module._accumulated(meta, (), True)) is shared
    # a launch that does not write the bias's gradient never zeroes it
    assert "DBIAS" not in jagged_attention_module._accumulated(meta, (), False)
    assert bias_grad_sum(buffer, torch.zeros(shape)).shape == shape
