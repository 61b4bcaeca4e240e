"""Precision tests run on the CPU (fp8 emulated) by default.

``GEMC_TEST_DEVICE=cuda pytest tests/precision`` also checks the emulation against the
real ``torch._scaled_mm`` on a GPU with fp8 tensor cores (the tests that need one skip
elsewhere). Everything here runs single-threaded: the GEMMs are tiny, and on a loaded
2-core machine thread synchronisation costs 1000x the arithmetic.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

DEVICE = os.environ.get("GEMC_TEST_DEVICE", "cpu")
if DEVICE == "cpu":  # gemc's fp8 quantisation kernels (quantizer "triton") run interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402  (after TRITON_INTERPRET: Triton reads it when kernels are defined)
import torch  # noqa: E402

MODEL = "tests/precision/models.py:build"


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def sqnr(ref: torch.Tensor, test: torch.Tensor) -> float:
    """SQNR in dB, computed here in float64 (independently of gemc.probe)."""
    ref, test = ref.detach().double(), test.detach().double()
    noise = ((ref - test) ** 2).sum()
    return float("inf") if noise == 0 else float(10 * torch.log10((ref**2).sum() / noise))
