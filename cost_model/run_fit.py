"""`gemc calibrate --from-run R.run.json ...`: fold measured runs back into a calibration.

A run report (``gemc run``'s ``*.run.json``) carries the measured step and peak memory next
to what the plan predicted, including the predicted step split by op kind
(``vs_predicted.kind_ms``: gemm, attention, memory-bound, embedding, optimizer, comm,
host; see ``gemc.costing.kind_breakdown_ms``) and the predicted memory split
(``vs_predicted.memory_breakdown_gb``, rank 0's). The fit is across runs, not per model, so it
generalises to models it has not seen:

- time: one multiplier per op kind, ``measured_step ~= sum_k f_k * predicted_k``, by
  least squares on the *relative* error of every run, with a ridge pull of every factor
  towards 1 (weight ``RIDGE``; with two or more runs the weight of ``RIDGE_GRID`` that
  predicts each run best from the others) so that a kind few runs exercise stays near
  the model, and
  every factor clipped to ``FACTOR_BOUNDS``. Where a report also has measured per-kind
  times (``measured_kind_ms``, e.g. from a profiled run) each is one more equation
  ``f_k * predicted_k = measured_k``.
- memory: one ``activation_factor`` on the activations (the part the model knows least;
  parameters, gradients and optimizer state are counted exactly), least squares of
  the *relative* error ``(static + a * activations - measured) / measured`` over runs
  (as the time fit and as the accuracy is judged: a 30 GB run must not outweigh a
  10 GB one ninefold), clipped the same way.

Factors multiply what the base calibration already predicts, so refitting a fitted file
composes. The residuals (per run, after the fit) are written next to the factors: a
small factor change with a large residual says the model misses a term, not a rate.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gemc.errors import GemcUserError

from .calibration import (
    FACTOR_BOUNDS,
    FIT_KINDS,
    Calibration,
    default_calibration,
    load_calibration,
)

RIDGE = 0.01  # weight of (f_k - 1)^2 against one run's squared relative error
RIDGE_GRID = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)  # what choose_ridge tries (>= 2 runs)


class RunReportError(GemcUserError):
    """A run report cannot be used for a fit."""


@dataclass(frozen=True)
class RunObservation:
    """What one run says: predicted by kind (ms) and measured step, memory by part."""

    source: str
    gpu: str | None
    measured_step_ms: float
    predicted_kind_ms: dict[str, float]
    measured_kind_ms: dict[str, float]
    measured_peak_bytes: float | None
    predicted_static_bytes: float | None   # params + grads + optimizer + workspace
    predicted_activation_bytes: float | None


def _bad(path: str, field: str, what: str, fix: str) -> RunReportError:
    return RunReportError(what, where=f"{path}: field '{field}'", fix=fix)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_run(path: str | Path, *, require_gpu: bool = True) -> RunObservation:
    """Read one ``*.run.json``; errors name the file, the field and the fix.
    ``require_gpu=False`` accepts CPU runs (benchmark smoke checks of the code path)."""
    p = str(path)
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise RunReportError(f"cannot read run report: {exc.strerror}", where=p,
                             fix="give the *.run.json that gemc run wrote") from None
    except json.JSONDecodeError as exc:
        raise RunReportError(f"invalid JSON: {exc.msg}", where=f"{p}:{exc.lineno}",
                             fix="give the *.run.json that gemc run wrote") from None
    if not isinstance(doc, Mapping) or "vs_predicted" not in doc:
        raise _bad(p, "vs_predicted", "not a gemc run report (no vs_predicted)",
                   "give the *.run.json that gemc run wrote")
    if require_gpu and doc.get("device") != "cuda":
        raise _bad(p, "device", f"the run ran on {doc.get('device')!r}, not a GPU: its times "
                   "say nothing about the GPU the calibration describes",
                   "fold in runs made on the GPU (gemc run on that machine)")
    vs = doc["vs_predicted"]
    step = (vs.get("step_ms") or {}).get("measured") if isinstance(vs, Mapping) else None
    if not (_num(step) and step > 0):
        raise _bad(p, "vs_predicted.step_ms.measured", f"no measured step time ({step!r})",
                   "run more steps than --warmup so that a step is timed")
    kinds = vs.get("kind_ms")
    if not isinstance(kinds, Mapping) or not kinds:
        raise _bad(p, "vs_predicted.kind_ms", "the report has no per-kind prediction",
                   "compile the plan with this gemc (plans carry predicted.kind_ms) and "
                   "run it again")
    for k, v in kinds.items():
        if k not in FIT_KINDS or not (_num(v) and v >= 0):
            raise _bad(p, f"vs_predicted.kind_ms.{k}", f"expected one of {FIT_KINDS} with "
                       f"milliseconds >= 0, got {k!r}: {v!r}", "recompile and rerun")
    if sum(kinds.values()) <= 0:
        raise _bad(p, "vs_predicted.kind_ms", "the predicted step is zero",
                   "compile with a cost model (not --disable-pass predict-time)")
    measured_kinds = vs.get("measured_kind_ms") or {}
    if not isinstance(measured_kinds, Mapping) or not all(
            k in FIT_KINDS and _num(v) and v >= 0 for k, v in measured_kinds.items()):
        raise _bad(p, "vs_predicted.measured_kind_ms", "expected op kind -> ms >= 0",
                   "drop the field or rerun with --profile")
    peak = static = act = None
    mem = vs.get("memory_per_rank") or []
    parts = vs.get("memory_breakdown_gb")
    if mem and isinstance(parts, Mapping) and doc.get("device") == "cuda":
        peaks = [m.get("measured_bytes") for m in mem if isinstance(m, Mapping)]
        if peaks and all(_num(x) for x in peaks):
            peak = float(max(peaks))
            act = 1e9 * float(parts.get("activations", 0.0))
            static = 1e9 * float(parts.get("total", 0.0)) - act
    return RunObservation(p, vs.get("gpu"), float(step),
                          {k: float(v) for k, v in kinds.items()},
                          {k: float(v) for k, v in measured_kinds.items()}, peak, static, act)


@dataclass(frozen=True)
class RunFit:
    factors: dict[str, float]          # relative to the base calibration
    activation_factor: float | None    # None: no run had memory to fit
    residuals: list[dict[str, Any]]
    ridge: float = RIDGE               # the pull towards 1 the time factors were fitted at


def _time_factors(runs: Sequence[RunObservation], kinds: list[str],
                  ridge: float) -> dict[str, float]:
    """The per-kind step factors of ``runs`` at ``ridge`` (see the module doc)."""
    rows, rhs = [], []
    for r in runs:  # relative error of the step: sum_k f_k p_k / m = 1
        rows.append([r.predicted_kind_ms.get(k, 0.0) / r.measured_step_ms for k in kinds])
        rhs.append(1.0)
        for k, m in r.measured_kind_ms.items():  # a measured kind time: f_k p_k / m = 1
            p = r.predicted_kind_ms.get(k, 0.0)
            if k in kinds and p > 0 and m > 0:
                rows.append([p / m if j == k else 0.0 for j in kinds])
                rhs.append(1.0)
    a = np.array(rows + [[math.sqrt(ridge) if i == j else 0.0 for j in range(len(kinds))]
                         for i in range(len(kinds))])
    b = np.array(rhs + [math.sqrt(ridge)] * len(kinds))
    lo, hi = FACTOR_BOUNDS
    f = np.clip(np.linalg.lstsq(a, b, rcond=None)[0], lo, hi) if kinds else np.array([])
    return {k: float(v) for k, v in zip(kinds, f, strict=True)}


def choose_ridge(runs: Sequence[RunObservation], kinds: list[str]) -> float:
    """The ridge of ``RIDGE_GRID`` whose fit predicts each run best from the others
    (leave-one-out mean relative step error; the larger ridge on a tie); ``RIDGE`` with
    a single run (nothing to hold out). Why: seven kinds fitted on a few runs are
    under-determined, and a weak pull lets one model's missing term set factors that
    mislead on the next
    (the zoo's leave-half-out refit: gemm 0.2, host 3.4 fitted on three models). Two runs
    already say whether one predicts the other: fitted at 0.01 on DIN's run (-33%, its own
    missing term) and BST's, the refit put DLRM-DCNv2 +71% over its run."""
    if len(runs) < 2:
        return RIDGE
    best, best_err = RIDGE, math.inf
    for ridge in RIDGE_GRID:
        errs = []
        for i, held in enumerate(runs):
            f = _time_factors([r for j, r in enumerate(runs) if j != i], kinds, ridge)
            pred = sum(f.get(k, 1.0) * v for k, v in held.predicted_kind_ms.items())
            errs.append(abs(pred - held.measured_step_ms) / held.measured_step_ms)
        err = sum(errs) / len(errs)
        if err <= best_err + 1e-12:
            best, best_err = ridge, err
    return best


