"""Compiled plans for the zoo tests, shared by the whole session (compiling is the slow part)."""

from __future__ import annotations

import os

import torch

# The plans' generated kernels run in Triton's interpreter on a CPU-only machine; that has
# to be chosen before Triton is first imported (the same rule as tests/runner/conftest.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
