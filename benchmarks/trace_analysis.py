"""Where a profiled training step's time goes: the profiler's events taken apart into GPU
busy time and idle gaps by cause (host late, sync, queued, tail), the host syncs and the
Python lines that made them, per-kernel device time, and one step's Chrome trace.

Shared by the benchmarks that profile steps (``e2e.py --profile N`` and through it
``zoo.py --profile N``); why a module of its own: the analysis is ~750 lines that do not
depend on which model or variant ran, and a second benchmark should not copy them.
"""

from __future__ import annotations

import bisect
import json
import os
import sys
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# A step's wall time minus its kernel time is time the GPU waited for the host. The kernel table
# cannot say which waits those are; the device timeline can: every interval between kernels is
# either a host call that drained the queue on purpose (a sync), the host being late with the
# next launch (Python dispatch, CPU-only ops), or device-side launch latency (the next kernel
# was already queued). The functions below take the profiler's events apart into those.

GAP_TOP = 15  # largest gaps listed per profiled step
TRACE_MAX_BYTES = 20 * 2**20  # one step's gzipped Chrome trace; larger ones are not kept
# host calls that block until the device has drained (a blocking cudaMemcpy is one too)
BLOCKING_CALLS = frozenset({
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
    "cudaMemcpy2D", "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize",
    "cuMemcpyDtoH", "cuMemcpyDtoH_v2",
})
# the benchmark's own step boundaries (torch.cuda.synchronize): they delimit the timed region
DEVICE_SYNCS = frozenset({"cudaDeviceSynchronize", "cuCtxSynchronize"})
# aten ops whose result the host needs (a scalar, a data-dependent size): a sync on a GPU
SYNC_OPS = frozenset({
    "aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero",
    "aten::masked_select", "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim",
    "aten::equal",
})
_GPU_ACTIVITIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_RUNTIME_ACTIVITIES = frozenset({"cuda_runtime", "cuda_driver"})
_CPU_ACTIVITIES = frozenset({"cpu_op", "user_annotation", "python_function"})
_SIZE_BUCKETS = ((10.0, "<10us"), (100.0, "10-100us"), (1000.0, "0.1-1ms"),
                 (float("inf"), ">=1ms"))
_CAUSES = ("host", "sync", "queued", "tail", "unknown")
_CAUSE_DOC = {
    "host": "the next kernel was launched after the GPU ran dry: the host was late "
            "(Python, CPU-only ops, launch overhead)",
    "sync": "the host sat in a blocking call when the GPU ran dry: it drained the queue on "
            "purpose, and launched the next work only after the call returned",
    "queued": "the next kernel was already queued: device-side launch latency",
    "tail": "after the step's last GPU work, until the step's closing synchronize",
    "unknown": "the next kernel's launch call is not in the trace",
}
_CLOCK_SLACK_US = 10.0  # CPU and GPU timestamps are aligned by the profiler, not exactly


@dataclass(slots=True, eq=False)
class TraceEvent:
    """One profiler event, reduced to what the gap analysis reads.

    ``kind``: step (a ProfilerStep span), op (an aten op or a user annotation), py (a Python
    function, only with --profile-stack), runtime (a CUDA runtime/driver call on the host),
    gpu (a kernel, memcpy or memset on the device). Times in microseconds on the profiler's
    clock. ``corr`` ties a runtime call to the device work it queued; ``linked`` ties both to
    the op that issued them.
    """

    name: str
    kind: str
    start: float
    end: float
    tid: int = 0
    corr: int = 0
    linked: int = 0
    stack: tuple[str, ...] = ()
    parent: TraceEvent | None = None


def _get(obj: Any, name: str, default: Any = None) -> Any:
    """A field of a _KinetoEvent (methods) or a FunctionEvent (attributes), whichever
    this torch has; the default when neither does."""
    value = getattr(obj, name, None)
    if value is None:
        return default
    try:
        return value() if callable(value) else value
    except Exception:  # a binding that exists but cannot answer for this event
        return default


def _event_kind(name: str, device: str, activity: str | None, annotation: bool) -> str | None:
    on_cpu = device.endswith("CPU")
    if name.startswith("[") or not name:  # [memory], [OutOfMemory]: no span
        return None
    if activity:
        if activity in _GPU_ACTIVITIES:
            return "gpu"
        if activity in _RUNTIME_ACTIVITIES:
            return "runtime"
        if activity not in _CPU_ACTIVITIES or not on_cpu:  # cuda_sync, gpu_user_annotation
            return None
        if activity == "python_function":
            return "py"
    elif not on_cpu:  # a torch without activity_type(): tell device work by name
        if annotation or name.startswith("ProfilerStep#") or name.endswith("Sync") or \
                name.startswith("Stream Wait"):
            return None
        return "gpu"
    elif name.startswith("cuda") or (name.startswith("cu") and name[2:3].isupper()):
        return "runtime"
    return "step" if name.startswith("ProfilerStep#") else "op"


