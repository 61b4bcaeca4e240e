"""Kernel tests run on the CPU through Triton's interpreter.

``TRITON_INTERPRET`` must be set before any gemc kernel is decorated, so it is set here, at
conftest import time, ahead of the test modules' imports. (On a machine without CUDA,
``gemc.backends.triton.runtime`` would also switch to the interpreter by itself.)
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
