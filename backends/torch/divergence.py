"""Loss safeguard: notice a training run blowing up, and say which low precision to revert.

Lower precision (bf16 / fp8 tables, bf16 / fp8 GEMM sites) is chosen because it is
predicted to be harmless; a run that then diverges must not go on silently burning GPU
hours. :class:`DivergenceGuard` watches every step's loss (and a gradient norm, where the
caller has one) and flags a step when

* the value is not finite (nan / inf);
* against the run's own recent statistics: after ``warmup`` steps, the value exceeds the
  median of the last ``window`` steps by more than ``spread`` times their median absolute
  deviation *and* by more than ``ratio`` times the median (a robust z-score: one noisy
  batch moves neither the median nor the MAD, a blow-up is orders of magnitude out);
  before ``warmup`` steps, when it exceeds ``early_ratio`` times the median so far (a run
  that blows up in its first steps has no statistics yet, but a 10x jump is not noise);
* against a reference trajectory (e.g. the same plan at fp32 / bf16, a previous run's
  report) when one is given: the loss is above the reference's at that step by more than
  ``reference_rtol`` for ``patience`` consecutive steps (a single bad batch is not enough).

What it then does is the caller's ``action``: ``warn`` (a loud warning, training goes on)
or ``stop`` (:class:`TrainingDiverged`, a GemcUserError naming the step, the evidence and
the sites to revert). The sites are read from the plan: tables stored bf16 / fp8 and
precision entries below fp32.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemc.checks import read_json
from gemc.errors import GemcUserError

ACTIONS = ("off", "warn", "stop")


class TrainingDiverged(GemcUserError):
    """The loss (or gradient norm) blew up under a plan with low-precision sites."""


@dataclass(frozen=True)
class Verdict:
    step: int
    what: str  # "loss" or "grad_norm"
    evidence: str
    non_finite: bool = False  # the value itself is NaN or infinite


def low_precision_sites(plan: dict[str, Any]) -> list[str]:
    """The plan's sites below fp32, as a user reverts them: tables, then precision sites."""
    out = [f"table {t['fqn']} ({t['precision']})" for t in plan.get("tables", [])
           if t.get("precision", "fp32") != "fp32"]
    for site in plan.get("precision", []):
        dtype = str(site.get("dtype", "fp32"))
        if dtype not in ("fp32", "float32"):
            out.append(f"precision site {site.get('target', '?')} ({dtype})")
    return out


def load_reference(path: str | Path) -> dict[int, float]:
    """Per-step losses of a reference run: a run report (``losses``: [{step, loss}]) or a
    JSON list of losses (step 1 first)."""
    where = f"--reference-losses {path}"
    data = read_json(path, "reference losses", where,
                     "give a run report (gemc run --report) or a JSON list of losses")
    if isinstance(data, dict):
        data = data.get("losses")
    if isinstance(data, list) and all(isinstance(x, dict) and "step" in x and "loss" in x
                                      for x in data):
        return {int(x["step"]): float(x["loss"]) for x in data}
    if isinstance(data, list) and all(isinstance(x, int | float) for x in data):
        return {i + 1: float(x) for i, x in enumerate(data)}
    raise GemcUserError("the reference losses are neither a run report nor a list of numbers",
                        where=where, fix="give a run report (gemc run --report) or a JSON "
                                         "list of losses")


def _from_initial_weights(v: Verdict) -> bool:
    """A non-finite loss at step 1 (steps count from the run's start, a resumed run's
    continue): computed before any update, so no learning rate made it."""
    return v.step == 1 and v.what == "loss" and v.non_finite


