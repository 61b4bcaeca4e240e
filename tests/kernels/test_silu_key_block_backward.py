"""The silu attention's key-block backward (``SILU_KEY_BLOCK_BACKWARD``: one program per
sequence and key block, the heads looped where they share the bias, its gradient summed
without atomics into a buffer that is never zeroed) computes the padded formula's output
and gradients: with dq fused (relaxed atomics) or from the dq kernel, causal or not, for a
bias shared by the heads, per head, or broadcast over the batch, on packed values and on
the padded op, with lengths 0..L. Its output buffers are filled with NaN before the
kernel runs, so an element it failed to write fails the comparison.

Also: the two-kernel path's dk/dv kernel no longer zeroes the bias gradient that the dq
kernel wrote before it (``_accumulated``), which on Triton 3.6 emptied the first step's
bias gradient."""

from __future__ import annotations

import importlib

import pytest
import torch
from gemc.backends.triton import config_choice as cc
from gemc.backends.triton import jagged_attention, jagged_to_padded
from gemc.backends.triton import ops as _ops  # noqa: F401  (registers the gemc:: ops)
from kernel_helpers import nan_buffers, silu_padded_reference

kernel = importlib.import_module("gemc.backends.triton.jagged_attention")
H, D = 2, 16


@pytest.fixture
def key_block(monkeypatch):
    """The key-block backward on, its uninitialised buffers NaN."""
    monkeypatch.setattr(kernel, "SILU_KEY_BLOCK_BACKWARD", True)
    monkeypatch.setattr(kernel, "uninitialised", nan_buffers)


def _inputs(lengths, bias_shape, seed, dtype=torch.float32):  # noqa: ANN001, ANN202
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    q, k, v, g = (torch.randn(int(lengths.sum()), H, D, generator=gen).to(dtype)
                  for _ in range(4))
    bias = None if bias_shape is None else \
        (0.5 * torch.randn(*bias_shape, generator=gen)).to(dtype)
    return q, k, v, g, bias, offsets


def _run(q, k, v, g, bias, offsets, L, causal, padded):  # noqa: ANN001, ANN202
    """Out, dq, dk, dv ([B, L, H, D]) and dbias from the kernels."""
    b = bias.clone().requires_grad_() if bias is not None else None
    if padded:
        x = [jagged_to_padded(t, offsets, L).requires_grad_() for t in (q, k, v)]
        out = torch.ops.gemc.padded_silu_attention(*x, offsets, b, L, D ** -0.5, causal)
        grads = torch.autograd.grad(out, (*x, b) if b is not None else x,
                                    jagged_to_padded(g, offsets, L))
        return [out, *grads]
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    out = jagged_attention(*x, offsets, L, scale=D ** -0.5, causal=causal, kind="silu",
                           bias=b)
    grads = torch.autograd.grad(out, (*x, b) if b is not None else x, g)
    return [jagged_to_padded(t, offsets, L) for t in (out, *grads[:3])] + list(grads[3:])


