"""benchmarks/first_step_cpu.py: its counting backend and its side-by-side table."""

from __future__ import annotations

import torch

from tests.benchmark_module import load_benchmark


def _row(variant: str, ops_bw: dict[str, int], kernels_bw: int) -> dict:
    return {"model": "m", "variant": variant,
            "steps": [{"s": 9.0, "graph_breaks": 1, "unique_graphs": 1, "frames_ok": 1},
                      {"s": 0.1, "graph_breaks": 0, "unique_graphs": 1, "frames_ok": 1}],
            "frames": [{"nodes": 5}, {"nodes": 5}],
            "graphs": [{"backward": False, "nodes": 7, "kernels": 3, "seconds": 1.0,
                        "ops": {"aten.mm.default": 2}},
                       {"backward": True, "nodes": 9, "kernels": kernels_bw, "seconds": 2.0,
                        "ops": ops_bw}],
            "phases": {"total_wall_time": 3.5}}


def test_table_counts_each_variant_and_names_the_ops_that_differ() -> None:
    fs = load_benchmark("first_step_cpu")
    rows = [_row("compile", {"aten.mm.default": 4}, 2),
            _row("gemc", {"aten.mm.default": 4, "aten.cat.default": 1}, 6)]
    s = fs.summarise(rows[1])
    # a compile in the second step is a recompile; breaks add up over the steps
    assert (s["frames"], s["breaks"], s["recompiles"]) == (2, 1, 1)
    assert (s["fw_kernels"], s["bw_kernels"], s["later_s"]) == (3, 6, 0.1)
    out = fs.table(rows)
    assert "m backward ops, compile -> gemc: cat.default 0->1" in out
    assert "m forward ops, compile -> gemc: " in out and "mm.default" not in \
        out.split("forward ops")[1].splitlines()[0]


def test_counting_backend_sees_the_forward_and_backward_graphs_and_their_kernels() -> None:
    fs = load_benchmark("first_step_cpu")
    counting = fs.Counting()
    torch._dynamo.reset()
    # a compile answered from Inductor's or AOTAutograd's on-disk cache (a test run before
    # this one compiled the same graph) never reaches the counting inner compile; the
    # benchmark gives each variant an empty cache directory, this test turns the caches off,
    # through the configs' own patch: monkeypatch's undo of a torch config module left
    # enable_autograd_cache deleted, failing every later test in the process that read it
    # (test_kernel_choices_and_cache, run after this file in one process)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        fn = torch.compile(lambda x: (x.sin() * 2).relu().sum(), backend=counting)
        x = torch.randn(8, requires_grad=True)
        fn(x).backward()
    assert len(counting.frames) == 1
    assert [g["backward"] for g in counting.graphs] == [False, True]
    assert all(g["nodes"] > 0 and g["kernels"] >= 1 for g in counting.graphs)
    torch.testing.assert_close(x.grad, 2 * x.detach().cos() * ((x.detach().sin() * 2) > 0))