class DivergenceGuard:
    """Watches a run's losses (and gradient norms); see the module docstring."""

    def __init__(self, sites: Sequence[str] = (), *, action: str = "warn",
                 reference: dict[int, float] | None = None, window: int = 20,
                 warmup: int = 5, spread: float = 10.0, ratio: float = 1.0,
                 early_ratio: float = 10.0,
                 reference_rtol: float = 0.5, patience: int = 3, quiet: bool = False) -> None:
        if action not in ACTIONS:
            raise ValueError(f"divergence action must be one of {ACTIONS}, got {action!r}")
        self.sites = list(sites)
        self.action = action
        self.quiet = quiet  # warn: only one rank of a run says it
        self.reference = dict(reference or {})
        self.warmup, self.spread, self.ratio = warmup, spread, ratio
        self.early_ratio = early_ratio
        self.reference_rtol, self.patience = reference_rtol, patience
        self.recent: dict[str, deque[float]] = {"loss": deque(maxlen=window),
                                                "grad_norm": deque(maxlen=window)}
        self.above_reference = 0
        self.verdicts: list[Verdict] = []

    def observe(self, step: int, loss: float, grad_norm: float | None = None) -> Verdict | None:
        """Record step ``step``; act (warn / raise) and return the verdict if it diverged."""
        if self.action == "off":
            return None
        verdict = self._check("loss", step, loss)
        if verdict is None and grad_norm is not None:
            verdict = self._check("grad_norm", step, grad_norm)
        if verdict is None and step in self.reference and math.isfinite(loss):
            ref = self.reference[step]
            if loss > ref + self.reference_rtol * abs(ref):
                self.above_reference += 1
            else:
                self.above_reference = 0
            if self.above_reference >= self.patience:
                verdict = Verdict(step, "loss", (
                    f"loss {loss:.6g} is above the reference trajectory ({ref:.6g} at this "
                    f"step) by more than {self.reference_rtol:.0%} for {self.patience} "
                    "steps in a row"))
        if verdict is not None:
            self._act(verdict)
        return verdict

    def _check(self, what: str, step: int, value: float) -> Verdict | None:
        recent = self.recent[what]
        if not math.isfinite(value):
            return Verdict(step, what, f"{what} is {value}", non_finite=True)
        verdict = None
        if 0 < len(recent) < self.warmup:
            median = statistics.median(recent)
            if abs(value) > self.early_ratio * max(abs(median), 1e-30):
                verdict = Verdict(step, what, (
                    f"{what} {value:.6g} is more than {self.early_ratio:g}x the median of the "
                    f"first {len(recent)} step(s) ({median:.6g})"))
        elif len(recent) >= self.warmup:
            median = statistics.median(recent)
            mad = statistics.median(abs(x - median) for x in recent)
            jump = value - median
            if jump > self.spread * mad and jump > self.ratio * abs(median):
                verdict = Verdict(step, what, (
                    f"{what} {value:.6g} against a median of {median:.6g} over the last "
                    f"{len(recent)} steps (median absolute deviation {mad:.3g}): "
                    f"{jump / max(mad, 1e-30):.3g} deviations and {jump / max(abs(median), 1e-30):.3g}x "
                    "the median above it"))
        if verdict is None:
            recent.append(value)  # a blown-up value does not become the new normal
        return verdict

    def message(self, v: Verdict) -> str:
        if self.sites:
            revert = "; ".join(self.sites)
        elif _from_initial_weights(v):
            revert = ("none: every table and site of this plan is fp32, and step 1's loss "
                      "is the initial weights' on the first batch (no update has run, so "
                      "not the learning rate either): the forward itself makes it")
        else:
            revert = ("none: every table and site of this plan is fp32 (look at the "
                      "learning rate and the data instead)")
        return (f"training diverged at step {v.step}: {v.evidence}. Low-precision sites to "
                f"revert: {revert}")

    def _act(self, v: Verdict) -> None:
        self.verdicts.append(v)
        if self.sites:
            fix = ("compile again with --table-precision fp32 and / or --precision bf16 (no "
                   "fp8 GEMM sites), or fp32")
        elif _from_initial_weights(v):
            fix = ("run the model eagerly on make_batch(0) under torch.autograd.detect_anomaly"
                   "() to find the first non-finite value; the usual ones: a softmax whose "
                   "every key is masked (a row that is all padding: keep one key, e.g. "
                   "mask[:, 0] = False), a log or a division of 0")
        else:
            fix = "lower the learning rate, check the data"
        if self.action == "stop":
            raise TrainingDiverged(self.message(v), where=f"gemc run, step {v.step}", fix=fix)
        if not self.quiet:
            warnings.warn(f"gemc: WARNING {self.message(v)} (fix: {fix})", stacklevel=3)

    def report(self) -> dict[str, Any]:
        return {"action": self.action, "sites": self.sites,
                "reference_steps": len(self.reference),
                "diverged": [{"step": v.step, "what": v.what, "evidence": v.evidence}
                             for v in self.verdicts]}
