"""Generated kernels against eager PyTorch, forward and backward, over random shapes.

Each case is a function whose whole body the fuse pass turns into one group. It is captured
and compiled once; since generated kernels are shape-generic, every hypothesis example
re-binds the same source to freshly drawn sizes (not multiples of the blocks, tiny ones,
several blocks) and fresh random inputs, and compares outputs and input gradients with
eager PyTorch under ``torch.testing.assert_close``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.triton.codegen import generated, host
from gemc.backends.triton.codegen.host import GEMM_PATH_ENV, make_runner
from gemc.backends.triton.codegen.kernels import (
    grad_aliases,
    passes_gradient_through,
    reloaded_outputs,
)
from gemc.backends.triton.runtime import cdiv
from gemc.passes.classify_ops import ClassifyOps
from gemc.passes.count_flops_bytes import CountFlopsBytes
from gemc.passes.fuse import Fuse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemc.context import PassContext
from gemc.plan_builder import kernel_entries
from tests.fusion.helpers import fresh_seed

SETTINGS = settings(max_examples=int(os.environ.get("GEMC_KERNEL_EXAMPLES", "4")),
                    deadline=None, suppress_health_check=list(HealthCheck))
Dims = dict[str, int]


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[..., Any]
    shapes: Callable[[Dims], list[tuple[int, ...]]]
    kind: str
    classes: Callable[[Dims], list[tuple[int, ...]]]  # shape of each shape class


def _gemm_gelu_residual(x, w, b, r):
    return F.gelu(F.linear(x, w, b)) + r


def _gemm_residual(x, w, b, r, r2):
    return r + F.linear(x, w, b) + r2


def _gemm_silu_scaled(x, w, s):
    return F.gelu(F.silu(F.linear(x, w)) * s * 0.5, approximate="tanh")


def _gemm_row_scaled(x, w, b, s):
    return torch.tanh(F.linear(x, w, b)) * s  # s: one scale per row (a mask, a weight)


def _gemm_two_outputs(x, w, b):
    z = F.linear(x, w, b)
    return z, torch.relu(z) - 0.25 * z


def _norm_residual(x, r, w, b, m):
    h = x + r
    return h, F.layer_norm(h, (h.shape[-1],), w, b, 1e-5) * m


def _norm_alone(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def _norm_plain(x):
    return F.layer_norm(x, (x.shape[-1],))


def _pointwise(a, b, c):
    return torch.sigmoid(a * b) + (a + c).exp().clamp(max=3.0) - a * a / (1.5 + torch.tanh(a))


def _reduction(x, m):
    return (x * m).sum(dim=1)


def _reduction_mean(x, y):
    return torch.relu(x + y).mean(dim=-2, keepdim=True)


def _blk(d: Dims) -> tuple[int, int, int]:
    return d["B"], d["L"], d["N"]


CASES = [
    Case("gemm_gelu_residual", _gemm_gelu_residual,
         lambda d: [(d["B"], d["L"], d["K"]), (d["N"], d["K"]), (d["N"],), _blk(d)],
         "gemm_epilogue", lambda d: [_blk(d)]),
    Case("gemm_residual", _gemm_residual,
         lambda d: [(d["B"], d["L"], d["K"]), (d["N"], d["K"]), (d["N"],), _blk(d),
                    (d["B"], 1, d["N"])],
         "gemm_epilogue", lambda d: [_blk(d)]),
    Case("gemm_silu_scaled", _gemm_silu_scaled,
         lambda d: [(d["B"], d["L"], d["K"]), (d["N"], d["K"]), (d["B"], 1, 1)],
         "gemm_epilogue", lambda d: [_blk(d)]),
    Case("gemm_row_scaled", _gemm_row_scaled,
         lambda d: [(d["B"], d["L"], d["K"]), (d["N"], d["K"]), (d["N"],), (d["B"], d["L"], 1)],
         "gemm_epilogue", lambda d: [_blk(d)]),
    Case("gemm_two_outputs", _gemm_two_outputs,
         lambda d: [(d["B"] * d["L"], d["K"]), (d["N"], d["K"]), (d["N"],)],
         "gemm_epilogue", lambda d: [(d["B"] * d["L"], d["N"])]),
    Case("norm_residual", _norm_residual,
         lambda d: [_blk(d), _blk(d), (d["N"],), (d["N"],), (d["B"], d["L"], 1)],
         "norm", lambda d: [_blk(d)]),
    Case("norm_alone", _norm_alone, lambda d: [_blk(d), (d["N"],), (d["N"],)],
         "norm", lambda d: [_blk(d)]),
    Case("norm_plain", _norm_plain, lambda d: [_blk(d)], "norm", lambda d: [_blk(d)]),
    Case("pointwise", _pointwise,
         lambda d: [_blk(d), (d["N"],), (d["B"], 1, d["N"])],
         "pointwise", lambda d: [_blk(d)]),
    Case("reduction_sum", _reduction,
         lambda d: [_blk(d), (d["B"], d["L"], 1)],
         "reduction", lambda d: [_blk(d), (d["B"], d["N"])]),
    Case("reduction_mean", _reduction_mean,
         lambda d: [_blk(d), (d["N"],)],
         "reduction", lambda d: [_blk(d), (d["B"], 1, d["N"])]),
]
BY_NAME = {c.name: c for c in CASES}
CANONICAL = {"B": 2, "L": 3, "K": 5, "N": 7}


class _Fn(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *xs: torch.Tensor) -> Any:
        return self.fn(*xs)


@cache
def compiled_case(name: str) -> dict[str, Any]:
    """The case's one kernel entry (captured at canonical sizes)."""
    case = BY_NAME[name]
    inputs = tuple(torch.randn(s) for s in case.shapes(CANONICAL))
    gm = torch.export.export(_Fn(case.fn), inputs, strict=False).graph_module
    ctx = PassContext()
    for p in (ClassifyOps(), CountFlopsBytes(), Fuse()):
        gm, _ = p.run(gm, ctx)
    entries = kernel_entries(gm, ctx)
    assert [e["kind"] for e in entries] == [case.kind], entries
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert set(entries[0]["binding"]["inputs"]) <= set(placeholders)
    return {"entry": entries[0], "placeholders": placeholders}


