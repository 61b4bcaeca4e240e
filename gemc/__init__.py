"""gemc: compile a PyTorch recommendation model into an executable training plan."""

from gemc.spec import ModelSpec
from gemc.version import __version__

__all__ = ["ModelSpec", "Plan", "__version__", "compile", "load_plan", "read_plan",
           "validate_plan"]


def __getattr__(name: str):
    # Lazy, so `import gemc` (the runner, the kernels) never pulls in the compiler's deps.
    if name == "compile":
        from gemc.api import compile as fn

        return fn
    if name in ("Plan", "load_plan", "read_plan", "validate_plan"):
        from gemc import plan

        return getattr(plan, name)
    raise AttributeError(f"module 'gemc' has no attribute {name!r}")
