"""The runner: execute a gemc plan on torch.distributed (gloo on CPU, NCCL on GPUs).

Imports only torch (and numpy through it) and gemc's light modules, so it runs on a GPU
host without the compiler's optional dependencies. Entry points: ``gemc run`` /
``python -m gemc.run`` (:mod:`.cli`), :func:`run` from Python, and :mod:`.reference`, the
single-process training a distributed run must reproduce.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RunOptions", "RunResult", "run"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the package (e.g. for the CLI's --help) does not set up the runner.
    if name in __all__:
        from gemc.backends.torch import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'gemc.backends.torch' has no attribute {name!r}")