def run_case(name: str, dims: Dims, dtype: torch.dtype = torch.float32) -> None:
    case = BY_NAME[name]
    found = compiled_case(name)
    entry, placeholders = found["entry"], found["placeholders"]
    structure = entry["structure"]
    classes = case.classes(dims)
    binding = {**entry["binding"],
               "shapes": [list(classes[q]) for q in structure["classes"]],
               "dtypes": [str(dtype).removeprefix("torch.")] * len(structure["outputs"])}
    source, _ = generated(structure)
    run = make_runner(source, binding)
    gen = torch.Generator().manual_seed(fresh_seed())
    inputs = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in case.shapes(dims)]
    # The reference runs in fp32 on the same (rounded) inputs: the kernels accumulate in fp32,
    # so a bf16 eager chain (rounding after every op) would be the less accurate side. For fp32
    # runs it runs in fp64: eager fp32 LayerNorm over N = 1 leaves x - mean a rounding error
    # away from 0 (times rstd = 316), so its weight gradient, exactly 0, came out ~1e-4.
    ref_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    ref_inputs = [x.detach().to(ref_dtype).requires_grad_() for x in inputs]
    by_name = dict(zip(placeholders, inputs))
    expected = case.fn(*ref_inputs)
    expected = list(expected) if isinstance(expected, tuple) else [expected]
    got = list(run(*(by_name[n] for n in binding["inputs"])))
    # bf16: GEMM operands (dz included, as in eager bf16 autograd) are rounded to 8 bits of
    # mantissa before the products, so errors grow like sqrt(reduction length) (~40 here).
    tol = {"atol": 8e-2, "rtol": 3e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), e.float(), **tol)
    grads = [torch.randn(e.shape, generator=gen).to(dtype) for e in expected]
    ref = torch.autograd.grad(expected, ref_inputs, [g.to(ref_dtype) for g in grads],
                              allow_unused=True)
    out = torch.autograd.grad(got, inputs, grads, allow_unused=True)
    eager32 = None
    if dtype == torch.float32:
        fp32_inputs = [x.detach().clone().requires_grad_() for x in inputs]
        eager_out = case.fn(*fp32_inputs)
        eager_out = list(eager_out) if isinstance(eager_out, tuple) else [eager_out]
        eager32 = [torch.zeros(x.shape, dtype=ref_dtype) if g is None else g.to(ref_dtype)
                   for x, g in zip(fp32_inputs, torch.autograd.grad(
                       eager_out, fp32_inputs, grads, allow_unused=True))]
    for i, (o, r) in enumerate(zip(out, ref)):
        r = torch.zeros_like(ref_inputs[i]) if r is None else r
        o = torch.zeros_like(inputs[i]) if o is None else o
        assert o.dtype == dtype
        # fp32: the bound is eager fp32's own error against the fp64 reference (times 4) on
        # top of 1e-4. Some cases are ill-conditioned, not the kernel: a LayerNorm over N = 2
        # nearly equal values has rstd in the thousands, so any fp32 program's input gradient
        # is off by ~1e-3 there. A wrong kernel is off by the gradient's own size.
        gtol = tol if eager32 is None else {
            **tol, "atol": tol["atol"] + 4 * float((eager32[i] - r).abs().max())}
        torch.testing.assert_close(o.float(), r.float(), **gtol,
                                   msg=lambda m, i=i: f"grad of input {i}: {m}")