def activation_factor(runs: Sequence[RunObservation]) -> float | None:
    """The ``a`` minimising sum over runs of ((static + a * activations - measured) /
    measured)^2, clipped to ``FACTOR_BOUNDS``; None when no run has memory to fit."""
    mem = [r for r in runs if r.measured_peak_bytes and r.predicted_activation_bytes
           and r.predicted_static_bytes is not None]
    if not mem:
        return None
    m = np.array([r.measured_peak_bytes for r in mem])
    x = np.array([r.predicted_activation_bytes for r in mem]) / m
    y = (m - np.array([r.predicted_static_bytes for r in mem])) / m
    lo, hi = FACTOR_BOUNDS
    return float(np.clip(float(x @ y) / float(x @ x), lo, hi))


def fit_runs(runs: Sequence[RunObservation], *, ridge: float | None = None) -> RunFit:
    """Least-squares factors over the runs (see the module doc); deterministic.
    ``ridge``: None chooses it by leave-one-out over the runs (``choose_ridge``)."""
    if not runs:
        raise RunReportError("no run reports given", where="--from-run",
                             fix="give one or more *.run.json files")
    kinds = [k for k in FIT_KINDS if any(r.predicted_kind_ms.get(k, 0.0) > 0 for r in runs)]
    ridge = choose_ridge(runs, kinds) if ridge is None else ridge
    factors = _time_factors(runs, kinds, ridge)
    lo, hi = FACTOR_BOUNDS

    act = activation_factor(runs)

    residuals = []
    for r in runs:
        pred = sum(factors.get(k, 1.0) * v for k, v in r.predicted_kind_ms.items())
        entry: dict[str, Any] = {
            "run": r.source, "measured_step_ms": r.measured_step_ms,
            "predicted_step_ms": sum(r.predicted_kind_ms.values()),
            "fitted_step_ms": pred,
            "step_residual_pct": 100 * (pred - r.measured_step_ms) / r.measured_step_ms}
        if act is not None and r.measured_peak_bytes and r.predicted_activation_bytes:
            fitted = r.predicted_static_bytes + act * r.predicted_activation_bytes
            entry.update(measured_peak_gb=r.measured_peak_bytes / 1e9,
                         predicted_peak_gb=(r.predicted_static_bytes
                                            + r.predicted_activation_bytes) / 1e9,
                         fitted_peak_gb=fitted / 1e9,
                         memory_residual_pct=100 * (fitted - r.measured_peak_bytes)
                         / r.measured_peak_bytes)
        residuals.append(entry)
    return RunFit(factors, act, residuals, ridge)


