"""Measured kernel efficiencies of one GPU: the file `gemc calibrate` writes.

A roofline says what a GPU could do; a calibration says what it did. The file holds raw
measurements (shape -> seconds), never fitted numbers, so it can be re-read by a newer
model. On load every measurement is turned into an *efficiency* — achieved work rate over
the datasheet peak, after taking off the per-kernel launch gap — and op costs interpolate
those efficiencies over shapes (interp.py). Format (version 1)::

    {"format": "gemc-calibration", "version": 1, "date": "2026-05-01T12:00:00Z",
     "gpu": {"name": "h200", "device_name": "NVIDIA H200", "sm_count": 132,
             "total_memory_bytes": 150754820096},
     "software": {"torch": "2.11.0+cu130", "cuda": "13.0", "driver": "580.65",
                  "cudnn": 91000},
     "launch": {"kernel_s": 2.4e-6, "eager_op_s": 9e-6, "eager_view_op_s": 3e-6,
                "eager_bwd_op_s": 14e-6},
     "gemm": {"bf16": [[m, n, k, seconds], ...], "fp32": [...], "tf32": [...],
              "fp8": [...]},
     "copy": [[bytes, seconds], ...],            # d2d copy, bytes = read + written
     "pointwise": [[bytes, seconds], ...],       # a + b, bytes = 3 * numel * elt
     "norm": [[bytes, fwd_s, bwd_s], ...],       # layer_norm, bytes = forward in + out
     "embedding_bag": [{"rows", "dim", "bags", "bag_size", "dtype", "fwd_s", "bwd_s"}],
     "attention": [{"batch", "heads", "q_len", "kv_len", "head_dim", "causal", "dtype",
                    "fwd_s", "bwd_s"}],
     "optimizer": {"adamw_foreach": [[param_bytes, seconds], ...],      # fp32 states
                   "adamw_foreach_bf16": [[param_bytes, seconds], ...]}, # bf16 states
     # the eager step's components at the example models' shapes (optional):
     "embedding_bag_skewed": [{... as embedding_bag, "ids": "skewed"}],
     "attention_masked": [{... as attention, "masked": true}],   # key-padding bool mask
     "pointwise_bf16": [[bytes, seconds], ...], "norm_bf16": [[bytes, fwd_s, bwd_s], ...],
     "collectives": {"ranks": 8, "all_reduce": [[bytes, seconds], ...], ...}
                    or {"skipped": "why"},
     "notes": ["..."],
     # folded back from `gemc run` reports by `gemc calibrate --from-run` (optional):
     "run_fit": {"factors": {"gemm": 1.0, "attention": 1.0, "memory": 1.0,
                             "embedding": 1.0, "optimizer": 1.0, "comm": 1.0, "host": 1.0},
                 "activation_factor": 1.0, "runs": [...], "residuals": {...}}}

Any section but format/version/date/gpu/software may be missing; the cost model falls
back to the roofline for what was not measured and says so.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

from gemc.errors import GemcUserError

from . import kernels
from .collectives import bus_factor
from .hardware import GB, GPUSpec, get_gpu
from .interp import LogCurve1D, LogIDW

FORMAT = "gemc-calibration"
VERSION = 1
DATA_DIR = Path(__file__).resolve().parent / "data"
_DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


class CalibrationError(GemcUserError):
    """A calibration file is unreadable, of another version, or malformed."""


def _fail(source: str, field: str, what: str, fix: str) -> CalibrationError:
    return CalibrationError(what, where=f"{source}: field '{field}'", fix=fix)


def _rows(d: Mapping[str, Any], key: str, width: int, source: str) -> list[list[float]]:
    rows = d.get(key, [])
    if not isinstance(rows, list):
        raise _fail(source, key, f"{key} must be a list of [numbers]", "re-run gemc calibrate")
    for i, row in enumerate(rows):
        if (not isinstance(row, list) or len(row) != width
                or not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0
                           for v in row)):
            raise _fail(source, f"{key}[{i}]", f"expected {width} positive numbers, got {row!r}",
                        "re-run gemc calibrate or delete the bad row")
    return rows


def _records(d: Mapping[str, Any], key: str, fields: tuple[str, ...],
             source: str) -> list[dict[str, Any]]:
    recs = d.get(key, [])
    if not isinstance(recs, list):
        raise _fail(source, key, f"{key} must be a list of objects", "re-run gemc calibrate")
    for i, rec in enumerate(recs):
        if not isinstance(rec, Mapping):
            raise _fail(source, f"{key}[{i}]", "expected an object", "re-run gemc calibrate")
        for f in fields:
            if f not in rec:
                raise _fail(source, f"{key}[{i}].{f}", f"missing field {f!r}",
                            "re-run gemc calibrate")
            v = rec[f]
            if f not in ("dtype", "causal") and not (
                    isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
                raise _fail(source, f"{key}[{i}].{f}", f"{f} must be positive, got {v!r}",
                            "re-run gemc calibrate")
    return recs


def validate_calibration(d: Any, source: str = "calibration") -> None:
    """Raise one CalibrationError naming the first bad field."""
    if not isinstance(d, Mapping):
        raise CalibrationError("a calibration file must hold a JSON object", where=source,
                               fix="re-run gemc calibrate")
    if d.get("format") != FORMAT:
        raise _fail(source, "format", f"not a gemc calibration (format={d.get('format')!r})",
                    f"give a file written by gemc calibrate (format {FORMAT!r})")
    if d.get("version") != VERSION:
        raise _fail(source, "version", f"calibration version {d.get('version')!r} is not "
                    f"supported", f"re-run gemc calibrate (writes version {VERSION})")
    for key in ("date", "gpu", "software"):
        if key not in d:
            raise _fail(source, key, f"missing field {key!r}", "re-run gemc calibrate")
    if not isinstance(d["gpu"], Mapping) or "name" not in d["gpu"]:
        raise _fail(source, "gpu.name", "missing the GPU name", "re-run gemc calibrate")
    try:
        get_gpu(d["gpu"]["name"])
    except GemcUserError as exc:
        raise _fail(source, "gpu.name", exc.what, exc.fix or "") from None
    launch = d.get("launch", {})
    if not isinstance(launch, Mapping):
        raise _fail(source, "launch", "launch must be an object", "re-run gemc calibrate")
    for key, value in launch.items():
        if not (isinstance(value, (int, float)) and 0 <= value < 1e-2):
            raise _fail(source, f"launch.{key}", f"a launch overhead must be 0..10 ms in "
                        f"seconds, got {value!r}", "re-run gemc calibrate")
    gemm = d.get("gemm", {})
    if not isinstance(gemm, Mapping):
        raise _fail(source, "gemm", "gemm must map dtype -> rows", "re-run gemc calibrate")
    for dtype in gemm:
        if dtype not in _DTYPE_BYTES:
            raise _fail(source, f"gemm.{dtype}", f"unknown dtype {dtype!r}",
                        f"use {sorted(_DTYPE_BYTES)}")
        _rows(gemm, dtype, 4, f"{source}: gemm")
    for key in ("copy", "pointwise", "pointwise_bf16"):
        _rows(d, key, 2, source)
    for key in ("norm", "norm_bf16"):
        _rows(d, key, 3, source)
    for key in ("embedding_bag", "embedding_bag_skewed"):
        _records(d, key, ("rows", "dim", "bags", "bag_size", "dtype", "fwd_s", "bwd_s"), source)
    for key in ("attention", "attention_masked"):
        _records(d, key, ("batch", "heads", "q_len", "kv_len", "head_dim", "causal", "dtype",
                          "fwd_s", "bwd_s"), source)
    opt = d.get("optimizer", {})
    if not isinstance(opt, Mapping):
        raise _fail(source, "optimizer", "optimizer must be an object", "re-run gemc calibrate")
    for key in opt:
        _rows(opt, key, 2, f"{source}: optimizer")
    fit = d.get("run_fit")
    if fit is not None:
        _validate_run_fit(fit, source)
    coll = d.get("collectives", {})
    if not isinstance(coll, Mapping):
        raise _fail(source, "collectives", "collectives must be an object",
                    "re-run gemc calibrate")
    for op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all"):
        if op in coll:
            _rows(coll, op, 2, f"{source}: collectives")


# Op kinds a run fit scales (run_fit.py fits them; op_cost and collectives apply them).
FIT_KINDS = ("gemm", "attention", "memory", "embedding", "optimizer", "comm", "host")
FACTOR_BOUNDS = (0.2, 5.0)  # a factor outside says the model is wrong, not the GPU slow


def _validate_run_fit(fit: Any, source: str) -> None:
    if not isinstance(fit, Mapping):
        raise _fail(source, "run_fit", "run_fit must be an object",
                    "re-run gemc calibrate --from-run")
    factors = fit.get("factors", {})
    if not isinstance(factors, Mapping):
        raise _fail(source, "run_fit.factors", "factors must map op kind -> number",
                    "re-run gemc calibrate --from-run")
    lo, hi = FACTOR_BOUNDS
    items = [*((f"factors.{k}", k, v) for k, v in factors.items()),
             ("activation_factor", None, fit.get("activation_factor", 1.0))]
    for field, kind, value in items:
        if kind is not None and kind not in FIT_KINDS:
            raise _fail(source, f"run_fit.{field}", f"unknown op kind {kind!r}",
                        f"use {', '.join(FIT_KINDS)}")
        if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                and lo <= value <= hi):
            raise _fail(source, f"run_fit.{field}", f"a factor must be {lo}..{hi}, got "
                        f"{value!r}", "re-run gemc calibrate --from-run")


class Calibration:
    """A validated calibration file with its measurements turned into efficiency curves.

    Every accessor returns None where nothing was measured, so op_cost can fall back to
    the roofline for that kind and say so.
    """

    def __init__(self, data: Mapping[str, Any], *, source: str = "calibration") -> None:
        validate_calibration(data, source)
        self.data = dict(data)
        self.source = source
        self.gpu: GPUSpec = get_gpu(data["gpu"]["name"])
        launch = data.get("launch", {})
        self.kernel_s = float(launch.get("kernel_s", 0.0))
        self.eager_op_s = launch.get("eager_op_s")
        self.eager_view_op_s = launch.get("eager_view_op_s")
        self.eager_bwd_op_s = launch.get("eager_bwd_op_s")
        # host seconds per kernel of a compiled step (cost_model.launches; None: its default)
        self.graph_launch_s = launch.get("graph_launch_s")
        fit = data.get("run_fit") or {}
        self.factors: dict[str, float] = {k: float(v) for k, v in fit.get("factors", {}).items()}
        self.activation_factor = float(fit.get("activation_factor", 1.0))

    def factor(self, kind: str) -> float:
        """The run-fitted multiplier of an op kind's predicted time (1 when not fitted):
        what ``gemc calibrate --from-run`` learned from measured steps."""
        return self.factors.get(kind, 1.0)

    def __repr__(self) -> str:
        return f"Calibration({self.gpu.name}, {self.data.get('date')}, {self.source})"

    def summary(self) -> dict[str, Any]:
        """What the plan records about the calibration it used."""
        return {"source": self.source, "gpu": self.data["gpu"].get("name"),
                "date": self.data.get("date"), "software": self.data.get("software")}

    def _busy(self, seconds: float, kernels_launched: int = 1) -> float:
        """Measured time minus the launch gaps of its kernels (as op_cost adds them back),
        floored at 10% of the measurement."""
        return max(seconds - kernels_launched * self.kernel_s, 0.1 * seconds)

    # ---- compute-bound kernels --------------------------------------------------------
    @cached_property
    def _gemm(self) -> dict[str, LogIDW]:
        out = {}
        for dtype, rows in self.data.get("gemm", {}).items():
            if not rows:
                continue
            peak = self.gpu.peak_flops(dtype)
            pts = [(m, n, k) for m, n, k, _ in rows]
            eff = [min(1.0, kernels.gemm_flops(1, m, n, k) / self._busy(t) / peak)
                   for m, n, k, t in rows]
            out[dtype] = LogIDW(pts, eff)
        return out

    def gemm_efficiency(self, m: int, n: int, k: int, dtype: str) -> float | None:
        curve = self._gemm.get(dtype)
        return curve((max(m, 1), max(n, 1), max(k, 1))) if curve else None

    def gemm_span(self, dtype: str) -> tuple[tuple[int, int, int], float] | None:
        """(largest measured m, n and k, best measured efficiency) of ``dtype``'s GEMMs
        (None: not measured): beyond them op_cost extrapolates the time, not the
        efficiency."""
        rows = self.data.get("gemm", {}).get(dtype)
        if not rows:
            return None
        span = tuple(int(max(r[i] for r in rows)) for i in range(3))
        return (span[0], span[1], span[2]), float(self._gemm[dtype].y.max())

    @cached_property
    def _attention(self) -> dict[tuple[str, str], LogIDW]:
        return self._attention_curves("attention")

    @cached_property
    def _attention_masked(self) -> dict[tuple[str, str], LogIDW]:
        return self._attention_curves("attention_masked")

    def _attention_curves(self, section: str) -> dict[tuple[str, str], LogIDW]:
        groups: dict[tuple[str, str], tuple[list, list]] = {}
        for rec in self.data.get(section, []):
            dtype = str(rec["dtype"])
            peak = self.gpu.peak_flops(dtype)
            flops = kernels.attention_flops(rec["batch"], rec["heads"], rec["q_len"],
                                            rec["kv_len"], rec["head_dim"], bool(rec["causal"]))
            pt = (rec["batch"] * rec["heads"], rec["q_len"], rec["kv_len"], rec["head_dim"],
                  1 + bool(rec["causal"]))
            for phase, mult in (("fwd", 1.0), ("bwd", kernels.ATTENTION_BWD_FLOPS)):
                pts, effs = groups.setdefault((dtype, phase), ([], []))
                pts.append(pt)
                busy = self._busy(rec[f"{phase}_s"], 1 if phase == "fwd" else 3)
                effs.append(min(1.0, flops * mult / busy / peak))
        return {key: LogIDW(p, e) for key, (p, e) in groups.items()}

    def attention_efficiency(self, batch_heads: int, q_len: int, kv_len: int, head_dim: int,
                             causal: bool, dtype: str, phase: str, *,
                             masked: bool = False) -> float | None:
        """Efficiency of SDPA; ``masked``: with an attn_mask (which keeps bf16 off the flash
        kernel), from the attention_masked measurements where the file has them."""
        point = (batch_heads, q_len, kv_len, head_dim, 1 + bool(causal))
        if masked and (dtype, phase) in self._attention_masked:
            return self._attention_masked[(dtype, phase)](point)
        curve = self._attention.get((dtype, phase))
        if curve is None and dtype == "fp32":  # fp32 SDPA runs the math path; bf16 otherwise
            return None
        if curve is None:
            curve = next((c for (d, p), c in self._attention.items() if p == phase), None)
        if curve is None:
            return None
        return curve((batch_heads, q_len, kv_len, head_dim, 1 + bool(causal)))

    def masked_attention_s(self, batch: int, heads: int, q_len: int, kv_len: int,
                           head_dim: int, dtype: str) -> float | None:
        """Fwd+bwd seconds of a masked SDPA record of exactly this shape and dtype, or None:
        a measurement of the very shape wins over ``attention_fit``'s law elsewhere."""
        for rec in self.data.get("attention_masked", []):
            if (rec["batch"], rec["heads"], rec["q_len"], rec["kv_len"], rec["head_dim"],
                    str(rec["dtype"])) == (batch, heads, q_len, kv_len, head_dim, dtype):
                return float(rec["fwd_s"]) + float(rec["bwd_s"])
        return None

    # ---- memory-bound kernels ---------------------------------------------------------
    def _mem_curve(self, rows: list[list[float]], col: int = 1, *, bytes_mult: float = 1.0,
                   kernels_launched: int = 1) -> LogCurve1D | None:
        if not rows:
            return None
        bw = self.gpu.hbm_bandwidth
        xs = [r[0] * bytes_mult for r in rows]
        return LogCurve1D(xs, [min(1.0, x / self._busy(r[col], kernels_launched) / bw)
                               for x, r in zip(xs, rows, strict=True)])

    @cached_property
    def _memory(self) -> dict[str, LogCurve1D | None]:
        d = self.data
        out = {}
        for suffix in ("", "_bf16"):
            norm = d.get("norm" + suffix, [])
            out.update({
                "pointwise" + suffix: self._mem_curve(d.get("pointwise" + suffix, [])),
                "norm_fwd" + suffix: self._mem_curve(norm, 1),
                # backward moves ~2x the forward bytes in 2 kernels (op_cost's rule)
                "norm_bwd" + suffix: self._mem_curve(norm, 2, bytes_mult=2.0,
                                                     kernels_launched=2)})
        out["copy"] = self._mem_curve(d.get("copy", []))
        return out

    def memory_efficiency(self, curve: str, nbytes: float,
                          dtype: str | None = None) -> float | None:
        """Achieved fraction of HBM bandwidth of a memory-bound kernel moving nbytes;
        curve in copy, pointwise, norm_fwd, norm_bwd (pointwise when that one is missing).
        For 16-bit ``dtype`` the ``*_bf16`` measurement is used where the file has one."""
        c = None
        if dtype in ("bf16", "fp16"):
            c = self._memory.get(curve + "_bf16")
        c = c or self._memory.get(curve) or self._memory.get("pointwise") \
            or self._memory.get("copy")
        return c(nbytes) if c else None

    # Which embedding measurements the curves are built from: the at-shape measurements
    # ("embedding_bag_skewed": the example models' shapes, hot-head ids, the way eager runs
    # them) where the file has them -- the uniform-id sweep ("embedding_bag", 8192 bags,
    # tables to 1e7 rows) mixed in pulls the IDW curves towards shapes the models never
    # run (GEM's backward came out 2x the profiled kernels) -- else the uniform sweep.
    EMBEDDING_SECTIONS: tuple[str, ...] = ("embedding_bag_skewed", "embedding_bag")
    # Curves per dtype: a bf16 lookup moves half the bytes of an fp32 one but measures
    # about as long (gathers are latency-bound; the backward accumulates in fp32), so a
    # curve pooled over dtypes (by row bytes) priced bf16 embeddings at ~0.6x fp32.
    EMBEDDING_BY_DTYPE = True

    def _embedding_sections(self) -> tuple[str, ...]:
        """The first of EMBEDDING_SECTIONS the file has measurements in."""
        for section in self.EMBEDDING_SECTIONS:
            if self.data.get(section):
                return (section,)
        return ()

    @cached_property
    def _embedding(self) -> dict[tuple[str | None, str], LogIDW]:
        """(dtype, phase) -> efficiency curve; (None, phase) pools every dtype."""
        groups: dict[tuple[str | None, str], tuple[list, list]] = {}
        bw = self.gpu.hbm_bandwidth
        for section in self._embedding_sections():
            for rec in self.data.get(section, []):
                dtype = str(rec["dtype"])
                elt = _DTYPE_BYTES.get(dtype, 4)
                nnz = rec["bags"] * rec["bag_size"]
                pt = (rec["dim"] * elt, rec["bag_size"], rec["rows"], nnz)
                fb = kernels.embedding_fwd_bytes(nnz, rec["dim"], rec["bags"], elt)
                bb = kernels.embedding_bwd_bytes(nnz, rec["dim"], rec["bags"], rec["rows"], elt,
                                                 dense_grad=True)
                effs = {"fwd": min(1.0, fb / self._busy(rec["fwd_s"]) / bw),
                        "bwd": min(1.0, bb / self._busy(rec["bwd_s"], 3) / bw)}
                for key in (dtype, None):
                    for phase, eff in effs.items():
                        pts, ys = groups.setdefault((key, phase), ([], []))
                        pts.append(pt)
                        ys.append(eff)
        return {key: LogIDW(p, y) for key, (p, y) in groups.items()}

    def embedding_efficiency(self, row_bytes: int, bag_size: float, rows: int, nnz: int,
                             phase: str, dtype: str | None = None) -> float | None:
        """Achieved fraction of HBM bandwidth of a pooled lookup (fwd) or its dense-gradient
        backward (bwd), from the measurements of ``dtype`` where the file has some (a bf16
        backward accumulates in fp32 and does not halve with the row bytes), else of all."""
        curve = self._embedding.get((dtype, phase)) if self.EMBEDDING_BY_DTYPE else None
        curve = curve or self._embedding.get((None, phase))
        return curve((max(row_bytes, 1), max(bag_size, 1.0), max(rows, 1), max(nnz, 1))) \
            if curve else None

    @cached_property
    def _embedding_dispatch(self) -> dict[str, float]:
        """phase -> CPU seconds of one eager EmbeddingBag call (forward; backward with
        its dense gradient: ~30 kernels -- fill, radix-sort passes, scan, segment sums --
        each launched by the CPU). Read off the measurements whose modeled traffic at
        peak HBM bandwidth is under 10% of the measured time: those are bound by the CPU
        launching the kernels, not by the GPU, so the median of them is the CPU cost."""
        bw = self.gpu.hbm_bandwidth
        samples: dict[str, list[float]] = {"fwd": [], "bwd": []}
        for section in ("embedding_bag", "embedding_bag_skewed"):
            for rec in self.data.get(section, []):
                elt = _DTYPE_BYTES.get(str(rec["dtype"]), 4)
                nnz = rec["bags"] * rec["bag_size"]
                traffic = {
                    "fwd": kernels.embedding_fwd_bytes(nnz, rec["dim"], rec["bags"], elt),
                    "bwd": kernels.embedding_bwd_bytes(nnz, rec["dim"], rec["bags"],
                                                       rec["rows"], elt, dense_grad=True)}
                for phase, nbytes in traffic.items():
                    if nbytes / bw < 0.1 * rec[f"{phase}_s"]:
                        samples[phase].append(float(rec[f"{phase}_s"]))
        return {ph: statistics.median(v) for ph, v in samples.items() if v}

    def embedding_dispatch_s(self, phase: str) -> float | None:
        """CPU seconds of one eager EmbeddingBag forward ("fwd") or dense-gradient
        backward ("bwd"), where the file has dispatch-bound measurements; else None."""
        return self._embedding_dispatch.get(phase)

    @cached_property
    def _optimizer(self) -> dict[str, LogCurve1D]:
        bw = self.gpu.hbm_bandwidth
        out = {}
        for name, rows in self.data.get("optimizer", {}).items():
            if rows:  # seconds per parameter byte -> effective bandwidth over param bytes
                out[name] = LogCurve1D([r[0] for r in rows],
                                       [min(1.0, r[0] / r[1] / bw) for r in rows])
        return out

    def optimizer_param_rate(self, name: str, param_bytes: float) -> float | None:
        """Parameter bytes per second one optimizer step processes (e.g. adamw_foreach)."""
        c = self._optimizer.get(name)
        return c(param_bytes) * self.gpu.hbm_bandwidth if c else None

    # ---- collectives ------------------------------------------------------------------
    @cached_property
    def _collectives(self) -> dict[str, LogCurve1D]:
        coll = self.data.get("collectives", {})
        n = int(coll.get("ranks", 0) or 0)
        out = {}
        if n < 2:
            return out
        for op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all"):
            rows = coll.get(op, [])
            if rows:
                out[op] = LogCurve1D([r[0] for r in rows],
                                     [r[0] * bus_factor(op, n) / r[1] for r in rows])
        return out

    def collective_bus_bandwidth(self, op: str, nbytes: float, ranks: int) -> float | None:
        """Measured bus bandwidth (B/s, latency included) of an op inside one host.

        NVSwitch gives every GPU its full NVLink bandwidth whatever the group, so the
        curve measured on all GPUs of the host stands for any group inside it."""
        curve = self._collectives.get(op)
        return curve(nbytes) if curve else None

    def describe(self) -> str:
        parts = [f"{k}={len(v)}" for k, v in self.data.get("gemm", {}).items()]
        return (f"{self.gpu.name} calibrated {self.data.get('date')} ({', '.join(parts)} GEMM "
                f"points; HBM peak {self.gpu.hbm_bandwidth / GB:.0f} GB/s)")


