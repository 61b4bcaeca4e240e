"""jagged_to_padded / padded_to_jagged against their index / index_put formulations."""

from __future__ import annotations

import pytest
import torch
from gemc.backends.triton.jagged import (
    jagged_to_padded,
    jagged_to_padded_reference,
    padded_to_jagged,
    padded_to_jagged_reference,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_helpers import KERNEL_SETTINGS, SEEDS, fresh_generator, offsets_of, randn

LENGTHS = st.lists(st.integers(0, 20), min_size=0, max_size=5)
FEATURES = st.sampled_from([(), (1,), (5,), (32,), (2, 3), (3, 17)])
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
OFFSET_DTYPES = st.sampled_from([torch.int32, torch.int64])


@KERNEL_SETTINGS
@given(lengths=LENGTHS, feature=FEATURES, dtype=DTYPES, offset_dtype=OFFSET_DTYPES,
       extra=st.integers(-3, 3), pad=st.sampled_from([0.0, -1.5, float("-inf")]), seed=SEEDS)
def test_jagged_to_padded_matches_index_put(lengths, feature, dtype, offset_dtype, extra, pad,
                                            seed):
    gen = torch.Generator().manual_seed(seed)
    offsets = offsets_of(lengths, offset_dtype)
    max_len = max(0, max(lengths, default=0) + extra)  # extra < 0 truncates long sequences
    values = randn(sum(lengths), *feature, gen=gen, dtype=dtype, requires_grad=True)
    out = jagged_to_padded(values, offsets, max_len, pad)
    ref = jagged_to_padded_reference(values, offsets, max_len, pad)
    assert out.shape == (len(lengths), max_len, *feature)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    grad = randn(*out.shape, gen=gen, dtype=dtype)
    (g,) = torch.autograd.grad(out, values, grad, allow_unused=True)
    (g_ref,) = torch.autograd.grad(ref, values, grad, allow_unused=True)
    if g_ref is None:  # nothing of values reached the output (everything truncated or empty)
        g_ref = torch.zeros_like(values)
    torch.testing.assert_close(g, g_ref, atol=0, rtol=0)


@KERNEL_SETTINGS
@given(lengths=LENGTHS, feature=FEATURES, dtype=DTYPES, offset_dtype=OFFSET_DTYPES,
       extra=st.integers(-3, 3), seed=SEEDS)
def test_padded_to_jagged_matches_gather(lengths, feature, dtype, offset_dtype, extra, seed):
    gen = torch.Generator().manual_seed(seed)
    offsets = offsets_of(lengths, offset_dtype)
    max_len = max(0, max(lengths, default=0) + extra)
    padded = randn(len(lengths), max_len, *feature, gen=gen, dtype=dtype, requires_grad=True)
    out = padded_to_jagged(padded, offsets)
    ref = padded_to_jagged_reference(padded, offsets)
    if not ref.requires_grad:
        ref.requires_grad_()
    assert out.shape == (sum(lengths), *feature)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    grad = randn(*out.shape, gen=gen, dtype=dtype)
    (g,) = torch.autograd.grad(out, padded, grad)
    (g_ref,) = torch.autograd.grad(ref, padded, grad, allow_unused=True)
    if g_ref is None:  # the reference returns a fresh zero tensor when max_len == 0
        g_ref = torch.zeros_like(padded)
    torch.testing.assert_close(g, g_ref, atol=0, rtol=0)
    # Padding positions never receive gradient.
    for b, n in enumerate(lengths):
        assert torch.all(g[b, n:] == 0)


def test_round_trip_is_identity_and_padding_is_pad_value():
    gen = fresh_generator()
    lengths = [4, 0, 17, 1, 9]
    offsets = offsets_of(lengths)
    values = randn(sum(lengths), 3, gen=gen)
    padded = jagged_to_padded(values, offsets, 17, pad_value=7.0)
    assert torch.all(padded[1] == 7.0)
    assert torch.all(padded[0, 4:] == 7.0)
    torch.testing.assert_close(padded[2], values[4:21], atol=0, rtol=0)
    torch.testing.assert_close(padded_to_jagged(padded, offsets, total_len=31), values,
                               atol=0, rtol=0)


def test_truncation_zeroes_tail_rows():
    gen = fresh_generator()
    offsets = offsets_of([6, 2])
    padded = randn(2, 4, 5, gen=gen)
    out = padded_to_jagged(padded, offsets)
    torch.testing.assert_close(out[:4], padded[0], atol=0, rtol=0)
    assert torch.all(out[4:6] == 0)
    torch.testing.assert_close(out[6:], padded[1, :2], atol=0, rtol=0)


def test_all_empty_batch():
    offsets = offsets_of([0, 0, 0])
    values = torch.zeros(0, 8, requires_grad=True)
    padded = jagged_to_padded(values, offsets, 5, pad_value=-2.0)
    assert padded.shape == (3, 5, 8) and torch.all(padded == -2.0)
    padded.sum().backward()
    assert values.grad.shape == (0, 8)
    assert padded_to_jagged(padded, offsets).shape == (0, 8)


def test_rejects_bad_offsets():
    with pytest.raises(TypeError):
        jagged_to_padded(torch.zeros(3, 2), torch.tensor([0.0, 3.0]), 3)
    with pytest.raises(ValueError):
        padded_to_jagged(torch.zeros(2, 3, 2), offsets_of([3]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=9), st.integers(0, 3),
       st.integers(0, 2))
def test_packed_layout_rows_equal_searchsorted_and_trace_without_it(lengths, spare, clamp):
    """A packed region's token -> row map equals ``searchsorted(offsets[1:], t, right=True)``
    (spare slots: ``B``), and the graph it traces into has no ``searchsorted``: Inductor's
    CUDA lowering of it over a sliced boundary tensor is off by one row
    (pytorch/pytorch#182343), which silently shifted GEM's packed history on the H200."""
    from gemc.backends.triton.packed_tokens import TokenLayout
    from torch.fx.experimental.proxy_tensor import make_fx

    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    layout = TokenLayout.bounded(offsets, clamp, 7, sum(lengths) + spare)
    t = torch.arange(layout.total)
    row = torch.searchsorted(layout.offsets[1:], t, right=True)
    assert torch.equal(layout.index("row_out"), row)
    live = row < len(lengths)
    start = layout.offsets[row.clamp(max=len(lengths) - 1)]
    assert torch.equal(layout.index("pos")[live], (t - start)[live])

    def rows(off: torch.Tensor) -> torch.Tensor:
        values = layout.total - len(lengths) * clamp
        return TokenLayout.bounded(off, clamp, 7, values).index("row_out")

    traced = make_fx(rows)(offsets)
    assert not any("searchsorted" in str(n.target) or "bucketize" in str(n.target)
                   for n in traced.graph.nodes)
    assert torch.equal(traced(offsets), row)
