"""The first step's accounting (gemc.backends.torch.first_step): Triton compiles split into
gemc's kernels and the rest by the module that defined them, the listener it replaced still
called, and the run report's one-line form."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from gemc.backends.torch.cli import first_step_line
from gemc.backends.torch.first_step import FirstStepAccount, TritonCompiles


def _source(name: str, module: str) -> SimpleNamespace:
    """A compile's ``src`` as Triton passes it: ``src.fn`` is the JITFunction, whose ``fn``
    is the Python function."""
    def fn() -> None:
        pass

    fn.__name__, fn.__module__ = name, module
    return SimpleNamespace(fn=SimpleNamespace(__name__=name, fn=fn))


def test_compiles_are_split_by_the_defining_module_and_chained() -> None:
    seen = []
    listener = TritonCompiles()
    listener._previous = lambda **kw: seen.append(kw["src"])
    for name, module, us in (("_fwd_kernel", "gemc.backends.triton.jagged_attention", 2e6),
                             ("group_0", "gemc_group_3f2a", 5e5),
                             ("triton_poi_fused_0", "torch._inductor.codecache.abc", 1e6)):
        listener(src=_source(name, module), metadata={}, metadata_group={},
                 times=SimpleNamespace(total=us), cache_hit=False)
    rep = listener.report()
    assert rep["compiles"] == 3 and len(seen) == 3
    assert rep["gemc_kernels_s"] == pytest.approx(2.5)
    assert rep["other_kernels_s"] == pytest.approx(1.0)
    assert list(rep["by_kernel"]) == ["_fwd_kernel", "triton_poi_fused_0", "group_0"]


def test_install_gives_the_listener_slot_back() -> None:
    knobs = pytest.importorskip("triton.knobs")
    if not hasattr(getattr(knobs, "compilation", None), "listener"):
        pytest.skip("this Triton has no compilation listener")
    before = knobs.compilation.listener
    account = FirstStepAccount().start()
    assert knobs.compilation.listener is account.triton
    out = account.finish(1.5)
    assert knobs.compilation.listener is before
    assert out["first_step_s"] == 1.5
    assert out["outside_torch_compile_s"] == pytest.approx(1.5 - out["torch_compile_s"])


def test_report_line_names_each_part() -> None:
    acc = {"first_step_s": 73.5, "torch_compile_s": 52.7, "outside_torch_compile_s": 20.8,
           "torch_phases_s": {"entire_backward_compile": 13.9},
           "torch_timers": {"bytecode_tracing": {"seconds": 4.1, "calls": 9}},
           "triton_in_process": {"compiles": 27, "gemc_kernels_s": 6.3,
                                 "other_kernels_s": 6.1},
           "phases": {"forward": {"wall_s": 40.2, "torch_compile_s": 30.1,
                                  "gemc_triton_compile_s": 2.0, "rest_s": 8.1}}}
    line = first_step_line(acc)
    for part in ("first step 73.5 s", "torch.compile 52.7 s", "Dynamo tracing 4.1",
                 "backward 13.9", "outside it 20.8 s", "gemc's kernels 6.3 s", "others 6.1 s",
                 "forward 40.2 (compile 30.1, kernels 2.0, running 8.1)"):
        assert part in line, (part, line)


def test_marks_split_the_step_into_phases() -> None:
    """Each mark ends a phase; the wait runs before the clock is read (a device sync, so a
    phase's queued kernels count in it); without start() marks are ignored."""
    import time

    idle = FirstStepAccount()
    idle.mark("forward")
    assert "phases" not in idle.finish(0.1)
    account = FirstStepAccount().start()
    account.mark("forward", lambda: time.sleep(0.05))
    account.mark("backward")
    phases = account.finish(0.2)["phases"]
    assert list(phases) == ["forward", "backward"]
    assert phases["forward"]["wall_s"] >= 0.05 and phases["backward"]["wall_s"] < 0.05
    assert phases["forward"]["rest_s"] == pytest.approx(phases["forward"]["wall_s"], abs=2e-3)


def test_compile_workers_start_ahead_only_for_triton_compiles(monkeypatch) -> None:
    """Inductor's compile pool is started before setup on a CUDA device (so the first step
    does not compile kernels one by one in the main process while it starts), not on the
    CPU, and a torch without the hook is said so, loudly."""
    import sys

    import torch
    from gemc.backends.torch.first_step import warm_compile_workers
    from torch._inductor import async_compile

    calls = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: calls.append(1))
    assert warm_compile_workers(torch.device("cpu")).startswith("not started")
    assert calls == []
    assert warm_compile_workers(torch.device("cuda")) == "started before setup"
    assert calls == [1]
    monkeypatch.delattr(async_compile, "maybe_warm_pool")
    monkeypatch.setitem(sys.modules, "torch._inductor.async_compile", async_compile)
    with pytest.warns(UserWarning, match="compile workers not started"):
        assert warm_compile_workers(torch.device("cuda")).startswith("not started")
