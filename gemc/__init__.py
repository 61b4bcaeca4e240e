"""gemc: compile a PyTorch recommendation model into an executable training plan.

Every public name but ``__version__`` is loaded on first use: importing any ``gemc.*``
module runs this file first, and ``gemc --help`` or a mistyped option must be answered
without importing torch (a second and a half per process; tests/test_cli_lazy_imports.py).
"""

from gemc.version import __version__

__all__ = ["ModelSpec", "Plan", "__version__", "compile", "load_plan", "read_plan",
           "validate_plan"]


def __getattr__(name: str):
    # Lazy, so `import gemc` (the runner, the kernels, the CLI's argument checks) pulls in
    # neither the compiler's deps nor torch.
    if name == "ModelSpec":
        from gemc.spec import ModelSpec

        return ModelSpec
    if name == "compile":
        from gemc.api import compile as fn

        return fn
    if name in ("Plan", "load_plan", "read_plan", "validate_plan"):
        from gemc import plan

        return getattr(plan, name)
    raise AttributeError(f"module 'gemc' has no attribute {name!r}")