def _trace_event(raw: Any) -> TraceEvent | None:
    if _get(raw, "is_hidden_event", False):
        return None
    # a FunctionEvent's name is rewritten (ProfilerStep#6 -> ProfilerStep*); trace_name is not
    name = str(_get(raw, "trace_name", None) or _get(raw, "name", "") or "")
    device = str(_get(raw, "device_type", "CPU"))
    kind = _event_kind(name, device, _get(raw, "activity_type"),
                       bool(_get(raw, "is_user_annotation", False)))
    if kind is None or (kind in ("op", "py") and _get(raw, "is_async", False)):
        return None
    span = getattr(raw, "time_range", None)
    if span is not None:  # FunctionEvent: microseconds from the trace's start
        start, end = float(span.start), float(span.end)
    else:  # _KinetoEvent: nanoseconds
        start_ns = _get(raw, "start_ns")
        if start_ns is None:
            return None
        end_ns = _get(raw, "end_ns")
        if end_ns is None:
            end_ns = start_ns + (_get(raw, "duration_ns", 0) or 0)
        start, end = start_ns / 1e3, end_ns / 1e3
    corr = _get(raw, "correlation_id")
    return TraceEvent(
        name=name,
        kind=kind,
        start=start,
        end=max(end, start),
        tid=int(_get(raw, "start_thread_id", None) or _get(raw, "thread", 0) or 0),
        corr=int(corr if corr is not None else _get(raw, "id", 0) or 0),
        linked=int(_get(raw, "linked_correlation_id", 0) or 0),
        stack=tuple(_get(raw, "stack", ()) or ()),
    )


def profiler_events(prof: Any) -> list[TraceEvent]:
    """The finished profile's events. Reads the Kineto results directly (they carry the
    correlation ids that tie a kernel to its launch); falls back to ``prof.events()``.
    Raises AttributeError when this torch offers neither."""
    kineto = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    raw = kineto.events() if kineto is not None else prof.events()
    return [ev for ev in map(_trace_event, raw) if ev is not None]


class _HostTimeline:
    """The host events per thread with their nesting, to name what the host was doing at a
    given moment (the op chain around a launch, a sync, or the start of a gap)."""

    def __init__(self, events: list[TraceEvent]) -> None:
        ops = [e for e in events if e.kind in ("op", "py", "step")]
        op_tid = {e.corr: e.tid for e in ops if e.kind == "op"}
        op_tids = {e.tid for e in ops}
        self.main = main = next((e.tid for e in events if e.kind == "step"), 0)
        runtime = [e for e in events if e.kind == "runtime"]
        for e in runtime:
            # Kineto may number the runtime calls' threads apart from the ops' threads: a
            # call belongs to the thread of the op that made it (a Triton launch from Python
            # has none, and is given the main thread)
            if e.linked in op_tid:
                e.tid = op_tid[e.linked]
            elif e.tid not in op_tids:
                e.tid = main
        self.threads: dict[int, list[TraceEvent]] = {}
        for e in ops + runtime:
            self.threads.setdefault(e.tid, []).append(e)
        self.starts: dict[int, list[float]] = {}
        for tid, evs in self.threads.items():
            evs.sort(key=lambda e: (e.start, -e.end))
            open_: list[TraceEvent] = []
            for e in evs:
                while open_ and (open_[-1].end <= e.start or open_[-1].end < e.end):
                    open_.pop()
                e.parent = open_[-1] if open_ else None
                open_.append(e)
            self.starts[tid] = [e.start for e in evs]

    def at(self, t: float, tid: int) -> TraceEvent | None:
        """The innermost host event on ``tid`` that spans ``t``."""
        evs = self.threads.get(tid)
        if not evs:
            return None
        i = bisect.bisect_right(self.starts[tid], t) - 1
        e = evs[i] if i >= 0 else None
        while e is not None and e.end < t:
            e = e.parent
        return e

    def ops_between(self, t0: float, t1: float, tid: int) -> Counter[str]:
        """The ops ``tid`` began in [t0, t1): what the host did while the GPU waited."""
        evs = self.threads.get(tid, [])
        lo = bisect.bisect_left(self.starts.get(tid, []), t0)
        hi = bisect.bisect_left(self.starts.get(tid, []), t1)
        return Counter(e.name for e in evs[lo:hi] if e.kind == "op")


