"""The errors gemc raises at its user-facing edges.

Every user mistake ends in one :class:`GemcUserError` that names the thing that is wrong,
where it is, and how to fix it. The CLI prints it as one message and exits 2; anything else
escaping is a bug in gemc and exits 1.
"""

from __future__ import annotations

import sysconfig
import traceback
from pathlib import Path


class GemcError(Exception):
    """Base class of gemc's own errors."""


class GemcUserError(GemcError):
    """Bad input from the user: a message naming the thing, the place and the fix."""

    def __init__(self, what: str, where: str | None = None, fix: str | None = None) -> None:
        self.what = what
        self.where = where
        self.fix = fix
        super().__init__(self.render())

    def render(self) -> str:
        parts = [self.what]
        if self.where:
            parts.append(f"  where: {self.where}")
        if self.fix:
            parts.append(f"  fix: {self.fix}")
        return "\n".join(parts)


def _library_roots() -> tuple[str, ...]:
    """Folders of code that is not the user's: Python's own library, installed packages,
    and gemc's package (found by path, so gemc's namespace packages count too)."""
    paths = sysconfig.get_paths()
    return tuple({str(Path(p).resolve()) for p in (paths["stdlib"], paths["purelib"],
                                                   paths["platlib"])}
                 | {str(Path(__file__).resolve().parent)})


def users_file(filename: str) -> bool:
    """``filename`` is the user's code: not Python's library, an installed package or gemc."""
    return not filename.startswith("<") and not str(Path(filename).resolve()).startswith(
        _library_roots())


def user_frame(exc: BaseException) -> str | None:
    """``file:line`` of the innermost frame of ``exc``'s traceback in the user's code, or
    None: a torch error raised deep in torch is the user's line that called it."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if users_file(f.filename)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


class EntrypointError(GemcUserError):
    """The model entrypoint could not be loaded or returned the wrong thing."""


class CaptureError(GemcUserError):
    """torch.export could not capture the model."""


class TopologyError(GemcUserError):
    """A topology spec or file is malformed."""


class PlanError(GemcUserError):
    """A plan file is corrupt, of another schema version, or inconsistent."""


class UnsupportedOpError(GemcUserError):
    """An op no pass of gemc knows how to treat, where no fallback is safe."""


class PassFailure(GemcError):
    """A pass raised or left an invalid graph; carries the pass name for the dump."""

    def __init__(self, pass_name: str, message: str) -> None:
        self.pass_name = pass_name
        super().__init__(f"pass '{pass_name}' failed: {message}")
