"""The tests' faster interpreter patching (tests/triton_interpreter.py) is in effect where
the kernels run interpreted, and an interpreted kernel calling jit helpers (its own and
``tl.sum``, a jit function of triton.language) computes as eager and leaves the language
as Triton's own patching leaves it."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tests.triton_interpreter import install

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
WRITTEN_FOR = "3.9.0"  # the Triton whose interpreter sources tests/triton_interpreter.py expects


@triton.jit
def _scaled(x, s):
    return x * s


@triton.jit
def _row_sums_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n + cols, mask=cols < n, other=0.0)
    tl.store(out_ptr + row, tl.sum(_scaled(x, 2.0), axis=0) + tl.cdiv(n, 4))


def test_interpreted_kernels_with_jit_helpers_compute_as_eager() -> None:
    if INTERPRETED and triton.__version__ == WRITTEN_FOR:
        assert install(), (
            f"Triton {WRITTEN_FOR} interpreted, but tests/triton_interpreter.py did not "
            "recognise its interpreter's sources (the tests still pass, minutes slower)")
    elif not INTERPRETED:
        assert not install()
    device = "cpu" if INTERPRETED else "cuda"
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(0)).to(device)
    out = torch.empty(5, device=device)
    for _ in range(2):  # the second launch starts from the first's restored language
        _row_sums_kernel[(5,)](x, out, 7, BLOCK=8)
        torch.testing.assert_close(out, (2 * x).sum(1) + 2)
        assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.tensor.__add__)