DIMS = st.fixed_dictionaries({
    "B": st.integers(1, 3), "L": st.integers(1, 90), "K": st.integers(1, 80),
    "N": st.integers(1, 150),
})


@pytest.mark.parametrize("name", [c.name for c in CASES])
@SETTINGS
@given(dims=DIMS)
def test_generated_kernel_matches_eager(name: str, dims: Dims) -> None:
    run_case(name, dims)


@pytest.mark.parametrize("name", ["gemm_gelu_residual", "norm_residual", "norm_alone"])
def test_bf16(name: str) -> None:
    run_case(name, {"B": 2, "L": 5, "K": 24, "N": 40}, torch.bfloat16)


@pytest.mark.parametrize("name", ["gemm_gelu_residual", "norm_residual", "pointwise"])
def test_one_row_and_one_column(name: str) -> None:
    run_case(name, {"B": 1, "L": 1, "K": 1, "N": 1})


def test_shape_generic_source_is_shared_and_deterministic() -> None:
    """Groups of one structure share one source; generating twice gives the same bytes."""
    entry = compiled_case("gemm_gelu_residual")["entry"]
    first, digest = generated(entry["structure"])
    again, digest2 = generated(entry["structure"])
    assert first == again and digest == digest2 == entry["sha256"]
    assert entry["code"] == first
    assert "@triton.jit" in first and "def dgrad(" in first and "def wgrad(" in first


