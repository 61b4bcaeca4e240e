"""Writing a file whole or not at all (through a temporary file and a rename).

A module of the core without torch: the plan format writes through it, and ``gemc.plan`` is
imported by the command line's argument checks, which must not import torch (``gemc
--help`` and a mistyped option answer in a fraction of a second;
tests/test_cli_lazy_imports.py). The pass dumps (``gemc.dump``) write through it too.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write through a temporary file in the same folder, then rename: never half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = text.encode() if isinstance(text, str) else text
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual mode
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json_atomic(path: Path, obj: Any) -> None:
    """JSON with sorted keys (the same object gives the same bytes), written atomically."""
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")