def _ancestry(e: TraceEvent | None) -> list[TraceEvent]:
    out = []
    while e is not None:
        out.append(e)
        e = e.parent
    return out[::-1]


def _chain(e: TraceEvent | None) -> str:
    """outer > ... > inner op names around ``e`` (itself included), ProfilerStep left out."""
    names = [a.name[:60] for a in _ancestry(e) if a.kind in ("op", "runtime")]
    if len(names) > 5:
        names = names[:1] + ["..."] + names[-3:]
    return " > ".join(names) if names else "(no op: Python)"


_REPO_FILES: dict[str, bool] = {}


def _repo_frame(entry: str) -> bool:
    """Whether a frame ('path(line): function', or a bare path) is this repository's code.
    The profiler strips sys.path prefixes from Python-function names, so a path may be
    relative (to the repository root or to a library's root) or absolute."""
    path = entry.split("(", 1)[0]
    if path not in _REPO_FILES:
        if os.path.isabs(path):
            inside = path.startswith(str(REPO) + os.sep)
        else:
            inside = not path.startswith("<") and (REPO / path).is_file()
        _REPO_FILES[path] = inside and "site-packages" not in path and \
            f"{os.sep}.venv{os.sep}" not in path
    return _REPO_FILES[path]


def _short_path(entry: str) -> str:
    text = entry.replace(str(REPO) + os.sep, "")
    cut = text.find("site-packages" + os.sep)
    return text[cut + len("site-packages") + 1:] if cut >= 0 else text


def _frame(e: TraceEvent | None) -> str:
    """The innermost Python frame in this repository around ``e`` (with --profile-stack:
    from the ops' recorded stacks or the Python-function events); '' without stacks."""
    for a in reversed(_ancestry(e)):
        if a.kind == "py" and _repo_frame(a.name):
            return _short_path(a.name)
        for entry in a.stack:  # innermost first
            if _repo_frame(entry):
                return _short_path(entry)
    return ""


def _site(e: TraceEvent | None) -> str:
    frame = _frame(e)
    return f"{_chain(e)}  [{frame}]" if frame else _chain(e)


def _union(intervals: list[tuple[float, float, TraceEvent]]) -> list[list[Any]]:
    """Merged busy intervals [start, end, first event, event that ends it], by start."""
    merged: list[list[Any]] = []
    for s, t, e in sorted(intervals, key=lambda x: x[0]):
        if merged and s <= merged[-1][1]:
            if t > merged[-1][1]:
                merged[-1][1], merged[-1][3] = t, e
        else:
            merged.append([s, t, e, e])
    return merged


def _outermost(events: list[TraceEvent], names: frozenset[str]) -> list[TraceEvent]:
    """The events named in ``names`` that are not inside another such event (aten::item
    around aten::_local_scalar_dense is one sync, not two)."""
    out = []
    for e in events:
        if e.name in names and not any(a.name in names for a in _ancestry(e.parent)):
            out.append(e)
    return out


