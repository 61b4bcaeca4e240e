"""segment_sum_rows (the packed region's per-row sums) against a plain fp64 sum per segment."""

from __future__ import annotations

import pytest
import torch
from gemc.backends.triton import segment_sum as mod
from gemc.backends.triton.segment_sum import segment_sum_rows
from hypothesis import given
from hypothesis import strategies as st
from kernel_helpers import KERNEL_SETTINGS, SEEDS, fresh_generator, offsets_of, randn


def _expected(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    bounds = offsets.tolist()
    return torch.stack([x[a:b].double().sum(0) for a, b in zip(bounds, bounds[1:])]) \
        if len(bounds) > 1 else x.new_zeros((0, *x.shape[1:]), dtype=torch.float64)


def _check(lengths: list[int], rest: tuple[int, ...], spare: int, dtype: torch.dtype,
           offset_dtype: torch.dtype, gen: torch.Generator) -> None:
    offsets = offsets_of(lengths, offset_dtype)
    x = randn(sum(lengths) + spare, *rest, gen=gen, dtype=dtype)
    if spare:  # rows past the last offset (a packed layout's spare slots) are never read
        x[sum(lengths):] = float("nan")
    got = segment_sum_rows(x, offsets)
    assert got.shape == (len(lengths), *rest) and got.dtype == dtype
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else \
        {"atol": 1e-3, "rtol": 2.0 ** -8}  # one bf16 rounding (to nearest) of an fp32 sum
    torch.testing.assert_close(got.double(), _expected(x, offsets), **tol)


@KERNEL_SETTINGS
@given(lengths=st.lists(st.integers(0, 70), min_size=0, max_size=6),
       rest=st.sampled_from([(1,), (5,), (16,), (130,), (3, 7)]),
       spare=st.integers(0, 5), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       offset_dtype=st.sampled_from([torch.int32, torch.int64]), seed=SEEDS)
def test_property_matches_a_plain_sum(lengths, rest, spare, dtype, offset_dtype, seed):
    """Empty and length-1 segments, widths not a multiple of the column block, rows past
    the last offset, no segments at all."""
    _check(lengths, rest, spare, dtype, offset_dtype, torch.Generator().manual_seed(seed))


def test_bf16_rows_add_up_in_fp32():
    """300 bf16 ones: a bf16 running sum stops at 256 (257 rounds back to it); fp32
    accumulation reaches 300 (the reason the gather's gradient does not add with bf16 atomics)."""
    x = torch.ones(300, 4, dtype=torch.bfloat16)
    got = segment_sum_rows(x, offsets_of([300]), torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.full((1, 4), 300.0))


def test_aten_path_matches_the_kernel(monkeypatch: pytest.MonkeyPatch):
    """The CPU path without the interpreter (ATen ops) computes the same sums."""
    gen = fresh_generator()
    x = randn(23, 6, gen=gen)
    offsets = offsets_of([4, 0, 9, 1])
    kernel = segment_sum_rows(x, offsets)
    monkeypatch.setattr(mod, "INTERPRETED", False)
    torch.testing.assert_close(segment_sum_rows(x, offsets), kernel, atol=1e-6, rtol=1e-6)
