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

_TRITON: dict[str, Any] = {"compiles": 0, "cache_hits": 0, "seconds": 0.0,
                           "by_kernel": defaultdict(float),
                           "autotunes": 0, "autotune_seconds": 0.0,
                           "autotune_by_kernel": defaultdict(float)}

# torch._dynamo.utils.compilation_time_metrics keys worth reporting (seconds summed, calls).
_TORCH_KEYS = ("bytecode_tracing", "create_aot_dispatcher_function",
               "compile_fx.<locals>.fw_compiler_base", "compile_fx.<locals>.bw_compiler",
               "compile_fx_inner", "GraphLowering.codegen", "PyCodeCache.load_by_key_path",
               "async_compile.wait", "_recursive_joint_graph_passes",
               "min_cut_rematerialization_partition", "build_guards")


def _kernel_name(src: Any, metadata: Any) -> str:
    name = getattr(getattr(src, "fn", None), "__name__", None)
    if name is None and isinstance(metadata, dict):
        name = metadata.get("name")
    return str(name or "?")


def _on_compile(*, src: Any, metadata: Any, metadata_group: Any, times: Any,
                cache_hit: bool) -> None:
    _TRITON["compiles"] += 1
    _TRITON["cache_hits"] += int(bool(cache_hit))
    seconds = getattr(times, "total", 0) / 1e6  # Triton reports microseconds
    _TRITON["seconds"] += seconds
    _TRITON["by_kernel"][_kernel_name(src, metadata)] += seconds


def _on_autotune(*, fn: Any, key: Any, best_config: Any, configs_timings: Any,
                 duration: float | None, cache_hit: bool) -> None:
    _TRITON["autotunes"] += 1
    _TRITON["autotune_seconds"] += float(duration or 0.0)
    name = getattr(getattr(fn, "fn", fn), "__name__", "?")
    _TRITON["autotune_by_kernel"][name] += float(duration or 0.0)


def start() -> list[str]:
    """Install the Triton listeners; the names of those this Triton lacks (older Tritons
    have no ``knobs``: then only torch's timers are reported)."""
    missing = []
    try:
        from triton import knobs
    except ImportError:
        return ["triton.knobs"]
    for group, attr, hook in (("compilation", "listener", _on_compile),
                              ("autotuning", "listener", _on_autotune)):
        holder = getattr(knobs, group, None)
        if holder is None or not hasattr(holder, attr):
            missing.append(f"triton.knobs.{group}.{attr}")
            continue
        setattr(holder, attr, hook)
    return missing


def report(missing: list[str] | None = None) -> dict[str, Any]:
    """torch's compile timers and the Triton listeners' totals, in seconds."""
    from torch._dynamo import utils

    metrics = {k: {"seconds": round(sum(v), 3), "calls": len(v)}
               for k, v in utils.compilation_time_metrics.items() if k in _TORCH_KEYS}
    try:
        phases = {k: round(v, 3) for k, v in utils.calculate_time_spent().items()}
    except Exception:  # noqa: BLE001 - a private helper; its absence costs one section
        phases = {}

    def top(table: dict[str, float]) -> dict[str, float]:
        return {k: round(v, 3) for k, v in sorted(table.items(), key=lambda kv: -kv[1])[:12]}

    return {"torch_phases": phases, "torch_timers": metrics,
            "triton_in_process": {"compiles": _TRITON["compiles"],
                                  "cache_hits": _TRITON["cache_hits"],
                                  "seconds": round(_TRITON["seconds"], 3),
                                  "by_kernel": top(_TRITON["by_kernel"])},
            "triton_autotune": {"runs": _TRITON["autotunes"],
                                "seconds": round(_TRITON["autotune_seconds"], 3),
                                "by_kernel": top(_TRITON["autotune_by_kernel"])},
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
            f"({tri.get('cache_hits', 0)} cached) {tri.get('seconds', 0.0):.1f} s; "
            f"triton autotune {tune.get('runs', 0)} runs {tune.get('seconds', 0.0):.1f} s")