def step_gaps(events: list[TraceEvent], top: int = GAP_TOP) -> dict[str, Any]:
    """Per profiled step: the GPU's busy and idle time, the idle gaps by cause and size, the
    largest gaps with what the host was doing, and the host syncs with the op chain that
    issued them. Without device events (a CPU run) only the syncs and step spans are
    reported."""
    host = _HostTimeline(events)
    steps = sorted((e for e in events if e.kind == "step"), key=lambda e: e.start)
    gpu = sorted((e for e in events if e.kind == "gpu"), key=lambda e: e.start)
    runtime = sorted((e for e in events if e.kind == "runtime"), key=lambda e: e.start)
    ops = sorted((e for e in events if e.kind == "op"), key=lambda e: e.start)
    launch_of = {e.corr: e for e in runtime if e.corr}
    work_of: dict[int, TraceEvent] = {}
    for e in gpu:
        work_of.setdefault(e.corr, e)
    device = bool(gpu)
    out_steps = []
    sites: dict[str, list[float]] = {}  # site -> [count, blocked us]
    for st in steps:
        in_step = [e for e in runtime if st.start <= e.start < st.end]
        bounds = [e for e in in_step if e.name in DEVICE_SYNCS]
        if device and len(bounds) >= 2:
            w0, w1, window = bounds[0].end, bounds[-1].end, "timed"
            skip = {id(bounds[0]), id(bounds[-1])}
        else:
            w0, w1, window, skip = st.start, st.end, "profiler step", set()
        blocking = [e for e in in_step
                    if e.name in BLOCKING_CALLS and id(e) not in skip and w0 <= e.start < w1]
        sync_ops = _outermost([e for e in ops if w0 <= e.start < w1], SYNC_OPS)
        d2h = [e for e in in_step if "emcpy" in e.name and w0 <= e.start < w1
               and "DtoH" in getattr(work_of.get(e.corr), "name", "")]
        row: dict[str, Any] = {
            "step": st.name, "window": window, "window_ms": (w1 - w0) / 1e3,
            "blocking_calls": len(blocking), "sync_ops": len(sync_ops), "d2h_copies": len(d2h),
        }
        for e in (blocking if device else sync_ops):
            acc = sites.setdefault(_site(e), [0, 0.0])
            acc[0] += 1
            acc[1] += e.end - e.start
        if device:
            row.update(_device_gaps(host, gpu, blocking, launch_of, w0, w1, top))
        out_steps.append(row)
    n = max(len(out_steps), 1)
    summary: dict[str, Any] = {
        "profiled_steps": len(out_steps),
        "device_timeline": device,
        "window_ms": sum(r["window_ms"] for r in out_steps) / n if out_steps else None,
        "gpu_busy_ms": None,
        "gpu_idle_ms": None,
        # on a GPU: blocking runtime calls besides the step's own two synchronizes (the loss
        # read is one); on the CPU: the host-read aten ops (item, nonzero, ...)
        "syncs_per_step": sum(r["blocking_calls" if device else "sync_ops"]
                              for r in out_steps) / n,
        "sync_ops_per_step": sum(r["sync_ops"] for r in out_steps) / n,
        "d2h_copies_per_step": sum(r["d2h_copies"] for r in out_steps) / n,
    }
    if device and out_steps:
        summary["gpu_busy_ms"] = sum(r["gpu_busy_ms"] for r in out_steps) / n
        summary["gpu_idle_ms"] = sum(r["gpu_idle_ms"] for r in out_steps) / n
        summary["idle_by_cause_ms"] = {
            c: sum(r["idle_by_cause"][c][1] for r in out_steps) / n / 1e3 for c in _CAUSES}
    late: dict[str, list[float]] = {}
    for r in out_steps:
        for site, (c, us) in r.get("host_late_by_launch", {}).items():
            acc = late.setdefault(site, [0, 0.0])
            acc[0] += c
            acc[1] += us
    return {
        "summary": summary,
        "steps": out_steps,
        "host_late_sites": sorted(((k, c / n, us / n) for k, (c, us) in late.items()),
                                  key=lambda x: -x[2]),
        "sync_sites": sorted(((k, c / n, us / n) for k, (c, us) in sites.items()),
                             key=lambda x: (-x[1], -x[2])),
    }


