"""Host randomness in a forward: values drawn from Python's ``random`` or NumPy's global
generator while torch.export traces the model.

Why gemc watches for it: torch.export (non-strict, as gemc captures) runs the forward's
Python once, so any value the forward draws there (a random masking window drawn with
``random.randint`` in a published recommender's forward, for one) enters the graph
as the constant drawn at capture, and every compiled step would reuse it where eager
PyTorch draws a fresh one (torch.compile lifts such draws into inputs; strict export
refuses them). Training would differ from the model as written, silently. So the capture
records each draw with its place in the user's code; the compile refuses it by default
(``CaptureError`` naming the line and the fix) or, asked to (``--host-randomness freeze``),
keeps the traced values and says so in the plan's warnings.

During the capture both generators are seeded with :data:`CAPTURE_SEED`, so a frozen
value is the same at compile and at run time (the runner captures the graph again, and
checks its fingerprint against the plan's), and the caller's generator states are put
back afterwards: capturing never moves the user's own random streams.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

CAPTURE_SEED = 0
MODES = ("error", "freeze")

# Python's module-level draws (bound methods of random's hidden instance, looked up on the
# module when user code calls ``random.randint(...)``)
_PY_DRAWS = ("random", "uniform", "randint", "randrange", "choice", "choices", "shuffle",
             "sample", "gauss", "normalvariate", "lognormvariate", "expovariate",
             "vonmisesvariate", "gammavariate", "betavariate", "paretovariate",
             "weibullvariate", "triangular", "getrandbits", "binomialvariate")
_NP_DRAWS = ("rand", "randn", "randint", "random", "random_sample", "uniform", "normal",
             "choice", "permutation", "shuffle", "binomial", "poisson", "exponential",
             "beta", "gamma")


@dataclass
class Draws:
    """What one capture drew: ``sites`` (``file:line in function: code``, first call of
    each), ``calls`` in all, and whether a generator moved without a named call (a draw
    through a name bound before the capture, e.g. ``from random import randint``)."""

    sites: list[str] = field(default_factory=list)
    calls: int = 0
    unnamed: bool = False
    internal: int = 0  # draws made by torch itself while tracing

    def __bool__(self) -> bool:
        return self.calls > 0 or self.unnamed

    def describe(self) -> str:
        where = "; ".join(self.sites[:3]) + (f" and {len(self.sites) - 3} more"
                                            if len(self.sites) > 3 else "")
        if self.unnamed and not self.sites:
            where = "a draw through a name bound before the capture (e.g. `from random " \
                    "import randint`): the generator's state moved"
        return where


def _user_site(skip_files: tuple[str, ...]) -> str | None:
    """The innermost frame outside the generators, torch and this module (None: the
    draw is torch's own)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(name.startswith(s) for s in skip_files):
            import linecache

            code = linecache.getline(name, frame.f_lineno).strip()
            return f"{os.path.basename(name)}:{frame.f_lineno} in {frame.f_code.co_name}" \
                + (f": `{code}`" if code else "")
        frame = frame.f_back
    return None


def _skipped_files() -> tuple[str, ...]:
    import torch

    dirs = [os.path.dirname(random.__file__) + os.sep + "random.py", __file__,
            os.path.dirname(torch.__file__) + os.sep, contextlib.__file__]
    np = _numpy()
    if np is not None:
        dirs.append(os.path.dirname(np.__file__) + os.sep)
    return tuple(dirs)


def _numpy() -> Any:
    if "numpy" not in sys.modules:  # a model that never imported NumPy draws nothing there
        return None
    return sys.modules["numpy"]


@contextlib.contextmanager
def watch() -> Iterator[Draws]:
    """Within the block, record every draw from Python's ``random`` module and NumPy's
    global generator (both seeded with :data:`CAPTURE_SEED`); restore both generators'
    states and functions on the way out."""
    draws = Draws()
    skip = _skipped_files()
    np = _numpy()
    py_state = random.getstate()
    np_state = np.random.get_state() if np is not None else None
    patched: list[tuple[Any, str, Any]] = []

    def wrap(module: Any, name: str) -> None:
        original = getattr(module, name, None)
        if not callable(original):
            return

        @functools.wraps(original)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            site = _user_site(skip)
            if site is None:  # torch's own use (none seen; not the model's draw)
                draws.internal += 1
            else:
                draws.calls += 1
                if site not in draws.sites:
                    draws.sites.append(site)
            return original(*args, **kwargs)

        patched.append((module, name, original))
        setattr(module, name, recorded)

    for name in _PY_DRAWS:
        wrap(random, name)
    if np is not None:
        for name in _NP_DRAWS:
            wrap(np.random, name)
    random.seed(CAPTURE_SEED)
    if np is not None:
        np.random.seed(CAPTURE_SEED)
    seeded_py = random.getstate()
    seeded_np = np.random.get_state() if np is not None else None
    try:
        yield draws
    finally:
        for module, name, original in reversed(patched):
            setattr(module, name, original)
        moved = random.getstate() != seeded_py
        if np is not None:
            moved = moved or _np_state_moved(np, np.random.get_state(), seeded_np)
        draws.unnamed = moved and draws.calls == 0 and not draws.internal
        random.setstate(py_state)
        if np is not None:
            np.random.set_state(np_state)


def _np_state_moved(np: Any, now: tuple, before: tuple) -> bool:
    return now[0] != before[0] or not np.array_equal(now[1], before[1]) \
        or tuple(now[2:]) != tuple(before[2:])


__all__ = ["CAPTURE_SEED", "MODES", "Draws", "watch"]