def load_calibration(path: str | Path) -> Calibration:
    """Read and validate a calibration file; errors name the file and the field."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CalibrationError(f"cannot read calibration file: {exc.strerror}", where=str(p),
                               fix="check the path, or run gemc calibrate --out FILE") from None
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"invalid JSON: {exc.msg}", where=f"{p}:{exc.lineno}",
                               fix="re-run gemc calibrate") from None
    return Calibration(data, source=str(p))


def default_calibration(gpu_name: str) -> Calibration | None:
    """The calibration shipped for a GPU (cost_model/data/<gpu>.json), or None."""
    try:
        name = get_gpu(gpu_name).name
    except GemcUserError:
        return None
    path = DATA_DIR / f"{name}.json"
    return load_calibration(path) if path.is_file() else None


def resolve_calibration(choice: Calibration | str | Path | None,
                        gpu_name: str) -> Calibration | None:
    """One way for every caller (API, CLI, benchmarks) to name a calibration: a loaded
    ``Calibration``, a file path, "auto" (the file shipped for ``gpu_name``), or
    None / "none" (roofline only)."""
    if isinstance(choice, Calibration):
        return choice
    if choice is None or choice == "none":
        return None
    if choice == "auto":
        return default_calibration(gpu_name)
    return load_calibration(choice)