def _device_gaps(
    host: _HostTimeline,
    gpu: list[TraceEvent],
    blocking: list[TraceEvent],
    launch_of: dict[int, TraceEvent],
    w0: float,
    w1: float,
    top: int,
) -> dict[str, Any]:
    merged = _union([(max(e.start, w0), min(e.end, w1), e) for e in gpu
                     if e.start < w1 and e.end > w0])
    busy = sum(t - s for s, t, _, _ in merged)
    raw: list[tuple[float, float, TraceEvent | None, TraceEvent | None]] = []
    cursor, prev = w0, None
    for s, t, first, last in merged:
        if s > cursor:
            raw.append((cursor, s, prev, first))
        cursor, prev = max(cursor, t), last
    if cursor < w1:
        raw.append((cursor, w1, prev, None))
    by_cause = {c: [0, 0.0] for c in _CAUSES}
    by_size = {label: [0, 0.0] for _, label in _SIZE_BUCKETS}
    late: dict[str, list[float]] = {}  # launch site -> [host-late gaps, idle us]
    gaps = []
    for g0, g1, before, after in raw:
        dur = g1 - g0
        launch = launch_of.get(after.corr) if after is not None and after.corr else None
        # the host was already blocked when the GPU ran dry (a sync it began later, with
        # the GPU idle, is the host being late, and is listed as one of the gap's syncs)
        sync = next((e for e in reversed(blocking)
                     if e.start <= g0 + _CLOCK_SLACK_US and e.end >= g0 - _CLOCK_SLACK_US),
                    None)
        if sync is not None:
            cause = "sync"
        elif after is None:
            cause = "tail"
        elif launch is None:
            cause = "unknown"
        elif launch.start <= g0 + _CLOCK_SLACK_US:
            cause = "queued"
        else:
            cause = "host"
        by_cause[cause][0] += 1
        by_cause[cause][1] += dur
        if cause == "host":  # most of a Python-bound step is many small gaps: sum them by site
            acc = late.setdefault(_site(launch), [0, 0.0])
            acc[0] += 1
            acc[1] += dur
        label = next(lb for limit, lb in _SIZE_BUCKETS if dur < limit)
        by_size[label][0] += 1
        by_size[label][1] += dur
        gaps.append((dur, g0, g1, cause, before, after, launch, sync))
    gaps.sort(key=lambda g: -g[0])
    listed = []
    for dur, g0, g1, cause, before, after, launch, sync in gaps[:top]:
        syncs_in_gap = [e for e in blocking if g0 < e.start < g1 and e is not sync]
        tid = launch.tid if launch is not None else (sync.tid if sync is not None else host.main)
        in_gap = host.ops_between(g0, launch.start if launch is not None else g1, tid)
        listed.append({
            "us": dur,
            "at_ms": (g0 - w0) / 1e3,
            "cause": cause,
            "after": before.name if before is not None else None,
            "next": after.name if after is not None else None,
            "launch": launch.name if launch is not None else None,
            "host_late_us": (launch.start - g0) if launch is not None else None,
            "launch_site": _site(launch) if launch is not None else None,
            "sync_site": _site(sync) if sync is not None else None,
            "syncs_in_gap": [_site(e) for e in syncs_in_gap[:3]],
            "host_at_idle": _site(host.at(g0, tid)),
            "ops_in_gap": sum(in_gap.values()),
            "top_ops_in_gap": in_gap.most_common(4),
        })
    return {
        "gpu_busy_ms": busy / 1e3,
        "gpu_idle_ms": (w1 - w0 - busy) / 1e3,
        "gaps": len(raw),
        "idle_by_cause": by_cause,
        "idle_by_size": by_size,
        "host_late_by_launch": late,
        "largest_gaps": listed,
    }


