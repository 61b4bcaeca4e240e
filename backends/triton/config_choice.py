"""Which launch config each hand-written gemc kernel runs, without paying for autotuning
on a cold first step.

``triton.autotune`` compiles and times every config of a kernel the first time it sees a
key: on the H200 that was 18 s of the GEM example's first step and 38 s of an HSTU model's
(issue 16), several configs compiled only to fail with "out of resource: shared memory".
Two decisions, both made in one ``early_config_prune`` hook (:class:`ConfigChoice`), so
every kernel decides the same way:

1. **Fit.** A config whose estimated shared memory (:func:`shared_memory_bytes`) exceeds
   the device's limit (:func:`shared_memory_limit`) is dropped before anything compiles.
2. **Tune or not.** Unless the user asked for autotuning (``GEMC_AUTOTUNE=1``, which
   ``gemc run --autotune`` sets) or the kernel's tuning is cheap (``tune_cold``: the
   pooled embedding bag, 1.7 s for its four small configs in the GEM log, whose best
   config depends on the model's bag sizes), the kernel runs *one* config per key: the one an earlier
   ``--autotune`` run measured and recorded in the run's Triton cache directory
   (:data:`RECORD_NAME`), else the kernel's heuristic (the configs the H200 picked, by
   shape). Which of the two each kernel ran is in the run report (:func:`report`), so a
   heuristic config is never mistaken for a tuned one.

Under the interpreter most kernels have a single config and Triton never calls the hook;
the softmax row kernel keeps one of each orientation (``KEY_MAJOR``), and its heuristic picks
between them as on a GPU (the interpreter's timer ties them, ``_triton_timer``).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import triton

from .direct_launch import DirectAutotuner
from .runtime import INTERPRETED

__all__ = ["AUTOTUNE_ENV", "COLD_BENCH_MS", "H200_SHARED_MEMORY", "RECORD_NAME", "ConfigChoice",
           "Preferred", "Tiles", "autotune", "autotuning_requested", "forget", "ran",
           "record_tuned", "report", "shared_memory_bytes", "shared_memory_limit", "tuning_key"]

AUTOTUNE_ENV = "GEMC_AUTOTUNE"
"""``1``: gemc's kernels autotune over every config that fits (``gemc run --autotune``)."""
H200_SHARED_MEMORY = 232448
"""Opt-in shared memory per block of an H100/H200 (227 KiB): the limit assumed where no
CUDA device can be asked (compiling on a CPU machine, tests)."""
RECORD_NAME = "gemc-tuned-configs.json"
"""The tuned choices of ``--autotune`` runs, in the run's ``TRITON_CACHE_DIR``."""


@dataclass(frozen=True)
class Tiles:
    """Bytes of a config's tiles that pass through shared memory. ``streamed``: loaded in
    every loop iteration (the software pipeliner keeps ``num_stages - 1`` copies in
    flight); ``resident``: loaded once and kept as a ``tl.dot`` operand; ``scratch``:
    layout conversions of score tiles (once)."""

    streamed: int = 0
    resident: int = 0
    scratch: int = 0


def shared_memory_bytes(num_stages: int, tiles: Tiles) -> int:
    """Estimated shared memory of one program. Fitted to what Triton 3.6 reported on the
    H200 for the jagged attention kernels (exact for the three configs that failed there);
    Triton 3.9 allocates less for the same configs, so it errs on the safe side."""
    return max(num_stages - 1, 1) * tiles.streamed + tiles.resident + tiles.scratch


