"""Shared helpers of the kernel tests: fresh random generators, jagged batches, tolerances."""

from __future__ import annotations

import os
import random

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# The interpreter runs a kernel in about a second; keep the example counts small by default
# (GEMC_KERNEL_EXAMPLES=200 for a soak run).
KERNEL_SETTINGS = settings(
    max_examples=int(os.environ.get("GEMC_KERNEL_EXAMPLES", "12")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
)

SEEDS = st.integers(min_value=0, max_value=2**31 - 1)


def fresh_generator() -> torch.Generator:
    """A CPU generator with a new seed per call, printed so a failure can be replayed.

    Tests draw on the CPU with it and move the result to the test device (``randn`` does).
    """
    seed = random.SystemRandom().randrange(2**31)
    print(f"torch generator seed: {seed}")
    return torch.Generator().manual_seed(seed)


def offsets_of(lengths: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``[0, l0, l0+l1, ...]`` as a tensor of ``dtype``."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype)  # on the default device (the test device)


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32,
          requires_grad: bool = False) -> torch.Tensor:
    x = torch.randn(*shape, generator=gen, device="cpu").to(torch.get_default_device(), dtype)
    return x.requires_grad_(requires_grad)


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances: fp32 tight; bf16 a few units of its 8-bit mantissa."""
    if dtype == torch.bfloat16:
        return {"atol": 3e-2, "rtol": 3e-2}
    return {"atol": 2e-5, "rtol": 2e-5}