def test_sources_reference_no_plain_globals() -> None:
    """Triton 3.6 rejects non-constexpr globals in @triton.jit functions: generated kernels
    read only their arguments, ``tl`` and literals."""
    import ast

    for case in CASES:
        source, _ = generated(compiled_case(case.name)["entry"]["structure"])
        tree = ast.parse(source)
        module_names = {t.id for node in tree.body if isinstance(node, ast.Assign)
                        for t in node.targets if isinstance(t, ast.Name)}
        for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
            loads = {n.id for stmt in fn.body for n in ast.walk(stmt)
                     if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            assert not loads & module_names, (case.name, fn.name, loads & module_names)


@pytest.mark.parametrize("name", ["gemm_gelu_residual", "norm_residual", "norm_alone",
                                  "pointwise"])
def test_autocast_mixed_dtypes_follow_eager(name: str) -> None:
    """Under autocast a group sees bf16 activations next to fp32 parameters (the runner's
    graph mode): the GEMM runs in bf16 like F.linear, outputs take eager's promoted dtype,
    and every gradient comes back in its input's dtype."""
    case = BY_NAME[name]
    dims = {"B": 2, "L": 5, "K": 24, "N": 40}
    found = compiled_case(name)
    entry, placeholders = found["entry"], found["placeholders"]
    binding = {**entry["binding"],
               "shapes": [list(case.classes(dims)[q]) for q in entry["structure"]["classes"]]}
    run = make_runner(generated(entry["structure"])[0], binding)
    gen = torch.Generator().manual_seed(fresh_seed())
    # activations (rank > 1) in bf16, parameters (rank 1, and the GEMM weight) in fp32
    inputs = [torch.randn(s, generator=gen)
              .to(torch.bfloat16 if len(s) > 2 or i == 0 else torch.float32).requires_grad_()
              for i, s in enumerate(case.shapes(dims))]
    by_name = dict(zip(placeholders, inputs))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = case.fn(*inputs)
        got = run(*(by_name[n] for n in binding["inputs"]))
    eager = list(eager) if isinstance(eager, tuple) else [eager]
    # Dtypes as eager autocast gives them; values against fp32 on the same inputs, the
    # GEMM's operands rounded to bf16 as the GEMM reads them. (The kernels compute in fp32;
    # eager's bf16 chain rounds after every op and can land on the other side of a clamp,
    # where the derivative jumps.)
    op0 = entry["structure"]["ops"][0]
    gemm = {binding["inputs"][r[1]] for r in op0["args"] if r is not None} \
        if op0["op"] == "linear" else set()
    ref_inputs = [x.detach().to(torch.bfloat16 if n in gemm else x.dtype).float()
                  .requires_grad_() for n, x in zip(placeholders, inputs)]
    expected = case.fn(*ref_inputs)
    expected = list(expected) if isinstance(expected, tuple) else [expected]
    for g, e, ea in zip(got, expected, eager):
        assert g.dtype == ea.dtype, (g.dtype, ea.dtype)
        torch.testing.assert_close(g.float(), e, atol=8e-2, rtol=3e-2)
    grads = [torch.randn(e.shape, generator=gen).to(ea.dtype) for e, ea in zip(expected, eager)]
    ref = torch.autograd.grad(expected, ref_inputs, [g.float() for g in grads],
                              allow_unused=True)
    out = torch.autograd.grad(list(got), inputs, grads, allow_unused=True)
    for i, (o, r) in enumerate(zip(out, ref)):
        if r is None:
            continue
        assert o.dtype == inputs[i].dtype
        torch.testing.assert_close(o.float(), r, atol=1e-1, rtol=5e-2,
                                   msg=lambda m, i=i: f"grad of input {i}: {m}")


GEMM_CASES = [c.name for c in CASES if c.kind == "gemm_epilogue"]


@pytest.mark.parametrize("name", GEMM_CASES)
@pytest.mark.parametrize("dims", [{"B": 2, "L": 37, "K": 19, "N": 70},
                                  {"B": 1, "L": 1, "K": 1, "N": 1},
                                  {"B": 3, "L": 65, "K": 80, "N": 300}])
def test_library_gemm_path_matches_eager(name: str, dims: Dims,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The cuBLAS path (library GEMMs around the generated epilogue and dz kernels) computes
    what the fused path and eager compute, forward and backward; N=300 spans two column
    tiles of the epilogue pass."""
    monkeypatch.setenv(GEMM_PATH_ENV, "library")
    run_case(name, dims)


def test_library_gemm_path_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GEMM_PATH_ENV, "library")
    run_case("gemm_gelu_residual", {"B": 2, "L": 5, "K": 24, "N": 40}, torch.bfloat16)


def test_gemm_path_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GEMM_PATH_ENV, "cublas")
    with pytest.raises(ValueError, match="GEMC_GEMM_PATH='cublas'.*auto, fused, library"):
        run_case("gemm_two_outputs", {"B": 1, "L": 2, "K": 3, "N": 4})


def test_only_pure_residual_epilogues_pass_the_gradient_through() -> None:
    """The library backward skips its dz kernel exactly for ``z + r (+ r2 ...)``."""
    verdicts = {name: passes_gradient_through(compiled_case(name)["entry"]["structure"])
                for name in GEMM_CASES}
    assert verdicts == {"gemm_gelu_residual": False, "gemm_residual": True,
                        "gemm_silu_scaled": False, "gemm_row_scaled": False,
                        "gemm_two_outputs": False}


@pytest.mark.parametrize("name", ["pointwise", "norm_residual", "reduction_sum",
                                  "reduction_mean"])
def test_backward_walks_several_row_blocks_per_program(name: str) -> None:
    """The looping backward (column sums kept in registers across row blocks) at a size
    where each program walks more than one block."""
    dims = {"B": 3, "L": 90, "K": 5, "N": 20}
    bm = host._loop_rows(host._tile_n(dims["N"]))
    assert host._row_programs(dims["B"] * dims["L"], bm)[1] > 1
    run_case(name, dims)


@pytest.mark.parametrize("launch", [{"ROW_PROGRAMS": 0}, {"LOOP_STAGES": 2, "LOOP_TILE": 256},
                                    {"LOOP_TILE": 64, "ROW_PROGRAMS": 5}],
                         ids=["one_block_per_program", "pipelined", "small_tiles"])
@pytest.mark.parametrize("name", ["pointwise", "norm_residual", "reduction_sum",
                                  "gemm_gelu_residual"])
def test_backward_launch_settings(name: str, launch: dict[str, int],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The looping backward passes are right at every launch shape the GPU sweep
    (benchmarks/bwd_sweep.py) may pick: one row block per program (ITERS = 1, a partial
    column-sum row per block), a software-pipelined row loop, small tiles over many
    programs. The GEMM case runs the library path, whose dz kernel loops the same way."""
    for key, value in launch.items():
        monkeypatch.setattr(host, key, value)
    if name.startswith("gemm"):
        monkeypatch.setenv(GEMM_PATH_ENV, "library")
    run_case(name, {"B": 3, "L": 50, "K": 7, "N": 40})


def test_launch_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMC_LOOP_TILE", " 2048 ")
    assert host._env_int("GEMC_LOOP_TILE", 1024) == 2048
    monkeypatch.setenv("GEMC_LOOP_TILE", "")
    assert host._env_int("GEMC_LOOP_TILE", 1024) == 1024
    monkeypatch.setenv("GEMC_ROW_PROGRAMS", "many")
    with pytest.raises(ValueError, match="GEMC_ROW_PROGRAMS='many'"):
        host._env_int("GEMC_ROW_PROGRAMS", 3)
    monkeypatch.setattr(host, "ROW_PROGRAMS", 0)
    assert host._row_programs(1000, 16) == (63, 1)
    monkeypatch.setattr(host, "ROW_PROGRAMS", 10)
    assert host._row_programs(1000, 16) == (9, 7)  # 63 blocks: 7 each, 9 programs


def test_launch_shapes_scale_with_the_devices_sms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, the row programs and the wgrad's split are per SM of the device (what was
    tuned on the H200's 132 SMs), so an A100 (108) or a B200 (148) gets as many per SM."""
    monkeypatch.setattr(host, "ROW_PROGRAMS", None)
    monkeypatch.setattr(host, "INTERPRETED", False)
    for sms in (132, 108, 148):
        monkeypatch.setattr(host, "sm_count", lambda sms=sms: sms)
        assert host.row_programs() == 16 * sms
        assert host.loop_launch()["row_programs"] == 16 * sms
        blocks = 3 * 16 * sms  # three row blocks for each program
        assert host._row_programs(16 * blocks, 16) == (16 * sms, 3)
        # the split-M wgrad: two programs per SM over its 128 x 128 tiles
        assert host._Gemm._split(1 << 20, 256, 256) == cdiv(2 * sms, 4)
    monkeypatch.setattr(host, "ROW_PROGRAMS", 5)
    assert host.row_programs() == 5


def _bwd_source(name: str) -> str:
    source, _ = generated(compiled_case(name)["entry"]["structure"])
    return source[source.index("def bwd("):]


def test_residual_norm_backward_reads_the_stored_sum() -> None:
    """``h = x + r; y = LN(h) * m``: the backward reads the stored ``h`` (one whole tile)
    instead of ``x`` and ``r`` (two), and stores one gradient for both operands of the
    sum. Groups with nothing to gain keep recomputing."""
    structures = {c.name: compiled_case(c.name)["entry"]["structure"] for c in CASES}
    assert {n: reloaded_outputs(s) for n, s in structures.items() if reloaded_outputs(s)} == \
        {"norm_residual": [0]}
    assert {n: grad_aliases(s) for n, s in structures.items() if grad_aliases(s)} == \
        {"norm_residual": {1: 0}}
    bwd = _bwd_source("norm_residual")
    assert "tl.load(y0" in bwd
    assert "tl.load(s0" not in bwd and "tl.load(s1" not in bwd
    assert "tl.load(s0" in _bwd_source("pointwise")  # nothing stored to read back


def _norm_residual_grads(dx: torch.dtype, dr: torch.dtype) -> tuple[torch.Tensor, ...]:
    entry = compiled_case("norm_residual")["entry"]
    dims = {"B": 2, "L": 9, "K": 1, "N": 33}
    binding = {**entry["binding"], "shapes": [list(_blk(dims))] * len(entry["binding"]["shapes"])}
    run = make_runner(generated(entry["structure"])[0], binding)
    gen = torch.Generator().manual_seed(fresh_seed())
    shapes = BY_NAME["norm_residual"].shapes(dims)
    inputs = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
    inputs[0] = inputs[0].detach().to(dx).requires_grad_()
    inputs[1] = inputs[1].detach().to(dr).requires_grad_()
    by_name = dict(zip(compiled_case("norm_residual")["placeholders"], inputs))
    outs = run(*(by_name[n] for n in binding["inputs"]))
    seeds = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
    got = torch.autograd.grad(outs, inputs, seeds)
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    ref = torch.autograd.grad(_norm_residual(*ref_in), ref_in, [s.double() for s in seeds])
    for i, (g, e) in enumerate(zip(got, ref)):
        assert g.dtype == inputs[i].dtype
        tol = ({"atol": 1e-4, "rtol": 1e-4} if g.dtype == torch.float32
               else {"atol": 3e-2, "rtol": 2e-2})
        torch.testing.assert_close(g.double(), e, **tol, msg=lambda m, i=i: f"input {i}: {m}")
    return got


def test_aliased_gradient_is_one_tensor_for_both_operands() -> None:
    """Same shape and dtype: the one stored gradient is handed to ``x`` and ``r`` as the
    same tensor object (as eager's add does, so autograd never adds into it in place);
    different dtypes: each gets its own, in its own dtype."""
    gx, gr = _norm_residual_grads(torch.float32, torch.float32)[:2]
    assert gx is gr
    gx, gr = _norm_residual_grads(torch.float32, torch.bfloat16)[:2]
    assert gx is not gr and gr.dtype == torch.bfloat16


def test_aliased_gradient_accumulates_into_leaves_separately() -> None:
    """Two leaves fed by one aliased gradient, each used again elsewhere: their ``.grad``
    must not share storage (an in-place change of one must leave the other alone)."""
    entry = compiled_case("norm_residual")["entry"]
    dims = {"B": 1, "L": 4, "K": 1, "N": 8}
    binding = {**entry["binding"], "shapes": [list(_blk(dims))] * len(entry["binding"]["shapes"])}
    run = make_runner(generated(entry["structure"])[0], binding)
    inputs = [torch.randn(s).requires_grad_() for s in BY_NAME["norm_residual"].shapes(dims)]
    by_name = dict(zip(compiled_case("norm_residual")["placeholders"], inputs))
    h, y = run(*(by_name[n] for n in binding["inputs"]))
    (h.sum() + y.sum() + (inputs[0] * 2).sum() + (inputs[1] * 3).sum()).backward()
    ref_in = [t.detach().clone().requires_grad_() for t in inputs]
    rh, ry = _norm_residual(*ref_in)
    (rh.sum() + ry.sum() + (ref_in[0] * 2).sum() + (ref_in[1] * 3).sum()).backward()
    x, r = inputs[0], inputs[1]
    assert x.grad.data_ptr() != r.grad.data_ptr()
    torch.testing.assert_close(x.grad, ref_in[0].grad)
    torch.testing.assert_close(r.grad, ref_in[1].grad)
    x.grad.zero_()
    torch.testing.assert_close(r.grad, ref_in[1].grad)


def test_launch_memo_follows_strides_and_dtypes() -> None:
    """The host memoises launch arguments per input signature: the same runner called
    with contiguous inputs, then with strided views of wider tensors, then in another
    dtype, matches eager every time (a stale memo would address the views' elements with
    the contiguous strides)."""
    entry = compiled_case("pointwise")["entry"]
    dims = {"B": 2, "L": 5, "K": 1, "N": 12}
    shapes = BY_NAME["pointwise"].shapes(dims)
    binding = {**entry["binding"], "shapes": [list(_blk(dims))] * len(entry["binding"]["shapes"])}
    run = make_runner(generated(entry["structure"])[0], binding)
    order = [compiled_case("pointwise")["placeholders"].index(n) for n in binding["inputs"]]
    gen = torch.Generator().manual_seed(fresh_seed())

    def check(inputs: list[torch.Tensor]) -> None:
        got = run(*(inputs[i] for i in order))[0]
        assert got.dtype == inputs[0].dtype
        # against fp32 eager on the same inputs: the kernel computes in fp32 and rounds
        # once (bf16: at most one ulp, 2^-7 relative, as the interpreter's store truncates)
        want = _pointwise(*(t.float() for t in inputs))
        torch.testing.assert_close(got.float(), want, atol=1e-3, rtol=2.0 ** -7)

    check([torch.randn(s, generator=gen) for s in shapes])
    wide = [torch.randn((*s[:-1], 2 * s[-1] + 3), generator=gen) for s in shapes]
    views = [w[..., 3:3 + 2 * s[-1]:2] for w, s in zip(wide, shapes)]
    assert not views[0].is_contiguous()
    check(views)
    check([torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes])
    check([torch.randn(s, generator=gen) for s in shapes])
