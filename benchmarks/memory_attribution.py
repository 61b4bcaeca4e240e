"""Where a zoo model's peak memory goes under gemc, next to the plan's predicted breakdown.

Why: issue 18 wants peak memory predicted within 10% on every zoo model, and the runner's
one number (``max_memory_allocated``) cannot say which term of the prediction is wrong
(MMoE packed: predicted 10.24 GB, measured 12.42 GB). This runs the model's ``gemc`` variant
exactly as ``benchmarks/zoo.py`` does (the plan compiled by ``zoo._compile_plan``, trained
by the runner's ``run`` with ``zoo.GEMC_OPTIONS["gemc"]``) for a few steps under
``torch.cuda.memory._record_memory_history``, then replays the allocator's trace to rebuild
the blocks live at each step's peak and attributes them:

* parameters, gradients and optimizer state by identity with the tensors the runner owns
  (``RunOptions.on_ready``; a gradient is a block at a ``.grad``'s address of that step that
  is freed between the dense optimizer's step and the step's end, i.e. by ``zero_grad``);
* everything else grouped by the line that allocated it: the innermost Python frame outside
  torch, which for compiled code is Inductor's generated file (``bufN = empty_strided...``,
  with the kernel that writes it and the FX nodes of its ``Topologically Sorted Source
  Nodes`` comment), split by whether a backward frame allocated it.

Prints the categories next to ``predicted.per_rank[0].memory`` and the largest groups;
writes ``OUT/<model>.memory.json``. One model per process (the allocator's state is the
thing measured); an h200 preset takes ~1 min (its cold compile ~25 s; keep the compile
caches out of OUT with ``GEMC_COMPILE_CACHE=/tmp/...``)::

    for m in mmoe sasrec_bst; do python benchmarks/memory_attribution.py --model $m --out $OUT; done
    python benchmarks/memory_attribution.py --smoke --out /tmp/mem     # CPU: tiny preset,
                                                   # a synthetic snapshot of the run's tensors
"""

from __future__ import annotations

import argparse
import json
import linecache
import re
import sys
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import zoo  # noqa: E402  (the zoo's models, plan compile and device set-up)

MARK_UNIT = 512  # the allocator's rounding: a marker's size says its kind
MARKS = {"ready": 1, "optimizer": 2, "end": 3}
"""Marker allocations (``_memory_mark``) cut the trace: set-up done, dense optimizer
stepped, step done."""
CATEGORIES = ("params", "grads", "optimizer", "buffers", "forward_allocated",
              "backward_allocated")
GENERATED = re.compile(r"/c[a-z0-9]{20,}\.py$")  # Inductor's output code files
SOURCE_NODES = re.compile(r"# Topologically Sorted Source Nodes: \[([^\]]*)\]")
INTERNAL = re.compile(r"(site|dist)-packages/(torch|triton)/|^<|^\?\?$")
"""torch's and Triton's own frames (not gemc's ``backends/torch/``)."""
KERNEL_CALL = re.compile(r"^\s*(?:\w+ = )?((?:extern_kernels|torch\.ops)\.[\w.]+|\w+\.run)\(")


@dataclass
class Block:
    """One live allocation: address, rounded size, allocation frames (innermost first), the
    trace index of its allocation (-1: before the trace) and of its free (None: never)."""

    addr: int
    size: int
    frames: list[dict[str, Any]]
    alloc_at: int = -1
    free_at: int | None = None


@dataclass
class Peak:
    """The most bytes allocated inside one window of the trace, and the blocks then live."""

    step: int
    bytes: int
    at: int
    blocks: list[Block] = field(default_factory=list)
    where: str = "before the trace"  # the allocation that reached the peak


def _marker(event: dict[str, Any]) -> str | None:
    if not any(f.get("name") == "_memory_mark" for f in event.get("frames") or ()):
        return None
    return {v * MARK_UNIT: k for k, v in MARKS.items()}.get(int(event["size"]))


def _memory_mark(kind: str, device: Any) -> None:
    """An allocation the trace shows with this function's frame: the replay's clock."""
    import torch

    torch.empty(MARKS[kind] * MARK_UNIT, dtype=torch.uint8, device=device)


