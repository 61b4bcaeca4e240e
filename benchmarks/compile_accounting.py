"""Where a cold first step's seconds go: torch's own compile timers and Triton's listeners.

Issue 16 asks for a first step within 1.5x torch.compile's; to get there the seconds must be
attributed. A profiler cannot do it: on Python 3.12 cProfile and Dynamo share
``sys.monitoring`` and cProfile silently loses the outer frames. So this reads the timers
torch keeps anyway (``torch._dynamo.utils``: Dynamo's bytecode tracing, the whole forward
frame compile with AOT autograd and Inductor inside it, the lazy backward compile, Inductor's
code generation and its wait on the compile workers) and hangs listeners on Triton for the
kernels compiled in this process (gemc's own kernels compile on their first launch; Inductor
compiles its kernels in worker processes) and for Triton autotuning.

``benchmarks/zoo.py`` calls :func:`start` before a variant runs and stores :func:`report` in
the variant's row as ``compile_accounting``; :func:`summary` is the one-line form it prints.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from gemc.backends.torch.first_step import TORCH_TIMERS, TritonCompiles

_COMPILES = TritonCompiles()
_TUNES: dict[str, Any] = {"runs": 0, "seconds": 0.0, "by_kernel": defaultdict(float)}


def _on_autotune(*, fn: Any, key: Any, best_config: Any, configs_timings: Any,
                 duration: float | None, cache_hit: bool) -> None:
    _TUNES["runs"] += 1
    _TUNES["seconds"] += float(duration or 0.0)
    name = getattr(getattr(fn, "fn", fn), "__name__", "?")
    _TUNES["by_kernel"][name] += float(duration or 0.0)


def start() -> list[str]:
    """Install the Triton listeners (the compile listener is the runner's own,
    :class:`gemc.backends.torch.first_step.TritonCompiles`); the names of those this Triton
    lacks (older Tritons have no ``knobs``: then only torch's timers are reported)."""
    _COMPILES.install()
    missing = [_COMPILES.missing] if _COMPILES.missing else []
    try:
        from triton import knobs
    except ImportError:
        return missing
    holder = getattr(knobs, "autotuning", None)
    if holder is None or not hasattr(holder, "listener"):
        missing.append("triton.knobs.autotuning.listener")
    else:
        holder.listener = _on_autotune
    return missing


def report(missing: list[str] | None = None) -> dict[str, Any]:
    """torch's compile timers and the Triton listeners' totals, in seconds."""
    from torch._dynamo import utils

    metrics = {k: {"seconds": round(sum(v), 3), "calls": len(v)}
               for k, v in utils.compilation_time_metrics.items() if k in TORCH_TIMERS}
    try:
        phases = {k: round(v, 3) for k, v in utils.calculate_time_spent().items()}
    except Exception:  # noqa: BLE001 - a private helper; its absence costs one section
        phases = {}
    tunes = sorted(_TUNES["by_kernel"].items(), key=lambda kv: -kv[1])[:12]
    return {"torch_phases": phases, "torch_timers": metrics,
            "triton_in_process": _COMPILES.report(top=12),
            "triton_autotune": {"runs": _TUNES["runs"],
                                "seconds": round(_TUNES["seconds"], 3),
                                "by_kernel": {k: round(v, 3) for k, v in tunes}},
            "listeners_missing": list(missing or [])}


def summary(acc: dict[str, Any]) -> str:
    """One line: the phases a first step is made of."""
    ph, tm = acc.get("torch_phases", {}), acc.get("torch_timers", {})
    tri, tune = acc.get("triton_in_process", {}), acc.get("triton_autotune", {})

    def s(key: str) -> float:
        return float(ph.get(key, 0.0))

    return (f"forward frame {s('entire_frame_compile'):.1f} s (dynamo tracing "
            f"{tm.get('bytecode_tracing', {}).get('seconds', 0.0):.1f}, inductor "
            f"{s('inductor_compile'):.1f}, codegen {s('code_gen'):.1f}, wait on workers "
            f"{s('async_compile.wait'):.1f}); backward {s('entire_backward_compile'):.1f} s; "
            f"triton in-process {tri.get('compiles', 0)} compiles "
            f"({tri.get('cache_hits', 0)} cached) {tri.get('seconds', 0.0):.1f} s, gemc's "
            f"{tri.get('gemc_kernels_s', 0.0):.1f} s; "
            f"triton autotune {tune.get('runs', 0)} runs {tune.get('seconds', 0.0):.1f} s")
