"""benchmarks/e2e.py on the CPU (tiny preset, Triton interpreted): the three variants run,
train the same model to the same losses, and the per-kernel profile and the GPU-idle (gap)
analysis are written. The gap analysis of a CUDA step runs on a synthetic timeline: this
machine has no GPU, and the arithmetic is what needs checking."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tests.benchmark_module import load_benchmark


def _module():
    return load_benchmark("e2e")


def test_interpreter_only_for_cpu_runs() -> None:
    e2e = _module()
    assert e2e.interpreted_triton("cpu", True)
    assert e2e.interpreted_triton(None, False)
    assert not e2e.interpreted_triton(None, True)  # a GPU machine, device not given
    assert not e2e.interpreted_triton("cuda", True)


def test_smoke_runs_all_variants_with_matching_losses(tmp_path: Path) -> None:
    e2e = _module()
    out = tmp_path / "e2e.json"
    # batch 2: the gemc variant's kernels run interpreted, their time grows with the batch
    # (batch 4 cost 7.5 s more CPU; what is checked here does not depend on it)
    assert e2e.main(["--smoke", "--steps", "2", "--profile", "1", "--batch-size", "2",
                     "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["isolated"]  # each variant ran in its own child process
    rows = {r["variant"]: r for r in result["variants"]}
    assert set(rows) == {"eager", "compile", "gemc"}
    for name, row in rows.items():
        # 2 timed steps, then the profiler's warm-up, profiled and sync-site steps; the
        # median is over the timed ones after the warmup only
        assert len(row["losses"]) == len(row["step_ms_all"]) == 2 + 1 + 2, name
        assert row["step_ms"] == row["step_ms_all"][1], name
        assert row["max_rel_loss_diff_vs_eager"] < 2e-2, name  # bf16 autocast everywhere
        profile = Path(f"{out}.{name}.kernels.txt").read_text()
        assert profile.startswith("device time per step:") and "ms/step" in profile
        # where the GPU idles: a CPU run has no device timeline, and says so
        gaps = Path(f"{out}.{name}.gaps.txt").read_text()
        assert gaps.startswith(f"GPU idle analysis: {name}, 1 profiled steps")
        assert "no device timeline" in gaps and "aten::item" in gaps
        assert row["gpu_busy_ms"] is None and row["gpu_idle_ms"] is None
        assert row["syncs_per_step"] > 0  # the host-read ops (item, nonzero) of a step
        with gzip.open(f"{out}.{name}.trace.json.gz", "rt") as f:
            trace = json.load(f)["traceEvents"]
        assert any(str(e.get("name", "")).startswith("ProfilerStep#") for e in trace)
    assert "kernels applied" in rows["gemc"]["note"]


def _timeline(e2e):  # noqa: ANN001, ANN202
    """One profiled CUDA step, as Kineto reports it: ops on the Python thread (tid 1), runtime
    calls on their system thread (tid 99, tied to their op by ``linked``), device work tied to
    its launch by ``corr``. Times in us.

    100: end of the opening synchronize (the timed window starts)
    A [130, 300] launched at 115 by aten::mm      -> leading gap 30 us, host late
    B [305, 320] launched at 142 (already queued) -> 5 us, device-side latency
    three views, then aten::mul launches C at 405 -> 100 us, host late
    C [420, 600]; aten::item: D2H copy [600, 602] and a stream sync [521, 603]
    aten::add_ launches D at 725, D [740, 800]     -> 138 us after the sync
    900: end of the closing synchronize           -> 100 us tail
    """
    T = e2e.trace_analysis.TraceEvent

    def op(name, start, end, corr):  # noqa: ANN001, ANN202
        return T(name, "op", start, end, tid=1, corr=corr)

    def rt(name, start, end, corr, linked=0):  # noqa: ANN001, ANN202
        return T(name, "runtime", start, end, tid=99, corr=corr, linked=linked)

    def gpu(name, start, end, corr):  # noqa: ANN001, ANN202
        return T(name, "gpu", start, end, tid=7, corr=corr)

    return [
        T("ProfilerStep#6", "step", 0, 1000, tid=1, corr=1),
        rt("cudaDeviceSynchronize", 50, 100, 2000),
        op("aten::mm", 110, 130, 10), rt("cudaLaunchKernel", 115, 125, 1001, 10),
        gpu("gemm_A", 130, 300, 1001),
        op("aten::add", 140, 150, 11), rt("cudaLaunchKernel", 142, 148, 1002, 11),
        gpu("add_B", 305, 320, 1002),
        op("aten::view", 330, 335, 20), op("aten::view", 340, 345, 21),
        op("aten::view", 350, 355, 22),
        op("aten::mul", 400, 420, 12), rt("cudaLaunchKernel", 405, 415, 1003, 12),
        gpu("mul_C", 420, 600, 1003),
        op("aten::item", 510, 700, 13), op("aten::_local_scalar_dense", 512, 698, 14),
        rt("cudaMemcpyAsync", 515, 520, 1004, 14),
        gpu("Memcpy DtoH (Device -> Pageable)", 600, 602, 1004),
        rt("cudaStreamSynchronize", 521, 603, 1005, 14),
        op("aten::add_", 720, 740, 15), rt("cudaLaunchKernel", 725, 735, 1006, 15),
        gpu("add_D", 740, 800, 1006),
        rt("cudaDeviceSynchronize", 810, 900, 2001),
    ]


def test_gaps_of_a_cuda_step_by_cause() -> None:
    e2e = _module()
    result = e2e.trace_analysis.step_gaps(_timeline(e2e))
    s = result["summary"]
    assert s["device_timeline"] and s["profiled_steps"] == 1
    assert s["window_ms"] == pytest.approx(0.8)  # 100 -> 900: the timed region
    assert s["gpu_busy_ms"] == pytest.approx(0.427)  # 170 + 15 + 180 + 2 + 60
    assert s["gpu_idle_ms"] == pytest.approx(0.373)
    assert s["syncs_per_step"] == 1  # the stream sync; the two step boundaries left out
    assert s["sync_ops_per_step"] == 1  # aten::item around aten::_local_scalar_dense: one
    assert s["d2h_copies_per_step"] == 1
    causes = s["idle_by_cause_ms"]
    assert causes["host"] == pytest.approx(0.130) and causes["queued"] == pytest.approx(0.005)
    assert causes["sync"] == pytest.approx(0.138) and causes["tail"] == pytest.approx(0.100)
    (step,) = result["steps"]
    assert step["window"] == "timed" and step["gaps"] == 5
    first, second = step["largest_gaps"][:2]
    assert first["cause"] == "sync" and first["us"] == pytest.approx(138)
    assert first["sync_site"] == "aten::item > aten::_local_scalar_dense > cudaStreamSynchronize"
    assert first["launch_site"] == "aten::add_ > cudaLaunchKernel"
    assert second["cause"] == "host" and second["host_late_us"] == pytest.approx(85)
    assert second["after"] == "add_B" and second["next"] == "mul_C"
    assert second["ops_in_gap"] == 4 and second["top_ops_in_gap"][0] == ("aten::view", 3)
    assert [(site, c) for site, c, _ in result["host_late_sites"]] == [
        ("aten::mul > cudaLaunchKernel", 1), ("aten::mm > cudaLaunchKernel", 1)]
    (site,) = result["sync_sites"]
    assert site[0].endswith("cudaStreamSynchronize") and site[1] == 1
    assert site[2] == pytest.approx(82)  # us the host blocked
    text = e2e.trace_analysis.format_gaps("gemc", result, [], "trace: -")
    assert "GPU busy 0.43 ms + GPU idle 0.37 ms" in text
    assert "[sync]" in text and "ops in gap: 4 (aten::view x3, aten::mul x1)" in text


def test_gap_analysis_failure_keeps_the_benchmark(tmp_path: Path, monkeypatch, capsys) -> None:  # noqa: ANN001
    """A torch whose profiler hands out no event list: one loud line, the kernels file, and
    no exception."""
    import torch

    e2e = _module()

    def missing(_prof):  # noqa: ANN001, ANN202
        raise AttributeError("no events()")

    monkeypatch.setattr(e2e.trace_analysis, "profiler_events", missing)
    prof = e2e.trace_analysis.StepProfiler(1, 1, torch.device("cpu"), tmp_path / "x.json.v.kernels.txt")
    x = torch.randn(64, 64)
    for _ in range(3):
        (x @ x).sum().item()
        prof.step()
    prof.close()
    assert "WARNING: GPU gap analysis skipped" in capsys.readouterr().err
    assert prof.summary["gpu_busy_ms"] is None and "profile_error" in prof.summary
    assert (tmp_path / "x.json.v.kernels.txt").exists()


def test_sync_sites_name_the_repo_line(monkeypatch) -> None:  # noqa: ANN001
    """The sync debug mode's warnings become 'repo line -> library line' counts; other
    warnings pass through untouched. (torch's CUDA switch is stubbed: no GPU here.)"""
    import warnings

    import torch

    e2e = _module()
    modes, shown = [], []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(warnings, "showwarning", lambda message, *_: shown.append(str(message)))
    sites = e2e.trace_analysis.SyncSites()
    sites.start()
    for _ in range(2):
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
    warnings.warn("unrelated", UserWarning, stacklevel=1)
    sites.stop()
    assert modes == ["warn", 0]  # on for the step, then back to what it was
    assert shown == ["unrelated"]
    ((site, count),) = sites.sites.items()
    assert site.startswith("tests/runner/test_e2e_benchmark.py:") and count == 2
    assert any("2  tests/runner/test_e2e_benchmark.py:" in line for line in sites.lines(9))
