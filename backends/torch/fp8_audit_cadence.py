"""The fp8 audit's option and its default cadence (:mod:`.fp8_audit` is the audit).

A module of its own, without torch: ``gemc run``'s argument parser shows them in ``--help``
and checks ``--fp8-audit-every`` before anything imports torch
(tests/test_cli_lazy_imports.py).
"""

from __future__ import annotations

__all__ = ["FLAG", "DEFAULT_EVERY"]

FLAG = "--fp8-audit-every"
DEFAULT_EVERY = 100
"""Steps between audits. Why 100: on the CPU's 2-layer Wukong one audit cost 0.95 of a
training step (55 s for 10 audits in a 636 s run of 100 steps: BENCHMARKS.md, branch
s22-fp8audit), so 1% at 100; and the weight gradients there left the bound at steps 20-30,
so a 100-step cadence leaves at most 100 steps of a bad fp8 wgrad (on that model an fp8
run that never switched ended within 0.1% of bf16: branch s21-fp8loss). The run report's ``fp8_audit.seconds``
measures the cost of every run (device time included: the audit waits for the GPU); on a
GPU the fp32 reference GEMMs run at the fp32 rate (TF32 off), a larger share of a step
than on a CPU -- raise N where the report shows it."""
