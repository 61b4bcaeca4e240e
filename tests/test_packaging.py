"""Every package folder in the source tree is listed in pyproject.toml, so a regular
(non-editable) install ships it too."""

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = {"gemc": "gemc", "passes": "gemc.passes", "cost_model": "gemc.cost_model", "backends": "gemc.backends"}


def test_every_package_folder_is_listed():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for folder, dotted in ROOTS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((dotted, *rel)))
    assert found - listed == set(), "add these to [tool.setuptools] packages and package-dir"
