"""Kernel tests: on the CPU through Triton's interpreter by default, or on a GPU.

``TRITON_INTERPRET`` must be set before any gemc kernel is decorated, so it is set here, at
conftest import time, ahead of the test modules' imports. (On a machine without CUDA,
``gemc.backends.triton.runtime`` would also switch to the interpreter by itself.)

``GEMC_TEST_DEVICE=cuda pytest tests/kernels`` runs the same tests on the GPU with the
compiled kernels instead: every tensor a test makes is then created on that device.
"""

import os

import pytest
import torch

DEVICE = os.environ.get("GEMC_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _tensors_on_test_device():
    if DEVICE == "cpu":
        yield
        return
    with torch.device(DEVICE):
        yield
