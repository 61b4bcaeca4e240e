"""One persistent directory for the compile caches of a run: compile once, reuse across runs.

The first step of a run compiles the graph (Dynamo, AOTAutograd, Inductor's code
generation) and autotunes kernels, Inductor's and gemc's: tens of seconds on a large model
(issue 16 measured 81 s). All of it is cacheable, in three places this module points at one
directory (``gemc-cache/`` next to the plan by default, ``--cache-dir DIR``, or
``GEMC_COMPILE_CACHE``):

* ``TORCHINDUCTOR_CACHE_DIR`` = ``DIR/inductor-<ops>``: Inductor's FX graph cache,
  AOTAutograd's cache and Inductor's autotuning results (each on by default in torch 2.11
  and 2.13; torch's own default is a per-user folder under ``/tmp``, which a reboot or
  another job empties). ``<ops>`` fingerprints gemc's custom-op definitions
  (:func:`ops_fingerprint`): torch's cache keys do not cover a custom op's schema, so a
  gemc whose op changed its arguments would be served compiled code calling the old ones
  (seen: ``gemc::embedding_bag_update() expected at most 6 argument(s) but received 9``);
* ``TRITON_CACHE_DIR`` = ``DIR/triton``: compiled Triton kernels, Inductor's and gemc's
  (Inductor puts its own under its cache dir only when this is unset);
* ``TRITON_CACHE_AUTOTUNING=1``: ``triton.autotune`` keeps its timings in Triton's cache,
  so gemc's generated groups and ``--autotune`` runs of its hand-written kernels do not
  re-autotune in every run (without ``--autotune`` those run one recorded or heuristic
  config, :mod:`gemc.backends.triton.config_choice`, whose record is kept here too). Triton reads it when a kernel is defined, so it is set before
  the run captures the model (which imports gemc's kernels).

A variable the user set wins over gemc's directory (the report lists it under
``from_environment``); values torch wrote itself (its ``/tmp`` default, set the first time
anything asked) and values an earlier run in this process set are not the user's. The
variables are restored when the run ends. ``--cache-dir none``: a cold compile that keeps
nothing, in a temporary directory removed after the run (for measuring the cold first
step).

The run report's ``compile_cache`` says where the caches were, whether they were ``warm``
(held files before the run: compiled artifacts of this graph or of others; Inductor decides
what hits) and the cache counters torch kept during the run (hits and misses); its
``first_step_s`` is the first step, compile and autotuning included.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemc import checks

CACHE_ENV = "GEMC_COMPILE_CACHE"
DEFAULT_NAME = "gemc-cache"
NONE = "none"
INDUCTOR = "TORCHINDUCTOR_CACHE_DIR"
TRITON = "TRITON_CACHE_DIR"
AUTOTUNE = "TRITON_CACHE_AUTOTUNING"
_SET_HERE: dict[str, str] = {}
"""The values gemc set in this process (a later run must not take them for the user's)."""


@dataclass
class CompileCache:
    """Where this run's compile caches are, and what was there before it."""

    dir: str | None  # gemc's directory (None: --cache-dir none)
    inductor: str
    triton: str
    from_environment: list[str] = field(default_factory=list)  # variables the user set
    warm: bool = False
    _counters: dict[str, int] = field(default_factory=dict, repr=False)

    def report(self) -> dict[str, Any]:
        """The run report's ``compile_cache`` section (see the module doc)."""
        after = _cache_counters()
        counters = {k: v - self._counters.get(k, 0) for k, v in sorted(after.items())
                    if v != self._counters.get(k, 0)}
        return {"dir": self.dir, "inductor": self.inductor, "triton": self.triton,
                "from_environment": list(self.from_environment), "warm": self.warm,
                "kept": self.dir is not None, "counters": counters}


def ops_fingerprint() -> str:
    """12 hex digits of the file that defines gemc's custom ops (their schemas and
    autograd formulas): the Inductor cache's namespace (module doc)."""
    ops = Path(__file__).resolve().parent.parent / "triton" / "ops.py"
    try:
        return hashlib.sha256(ops.read_bytes()).hexdigest()[:12]
    except OSError:  # an install without the kernels: no compiled gemc ops to go stale
        return "no-ops"


def cache_base(option: str | None, plan_dir: Path | None) -> Path | None:
    """gemc's cache directory: ``--cache-dir`` (``none``: None), else ``GEMC_COMPILE_CACHE``,
    else ``gemc-cache/`` next to the plan, else (a plan given as a dict)
    ``~/.cache/gemc/compile``."""
    chosen = option or os.environ.get(CACHE_ENV)
    if chosen is not None:
        return None if chosen == NONE else Path(chosen)
    if plan_dir is not None:
        return plan_dir / DEFAULT_NAME
    return Path.home() / ".cache" / "gemc" / "compile"


def _users_value(var: str) -> str | None:
    """The variable's value when a person set it (see the module doc), else None."""
    value = os.environ.get(var)
    if value is None or _SET_HERE.get(var) == value:
        return None
    if var == AUTOTUNE:
        return value
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    inductor = os.path.abspath(os.environ.get(INDUCTOR) or default_cache_dir())
    if var == INDUCTOR and os.path.abspath(value) == os.path.abspath(default_cache_dir()):
        return None  # torch's own default, written by torch when first asked
    if var == TRITON and os.path.dirname(os.path.dirname(os.path.abspath(value))) == inductor \
            and os.path.basename(os.path.dirname(value)) == "triton":
        return None  # torch's <inductor dir>/triton/<device>, written by Inductor
    return value


def _has_files(path: str) -> bool:
    for _, _, files in os.walk(path):
        if files:
            return True
    return False


def _cache_counters() -> dict[str, int]:
    """torch's cache hit / miss counters (Inductor's FX graph cache, AOTAutograd's), by
    whatever names this torch uses."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {}
    out = {}
    for group in ("inductor", "aot_autograd"):
        for key, value in utils.counters.get(group, {}).items():
            if "cache" in key or "hit" in key or "miss" in key:
                out[f"{group}.{key}"] = int(value)
    return out


@contextmanager
def compile_cache(option: str | None, plan_dir: Path | None) -> Iterator[CompileCache]:
    """Point the caches at gemc's directory for the duration of a run (see the module
    doc); a directory that cannot be created is a user error naming the fix."""
    base = cache_base(option, plan_dir)
    if base is not None:
        checks.output_dir(base, f"--cache-dir ({CACHE_ENV}, default {DEFAULT_NAME}/ next to "
                          "the plan; --cache-dir none keeps no cache)")
        base.mkdir(parents=True, exist_ok=True)
        root = str(base.resolve())
    else:
        root = tempfile.mkdtemp(prefix="gemc-cold-cache-")
    wanted = {INDUCTOR: os.path.join(root, f"inductor-{ops_fingerprint()}"),
              TRITON: os.path.join(root, "triton"), AUTOTUNE: "1"}
    saved: dict[str, str | None] = {}
    kept = []
    for var, value in wanted.items():
        if _users_value(var) is not None:
            kept.append(var)
            continue
        saved[var] = os.environ.get(var)
        os.environ[var] = _SET_HERE[var] = value
    cache = CompileCache(dir=root if base is not None else None, inductor=os.environ[INDUCTOR],
                         triton=os.environ[TRITON], from_environment=kept)
    cache.warm = any(_has_files(d) for d in (cache.inductor, cache.triton))
    cache._counters = _cache_counters()
    try:
        yield cache
    finally:
        for var, old in saved.items():
            if os.environ.get(var) == wanted[var]:
                if old is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = old
        if base is None:
            shutil.rmtree(root, ignore_errors=True)