def _active(snapshot: dict[str, Any], device: int) -> dict[int, Block]:
    """The segments' ``active_allocated`` blocks (a block's address is its segment's plus
    the sizes of the blocks before it, when the snapshot does not say it)."""
    live: dict[int, Block] = {}
    for seg in snapshot["segments"]:
        if seg.get("device", device) != device:
            continue
        addr = seg.get("address", 0)
        for b in seg["blocks"]:
            addr = b.get("address", addr)
            if b["state"] == "active_allocated":
                live[addr] = Block(addr, b["size"], b.get("frames") or [])
            addr += b["size"]
    return live


def _bytes_step(e: dict[str, Any], live: dict[int, Block], i: int) -> int:
    """Apply one event to ``live``; the change of allocated bytes it makes."""
    if e["action"] == "alloc":
        live[e["addr"]] = Block(e["addr"], e["size"], e.get("frames") or [], alloc_at=i)
        return int(e["size"])
    if e["action"] == "free_requested":
        live.pop(e["addr"], None)
        return -int(e["size"])
    return 0


def step_peaks(snapshot: dict[str, Any], device: int = 0) -> tuple[list[Peak], dict[int, Any]]:
    """Per step the peak of allocated bytes and the blocks then live, replaying the trace
    from the state before it (rebuilt backwards from the segments' ``active_allocated``
    blocks). Windows: step 0 is the set-up before the ``ready`` marker, step k ends at the
    k-th ``end`` marker. Bytes fall at ``free_requested``, as
    ``torch.cuda.max_memory_allocated`` counts them. Also returns each step's marker
    indices."""
    events = snapshot["device_traces"][device]
    live = _active(snapshot, device)
    for e in reversed(events):  # back to the state before the trace
        if _marker(e):
            continue
        if e["action"] == "alloc":
            live.pop(e["addr"], None)
        elif e["action"] == "free_requested":
            live[e["addr"]] = Block(e["addr"], e["size"], e.get("frames") or [])
    start = dict(live)
    total = sum(b.size for b in live.values())
    peaks, marks, seen = [Peak(0, total, -1)], defaultdict(dict), False
    for i, e in enumerate(events):  # forward: bytes after each event, peak per window
        kind = _marker(e)
        if kind and e["action"] == "alloc":
            marks[peaks[-1].step][kind] = i
            if kind in ("ready", "end"):
                peaks.append(Peak(peaks[-1].step + 1, total, i))
                seen = False
            continue
        if kind:
            continue
        change = _bytes_step(e, {}, i)
        total += change
        seen = seen or change != 0
        if total > peaks[-1].bytes:
            peaks[-1].bytes, peaks[-1].at = total, i
    if not seen and len(peaks) > 1:
        peaks.pop()  # nothing after the last step's end marker
    for peak in peaks:
        peak.blocks = _live_at(events, dict(start), peak.at)
        if peak.at >= 0:
            frames = events[peak.at].get("frames") or []
            peak.where = describe(frames)[0] + (" (backward)" if _backward(frames) else "")
    return peaks, dict(marks)


def _live_at(events: list[dict[str, Any]], live: dict[int, Block], at: int) -> list[Block]:
    """The blocks live right after event ``at`` (biggest first), each with its free index."""
    for i, e in enumerate(events[:at + 1]):
        if not _marker(e):
            _bytes_step(e, live, i)
    for i in range(at + 1, len(events)):
        e = events[i]
        b = live.get(e["addr"])
        if b is not None and b.free_at is None and e["action"] == "free_requested":
            b.free_at = i
    return sorted(live.values(), key=lambda b: -b.size)


def _contains(ptrs: list[int], block: Block) -> bool:
    i = bisect_right(ptrs, block.addr + block.size - 1)
    return i > 0 and ptrs[i - 1] >= block.addr


def _short(filename: str) -> str:
    if GENERATED.search(filename):
        return "inductor:" + Path(filename).name
    for root in (str(zoo.REPO) + "/", "site-packages/"):
        if root in filename:
            return filename.split(root, 1)[1]
    return filename