def resolve_base(choice: str | Path, runs: Sequence[RunObservation]) -> Calibration:
    """``--base``: a calibration file, or "auto": the one shipped for the runs' GPU."""
    if str(choice) != "auto":
        return load_calibration(choice)
    gpus = {r.gpu for r in runs if r.gpu}
    if len(gpus) != 1:
        raise RunReportError(f"--base auto needs runs of one GPU, got {sorted(gpus) or 'none'}",
                             where="--from-run", fix="give --base FILE")
    base = default_calibration(gpus.pop())
    if base is None:
        raise RunReportError("no calibration is shipped for the runs' GPU", where="--base",
                             fix="give --base FILE (a gemc calibrate file for that GPU)")
    return base


def calibrate_from_runs(run_paths: Sequence[str | Path], base: str | Path | Calibration,
                        out: str | Path | None = None, *,
                        require_gpu: bool = True) -> dict[str, Any]:
    """Fit the runs, compose the factors with ``base``'s, validate, write ``out``
    (atomically) and return the new calibration document."""
    base_cal = base if isinstance(base, Calibration) else load_calibration(base)
    runs = [read_run(p, require_gpu=require_gpu) for p in run_paths]
    for r in runs:
        if r.gpu and r.gpu != base_cal.gpu.name:
            raise _bad(r.source, "vs_predicted.gpu", f"the run was predicted for {r.gpu}, the "
                       f"base calibration is for {base_cal.gpu.name}",
                       "give a --base calibration of the GPU the runs ran on")
    fit = fit_runs(runs)
    doc = json.loads(json.dumps(base_cal.data))
    old = (doc.get("run_fit") or {})
    lo, hi = FACTOR_BOUNDS
    factors = {k: min(hi, max(lo, old.get("factors", {}).get(k, 1.0) * fit.factors.get(k, 1.0)))
               for k in FIT_KINDS}
    act = float(old.get("activation_factor", 1.0))
    if fit.activation_factor is not None:
        act = min(hi, max(lo, act * fit.activation_factor))
    doc["run_fit"] = {
        "date": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
        "factors": {k: round(v, 6) for k, v in factors.items()},
        "activation_factor": round(act, 6),
        "runs": [str(p) for p in run_paths],
        "method": f"least squares over runs of relative step error, ridge {fit.ridge} "
                  "towards 1 (chosen by leave-one-out over the runs when there are 3 or more), "
                  f"factors clipped to {list(FACTOR_BOUNDS)}",
        "residuals": fit.residuals,
    }
    Calibration(doc, source=str(out or "run-fit"))  # validate before writing
    if out is not None:
        path = Path(out)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(path)
    return doc
