"""Up-front checks of command-line arguments: paths and numbers, before any work starts.

Why a module of its own: ``gemc compile`` spends seconds to minutes capturing and planning
before it writes ``--out``, and ``gemc run`` starts torchrun and builds a model before it
writes a checkpoint or a report. A path that cannot be written (a directory named as a file,
a read-only place) or a number out of range should end the command at once, with one
message naming the option, the value and the fix (exit 2), not as an internal error after
the work. Both command lines (``gemc.cli`` and ``gemc.backends.torch.cli``) use these
helpers, so each check is written once.

Writability is tested by creating (and removing) a temporary file in the directory that
would receive the output, or in its nearest existing ancestor when that directory does not
exist yet: ``os.access`` says "yes" to root whatever the mode bits, and special mounts
(``/proc``, some network file systems) refuse files it would allow, so only a real attempt
is trustworthy. A check creates nothing that outlives it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gemc.errors import GemcUserError

EXIT_USAGE = 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but usage errors name the fix and exit 2 like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        sys.stderr.write(f"gemc: error: {message}\n  fix: see `{self.prog} --help`\n")
        raise SystemExit(EXIT_USAGE)


# ---- numbers (argparse ``type=`` callables: a bad value is a usage error, exit 2) ----------


def _number(text: str, kind: type) -> float | int:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def int_at_least(low: int) -> Callable[[str], int]:
    """An integer >= ``low`` (``--steps``: 1, ``--checkpoint-every``: 0)."""

    def parse(text: str) -> int:
        value = int(_number(text, int))
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def positive_float(text: str) -> float:
    """A finite number > 0 (time limits, learning rates)."""
    value = float(_number(text, float))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {value:g}")
    return value


def float_in(low: float, high: float) -> Callable[[str], float]:
    """A finite number in [low, high] (SQNR thresholds in dB)."""

    def parse(text: str) -> float:
        value = float(_number(text, float))
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low:g}, {high:g}], got {value:g}")
        return value

    parse.__name__ = f"number in [{low:g}, {high:g}]"
    return parse


# ---- paths ---------------------------------------------------------------------------------


def _probe_writable(directory: Path) -> str | None:
    """None if a file can be created in ``directory``, else the reason (strerror)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".gemc-probe-", dir=directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.unlink(tmp)
    return None


def _nearest_existing(path: Path) -> Path:
    for parent in [path, *path.parents]:
        if parent.exists():
            return parent
    return Path(".")


def _unwritable(option: str, path: Path, reason: str, at: Path) -> GemcUserError:
    return GemcUserError(
        f"{option}: cannot write {path}: files cannot be created in {at} ({reason})",
        where=f"{option} {path}",
        fix=f"choose a writable location for {option}, or fix the permissions of {at}",
    )


def output_file(path: str | Path, option: str) -> Path:
    """A file gemc will (re)write: not a directory, in a place where files can be created."""
    p = Path(path)
    if p.is_dir():
        raise GemcUserError(
            f"{option} names a directory ({p}); it takes a file",
            where=f"{option} {p}",
            fix=f"give a file name, e.g. {option} {p / 'plan.json'}"
            if option == "--out" else f"give a file name inside it, e.g. {p}/<name>",
        )
    if p.exists() and not p.is_file():
        raise GemcUserError(f"{option} names {p}, which is not a regular file",
                            where=f"{option} {p}", fix=f"give another path for {option}")
    base = _nearest_existing(p.parent)
    if not base.is_dir():
        raise GemcUserError(
            f"{option}: {base} is a file, so {p} cannot be created under it",
            where=f"{option} {p}", fix=f"give a path for {option} whose folders are folders",
        )
    reason = _probe_writable(base)
    if reason is not None:
        raise _unwritable(option, p, reason, base)
    return p


def output_dir(path: str | Path, option: str) -> Path:
    """A directory gemc will create or fill: not a file, and writable (or creatable)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise GemcUserError(
            f"{option} names a file ({p}); it takes a directory",
            where=f"{option} {p}",
            fix=f"give a directory for {option} (it is created if missing)",
        )
    base = _nearest_existing(p)
    if not base.is_dir():
        raise GemcUserError(
            f"{option}: {base} is a file, so the directory {p} cannot be created",
            where=f"{option} {p}", fix=f"give a directory for {option}",
        )
    reason = _probe_writable(base)
    if reason is not None:
        raise _unwritable(option, p, reason, base)
    return p


def input_file(path: str | Path, option: str, *, what: str = "file",
               fix: str | None = None) -> Path:
    """A file gemc reads: exists, is a file, can be opened."""
    p = Path(path)
    if not p.exists():
        raise GemcUserError(f"{option}: {what} {p} does not exist", where=f"{option} {p}",
                            fix=fix or f"check the path given to {option}")
    if p.is_dir():
        raise GemcUserError(f"{option}: {p} is a directory, not a {what}",
                            where=f"{option} {p}", fix=fix or f"give the {what} itself")
    if not os.access(p, os.R_OK):
        raise GemcUserError(f"{option}: {what} {p} cannot be read (permission denied)",
                            where=f"{option} {p}", fix=f"fix the permissions of {p}")
    return p


def read_json(path: str | Path, what: str, where: str, fix: str) -> Any:
    """A JSON file a user handed in, parsed; one named error (``what`` it should have been,
    ``where`` it was given, the ``fix``) when it cannot be read or parsed."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise GemcUserError(f"cannot read the {what} {path}: {exc}", where=where,
                            fix=fix) from None


def input_dir(path: str | Path, option: str, *, what: str = "directory",
              fix: str | None = None) -> Path:
    """A directory gemc reads: exists and is a directory."""
    p = Path(path)
    if not p.exists():
        raise GemcUserError(f"{option}: {what} {p} does not exist", where=f"{option} {p}",
                            fix=fix or f"check the path given to {option}")
    if not p.is_dir():
        raise GemcUserError(f"{option}: {p} is a file, not a {what}", where=f"{option} {p}",
                            fix=fix or f"give the {what} itself")
    return p
