"""What a run's first step is made of: torch's own compile timers and the Triton kernels
compiled in this process while it ran.

Issue 16 asks for a cold first step within 1.5x torch.compile's, and a first step that is
slow must say where its seconds went. A profiler cannot: on Python 3.12 cProfile and Dynamo
share ``sys.monitoring`` and cProfile silently loses the outer frames. So this reads what
torch times anyway (``torch._dynamo.utils``: Dynamo's bytecode tracing, the forward frame
compile with AOTAutograd and Inductor inside it, the lazy backward compile, Inductor's code
generation, its wait on the compile workers, its autotuning) and hangs a listener on
Triton's compiler for the kernels compiled in this process. gemc's hand-written kernels
compile there, on their first launch; they are told from Inductor's by the module that
defined the kernel (gemc's packages), not by a kernel name.

Everything is a difference between two snapshots, so a process that compiled before (tests,
benchmarks running several variants) reports only what this first step added. Cost: one
dictionary copy before the step, one after, and a counter per Triton compile.

``benchmarks/compile_accounting.py`` reports the same numbers for the baselines, which do
not run through the runner.

:func:`warm_compile_workers` takes one cost out of the first step: Inductor compiles its
Triton kernels in a pool of worker processes, but starts that pool only when the first graph
reaches Inductor, and until every worker has imported torch it compiles each kernel in the
main process, one after another (``AsyncCompile.use_process_pool`` is False until the pool
answers). The runner starts the pool before its setup (capture, table materialisation), so
the workers are up when the first step compiles.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

__all__ = ["TORCH_TIMERS", "FirstStepAccount", "TritonCompiles", "torch_phases",
           "torch_timers", "warm_compile_workers", "warm_kernels"]

TORCH_TIMERS = ("bytecode_tracing", "create_aot_dispatcher_function",
                "compile_fx.<locals>.fw_compiler_base", "compile_fx.<locals>.bw_compiler",
                "compile_fx_inner", "GraphLowering.codegen", "PyCodeCache.load_by_key_path",
                "async_compile.wait", "_recursive_joint_graph_passes",
                "min_cut_rematerialization_partition", "build_guards",
                "CachingAutotuner.benchmark_all_configs")
"""``torch._dynamo.utils.compilation_time_metrics`` keys worth reporting (seconds, calls)."""

_OWN_PACKAGES = ("gemc.", "gemc_")
"""Module-name prefixes of gemc's own kernels (installed as ``gemc.backends.triton...``; a
plan's generated groups load as modules named ``gemc_...``)."""


def torch_phases() -> dict[str, float]:
    """torch's cumulative phase seconds (``calculate_time_spent``; its ``total_wall_time``
    is the forward frames' compile plus the backward compiles). Empty where the private
    helper is missing: then only :func:`torch_timers` is reported."""
    try:
        from torch._dynamo import utils

        return {k: float(v) for k, v in utils.calculate_time_spent().items()}
    except Exception:  # noqa: BLE001 - a private helper; its absence costs one section
        return {}


def torch_timers() -> dict[str, list[float]]:
    """A copy of torch's per-call compile timers (seconds per call), by name."""
    try:
        from torch._dynamo import utils
    except ImportError:
        return {}
    return {k: list(v) for k, v in utils.compilation_time_metrics.items()}


def _kernel_identity(src: Any, metadata: Any) -> tuple[str, str]:
    """(kernel name, defining module) of a Triton compile's source."""
    fn = getattr(src, "fn", None)
    name = getattr(fn, "__name__", None)
    if name is None and isinstance(metadata, dict):
        name = metadata.get("name")
    module = getattr(getattr(fn, "fn", fn), "__module__", None) or ""
    return str(name or "?"), str(module)