def shared_memory_limit(device: torch.device | int | None = None) -> int:
    """The device's opt-in shared memory per block, or :data:`H200_SHARED_MEMORY` where no
    CUDA device answers."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(
            device if device is not None else torch.cuda.current_device())
        limit = getattr(props, "shared_memory_per_block_optin", 0)
        if limit:
            return int(limit)
    return H200_SHARED_MEMORY


def autotuning_requested() -> bool:
    """Whether this run autotunes (``GEMC_AUTOTUNE=1``); read at the launch, not at import."""
    return os.environ.get(AUTOTUNE_ENV, "0") == "1"


def describe(cfg: triton.Config) -> str:
    """A config as a stable string (the record's and the report's spelling)."""
    kw = ", ".join(f"{k}={v}" for k, v in sorted(cfg.kwargs.items()))
    cap = getattr(cfg, "maxnreg", None)
    capped = f", maxnreg={cap}" if cap else ""
    return f"{kw}, num_warps={cfg.num_warps}, num_stages={cfg.num_stages}{capped}"


Preferred = (tuple[Mapping[str, int], int, int | None]
             | tuple[Mapping[str, int], int, int | None, int | None])
"""A heuristic's pick: (block sizes, num_warps, num_stages or None: the config's own[,
maxnreg]). A fourth element names a config whose registers a thread are capped
(``triton.Config(maxnreg=...)``); without it only an uncapped config matches. Why a cap: a
latency-bound kernel's speed follows how many programs an SM holds, which its registers
bound (``softmax_row_backward``)."""


def _matches(cfg: triton.Config, want: Preferred) -> bool:
    kwargs, warps, stages, *cap = want
    return dict(cfg.kwargs) == dict(kwargs) and cfg.num_warps == warps \
        and stages in (None, cfg.num_stages) \
        and getattr(cfg, "maxnreg", None) == (cap[0] if cap else None)


def tuning_key(arg_names: Sequence[str], keys: Sequence[str], args: Mapping[str, Any]
               ) -> str:
    """The autotuner's key of a launch, as ``triton.autotune`` forms it (the key
    arguments' values, then every tensor argument's dtype), spelled as a string."""
    present = {k: v for k, v in args.items() if k in arg_names}
    key: list[Any] = [present[k] for k in keys if k in present]
    key += [str(v.dtype) for v in present.values() if hasattr(v, "dtype")]
    return str(tuple(key))


@dataclass
class ConfigChoice:
    """The ``early_config_prune`` hook of one kernel (see the module doc). ``tiles`` gives
    a config's shared-memory tiles for a launch's arguments; ``prefer`` the heuristic's
    picks for those arguments, best first (the first that fits runs; none: the first
    config of the list that fits)."""

    name: str
    keys: Sequence[str]
    tiles: Callable[[triton.Config, Mapping[str, Any]], Tiles]
    prefer: Callable[[Mapping[str, Any]], Sequence[Preferred]] | None = None
    arg_names: Sequence[str] = ()
    source_key: str = ""  # the kernel source's hash: a record of other code is ignored
    fn: Any = None  # the jitted function, whose source hash is taken at the first launch
    tune_cold: bool = False  # autotune even on a cold run (a kernel whose tuning is cheap)
    # tuning key -> ("heuristic" | "recorded" | "autotuned", config or None until tuned)
    chosen: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    pruned: dict[str, list[str]] = field(default_factory=dict)  # key -> configs too big
    left: int = 0  # configs the last launch's pruning left (read by :meth:`bench`)

    def __call__(self, configs: list[triton.Config], nargs: Mapping[str, Any],
                 **kwargs: Any) -> list[triton.Config]:
        args = {**nargs, **kwargs}
        if not self.source_key and self.fn is not None:
            # at a launch, not at import: Triton hashes the source with its dependencies
            self.source_key = str(getattr(self.fn, "cache_key", ""))
        key = tuning_key(self.arg_names, self.keys, args)
        limit = shared_memory_limit(_device_of(args))
        fits = [c for c in configs
                if shared_memory_bytes(c.num_stages, self.tiles(c, args)) <= limit]
        self.pruned[key] = [describe(c) for c in configs if c not in fits]
        if not fits:  # nothing fits by the estimate: let the compiler be the judge
            fits = [min(configs, key=lambda c: shared_memory_bytes(c.num_stages,
                                                                   self.tiles(c, args)))]
        self.left = len(fits)
        if (autotuning_requested() or self.tune_cold) and len(fits) > 1:
            self.chosen[key] = ("autotuned", None)
            return fits
        self.left = 1
        recorded = _read_record().get(self.name, {})
        if recorded.get("source") == self.source_key:
            want = recorded.get("configs", {}).get(key)
            for c in fits:
                if describe(c) == want:
                    self.chosen[key] = ("recorded", want)
                    return [c]
        pick = self._heuristic(fits, args)
        self.chosen[key] = ("heuristic", describe(pick))
        return [pick]

    def bench(self, fn: Callable[[], Any], quantiles: Sequence[float]) -> Any:
        """The kernel's autotuner's timer (``triton.autotune(do_bench=...)``), reached only
        on the first launch of a key, right after this hook pruned it.

        One config left: nothing to choose, so nothing runs. Why: until Triton's PR 10413
        (May 2026; Triton 3.6, the H200's, predates it) an autotuner whose pruning leaves
        *one* config still times it, running the kernel a few hundred times on the first
        launch of each key: first-step time on every gemc kernel, and wrong for a kernel
        that adds into its output (the silu backward's one-kernel variant,
        ``FUSED_SILU_BACKWARD``, returned dq summed over every timing run on the H200: max
        abs error 21-78; the interpreter, with one config and no timing, was right).
        Several configs: a ``tune_cold`` kernel on a cold run times each
        :data:`COLD_BENCH_MS` (the pooled bag's four configs took 0.65 s of timing in DLRM's
        H200 first step, twelfth session's py-spy; they differ by 12-30% where the pick
        matters); otherwise Triton's own timer."""
        if self.left == 1:
            return [0.0] * len(quantiles) if quantiles else 0.0
        if self.tune_cold and not autotuning_requested():
            from triton.testing import do_bench

            warmup, rep = COLD_BENCH_MS
            return do_bench(fn, warmup=warmup, rep=rep, quantiles=quantiles)
        return _triton_timer()(fn, quantiles=quantiles)


    def _heuristic(self, fits: list[triton.Config], args: Mapping[str, Any]) -> triton.Config:
        for want in (self.prefer(args) if self.prefer else ()):
            for c in fits:
                if _matches(c, want):
                    return c
        return fits[0]


def _triton_timer() -> Callable[..., Any]:
    """Triton's own timer for the active device (what ``triton.autotune`` uses without a
    ``do_bench``). Under the interpreter (no driver to time with, and an interpreted
    kernel's time would mean nothing), a timer that runs nothing and ties every config, so
    the first that fits runs: a kernel keeps several configs there only for its CPU tests
    to force each (``softmax_row_backward``'s two orientations)."""
    if INTERPRETED:
        return lambda fn, quantiles=None: [0.0] * len(quantiles) if quantiles else 0.0
    return triton.runtime.driver.active.get_benchmarker()


def _device_of(args: Mapping[str, Any]) -> torch.device | None:
    for v in args.values():
        if isinstance(v, torch.Tensor) and v.device.type == "cuda":
            return v.device
    return None


_KERNELS: dict[str, tuple[ConfigChoice, Any]] = {}
"""name -> (its hook, its autotuner): what :func:`report` and :func:`record_tuned` read."""


COLD_BENCH_MS = (5, 20)
"""Warm-up and timing milliseconds per config when a ``tune_cold`` kernel tunes on a cold
run (Triton's defaults, 25 and 100, under ``--autotune``)."""


def autotune(configs: list[triton.Config], key: list[str], *, name: str,
             tiles: Callable[[triton.Config, Mapping[str, Any]], Tiles],
             prefer: Callable[[Mapping[str, Any]], Sequence[Preferred]] | None = None,
             tune_cold: bool = False,
             accumulates: Callable[[Mapping[str, Any]], Sequence[str]] | None = None,
             ) -> Callable[[Any], Any]:
    """``triton.autotune(configs, key)`` with :class:`ConfigChoice` as its pruning hook and
    its timer (:meth:`ConfigChoice.bench`): the decorator every hand-written gemc kernel
    with several configs uses. ``tune_cold``: the kernel autotunes on a cold run
    too, for kernels whose tuning costs little next to a wrong pick (small configs that
    all compile). ``accumulates``: given a launch's arguments, the outputs it adds into,
    zeroed before each timed run when it autotunes (Triton's ``reset_to_zero``, decided
    per launch: a kernel may add into an output under one constexpr and not another).
    A launch of a key already decided skips ``Autotuner.run`` (:mod:`.direct_launch`;
    ``GEMC_DIRECT_LAUNCH=0`` turns that off)."""
    hook = ConfigChoice(name, key, tiles, prefer, tune_cold=tune_cold)

    def zero_outputs(nargs: dict[str, Any], reset_only: bool = False) -> None:
        for out in accumulates(nargs) if accumulates is not None else ():
            nargs[out].zero_()

    def wrap(fn: Any) -> Any:
        tuner = DirectAutotuner.adopt(triton.autotune(
            configs=configs, key=key, prune_configs_by={"early_config_prune": hook},
            pre_hook=zero_outputs if accumulates is not None else None,
            do_bench=hook.bench)(fn))
        hook.arg_names = list(getattr(fn, "arg_names", ()))
        hook.fn = fn
        _KERNELS[name] = (hook, tuner)
        return tuner

    return wrap


def forget(prefix: str) -> list[str]:
    """Drop the configs chosen so far for the kernels whose name starts with ``prefix``
    (their autotuner's cache and this module's note of it), so their next launch chooses
    again, by the rules in force then (the heuristic, or ``GEMC_AUTOTUNE=1``'s timing).
    Why: a benchmark times one kernel under several choices in one process
    (``benchmarks/kernels.py --cases silu_variants``). Returns the kernels' names."""
    names = [name for name in _KERNELS if name.startswith(prefix)]
    for name in names:
        hook, tuner = _KERNELS[name]
        getattr(tuner, "cache", {}).clear()
        hook.chosen.clear()
    return names


def _record_path() -> Path | None:
    d = os.environ.get("TRITON_CACHE_DIR")
    return Path(d) / RECORD_NAME if d else None


def _read_record() -> dict[str, Any]:
    path = _record_path()
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record_tuned() -> int:
    """Write the configs this process autotuned into :data:`RECORD_NAME` (temp + rename),
    so a later run without ``--autotune`` runs them (``recorded``) instead of the
    heuristic. Returns how many keys were written; nothing without a cache directory."""
    path = _record_path()
    if path is None:
        return 0
    data = _read_record()
    written = 0
    for name, (hook, tuner) in _KERNELS.items():
        best = {str(k): describe(c) for k, c in getattr(tuner, "cache", {}).items()}
        tuned = {k: best[k] for k, (how, _) in hook.chosen.items()
                 if how == "autotuned" and k in best}
        if not tuned:
            continue
        hook.chosen.update({k: ("autotuned", v) for k, v in tuned.items()})
        entry = data.get(name, {})
        old = entry.get("configs", {}) if entry.get("source") == hook.source_key else {}
        data[name] = {"source": hook.source_key, "configs": {**old, **tuned}}
        written += len(tuned)
    if written:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".gemc-tuned-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    return written


def ran(prefix: str) -> dict[str, dict[str, str]]:
    """Per kernel whose name starts with ``prefix`` and per key, the config its autotuner
    runs now (timed best, recorded or heuristic alike; :func:`report` leaves a config
    autotuned in this process unnamed until :func:`record_tuned`). Why: a benchmark
    reports which config each timing ran (``benchmarks/attention_gpu_time.py``)."""
    return {name: {str(k): describe(c) for k, c in getattr(tuner, "cache", {}).items()}
            for name, (_, tuner) in sorted(_KERNELS.items()) if name.startswith(prefix)}


def report() -> dict[str, Any]:
    """The run report's ``kernel_tuning``: per kernel and key, the config it ran and where
    it came from (``heuristic``, ``recorded`` by an earlier ``--autotune`` run, or
    ``autotuned`` in this one), and the configs dropped as too big for shared memory."""
    out: dict[str, Any] = {}
    for name, (hook, _) in sorted(_KERNELS.items()):
        for key, (how, cfg) in hook.chosen.items():
            out.setdefault(name, {})[key] = {"source": how, "config": cfg,
                                             "too_big": hook.pruned.get(key, [])}
    return out
