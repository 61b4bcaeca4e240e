"""The one direction of imports (docs/architecture.md): the contracts in pyproject.toml hold,
every module of the package has a place in them, no module imports another package's
private names, and the runner imports without the solver's ortools."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _config() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _modules() -> dict[str, Path]:
    """Every module of the installed gemc package -> its file (package-dir applied)."""
    out: dict[str, Path] = {}
    for package, folder in _config()["tool"]["setuptools"]["package-dir"].items():
        for path in (REPO / folder).rglob("*.py"):
            parts = [*package.split("."), *path.relative_to(REPO / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.setdefault(".".join(parts), path)
    return out


def test_import_contracts_hold() -> None:
    # a dev dependency (setup.sh installs it; a GPU box with `pip install -e .` may not)
    pytest.importorskip("importlinter", reason="import-linter is a dev dependency: "
                        "pip install -e '.[dev]'")
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "lint_imports.py")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def test_every_module_has_a_layer() -> None:
    """A new module directly under gemc/ (or a new package) must be placed in the stack:
    otherwise the layers contract would say nothing about it."""
    contracts = _config()["tool"]["importlinter"]["contracts"]
    named: set[str] = set()
    for contract in contracts:
        for layer in contract.get("layers", []):
            named |= {m.strip() for m in layer.replace("|", ":").split(":") if m.strip()}
    unplaced = []
    for module in _modules():
        parts = module.split(".")
        if len(parts) < 2 or parts[1] == "backends":  # backends: their own contracts
            continue
        owner = ".".join(parts[:2])
        if owner not in named:
            unplaced.append(owner)
    assert not sorted(set(unplaced)), (
        f"modules in no layer of pyproject's [tool.importlinter] stack: {sorted(set(unplaced))}"
        " -- add each to the layer it belongs to (docs/architecture.md)")


def test_the_docs_picture_draws_the_stack_contracts_layers_in_order() -> None:
    """docs/architecture.md's picture of the package graph shows the ``stack`` contract's
    layers top to bottom (each above the layers it may import): a layer moved in
    pyproject.toml and not in the picture fails here."""
    text = (REPO / "docs" / "architecture.md").read_text()
    start = text.index("```", text.index("The same stack as a picture"))
    picture = text[start:text.index("```", start + 3)].splitlines()
    stack = next(c for c in _config()["tool"]["importlinter"]["contracts"] if c["id"] == "stack")
    rows = []
    for layer in stack["layers"][:-1]:  # the core: named in the table, summarised there
        names = [m.strip().removeprefix("gemc.") for m in layer.replace("|", ":").split(":")]
        row = next((i for i, line in enumerate(picture)
                    if all(f" {n} " in f" {line} " for n in names)), None)
        assert row is not None, f"layer {layer!r} is not drawn in docs/architecture.md"
        rows.append(row)
    assert rows == sorted(rows) and len(set(rows)) == len(rows), rows


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def test_no_private_names_imported_across_packages() -> None:
    """``from x import _name`` only inside x's own package: what another package needs
    gets a public name in its owner."""
    found = []
    for module, path in sorted(_modules().items()):
        here = _package_of(module, path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if not target.startswith("gemc"):
                continue
            private = [a.name for a in node.names
                       if a.name.startswith("_") and not a.name.startswith("__")]
            if private and target.rsplit(".", 1)[0] != here and target != here:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {target} {private}")
    assert not found, "private names imported across packages:\n" + "\n".join(found)


def _module_names(tree: ast.Module, modules: dict[str, Path]) -> dict[str, str]:
    """Local name -> the gemc module it is bound to (``import gemc.x.y as m``,
    ``from gemc.x import y`` where y is a module)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("gemc"):
                    bound[a.asname or "gemc"] = a.name if a.asname else "gemc"
        elif isinstance(node, ast.ImportFrom) and not node.level \
                and (node.module or "").startswith("gemc"):
            for a in node.names:
                if f"{node.module}.{a.name}" in modules:
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
    return bound


def test_no_private_names_read_across_packages_through_a_module() -> None:
    """``module._name`` (a gemc module imported whole, ``from gemc.x import y; y._f()``) only
    inside that module's package: the same rule as the import of the name itself."""
    modules = _modules()
    found = []
    for module, path in sorted(modules.items()):
        here = _package_of(module, path)
        tree = ast.parse(path.read_text(), str(path))
        bound = _module_names(tree, modules)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") \
                    or node.attr.startswith("__"):
                continue
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if not isinstance(value, ast.Name) or value.id not in bound:
                continue
            target = ".".join([bound[value.id], *reversed(chain)])
            if target in modules and _package_of(target, modules[target]) != here \
                    and target.rsplit(".", 1)[0] != here and target != here:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {target}.{node.attr}")
    assert not found, "private names read across packages:\n" + "\n".join(found)


OUTSIDE = ("tests", "benchmarks", "scripts", "examples")
"""The repository's Python outside the package: never one of gemc's packages."""


def test_no_private_gemc_names_imported_from_outside_the_package() -> None:
    """Tests, benchmarks, scripts and examples use gemc's public names only: what they
    need (a helper a test checks on its own) gets a public name in its owner."""
    found = []
    for folder in OUTSIDE:
        for path in sorted((REPO / folder).rglob("*.py")):
            if any(part.startswith(".venv") for part in path.relative_to(REPO).parts):
                continue  # a benchmark's own venv (vs_torchrec.py --setup-only): not ours
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ImportFrom) or node.level:
                    continue
                private = [a.name for a in node.names
                           if a.name.startswith("_") and not a.name.startswith("__")]
                if private and (node.module or "").startswith("gemc"):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.module} {private}")
    assert not found, "private gemc names imported from outside it:\n" + "\n".join(found)


def test_runner_imports_without_ortools() -> None:
    code = ("import sys; sys.modules['ortools'] = None\n"
            "import gemc.backends.torch.runner, gemc.backends.torch.cli, gemc.backends.triton.ops\n"
            "import gemc.backends.torch.materialize, gemc.backends.torch.graph_mode\n"
            "import gemc.backends.triton.inductor_graph, gemc.backends.triton.graph_runner\n"
            "assert 'gemc.solver' not in sys.modules and 'gemc.passes' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith('gemc.'))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