def _frame(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The innermost frame worth naming: generated code, else code outside torch/triton."""
    for f in frames:
        name = f.get("filename", "")
        if GENERATED.search(name) or f.get("fx_node_name") or not INTERNAL.search(name):
            return f
    return frames[0] if frames else None


def describe(frames: list[dict[str, Any]]) -> tuple[str, str]:
    """(group key, what it is): ``file:line`` of the naming frame, and its source line,
    with, in generated code, the kernel that follows and the FX nodes it fuses."""
    f = _frame(frames)
    if f is None:
        return "<no Python frame>", "allocated from C++ (autograd engine, fused optimizer)"
    filename, line = f.get("filename", "?"), int(f.get("line", 0))
    key = f"{_short(filename)}:{line} ({f.get('name', '?')})"
    text = linecache.getline(filename, line).strip()
    if GENERATED.search(filename):
        nodes = kernel = None
        for ahead in range(line + 1, line + 12):
            src = linecache.getline(filename, ahead)
            nodes = nodes or (m.group(1) if (m := SOURCE_NODES.search(src)) else None)
            kernel = kernel or (m.group(1) if (m := KERNEL_CALL.match(src)) else None)
        text += f"  -> {kernel or '?'} [{nodes or '?'}]"
    if f.get("fx_node_name"):  # FX code (augment_with_fx_traces): the node and its source
        text += f"  [fx {f['fx_node_name']}: {str(f.get('fx_original_trace', ''))[-120:]}]"
    return key, text


def _backward(frames: list[dict[str, Any]]) -> bool:
    return any("backward" in str(f.get("name", "")) for f in frames)


def attribute(peak: Peak, owned: dict[str, Iterable[int]], grads: Iterable[int],
              marks: dict[str, int], top: int = 25) -> dict[str, Any]:
    """Bytes per category of ``peak``'s live blocks and the ``top`` groups of the rest.

    ``owned``: storage addresses of ``params`` / ``buffers`` / ``optimizer`` state; ``grads``:
    the addresses the step's ``.grad`` s had; ``marks``: that step's marker indices (a
    gradient is freed after ``optimizer`` and before ``end``)."""
    ptrs = {k: sorted(v) for k, v in owned.items()}
    grad_ptrs = sorted(grads)
    lo, hi = marks.get("optimizer", -1), marks.get("end", 1 << 62)
    cats = dict.fromkeys(CATEGORIES, 0)
    groups: dict[str, dict[str, Any]] = {}
    for b in peak.blocks:
        kind = next((k for k, p in ptrs.items() if _contains(p, b)), None)
        if kind is None and b.free_at is not None and lo < b.free_at < hi \
                and _contains(grad_ptrs, b):
            kind = "grads"
        if kind is not None:
            cats[kind] += b.size
            continue
        phase = "backward_allocated" if _backward(b.frames) else "forward_allocated"
        cats[phase] += b.size
        key, text = describe(b.frames)
        g = groups.setdefault(key, {"group": key, "source": text, "bytes": 0, "blocks": 0,
                                    "phase": phase})
        g["bytes"] += b.size
        g["blocks"] += 1
    ranked = sorted(groups.values(), key=lambda g: -g["bytes"])
    return {"step": peak.step, "peak_bytes": peak.bytes, "trace_index": peak.at,
            "reached_by": peak.where,
            "categories": cats, "groups": ranked[:top],
            "other_groups_bytes": sum(g["bytes"] for g in ranked[top:])}


class Owned:
    """The run's own tensors by storage address (set at ``on_ready``, read at every step's
    end), each step's gradients (post-accumulate hooks), and the trace markers."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.trainables: Any = None
        self.grads: dict[int, set[int]] = defaultdict(set)
        self.step = 1

    def ready(self, trainables: Any) -> None:
        self.trainables = trainables
        for p in trainables.model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad)
        trainables.dense_opt.register_step_post_hook(
            lambda *_: _memory_mark("optimizer", self.device))
        _memory_mark("ready", self.device)

    def _grad(self, p: Any) -> None:
        if p.grad is not None and not p.grad.is_sparse:
            self.grads[self.step].add(p.grad.untyped_storage().data_ptr())

    def on_step(self, done: int) -> None:
        _memory_mark("end", self.device)
        self.step = done + 1

    def addresses(self) -> dict[str, set[int]]:
        import torch

        t = self.trainables
        out: dict[str, set[int]] = {
            "params": {p.untyped_storage().data_ptr() for p in t.model.parameters()},
            "buffers": {b.untyped_storage().data_ptr() for b in t.model.buffers()},
            "optimizer": set()}
        states = [s for st in t.dense_opt.state.values() for s in st.values()]
        states += [s for rs in t.emb_opt.state.values() for s in rs.tensors.values()]
        out["optimizer"] = {s.untyped_storage().data_ptr() for s in states
                            if isinstance(s, torch.Tensor) and s.device.type == self.device.type}
        out["optimizer"] -= out["params"]
        return out


