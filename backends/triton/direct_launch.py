"""A launch of an autotuned gemc kernel whose tuning key was already decided goes straight
to the kernel's ``JITFunction.run``, past Triton's ``Autotuner.run``.

Why: issue 17. One fwd+bwd of the jagged silu attention at HSTU's shape cost the host
1.41 ms on an H100 against 0.42 for padded cuDNN SDPA, while its GPU kernels took 0.52 ms
(BENCHMARKS.md, twenty-sixth session's host profile): ``do_bench`` read the host's time.
Three of that fwd+bwd's launches went through ``Autotuner.run`` on a cache hit, ~67 us of
its own time each (profiled): it rebuilds a dict of every argument by name, filters it by
a list membership test per argument (``k in self.arg_names``: a scan of a ~45-name list
for each of ~45 arguments) and asks every argument for a dtype, to form the key it then
finds in its cache. :class:`DirectAutotuner` forms the same key from precomputed
positions and a set, and on a hit does exactly what ``Autotuner.run`` does on one (Triton
3.6 and 3.9 alike): note the config as ``best_config``, run the config's own ``pre_hook``
(the autotuner's ``pre_hook`` / ``reset_to_zero`` run only around timing, never on a
launch), and call ``fn.run(*args, **kwargs, **config.all_kwargs())``. A miss (a key not
decided yet), a kernel of one config where Triton would not look at the key anyway, and
any launch while ``Autotuner.run`` is wrapped (:mod:`.warm` records launches at the
autotuner so) take ``Autotuner.run`` as before, so the config choice
(:mod:`.config_choice`: its pruning hook, report, records, ``forget``) sees every
decision it saw before.

Measured after (an H100, twenty-seventh session, ``attention_gpu_time.py --profile-host``):
HSTU's fwd+bwd issued in 0.943 ms of host against 0.960 with this off, inside that
machine's noise; the profiler's ~67 us overstated the saving (folding the zero-fills into
the kernels took it from 1.317 ms).

``GEMC_DIRECT_LAUNCH=0`` (read at each launch) sends every launch through
``Autotuner.run``: the A/B switch for timing the two on a GPU.
"""

from __future__ import annotations

import os
from typing import Any

from triton.runtime.autotuner import Autotuner

__all__ = ["DIRECT_LAUNCH_ENV", "DirectAutotuner", "direct_launch_enabled", "launch_key"]

DIRECT_LAUNCH_ENV = "GEMC_DIRECT_LAUNCH"
"""``1`` (default) or ``0``: whether a launch of a decided key skips ``Autotuner.run``."""

_TRITON_RUN = Autotuner.run  # Triton's own; anything else in its place is a wrapper


def direct_launch_enabled() -> bool:
    """:data:`DIRECT_LAUNCH_ENV`, read at the launch (a benchmark flips it between
    timings). Anything but ``0`` or ``1`` is refused by name rather than read as either."""
    value = os.environ.get(DIRECT_LAUNCH_ENV, "1")
    if value == "1":
        return True
    if value == "0":
        return False
    raise ValueError(f"{DIRECT_LAUNCH_ENV}={value!r}: set it to 1 (launch a decided config "
                     "directly) or 0 (every launch through triton's Autotuner.run), or "
                     "unset it")


class DirectAutotuner(Autotuner):
    """``triton.autotune``'s autotuner with :meth:`run`'s cache hit made cheap (module
    doc). :func:`adopt` turns an autotuner into one; nothing else about it changes."""

    _key_positions: tuple[tuple[str, int], ...]
    _position: dict[str, int]
    _kwargs_of: dict[int, tuple[Any, dict[str, Any]]]

    @classmethod
    def adopt(cls, tuner: Autotuner) -> DirectAutotuner:
        """``tuner`` as a :class:`DirectAutotuner` (the same object: its configs, cache and
        hooks stay where ``triton.autotune`` put them, whatever the Triton version)."""
        tuner.__class__ = cls
        assert isinstance(tuner, DirectAutotuner)
        names = list(tuner.arg_names)
        # a key that names no argument is dropped from the key, as Autotuner.run drops it
        tuner._key_positions = tuple((k, names.index(k)) for k in tuner.keys if k in names)
        tuner._position = {name: i for i, name in enumerate(names)}
        tuner._kwargs_of = {}
        return tuner

    def decided(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The config ``Autotuner.run`` would launch without tuning: the only one, or the
        one its cache holds for this launch's key; None where it would tune first."""
        if len(self.configs) <= 1:
            return self.configs[0]
        return self.cache.get(launch_key(self, args, kwargs))

    def run(self, *args: Any, **kwargs: Any) -> Any:
        if Autotuner.run is _TRITON_RUN and direct_launch_enabled():
            config = self.decided(args, kwargs)
            if config is not None:
                self.best_config = config
                if config.pre_hook is not None:
                    config.pre_hook({**dict(zip(self.arg_names, args)), **kwargs,
                                     **config.all_kwargs()})
                ret = self.fn.run(*args, **kwargs, **self._config_kwargs(config))
                self.nargs = None
                return ret
        return Autotuner.run(self, *args, **kwargs)

    def _config_kwargs(self, config: Any) -> dict[str, Any]:
        """``config.all_kwargs()``, formed once per config (a launch unpacks a copy)."""
        hit = self._kwargs_of.get(id(config))
        if hit is None or hit[0] is not config:
            hit = (config, config.all_kwargs())
            self._kwargs_of[id(config)] = hit
        return hit[1]


def launch_key(tuner: DirectAutotuner, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> tuple[Any, ...] | None:
    """The key ``Autotuner.run`` forms for a launch: the key arguments' values in the
    key's order, then the dtype (as a string) of every argument that has one, positional
    ones first, then keyword ones in their order; arguments that are not the kernel's
    (``grid``, ``warmup``) left out. None (no key: the launch takes ``Autotuner.run``)
    where a keyword also names a positional argument (the launch fails there as it
    would have)."""
    n = min(len(args), len(tuner.arg_names))
    position = tuner._position
    if any(position.get(name, n) < n for name in kwargs):
        return None
    key = [kwargs[name] if name in kwargs else args[pos]
           for name, pos in tuner._key_positions if name in kwargs or pos < n]
    key += [str(a.dtype) for a in args[:n] if hasattr(a, "dtype")]
    key += [str(v.dtype) for name, v in kwargs.items()
            if name in position and hasattr(v, "dtype")]
    return tuple(key)