def format_gaps(variant: str, analysis: dict[str, Any], sync_lines: list[str],
                trace_note: str) -> str:
    """The gaps file: the summary first, then the per-step tables, then the largest gaps."""
    s, rows = analysis["summary"], analysis["steps"]
    n = max(len(rows), 1)
    out = [f"GPU idle analysis: {variant}, {s['profiled_steps']} profiled steps"]
    if not rows:
        return "\n".join(out + ["no ProfilerStep spans in the trace (too few steps?)"]) + "\n"
    out.append(f"window: {rows[0]['window']}" + (
        " (from the end of the step's first device synchronize to the end of its last: the "
        "region the benchmark times)" if rows[0]["window"] == "timed" else
        " (a whole ProfilerStep span: batch creation included)"))
    if not s["device_timeline"]:
        out.append("no device timeline: no kernels in the trace (a CPU run). Sync counts are "
                   "the host-read aten ops (item, nonzero, ...): each syncs when its input is on "
                   "a GPU, which a CPU run cannot tell (optimizer step counters stay on the host)")
    else:
        b, i, w = s["gpu_busy_ms"], s["gpu_idle_ms"], s["window_ms"]
        out.append(f"per step: window {w:.2f} ms = GPU busy {b:.2f} ms + GPU idle {i:.2f} ms "
                   f"({100 * i / max(w, 1e-9):.1f}%); {s['syncs_per_step']:.1f} blocking syncs, "
                   f"{s['sync_ops_per_step']:.1f} sync ops, {s['d2h_copies_per_step']:.1f} "
                   "device-to-host copies")
    out += ["", f"{'step':>16} {'window ms':>10} {'busy ms':>9} {'idle ms':>9} {'gaps':>7} "
            f"{'syncs':>6} {'syncops':>7} {'d2h':>5}"]
    def cell(v: Any) -> str:
        return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))

    for r in rows:
        out.append(f"{r['step']:>16} {cell(r['window_ms']):>10} {cell(r.get('gpu_busy_ms')):>9} "
                   f"{cell(r.get('gpu_idle_ms')):>9} {cell(r.get('gaps')):>7} "
                   f"{r['blocking_calls']:>6} {r['sync_ops']:>7} {r['d2h_copies']:>5}")
    if s["device_timeline"]:
        out += ["", "idle by cause (per step):"]
        for c in _CAUSES:
            cnt = sum(r["idle_by_cause"][c][0] for r in rows) / n
            us = sum(r["idle_by_cause"][c][1] for r in rows) / n
            out.append(f"  {c:>8} {us / 1e3:8.2f} ms {cnt:8.1f} gaps  {_CAUSE_DOC[c]}")
        out += ["", "idle by gap size (per step):"]
        for _, label in _SIZE_BUCKETS:
            cnt = sum(r["idle_by_size"][label][0] for r in rows) / n
            us = sum(r["idle_by_size"][label][1] for r in rows) / n
            out.append(f"  {label:>8} {us / 1e3:8.2f} ms {cnt:8.1f} gaps")
        out += ["", "host-late idle by the launch that ended the gap (per step; the op that "
                "came late; a bare cuLaunchKernel is a launch from Python: a Triton kernel):",
                f"{'gaps':>7} {'idle ms':>10}  launched by"]
        out += [f"{c:7.1f} {us / 1e3:10.3f}  {site}"
                for site, c, us in analysis["host_late_sites"][:25]]
    if s["device_timeline"]:
        what, ms = "blocking runtime calls (the step's own two synchronizes left out)", "blocked ms"
    else:
        what, ms = "host-read aten ops", "op ms"
    out += ["", f"sync sites, {what}, per step:",
            f"{'calls':>7} {ms:>10}  op chain [innermost repo function (its def line), with --profile-stack]"]
    out += [f"{c:7.1f} {us / 1e3:10.3f}  {site}" for site, c, us in analysis["sync_sites"][:30]]
    if not analysis["sync_sites"]:
        out.append("      (none)")
    out += ["", *sync_lines]
    if s["device_timeline"]:
        for r in rows:
            out += ["", f"largest gaps, {r['step']} ({r['gaps']} gaps, "
                    f"{r['gpu_idle_ms']:.2f} ms idle):"]
            for k, g in enumerate(r["largest_gaps"], 1):
                lag = g["host_late_us"]
                late = ("" if lag is None else f", launched {lag:.0f} us after the GPU went idle"
                        if lag >= 0 else f", queued {-lag:.0f} us before")
                out.append(f"{k:3d}. {g['us']:8.1f} us at +{g['at_ms']:.2f} ms  [{g['cause']}]"
                           f"{late}")
                out.append(f"       after: {(g['after'] or '(window start)')[:110]}")
                out.append(f"        next: {(g['next'] or '(window end)')[:110]}")
                if g["sync_site"]:
                    out.append(f"        sync: {g['sync_site']}")
                for site in g["syncs_in_gap"]:
                    out.append(f" sync in gap: {site}")
                if g["launch_site"]:
                    out.append(f"    launched: {g['launch_site']}")
                if g["host_at_idle"]:
                    out.append(f"  host@start: {g['host_at_idle']}")
                if g["ops_in_gap"]:
                    ops = ", ".join(f"{k_} x{v}" for k_, v in g["top_ops_in_gap"])
                    out.append(f"  ops in gap: {g['ops_in_gap']} ({ops})")
    out += ["", trace_note]
    return "\n".join(out) + "\n"


class SyncSites:
    """torch.cuda's sync debug mode over one step: the Python line of every synchronizing
    call. The profiler's op chain says which op synced, not which line asked for it;
    recording stacks for every op would slow the profiled steps down more than the gaps
    being measured, so this runs on the step after the profiled ones instead."""

    def __init__(self) -> None:
        self.sites: Counter[str] = Counter()
        self.state = "not run"
        self._undo: list[Any] = []

    def start(self) -> None:
        import torch

        catcher = warnings.catch_warnings()
        catcher.__enter__()
        self._undo.append(lambda: catcher.__exit__(None, None, None))
        warnings.simplefilter("always")
        forward = warnings.showwarning

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                 line: Any = None) -> None:
            if "synchroniz" not in str(message):
                forward(message, category, filename, lineno, file, line)
                return
            frames = traceback.extract_stack()[:-1]
            own = next((f"{_short_path(f.filename)}:{f.lineno}" for f in reversed(frames)
                        if _repo_frame(f.filename)), "?")
            where = f"{_short_path(filename)}:{lineno}"
            self.sites[own if where == own else f"{own} -> {where}"] += 1

        warnings.showwarning = show
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        self._undo.append(lambda: torch.cuda.set_sync_debug_mode(previous))
        self.state = "running"

    def stop(self) -> None:
        while self._undo:
            self._undo.pop()()
        if self.state == "running":
            self.state = "done"

    def lines(self, step: int | None) -> list[str]:
        head = "sync sites by Python line (torch.cuda.set_sync_debug_mode('warn')"
        if self.state != "done":
            why = ("a CUDA run only" if self.state == "not run"
                   else "no step ran after the profiled ones: give --steps > warmup + profile + 1")
            return [f"{head}): not recorded ({why})"]
        out = [f"{head} on step {step}, the one after the profiled ones; the syncs torch "
               "makes (item, nonzero, blocking copies, stream synchronize), as innermost repo "
               "frame -> the library line that synced):",
               f"{'calls':>7}  site"]
        out += [f"{c:7d}  {site}" for site, c in self.sites.most_common(30)]
        return out + (["      (none)"] if not self.sites else [])


