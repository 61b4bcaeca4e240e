"""Kernel tests: on the CPU through Triton's interpreter by default, or on a GPU.

``TRITON_INTERPRET`` must be set before any gemc kernel is decorated, so it is set here, at
conftest import time, ahead of the test modules' imports. (On a machine without CUDA,
``gemc.backends.triton.runtime`` would also switch to the interpreter by itself.)

``GEMC_TEST_DEVICE=cuda pytest tests/kernels`` runs the same tests on the GPU with the
compiled kernels instead: every tensor a test makes is then created on that device. A draw
from a CPU generator (``fresh_generator``) with no device named is made on the CPU and
moved there, so the same seed gives the same numbers on both and no test has to spell the
move out (a CUDA default device would otherwise reject the CPU generator).
"""

import os

import pytest

DEVICE = os.environ.get("GEMC_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _test_device_context(device: str):
    """torch.device(device) as a context, except that a factory call drawing from a CPU
    generator without a device draws on the CPU and moves the result (see the module
    docstring). A subclass of torch's DeviceContext, so torch.get_default_device() sees it."""
    from torch.utils._device import DeviceContext, _device_constructors

    class TestDevice(DeviceContext):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            gen = kwargs.get("generator")
            if (func in _device_constructors() and kwargs.get("device") is None
                    and gen is not None and gen.device.type == "cpu"):
                grad = kwargs.pop("requires_grad", False)
                out = func(*args, **kwargs, device="cpu").to(self.device)
                return out.requires_grad_() if grad else out
            return super().__torch_function__(func, types, args, kwargs)

    return TestDevice(device)


@pytest.fixture(autouse=True)
def _tensors_on_test_device():
    if DEVICE == "cpu":
        yield
        return
    with _test_device_context(DEVICE):
        yield
