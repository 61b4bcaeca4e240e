"""The model entrypoint as the command line gives it: ``FILE.py:FUNC`` or
``package.module:FUNC``, and its keyword arguments from ``--set key=value``.

A module of its own, without torch: the command line checks both before it imports torch,
so a mistyped entrypoint, a missing model file or a bad ``--set`` is answered at once
(tests/test_cli_lazy_imports.py); ``gemc.entrypoint`` then imports the model and calls it,
through the same :func:`split_entrypoint`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gemc.errors import EntrypointError, GemcUserError

ENTRYPOINT_FIX = (
    "write it as FILE.py:FUNC (e.g. examples/gem/model.py:build) or package.module:FUNC"
)


def split_entrypoint(entrypoint: str) -> tuple[str, str]:
    """(``FILE.py`` or ``package.module``, ``FUNC``) of an entrypoint; a missing ``:FUNC``
    or a model file that does not exist is an EntrypointError (a module is found only by
    importing it: :func:`gemc.entrypoint.load_entrypoint`)."""
    target, sep, func_name = entrypoint.rpartition(":")
    if not sep or not target or not func_name:
        raise EntrypointError(
            f"malformed model entrypoint '{entrypoint}': no ':FUNC' part",
            where="ENTRYPOINT argument",
            fix=ENTRYPOINT_FIX,
        )
    if target.endswith(".py") and not Path(target).is_file():
        raise EntrypointError(
            f"model file '{target}' does not exist",
            where=str(Path(target).resolve()),
            fix="check the path (relative paths are taken from the current directory)",
        )
    return target, func_name


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    """``--set key=value`` pairs into kwargs; values are JSON scalars when they parse, else strings."""
    kwargs: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise GemcUserError(
                f"bad --set '{item}': expected key=value",
                where="--set",
                fix="write --set preset=tiny (one key=value per --set)",
            )
        if not key.isidentifier():
            raise GemcUserError(
                f"bad --set '{item}': '{key}' is not a valid Python keyword argument name",
                where="--set",
                fix="use a name of the entrypoint's parameters, e.g. --set batch_size=64",
            )
        if key in kwargs:
            raise GemcUserError(
                f"--set {key} is given twice", where="--set", fix="give each key once"
            )
        kwargs[key] = _parse_scalar(raw)
    return kwargs


def _parse_scalar(raw: str) -> Any:
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return value if isinstance(value, (int, float, bool, str)) or value is None else raw
