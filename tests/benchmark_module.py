"""Import a script of benchmarks/ (not a package) as a module, for its smoke tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as module ``gemc_benchmark_<name>`` (registered in
    sys.modules first: dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(f"gemc_benchmark_{name}",
                                                  BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