def export_step_trace(prof: Any, step: str, path: Path) -> str:
    """One ProfilerStep of the profile as a gzipped Chrome trace (Perfetto opens it): the
    whole profile is several steps of tens of thousands of events, too big to open
    comfortably, while one step shows the same pattern."""
    import gzip
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(full))
        size = full.stat().st_size
        if size > 40 * TRACE_MAX_BYTES:
            return f"trace: not written (the full profile's trace is {size / 2**20:.0f} MiB)"
        data = json.loads(full.read_text())
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    span = next(((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
                 if e.get("name") == step and e.get("ph") == "X"
                 and e.get("cat") != "gpu_user_annotation"), None)
    if span is None:
        return f"trace: not written ({step} is not in the exported trace)"
    lo, hi = span

    def keep(e: dict[str, Any]) -> bool:
        if e.get("ph") == "M" or "ts" not in e:
            return True
        ts = float(e["ts"])
        return ts < hi and ts + float(e.get("dur", 0) or 0) >= lo

    kept = [e for e in events if keep(e)]
    if isinstance(data, dict):
        data["traceEvents"] = kept
    else:
        data = kept
    blob = gzip.compress(json.dumps(data, separators=(",", ":")).encode())
    if len(blob) > TRACE_MAX_BYTES:
        path.unlink(missing_ok=True)
        return (f"trace: not written ({step} alone is {len(blob) / 2**20:.1f} MiB gzipped, "
                f"over {TRACE_MAX_BYTES / 2**20:.0f} MiB)")
    path.write_bytes(blob)
    return f"trace: {path} ({step}, {len(kept)} events, {len(blob) / 2**20:.1f} MiB; Perfetto)"


class StepProfiler:
    """torch.profiler over ``n`` steps after the warmup; a no-op when ``n`` is 0.

    Why: a variant's step time alone does not say where to look next. The per-kernel split
    (GEMMs vs generated kernels vs copies) says where the GPU's time goes; the gap analysis
    (``step_gaps``) says where the GPU waits for the host, and why.
    """

    def __init__(self, n: int, start: int, device: Any, path: Path,
                 stack: bool = False) -> None:
        self.n, self.path, self.prof = n, path, None
        self.cuda = device.type == "cuda"
        base = str(path).removesuffix(".kernels.txt")
        self.variant = base.rsplit(".", 1)[-1]
        self.gaps_path, self.trace_path = Path(f"{base}.gaps.txt"), Path(f"{base}.trace.json.gz")
        self.summary: dict[str, Any] = {}
        self.calls = 0
        wait = start  # steps before the profiler's warm-up step (the timed ones)
        self.sync_step = wait + 1 + n  # 0-based: the first step after the profiled ones
        self.sync_sites = SyncSites()
        if n <= 0:
            return
        import torch

        acts = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(
            activities=acts,
            schedule=torch.profiler.schedule(wait=wait, warmup=1, active=n, repeat=1),
            with_stack=stack,
        )
        self.prof.__enter__()

    def step(self, _done: int = 0) -> None:
        if self.prof is None:
            return
        self.prof.step()
        self.calls += 1
        if not self.cuda:
            return
        if self.calls == self.sync_step:
            try:
                self.sync_sites.start()
            except Exception as exc:  # an old torch without sync debug mode: no sites
                self.sync_sites.stop()
                self.sync_sites.state = f"failed: {type(exc).__name__}: {exc}"
        elif self.calls == self.sync_step + 1:
            self.sync_sites.stop()

    def abandon(self) -> None:
        """Stop the profiler of a variant that failed, so the next variant can start one."""
        self.sync_sites.stop()
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.prof = None

    def close(self) -> None:
        if self.prof is None:
            return
        self.sync_sites.stop()
        if self.sync_sites.state == "running":  # no step followed the profiled ones
            self.sync_sites.state = "incomplete"
        self.prof.__exit__(None, None, None)
        self._write_kernels()
        try:
            self._write_gaps()
        except Exception as exc:  # the analysis must never cost the benchmark its numbers
            print(f"e2e: WARNING: GPU gap analysis skipped for {self.gaps_path.name}: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)
            self.summary = {"gpu_busy_ms": None, "gpu_idle_ms": None, "syncs_per_step": None,
                            "profile_error": f"{type(exc).__name__}: {exc}"}

    def _write_kernels(self) -> None:
        events = self.prof.key_averages()
        rows = []
        for e in events:
            if self.cuda:
                # kernels only: CPU-side ops report their kernels' time as theirs too
                if str(getattr(e, "device_type", "CUDA")).endswith("CPU") or \
                        e.key.startswith("ProfilerStep"):
                    continue
                dev_us = getattr(e, "self_device_time_total", None)
                if dev_us is None:
                    dev_us = getattr(e, "self_cuda_time_total", 0)
            else:  # CPU run: the ops' own CPU time stands in
                dev_us = e.self_cpu_time_total
            if dev_us and dev_us > 0:
                rows.append((dev_us / self.n, e.count / self.n, e.key))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        lines = [f"device time per step: {total / 1e3:.2f} ms over {self.n} profiled steps",
                 f"{'ms/step':>9} {'share':>6} {'calls':>6}  kernel"]
        lines += [f"{us / 1e3:9.3f} {100 * us / max(total, 1e-9):5.1f}% {c:6.1f}  {k[:140]}"
                  for us, c, k in rows[:60]]
        self.path.write_text("\n".join(lines) + "\n")
        print(f"e2e: wrote {self.path} ({total / 1e3:.2f} ms device time/step)", file=sys.stderr)

    def _write_gaps(self) -> None:
        try:
            events = profiler_events(self.prof)
        except AttributeError as exc:
            raise RuntimeError(f"this torch's profiler exposes no event list ({exc})") from exc
        analysis = step_gaps(events)
        steps = analysis["steps"]
        trace_note = "trace: not written (no profiled step)"
        if steps:
            try:
                trace_note = export_step_trace(self.prof, steps[-1]["step"], self.trace_path)
            except Exception as exc:  # the trace is a convenience; the analysis stands
                trace_note = f"trace: not written ({type(exc).__name__}: {exc})"
        text = format_gaps(self.variant, analysis,
                           self.sync_sites.lines(self.sync_step + 1), trace_note)
        self.gaps_path.write_text(text)
        s = analysis["summary"]
        self.summary = {
            "gpu_busy_ms": s["gpu_busy_ms"],
            "gpu_idle_ms": s["gpu_idle_ms"],
            "syncs_per_step": s["syncs_per_step"],
            "profile": {**s, "gaps_file": str(self.gaps_path),
                        "trace_file": str(self.trace_path) if self.trace_path.exists()
                        else None,
                        "sync_sites_by_line": dict(self.sync_sites.sites.most_common(30))},
        }
        print(f"e2e: wrote {self.gaps_path} ({profile_line(self.summary)})", file=sys.stderr)


def profile_line(row: dict[str, Any]) -> str:
    p = row.get("profile") or {}
    if row.get("gpu_busy_ms") is None:
        window = p.get("window_ms")
        syncs = row.get("syncs_per_step")
        return (f"no device timeline; step {window:.2f} ms" if window is not None else
                "no gap analysis") + (f", {syncs:.1f} sync ops/step" if syncs is not None
                                      else "")
    busy, idle = row["gpu_busy_ms"], row["gpu_idle_ms"]
    causes = p.get("idle_by_cause_ms") or {}
    top = ", ".join(f"{c} {ms:.1f}" for c, ms in sorted(causes.items(), key=lambda x: -x[1])
                    if ms >= 0.05)
    return (f"GPU busy {busy:.2f} ms + idle {idle:.2f} ms/step "
            f"({100 * idle / max(busy + idle, 1e-9):.1f}% idle; {top} ms), "
            f"{row['syncs_per_step']:.1f} syncs/step")
