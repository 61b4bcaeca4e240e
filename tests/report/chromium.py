"""Headless Chromium for the report tests: the rendered DOM and a screenshot.

The test FAILS without Chromium (it is part of the test set-up: scripts/setup.sh installs
the Debian package as root), so a machine that cannot render the report never passes it
silently.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

CHROMIUM = Path(os.environ.get("GEMC_CHROMIUM", "/usr/bin/chromium"))
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--mute-audio",
]


def chromium() -> Path:
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        pytest.fail(
            f"headless Chromium not found at {CHROMIUM}: the report test renders the page in it. "
            "Install it with `bash scripts/setup.sh` as root (it runs `apt-get install chromium`), "
            "or `sudo apt-get install -y chromium`, or point GEMC_CHROMIUM at a chromium binary.",
            pytrace=False,
        )
    return CHROMIUM


def _run(*args: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="gemc-chromium-") as profile:
        proc = subprocess.run(
            [str(chromium()), *FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 0, f"chromium failed ({proc.returncode}): {proc.stderr[-2000:]}"
    return proc


def dump_dom(page: Path) -> str:
    """The DOM after Chromium parsed and laid out the page, serialized."""
    return _run("--dump-dom", page.resolve().as_uri()).stdout


def screenshot(page: Path, png: Path, size: str = "1400,3000") -> Path:
    png.parent.mkdir(parents=True, exist_ok=True)
    _run(f"--screenshot={png.resolve()}", f"--window-size={size}", page.resolve().as_uri())
    return png