class TritonCompiles:
    """A listener on Triton's compiler (``triton.knobs.compilation.listener``) that counts
    this process's compiles and their seconds, per kernel, split into gemc's own kernels
    and the rest (Inductor's). The listener it replaced is still called."""

    def __init__(self) -> None:
        self.compiles = 0
        self.cache_hits = 0
        self.seconds = {"gemc": 0.0, "other": 0.0}
        self.by_kernel: dict[str, float] = defaultdict(float)
        # gemc's kernels, per compile in this process: found in Triton's on-disk cache (a
        # warm-up compiled it, or an earlier run) or compiled here
        self.gemc_hits: list[str] = []
        self.gemc_misses: list[str] = []
        self.missing: str | None = None
        self._previous: Any = None
        self._installed = False

    def __call__(self, *, src: Any, metadata: Any, metadata_group: Any, times: Any,
                 cache_hit: bool) -> None:
        self.compiles += 1
        self.cache_hits += int(bool(cache_hit))
        seconds = float(getattr(times, "total", 0) or 0) / 1e6  # Triton reports microseconds
        name, module = _kernel_identity(src, metadata)
        own = module.startswith(_OWN_PACKAGES) or module == "gemc"
        self.seconds["gemc" if own else "other"] += seconds
        self.by_kernel[name] += seconds
        if own:
            (self.gemc_hits if cache_hit else self.gemc_misses).append(name)
        if self._previous is not None:
            self._previous(src=src, metadata=metadata, metadata_group=metadata_group,
                           times=times, cache_hit=cache_hit)

    def install(self) -> TritonCompiles:
        """Listen from now on (nothing where Triton has no ``knobs``: :attr:`missing`)."""
        try:
            from triton import knobs
        except ImportError:
            self.missing = "triton.knobs"
            return self
        holder = getattr(knobs, "compilation", None)
        if holder is None or not hasattr(holder, "listener"):
            self.missing = "triton.knobs.compilation.listener"
            return self
        self._previous = holder.listener
        holder.listener = self
        self._installed = True
        return self

    def remove(self) -> None:
        """Give the listener slot back to whatever held it before :meth:`install`."""
        if not self._installed:
            return
        from triton import knobs

        if knobs.compilation.listener is self:
            knobs.compilation.listener = self._previous
        self._installed = False

    def report(self, top: int = 10) -> dict[str, Any]:
        worst = sorted(self.by_kernel.items(), key=lambda kv: -kv[1])[:top]
        return {"compiles": self.compiles, "cache_hits": self.cache_hits,
                "seconds": round(sum(self.seconds.values()), 3),
                "gemc_kernels_s": round(self.seconds["gemc"], 3),
                "other_kernels_s": round(self.seconds["other"], 3),
                "by_kernel": {k: round(v, 3) for k, v in worst},
                "gemc_cache_hits": len(self.gemc_hits),
                "gemc_cache_misses": len(self.gemc_misses),
                **({"listener_missing": self.missing} if self.missing else {})}


