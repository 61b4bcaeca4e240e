"""Check gemc's import contracts (``[tool.importlinter]`` in pyproject.toml).

Why a wrapper: ``passes/``, ``cost_model/`` and ``backends/`` sit at the top of the
repository but install inside the ``gemc`` namespace (``package-dir`` in pyproject.toml),
and import-linter reads a package from one directory. This builds that installed layout
as a tree of symlinks in a temporary directory (nothing is copied or written in the
repository) and runs ``lint-imports`` on it with the repository's contracts.

    .venv/bin/python scripts/lint_imports.py        # exit status 0: every contract kept
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def installed_layout(dest: Path) -> None:
    """Symlink every .py file of the project to where it lands once installed."""
    with open(REPO / "pyproject.toml", "rb") as f:
        package_dir: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(package_dir.items()):
        source = REPO / folder
        target = dest.joinpath(*package.split("."))
        for path in source.rglob("*.py"):
            rel = path.relative_to(source)
            if "__pycache__" in rel.parts:
                continue
            link = target / rel
            if link.exists():  # a sub-folder that is also mapped on its own
                continue
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(path)


def main(argv: list[str]) -> int:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) \
        or shutil.which("lint-imports")
    if lint is None:
        print("lint_imports: `lint-imports` not found; install the dev extras: "
              "pip install -e '.[dev]'", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gemc-imports-") as tmp:
        installed_layout(Path(tmp))
        env = {**os.environ, "PYTHONPATH": tmp}
        return subprocess.call([lint, "--no-cache", str(REPO / "pyproject.toml"), *argv],
                               cwd=tmp, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
