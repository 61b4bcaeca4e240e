"""jagged_attention (softmax and HSTU silu) against the padded PyTorch reference."""

from __future__ import annotations

import math

import pytest
import torch
from gemc.backends.triton.jagged_attention import jagged_attention, jagged_attention_reference
from hypothesis import given
from hypothesis import strategies as st
from kernel_helpers import (
    KERNEL_SETTINGS,
    SEEDS,
    fresh_generator,
    offsets_of,
    randn,
    tolerances,
)

KINDS = ["softmax", "silu"]


def _qkv(total, heads, dim, gen, dtype):
    return tuple(randn(total, heads, dim, gen=gen, dtype=dtype, requires_grad=True)
                 for _ in range(3))


def _check(lengths, heads, dim, dtype, gen, *, offset_dtype=torch.int64, max_len=None,
           **kwargs):
    """Forward and q/k/v gradients of the kernel against the reference; returns the output."""
    offsets = offsets_of(lengths, offset_dtype)
    q, k, v = _qkv(sum(lengths), heads, dim, gen, dtype)
    out = jagged_attention(q, k, v, offsets, max_len, **kwargs)
    ref = jagged_attention_reference(q, k, v, offsets, max_len, **kwargs)
    tol = tolerances(dtype)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref, **tol)
    grad = randn(*out.shape, gen=gen, dtype=dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    if out.numel() == 0:  # every sequence empty: nothing to compare but shapes
        assert all(g.shape == q.shape for g in grads)
        return out
    refs = torch.autograd.grad(ref, (q, k, v), grad)
    if dtype == torch.bfloat16:
        _check_against_fp64(q, k, v, offsets, max_len, out, grad, grads, tol, **kwargs)
        return out
    for name, g, r in zip("qkv", grads, refs):
        assert g.dtype == dtype, name
        # Gradients sum over up to 20 keys: scale the tolerance by their magnitude.
        torch.testing.assert_close(g, r, atol=tol["atol"] * max(1.0, r.abs().max().item()),
                                   rtol=tol["rtol"], msg=lambda m, n=name: f"d{n}: {m}")
    return out


def _check_against_fp64(q, k, v, offsets, max_len, out, grad, grads, tol, **kwargs):
    """bf16 gradients, measured against fp64: each within twice eager PyTorch's error on
    the same padded attention in bf16, plus what the stored bf16 output costs the softmax
    backward, plus a small floor.

    The middle term: like FlashAttention-2 (and PyTorch's flash backward), the kernel
    takes ``delta_i = dO_i . O_i`` from the bf16 output, so ``delta`` carries up to
    ``eps_i = 2^-8 sum_d |dO_id O_id|``; every ``ds_ij = p_ij (dp_ij - delta_i)`` inherits
    ``p_ij eps_i``, and ``dq_i = scale sum_j ds_ij k_j``, ``dk_j = scale sum_i ds_ij q_i``
    add at most ``scale max(eps) max|k|`` (p sums to 1 over keys) and ``scale max(eps)
    max|q| L`` (over up to L queries). Hypothesis found lengths [2, 2, 0] with scale 1.0
    (sharp scores, where ``dp - delta`` cancels) at 6% of the largest dk against fp64, 9x
    eager CPU bf16's (which keeps the output in fp32 for its backward); with delta
    computed exactly the kernel's error there was 0.7%."""
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact = torch.autograd.grad(
        jagged_attention_reference(*wide, offsets, max_len, compute_dtype=torch.float64,
                                   **kwargs), wide, grad.double())
    narrow = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    eager = torch.autograd.grad(
        jagged_attention_reference(*narrow, offsets, max_len, compute_dtype=torch.bfloat16,
                                   **kwargs), narrow, grad)
    delta_term = {"q": 0.0, "k": 0.0, "v": 0.0}
    if kwargs.get("kind", "softmax") == "softmax":
        scale = kwargs.get("scale") or q.shape[-1] ** -0.5
        eps = 2.0 ** -8 * (grad.double() * out.detach().double()).abs().sum(-1).max().item()
        longest = int((offsets[1:] - offsets[:-1]).max())
        delta_term["q"] = scale * eps * k.detach().double().abs().max().item()
        delta_term["k"] = scale * eps * q.detach().double().abs().max().item() * longest
    for name, g, r, e in zip("qkv", grads, eager, exact):
        assert g.dtype == torch.bfloat16, name
        own = (r.double() - e).abs().max().item()
        err = (g.double() - e).abs().max().item()
        floor = tol["atol"] * max(1.0, e.abs().max().item())
        assert err <= 2 * own + delta_term[name] + floor, (
            f"d{name}: max error {err:.3g} against fp64, eager bf16's {own:.3g}, delta's "
            f"bound {delta_term[name]:.3g}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference(kind, causal, dtype):
    # Lengths 0 and 1, and lengths that are not a multiple of the 16-row blocks.
    _check([5, 0, 17, 1, 20], heads=2, dim=24, dtype=dtype, gen=fresh_generator(),
           causal=causal, kind=kind)


@KERNEL_SETTINGS
@given(
    lengths=st.lists(st.integers(0, 20), min_size=1, max_size=5),
    heads=st.integers(1, 2),
    dim=st.sampled_from([1, 8, 16, 20, 32]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    offset_dtype=st.sampled_from([torch.int32, torch.int64]),
    kind=st.sampled_from(KINDS),
    causal=st.booleans(),
    silu_normalizer=st.sampled_from(["max_len", "own_len"]),
    extra_len=st.integers(0, 4),
    scale=st.one_of(st.none(), st.floats(0.05, 1.0)),
    seed=SEEDS,
)
def test_property_matches_reference(lengths, heads, dim, dtype, offset_dtype, kind, causal,
                                    silu_normalizer, extra_len, scale, seed):
    _check(lengths, heads, dim, dtype, torch.Generator().manual_seed(seed),
           offset_dtype=offset_dtype, max_len=max(lengths) + extra_len, causal=causal,
           kind=kind, silu_normalizer=silu_normalizer, scale=scale)


@pytest.mark.parametrize("kind", KINDS)
def test_all_sequences_empty(kind):
    offsets = offsets_of([0, 0, 0])
    q, k, v = _qkv(0, 2, 8, fresh_generator(), torch.float32)
    out = jagged_attention(q, k, v, offsets, kind=kind)
    assert out.shape == (0, 2, 8)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert dq.shape == dk.shape == dv.shape == (0, 2, 8)


def test_single_key_softmax_returns_its_value():
    gen = fresh_generator()
    offsets = offsets_of([1, 0, 1, 1])
    q, k, v = _qkv(3, 2, 16, gen, torch.float32)
    out = jagged_attention(q, k, v, offsets, 1)
    torch.testing.assert_close(out, v.detach(), atol=1e-6, rtol=1e-6)
    dq, dk, _ = torch.autograd.grad(out.sum(), (q, k, v))
    # softmax over one key is constant: no gradient reaches q or k (up to rounding)
    torch.testing.assert_close(dq, torch.zeros_like(dq), atol=1e-5, rtol=0)
    torch.testing.assert_close(dk, torch.zeros_like(dk), atol=1e-5, rtol=0)


def test_silu_single_key_closed_form():
    gen = fresh_generator()
    offsets = offsets_of([1, 1])
    q, k, v = _qkv(2, 1, 16, gen, torch.float32)
    out = jagged_attention(q, k, v, offsets, 1, kind="silu", scale=0.5)
    expected = torch.nn.functional.silu(0.5 * (q * k).sum(-1, keepdim=True)) * v
    torch.testing.assert_close(out, expected.detach(), atol=1e-6, rtol=1e-6)


def test_silu_normalizers_differ_by_length_ratio():
    gen = fresh_generator()
    lengths = [3, 11, 7]
    offsets = offsets_of(lengths)
    q, k, v = _qkv(sum(lengths), 2, 16, gen, torch.float32)
    by_max = jagged_attention(q, k, v, offsets, 16, kind="silu", silu_normalizer="max_len")
    by_len = jagged_attention(q, k, v, offsets, 16, kind="silu", silu_normalizer="own_len")
    ratio = torch.repeat_interleave(torch.tensor(lengths, dtype=torch.float32) / 16,
                                    torch.tensor(lengths))
    torch.testing.assert_close(by_len * ratio[:, None, None], by_max, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_sequences_do_not_see_each_other(kind):
    gen = fresh_generator()
    lengths = [9, 18, 4]
    offsets = offsets_of(lengths)
    q, k, v = (x.detach() for x in _qkv(sum(lengths), 1, 16, gen, torch.float32))
    out = jagged_attention(q, k, v, offsets, kind=kind, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:9] += randn(9, 1, 16, gen=gen)  # change only sequence 0 ...
    v2[27:] -= 3.0  # ... and sequence 2
    out2 = jagged_attention(q, k2, v2, offsets, kind=kind, causal=True)
    torch.testing.assert_close(out2[9:27], out[9:27], atol=0, rtol=0)
    assert not torch.allclose(out2[:9], out[:9])
    # Causal: changing the last key of sequence 1 leaves its earlier queries alone.
    v3 = v.clone()
    v3[26] += 1.0
    out3 = jagged_attention(q, k, v3, offsets, kind=kind, causal=True)
    torch.testing.assert_close(out3[9:26], out[9:26], atol=0, rtol=0)
    assert not torch.allclose(out3[26], out[26])


def test_strided_inputs_from_fused_projection():
    gen = fresh_generator()
    lengths = [6, 13]
    offsets = offsets_of(lengths)
    qkv = randn(sum(lengths), 3, 2, 16, gen=gen, requires_grad=True)
    q, k, v = qkv.unbind(1)  # row stride 3 * heads * dim
    out = jagged_attention(q, k, v, offsets, scale=1 / math.sqrt(16))
    ref = jagged_attention_reference(q, k, v, offsets)
    torch.testing.assert_close(out, ref, **tolerances(torch.float32))
    (g,) = torch.autograd.grad(out.square().sum(), qkv)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), qkv)
    torch.testing.assert_close(g, g_ref, **tolerances(torch.float32))


def test_rejects_bad_arguments():
    q = torch.zeros(4, 1, 8)
    offsets = offsets_of([4])
    with pytest.raises(ValueError):
        jagged_attention(q, q, q, offsets, kind="relu")
    with pytest.raises(ValueError):
        jagged_attention(q, q[:3], q, offsets)
    with pytest.raises(TypeError):
        jagged_attention(q, q, q, offsets.float())


@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)], ids=["m16n32", "m32n16"])
@pytest.mark.parametrize("kind", KINDS)
def test_unequal_query_and_key_blocks(blocks, kind, monkeypatch):
    """The masked / unmasked phase split with BLOCK_M != BLOCK_N, over several blocks.

    The interpreter's default config is 16 x 16; this forces other shapes on all three
    kernels (as the GPU autotuner may pick) with sequences spanning several blocks.
    """
    import importlib

    import triton

    # (the package re-exports the function under the module's name)
    module = importlib.import_module("gemc.backends.triton.jagged_attention")

    block_m, block_n = blocks
    config = triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=1)
    for kernel in (module._fwd_kernel, module._bwd_dq_kernel, module._bwd_dkdv_kernel):
        monkeypatch.setattr(kernel, "configs", [config])
    gen = fresh_generator()
    for causal in (False, True):
        _check([40, 33, 0, 17, 1, 64], heads=1, dim=16, dtype=torch.float32, gen=gen,
               causal=causal, kind=kind)
