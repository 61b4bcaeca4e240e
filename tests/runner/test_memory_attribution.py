"""benchmarks/memory_attribution.py on a hand-made allocator snapshot: the peak rebuilt from
the trace (blocks allocated before it included), the step windows its markers cut, the
identity categories (a gradient's address reused by an activation is not a gradient) and
the grouping by Inductor's generated line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.benchmark_module import load_benchmark

ma = load_benchmark("memory_attribution")
MARK = {"filename": "memory_attribution.py", "line": 1, "name": "_memory_mark"}
TORCH = {"filename": "/x/site-packages/torch/_inductor/utils.py", "line": 9, "name": "empty"}
BWD = [{"filename": "/repo/model.py", "line": 7, "name": "backward"}]
P, S, A0, X, Y, G, T, Z = 0x1000, 0x1800, 0x9000, 0x4000, 0x5000, 0x6000, 0x7000, 0x6000


def _ev(action: str, addr: int, size: int, frames: list[dict[str, Any]]) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "frames": frames}


def _mark(kind: str) -> dict[str, Any]:
    return _ev("alloc", 0x10, ma.MARKS[kind] * ma.MARK_UNIT, [MARK])


@pytest.fixture
def snapshot(tmp_path: Path) -> dict[str, Any]:
    gen = tmp_path / "ab" / ("c" + "q" * 24 + ".py")
    gen.parent.mkdir()
    gen.write_text("def call(args):\n"
                   "    buf3 = empty_strided_cuda((8, 16), (16, 1), torch.float32)\n"
                   "    # Topologically Sorted Source Nodes: [linear, relu], Original ATen: []\n"
                   "    triton_poi_fused_relu_0.run(buf3, 128)\n")
    fwd = [TORCH, {"filename": str(gen), "line": 2, "name": "call"}]
    trace = [
        _mark("ready"),                                   # 0: step 1 starts
        _ev("alloc", X, 4096, fwd), _ev("alloc", Y, 4096, fwd),
        _ev("free_requested", A0, 512, []),               # 3: allocated before the trace
        _ev("alloc", G, 1024, BWD),                       # 4: the gradient
        _ev("alloc", T, 6144, BWD),                       # 5: step 1's peak, 18432
        _ev("free_requested", T, 6144, BWD), _ev("free_requested", X, 4096, fwd),
        _ev("free_requested", Y, 4096, fwd),
        _mark("optimizer"),                               # 9
        _ev("free_requested", G, 1024, BWD),              # 10: zero_grad
        _mark("end"),                                     # 11: step 2 starts
        _ev("alloc", Z, 1024, fwd),                       # the gradient's address, reused
        _ev("alloc", X, 4096, fwd),                       # 13: step 2's peak, 8192
        _ev("free_requested", X, 4096, fwd), _ev("free_requested", Z, 1024, fwd),
        _mark("optimizer"), _mark("end")]
    blocks = [{"size": 1024, "state": "active_allocated", "frames": []},    # P
              {"size": 1024, "state": "inactive"},
              {"size": 2048, "state": "active_allocated", "frames": []}]    # S
    return {"segments": [{"device": 0, "address": P, "blocks": blocks}],
            "device_traces": [trace]}


def test_peaks_rebuilt_per_step(snapshot: dict[str, Any]) -> None:
    peaks, marks = ma.step_peaks(snapshot)
    # step 0: the state before the trace (P, S and A0); the empty window after the last
    # end marker is dropped
    assert [(p.step, p.bytes, p.at) for p in peaks] == [(0, 3584, -1), (1, 18432, 5),
                                                        (2, 8192, 13)]
    assert {b.addr for b in peaks[1].blocks} == {P, S, X, Y, G, T}
    assert marks[1] == {"optimizer": 9, "end": 11}
    assert next(b for b in peaks[1].blocks if b.addr == G).free_at == 10


def test_attribution_by_identity_and_line(snapshot: dict[str, Any]) -> None:
    peaks, marks = ma.step_peaks(snapshot)
    owned = {"params": {P}, "optimizer": {S + 64}}  # a view inside the block counts
    one = ma.attribute(peaks[1], owned, {G}, marks[1], top=1)
    assert one["categories"] == {"params": 1024, "grads": 1024, "optimizer": 2048,
                                 "buffers": 0, "forward_allocated": 8192,
                                 "backward_allocated": 6144}
    (group,) = one["groups"]
    assert group["bytes"] == 8192 and group["blocks"] == 2
    assert group["group"].startswith("inductor:c") and group["group"].endswith(":2 (call)")
    assert "buf3 = empty_strided_cuda" in group["source"]
    assert "triton_poi_fused_relu_0.run [linear, relu]" in group["source"]
    assert one["other_groups_bytes"] == 6144
    assert one["reached_by"] == "/repo/model.py:7 (backward) (backward)"
    # gemc's own backends/torch/ is not torch: its frame names the group
    runner = {"filename": "/w/gemc/backends/torch/runner.py", "line": 3, "name": "_run"}
    assert ma.describe([TORCH, runner])[0] == "/w/gemc/backends/torch/runner.py:3 (_run)"
    # step 2: the block at step 1's gradient address is an activation freed before the
    # optimizer, not a gradient
    two = ma.attribute(peaks[2], owned, {G}, marks[2])
    assert two["categories"]["grads"] == 0
    assert two["categories"]["forward_allocated"] == 5120
    report = {"predicted": {"memory_gb": {"params": 1e-6, "total": 2e-5},
                            "activations": {"saved_bytes": 8000}},
              "peak": one, "last_step": two}
    text = ma.table(report)
    assert "peak (step 1)" in text and "last (step 2)" in text
