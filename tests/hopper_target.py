"""A subprocess prelude that makes Triton compile for an H100/H200 on a machine without a GPU.

Why: the interpreter runs kernels the GPU compiler refuses (a run-time branch whose arms
give a variable different types, for one), so tests compile the launches they care about
for ``GPUTarget("cuda", 90, 32)`` (ptxas ships with the Triton wheel). The driver answers
what a compile asks; nothing is launched. Prepend :data:`HOPPER_DRIVER` to the script a
test runs in a child process with ``TRITON_INTERPRET=0``.
"""

import textwrap

HOPPER_DRIVER = textwrap.dedent("""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime.driver import driver

    class Hopper(DriverBase):  # what a launch asks the driver, answered for an H100/H200
        @classmethod
        def is_active(cls): return True
        def map_python_to_cpp_type(self, ty): return ty
        def get_current_target(self): return GPUTarget("cuda", 90, 32)
        def get_active_torch_device(self): return torch.device("cpu")
        def get_benchmarker(self): raise NotImplementedError
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0

    driver.set_active(Hopper())
""")