def _check(got, ref, tol=1e-4):  # noqa: ANN001, ANN202
    for name, a, r in zip(("out", "dq", "dk", "dv", "dbias"), got, ref):
        assert a.shape == r.shape, name
        torch.testing.assert_close(a.float(), r, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("fused, causal, bias_shape", [
    (True, True, "shared"), (True, False, "per_head"), (True, True, "no_batch"),
    (True, False, None), (False, True, "shared"), (False, False, None),
])  # every bias shape and both masks once each, fused and not (CI time: interpreted)
def test_key_block_backward_matches_the_formula(key_block, monkeypatch, fused, causal,
                                                bias_shape):
    """Lengths 0 (no programs of its own but its bias gradient's zeros), L (every block
    full), and ragged ends; 40 rows: three 16-row key blocks under the interpreter."""
    L, B = 40, 4
    shape = {"shared": (B, 1, L, L), "per_head": (B, H, L, L), "no_batch": (L, L),
             None: None}[bias_shape]
    monkeypatch.setattr(kernel, "FUSED_SILU_BACKWARD", fused)
    if fused:
        class Refused:  # the fused path never launches the dq kernel
            def __getitem__(self, grid: object) -> object:
                raise AssertionError("the fused key-block backward launched the dq kernel")

        monkeypatch.setattr(kernel, "_bwd_dq_kernel", Refused())
    q, k, v, g, bias, offsets = _inputs(torch.tensor([0, L, 17, 33]), shape,
                                        seed=11 + causal + 2 * fused)
    got = _run(q, k, v, g, bias, offsets, L, causal, padded=False)
    _check(got, silu_padded_reference(q, k, v, bias, g, offsets, L, causal))
    if bias is not None:
        # scores no query sees get a zero gradient, written (the buffer started NaN)
        assert torch.isfinite(got[4]).all() and got[4].abs().max() > 0


@pytest.mark.parametrize("causal", [True, False])
def test_every_length_from_0_to_L_on_the_padded_op(key_block, causal):
    """The graph's op (padded rows read in place) over sequences of every length 0..L,
    with HSTU's shared ``[B, 1, L, L]`` bias and dq fused: each (length, key block) pair's
    diagonal, ragged and empty cases."""
    L = 20
    kernel.FUSED_SILU_BACKWARD = True
    try:
        lengths = torch.arange(L + 1)
        q, k, v, g, bias, offsets = _inputs(lengths, (L + 1, 1, L, L), seed=5 + causal)
        got = _run(q, k, v, g, bias, offsets, L, causal, padded=True)
    finally:
        kernel.FUSED_SILU_BACKWARD = False
    _check(got, silu_padded_reference(q, k, v, bias, g, offsets, L, causal))


def test_a_bias_gradient_of_empty_sequences_is_all_zeros(key_block):
    """No token at all: no q/k/v work, yet every element of the (never zeroed) bias
    gradient is written, as zeros."""
    L = 24
    q, k, v, g, bias, offsets = _inputs(torch.tensor([0, 0, 0]), (3, 1, L, L), seed=3)
    got = _run(q, k, v, g, bias, offsets, L, causal=True, padded=False)
    assert torch.equal(got[4], torch.zeros_like(bias))
    assert all(t.abs().max() == 0 for t in got[:4])


def test_bf16_bias_gradient_is_written_in_the_bias_dtype(key_block):
    """HSTU's dtypes: bf16 q, k, v and bias; the heads' sum kept in fp32 and stored once
    in bf16 (the buffer is the gradient: no fp32 buffer, no cast pass)."""
    L, B = 40, 3
    q, k, v, g, bias, offsets = _inputs(torch.tensor([L, 29, 7]), (B, 1, L, L), seed=9,
                                        dtype=torch.bfloat16)
    got = _run(q, k, v, g, bias, offsets, L, causal=True, padded=False)
    assert got[4].dtype == torch.bfloat16
    ref = silu_padded_reference(q, k, v, bias, g, offsets, L, causal=True)
    for name, a, r in zip(("out", "dq", "dk", "dv", "dbias"), got, ref):
        torch.testing.assert_close(a.float(), r, rtol=2e-2, atol=2e-2, msg=name)


def test_dkdv_kernel_zeroes_the_bias_gradient_only_where_it_writes_it():
    """Two-kernel path: the dq kernel adds the heads' bias gradients, then the dk/dv kernel
    runs; the dk/dv kernel's hook (called by Triton 3.6 after its config choice, even of
    one config) must leave them. Fused: the dk/dv kernel writes them, and zeroes first."""
    _, dkdv = cc._KERNELS["jagged_attention._bwd_dkdv_kernel"]
    _, dq_kernel = cc._KERNELS["jagged_attention._bwd_dq_kernel"]
    args = {"BIAS_GRAD": True, "BIAS_GRAD_ADD": True}
    dbias, dq = torch.ones(3), torch.ones(3)
    dkdv.pre_hook({**args, "DBIAS": dbias, "DQ": dq, "FUSED_DQ": False}, reset_only=True)
    assert torch.equal(dbias, torch.ones(3)) and torch.equal(dq, torch.ones(3))
    dkdv.pre_hook({**args, "DBIAS": dbias, "DQ": dq, "FUSED_DQ": True}, reset_only=True)
    assert torch.equal(dbias, torch.zeros(3)) and torch.equal(dq, torch.zeros(3))
    dbias.fill_(1.0)
    dq_kernel.pre_hook({**args, "DBIAS": dbias, "FUSED_DQ": False}, reset_only=True)
    assert torch.equal(dbias, torch.zeros(3))
