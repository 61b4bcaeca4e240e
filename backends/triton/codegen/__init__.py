"""Triton code generation for fusion groups: spec in, kernel source (forward + backward) out.

* :func:`generate` writes the source of a group ``structure`` (see :mod:`.spec`); it is a
  pure function of the structure, so a plan that carries the structure, or the source and
  its sha256, is enough to rebuild the same kernel anywhere.
* :func:`.host.make_runner` imports a source and returns ``run(*inputs) -> outputs``, an
  autograd function whose backward is the generated backward.

Emitting source needs neither Triton nor a GPU (the compiler runs on CPU machines); running
it does (or ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from typing import Any

from .kernels import generate
from .spec import canonical, sha256

__all__ = ["canonical", "generate", "generated", "sha256", "source_file_name"]


def generated(structure: dict[str, Any]) -> tuple[str, str]:
    """``(source, sha256 of the source)`` of a group structure."""
    source = generate(structure)
    return source, sha256(source)


def source_file_name(digest: str) -> str:
    """Where a source lives in a dump directory (and how the plan names it)."""
    return f"kernels/{digest[:16]}.py"