class FirstStepAccount:
    """Snapshots torch's compile timers and listens to Triton from :meth:`start` until
    :meth:`finish`, which returns the first step's accounting for the run report:

    * ``torch_compile_s``: Dynamo + AOTAutograd + Inductor, forward frames and backward
      (``total_wall_time``), with its parts (``torch_phases_s``, ``torch_timers``);
    * ``outside_torch_compile_s``: the rest of the first step (running it, gemc's own
      kernels compiling on first launch, Inductor's autotuning at first run, the
      optimizers);
    * ``triton_in_process``: Triton compiles made in this process, gemc's and the rest.

    Triton's compiles may overlap torch's timers (Inductor loads and compiles kernels
    inside its code generation), so the parts are not meant to add up."""

    def __init__(self) -> None:
        self._phases: dict[str, float] = {}
        self._timers: dict[str, list[float]] = {}
        self._marks: list[tuple[str, float, float, float]] = []
        self.triton = TritonCompiles()

    def start(self) -> FirstStepAccount:
        self._phases = torch_phases()
        self._timers = torch_timers()
        self.triton.install()
        self._marks = [("start", *self._clock())]
        return self

    def _clock(self) -> tuple[float, float, float]:
        """(wall s, torch's cumulative compile s, gemc's own Triton compile s) now. Only
        gemc's kernels: Inductor's in-process compiles happen inside torch's compile time."""
        return (time.perf_counter(), torch_phases().get("total_wall_time", 0.0),
                self.triton.seconds["gemc"])

    def mark(self, phase: str, wait: Callable[[], None] | None = None) -> None:
        """End the first step's ``phase`` here (after ``wait``, e.g. a device sync, so the
        phase's queued kernels are counted in it, not in the next one). The two totals do
        not say *where* in the step the seconds outside torch's compile went: a slow
        optimizer's first launch and a slow forward read the same; these marks do."""
        if not self._marks:
            return
        if wait is not None:
            wait()
        self._marks.append((phase, *self._clock()))

    def _phase_walls(self) -> dict[str, dict[str, float]]:
        """Per marked phase: wall seconds, torch's compile and gemc's Triton compiles inside
        it, and the rest (running it: first launches, allocations, host work)."""
        out: dict[str, dict[str, float]] = {}
        for (_, t0, c0, k0), (name, t1, c1, k1) in zip(self._marks, self._marks[1:]):
            wall, comp, trit = t1 - t0, max(0.0, c1 - c0), max(0.0, k1 - k0)
            out[name] = {"wall_s": round(wall, 3), "torch_compile_s": round(comp, 3),
                         "gemc_triton_compile_s": round(trit, 3),
                         "rest_s": round(max(0.0, wall - comp - trit), 3)}
        return out

    def finish(self, first_step_s: float | None) -> dict[str, Any]:
        self.triton.remove()
        phases = {k: v - self._phases.get(k, 0.0) for k, v in torch_phases().items()}
        phases = {k: round(v, 3) for k, v in phases.items() if v > 5e-4}
        timers = {}
        for k, v in torch_timers().items():
            new = v[len(self._timers.get(k, [])):]
            if k in TORCH_TIMERS and new:
                timers[k] = {"seconds": round(sum(new), 3), "calls": len(new)}
        compile_s = phases.get("total_wall_time", 0.0)
        return {
            "first_step_s": first_step_s,
            "torch_compile_s": compile_s,
            "outside_torch_compile_s": (round(first_step_s - compile_s, 3)
                                        if first_step_s is not None else None),
            "torch_phases_s": phases,
            "torch_timers": timers,
            "triton_in_process": self.triton.report(),
            **({"phases": self._phase_walls()} if len(self._marks) > 1 else {}),
        }


def warm_compile_workers(device: Any) -> str:
    """Start Inductor's compile workers now, in the background (see the module doc), where
    the run will compile Triton kernels with Inductor (a CUDA device). Returns what it did,
    for the report. Call it after the compile cache's variables are set: the workers
    inherit the environment they start with. A torch without the hook runs as before, with a
    warning (its first step then starts the workers itself)."""
    if getattr(device, "type", None) != "cuda":
        return "not started: Inductor's compile workers serve Triton (CUDA) compiles only"
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError as exc:
        import warnings

        warnings.warn(f"gemc: Inductor's compile workers not started ahead of the first "
                      f"step ({exc}); the first step starts them and compiles in this "
                      "process until they are up", stacklevel=2)
        return f"not started: {exc}"
    maybe_warm_pool()  # honours TORCH_WARM_POOL=0 and TORCHINDUCTOR_COMPILE_THREADS=1
    return "started before setup"


def warm_kernels(device: Any) -> Any:
    """The warm-up of gemc's own kernels (:class:`gemc.backends.triton.warm.WarmUp`), its
    workers started now, before setup: on a CUDA device. Elsewhere (Triton's interpreter:
    nothing compiles) it derives the launches for the report and compiles nothing. Call it
    after the compile cache's variables are set (the workers inherit them)."""
    from gemc.backends.triton.warm import WarmUp

    if getattr(device, "type", None) != "cuda":
        return WarmUp(workers=0)
    return WarmUp().start()