def synthetic_snapshot(owned: dict[str, set[int]], grads: set[int]) -> dict[str, Any]:
    """A snapshot in ``torch.cuda.memory._snapshot()``'s format of one step over the run's
    real tensor addresses (``--smoke``: no CUDA history on the CPU): the owned tensors
    live throughout, a forward activation, the gradients, a backward temporary."""
    here = {"filename": __file__, "line": 1, "name": "_memory_mark"}
    code = [{"filename": str(zoo.REPO / "backends/torch/graph_mode.py"), "line": 1,
             "name": "forward"}]
    static = sorted(a for v in owned.values() for a in v)
    blocks = [{"address": a, "size": 512, "state": "active_allocated", "frames": code}
              for a in static]
    base = max([*static, *grads, 1 << 20]) + (1 << 20)
    trace = [{"action": "alloc", "addr": 1, "size": MARK_UNIT, "frames": [here]},
             {"action": "alloc", "addr": base, "size": 4096, "frames": code},
             *[{"action": "alloc", "addr": g, "size": 512,
                "frames": [{"filename": "x", "line": 1, "name": "backward"}]} for g in grads],
             {"action": "alloc", "addr": base + 8192, "size": 1024,
              "frames": [{"filename": "y", "line": 2, "name": "backward"}]},
             {"action": "free_requested", "addr": base + 8192, "size": 1024, "frames": []},
             {"action": "free_requested", "addr": base, "size": 4096, "frames": code},
             {"action": "alloc", "addr": 1, "size": 2 * MARK_UNIT, "frames": [here]},
             *[{"action": "free_requested", "addr": g, "size": 512, "frames": []}
               for g in grads],
             {"action": "alloc", "addr": 1, "size": 3 * MARK_UNIT, "frames": [here]}]
    return {"segments": [{"device": 0, "blocks": blocks}], "device_traces": [trace]}


def _mb(n: float) -> str:
    return f"{n / 1e6:10.1f}"


