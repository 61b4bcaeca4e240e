"""Whether a graph-mode run replays its compiled step as CUDA graphs, when nobody said.

Why: a step whose host issues its kernels slower than the GPU runs them leaves the GPU
waiting, and ``torch.compile(mode="reduce-overhead")`` (CUDA graphs) takes the host out
of the loop. On one H100 every zoo model's median step was faster under it, most where
the host bounds the step (TransAct 17.39 -> 9.43 ms; the others 1.01-1.09x), its
losses the same (BENCHMARKS.md, thirty-first session). The GEM and DLRM examples, whose
steps the GPU bounds, have never run under it; GEM holds the largest memory and updates
its tables inside the compiled frame.

So ``auto`` (the default) turns CUDA graphs on where the plan predicts the host bounds the
step. The plan predicts this from its launch count at its per-launch host price against
its device time (``plan["predicted"]``: ``cost_model.launches``). That puts TransAct, MMoE,
DIN, Wukong and DLRM-DCNv2 under CUDA graphs; all five gained on the H100. It leaves off
HSTU, SASRec/BST, GEM and DLRM, which the GPU bounds. One rank only: CUDA graphs over the
collectives of several ranks have not run. ``--compile-mode`` names a mode to take
(``default``: no CUDA graphs), and the run report says which was taken and why.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gemc.errors import GemcUserError

__all__ = ["AUTO", "CUDA_GRAPHS", "MODES", "resolve_compile_mode"]

AUTO = "auto"
CUDA_GRAPHS = "reduce-overhead"
MODES = (AUTO, "default", CUDA_GRAPHS, "max-autotune", "max-autotune-no-cudagraphs")
"""What ``--compile-mode`` accepts: ``auto``, or one of ``torch.compile``'s modes."""


def resolve_compile_mode(requested: str | None, *, device_type: str, executor: str,
                         world_size: int, predicted: Mapping[str, Any] | None
                         ) -> tuple[str | None, str]:
    """The ``torch.compile`` mode a graph-mode run takes (None: torch's default) and why,
    in words for the run report. ``requested``: ``--compile-mode`` (None or ``auto``: the
    plan's prediction decides)."""
    if requested not in (None, AUTO):
        if requested not in MODES:
            raise GemcUserError(f"compile mode {requested!r} is not one gemc run takes",
                                where="--compile-mode (RunOptions.compile_mode)",
                                fix=f"use one of {', '.join(MODES)}")
        return (None if requested == "default" else requested), f"asked for ({requested})"
    if device_type != "cuda":
        return None, "auto: CUDA graphs need a CUDA device"
    if executor != "inductor":
        return None, f"auto: the {executor} executor does not compile the step"
    if world_size > 1:
        return None, (f"auto: {world_size} ranks (CUDA graphs over collectives have not run; "
                      f"--compile-mode {CUDA_GRAPHS} turns them on)")
    host = (predicted or {}).get("host") or {}
    device_ms = (predicted or {}).get("device_step_ms")
    launches, per_us = host.get("launches"), host.get("per_launch_us")
    if not all(isinstance(x, (int, float)) for x in (device_ms, launches, per_us)):
        return None, "auto: the plan predicts no host and device time to compare"
    issue_ms = float(launches) * float(per_us) / 1e3
    figures = (f"{issue_ms:.3g} ms to issue {int(launches)} launches against "
               f"{float(device_ms):.3g} ms on the GPU, predicted")
    if issue_ms > float(device_ms):
        return CUDA_GRAPHS, f"auto: the host bounds the step ({figures})"
    return None, f"auto: the GPU bounds the step ({figures})"
