"""How a gemc command ends: exit codes, interrupts, and the report of a bug.

Exit codes (the same for ``gemc`` and ``python -m gemc.run``, on every rank):

* 0 success; 2 bad input or usage (one message: what, where, fix);
* 1 a bug in gemc (the traceback is saved to a file the message names);
* 130 interrupted by SIGINT (Ctrl-C), 143 by SIGTERM (a scheduler's stop), the shell's
  128 + signal convention, so a job script can tell "stopped" from "failed".

SIGTERM is turned into :class:`Terminated`, a ``KeyboardInterrupt``, so one code path
(``except KeyboardInterrupt``) cleans up after both signals: the files gemc writes are
renamed into place only when complete, so an interrupt leaves the previous file (or none).

A signal can land while a C extension converts its arguments (torch's argument parser
asks Python for an int, the handler raises there); the extension then reports its own
error, e.g. ``TypeError: expected a sequence of integers ... got '(16)'``, and the
interrupt is lost. The handlers therefore also remember the signal, and
:func:`interrupt_behind` turns such an error back into the interrupt it hides, so Ctrl-C
is exit 130, not "internal error".
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE = 0, 1, 2
EXIT_SIGINT, EXIT_SIGTERM = 128 + signal.SIGINT, 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread where Ctrl-C raises KeyboardInterrupt."""


_received: list[int] = []  # signals taken by gemc's handlers since they were installed


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)
    raise Terminated()


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)
    raise KeyboardInterrupt()


def raise_pending_interrupt() -> None:
    """Raise the interrupt a signal asked for that has not ended the command: one that
    landed in code which swallowed it (a C extension reporting its own error, which a
    fallback then caught) would otherwise be lost, and a run would go on for all its
    steps (seen in CI: ``gemc run --steps 100000`` kept training after Ctrl-C). Called
    where stopping is clean, between a run's steps."""
    if _received:
        signum = _received[-1]
        _received.clear()
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def interrupt_behind(exc: BaseException) -> KeyboardInterrupt | None:
    """The interrupt an error stands for, or None when it is an error of its own: one in
    its cause / context chain, or a signal gemc's handlers took since they were installed
    (the one a C extension swallowed and reported as its own error)."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        if isinstance(link, KeyboardInterrupt):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    if not _received:
        return None
    return Terminated() if _received[-1] == signal.SIGTERM else KeyboardInterrupt()


def install_signal_handlers() -> dict[int, Any]:
    """SIGTERM raises :class:`Terminated`; SIGINT raises KeyboardInterrupt as Python's own
    handler does (also where an embedding program ignored it; a handler of its own is
    kept). Both remember the signal for :func:`interrupt_behind`. Only the main thread
    may install handlers. Returns the handlers it replaced, for
    :func:`restore_signal_handlers`."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    _received.clear()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, _raise_terminated)
    if saved[signal.SIGINT] in (signal.SIG_IGN, signal.SIG_DFL, signal.default_int_handler):
        signal.signal(signal.SIGINT, _raise_interrupt)
    return saved


def restore_signal_handlers(saved: dict[int, Any]) -> None:
    """Put back what :func:`install_signal_handlers` replaced: a CLI ``main()`` called in
    a longer-lived process (a test run, a notebook) must not leave Ctrl-C ignored after
    :func:`ignore_further_interrupts`."""
    if threading.current_thread() is not threading.main_thread():
        return
    _received.clear()
    for sig, handler in saved.items():
        if handler is not None:
            signal.signal(sig, handler)


@contextmanager
def signal_handlers() -> Iterator[None]:
    """A CLI ``main()``'s body with gemc's handlers installed, and what they replaced put
    back however it ends (both ``gemc`` and ``gemc run`` are such mains)."""
    saved = install_signal_handlers()
    try:
        yield
    finally:
        restore_signal_handlers(saved)


def ignore_further_interrupts() -> None:
    """While cleaning up after the first interrupt, a second one must not cut the cleanup
    short with a traceback: the user pressed Ctrl-C once and gets exit 130 once."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def interrupt_code(exc: KeyboardInterrupt) -> int:
    return EXIT_SIGTERM if isinstance(exc, Terminated) else EXIT_SIGINT


def signal_name(exc: KeyboardInterrupt) -> str:
    return "SIGTERM" if isinstance(exc, Terminated) else "SIGINT (Ctrl-C)"


def report_crash(exc: BaseException, *, prefix: str = "gemc") -> int:
    """A bug in gemc: one line naming it, the traceback in a file; returns exit 1."""
    fd, path = tempfile.mkstemp(prefix="gemc-crash-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=f)
    print(
        f"{prefix}: internal error (a bug in gemc, please report it): "
        f"{type(exc).__name__}: {exc}\n  traceback: {path}",
        file=sys.stderr,
    )
    return EXIT_INTERNAL
