"""Fusion tests run the generated kernels on the CPU through Triton's interpreter.

``TRITON_INTERPRET`` must be set before any kernel module is imported (``@triton.jit`` reads
it at decoration), so it is set here, at conftest import time.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