def table(result: dict[str, Any]) -> str:
    """Measured categories (at the run's peak step and at the last step) beside the plan's."""
    pred = result["predicted"]["memory_gb"] or {}
    acts = result["predicted"]["activations"] or {}
    runs = [result["peak"], result["last_step"]]
    rows = [("params", "params", ["params", "buffers"]), ("grads", "grads", ["grads"]),
            ("optimizer", "optimizer", ["optimizer"]),
            ("activations", "activations", ["forward_allocated"]),
            ("workspace", "workspace", ["backward_allocated"])]
    lines = [f"{'':>24} {'predicted MB':>12} {'peak (step ' + str(runs[0]['step']) + ')':>16} "
             f"{'last (step ' + str(runs[1]['step']) + ')':>16}"]
    for label, pkey, mkeys in rows:
        p = pred.get(pkey)
        lines.append(f"{label:>24} {(_mb(p * 1e9) if p is not None else '-'):>12} "
                     + " ".join(f"{_mb(sum(r['categories'][k] for k in mkeys)):>16}"
                                for r in runs))
    lines.append(f"{'total':>24} {_mb(pred.get('total', 0) * 1e9):>12} "
                 + " ".join(f"{_mb(r['peak_bytes']):>16}" for r in runs))
    lines.append(f"(activations measured: forward-allocated blocks live at the peak; "
                 f"workspace: backward-allocated; predicted saved {_mb(acts.get('saved_bytes', 0))}"
                 f" MB, forward peak {_mb(acts.get('forward_peak_bytes', 0))} MB)")
    lines.append(f"\nlargest groups at the peak (step {runs[0]['step']}, reached by "
                 f"{runs[0].get('reached_by')}):")
    lines += [f"{_mb(g['bytes'])} MB {g['blocks']:>5}x {g['phase'][:3]} {g['group']}\n"
              f"{'':>20}{g['source'][:160]}" for g in runs[0]["groups"]]
    return "\n".join(lines)


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mmoe", help="a zoo model (benchmarks/zoo.py's names)")
    p.add_argument("--out", required=True, help="directory for the plan and the JSON")
    p.add_argument("--steps", type=int, default=3, help="steps to train (default 3)")
    p.add_argument("--top", type=int, default=25, help="groups kept per peak (default 25)")
    p.add_argument("--max-entries", type=int, default=1_000_000,
                   help="allocator trace entries kept (the oldest dropped beyond it)")
    p.add_argument("--preset", default=None, help="model preset (default h200; tiny: --smoke)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny preset, batch 8: the run with a synthetic snapshot")
    args = p.parse_args(argv)
    args.preset = args.preset or ("tiny" if args.smoke else "h200")
    args.device = "cpu" if args.smoke else "cuda"
    args.batch_size = 8 if args.smoke else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    known = zoo.models()
    if args.model not in known:
        print(f"memory_attribution: unknown model {args.model!r} (--model); known: "
              f"{', '.join(known)}", file=sys.stderr)
        return 2
    device = zoo._setup_child(args)
    import torch
    from gemc.backends.torch.runner import RunOptions, run

    plan, error = zoo._compile_plan(args.model, known[args.model], args, out)
    if plan is None:
        print(f"memory_attribution: {args.model}: {error}", file=sys.stderr)
        return 1
    owned = Owned(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.memory._record_memory_history(max_entries=args.max_entries,
                                                 context="all", stacks="python")
    result = run(plan, RunOptions(steps=args.steps, device=device.type, seed=args.seed,
                                  progress=False, on_step=owned.on_step, on_ready=owned.ready,
                                  **zoo.GEMC_OPTIONS["gemc"]))
    addresses = owned.addresses()
    if cuda:
        try:  # FX code's frames named by node (torch >= 2.9)
            snapshot = torch.cuda.memory._snapshot(augment_with_fx_traces=True)
        except Exception as exc:  # noqa: BLE001 - the plain snapshot still attributes
            print(f"memory_attribution: no FX node names ({type(exc).__name__}: {exc})",
                  file=sys.stderr)
            snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        index = device.index if device.index is not None else torch.cuda.current_device()
    else:
        snapshot, index = synthetic_snapshot(addresses, owned.grads[1]), 0
    peaks, marks = step_peaks(snapshot, index)
    steps = [p for p in peaks if p.step >= 1] or peaks
    top = max(steps, key=lambda p: p.bytes)
    attributed = {p.step: attribute(p, addresses, owned.grads[p.step],
                                    marks.get(p.step, {}), args.top)
                  for p in {top.step: top, steps[-1].step: steps[-1]}.values()}
    rep = result.report
    report = {
        "model": args.model, "preset": args.preset, "device": str(device),
        "steps": args.steps, "synthetic_snapshot": not cuda,
        "runner_peak_bytes": rep["per_rank"][0]["memory"].get("peak_bytes"),
        "max_memory_allocated": torch.cuda.max_memory_allocated(device) if cuda else None,
        "trace_events": len(snapshot["device_traces"][index]),
        "step_peaks_bytes": {p.step: p.bytes for p in peaks},
        "compiled_variants": (rep.get("graph_executor") or {}).get("compiled_variants"),
        "predicted": {"memory_gb": plan["predicted"]["per_rank"][0]["memory"],
                      "activations": plan["predicted"].get("activations"),
                      "packed_fill": plan["predicted"].get("packed_fill")},
        "peak": attributed[top.step], "last_step": attributed[steps[-1].step],
    }
    path = out / f"{args.model}.memory.json"
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"== {args.model} ({args.preset}, {device}{', synthetic snapshot' if not cuda else ''}"
          f"): runner peak {report['runner_peak_bytes']}, step peaks "
          f"{report['step_peaks_bytes']}, {report['trace_events']} trace events")
    print(table(report))
    print(f"memory_attribution: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
