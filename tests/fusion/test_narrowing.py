"""Outputs written in the autocast dtype where only GEMMs read them (graph mode).

Under autocast a GEMM casts its input to the autocast dtype, so a fused group whose output
only GEMMs read may write it in that dtype directly: eager's rounding, one pass over memory
fewer. CPU autocast leaves layer_norm in its input's dtype (CUDA runs it in fp32), so the
model here feeds its LayerNorms fp32 activations: their natural output is fp32, and the one
whose only reader is a GEMM's input must come out bf16.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from gemc.backends.triton.codegen import generated
from gemc.backends.triton.codegen.host import make_runner
from gemc.backends.triton.graph_runner import GraphRunner

from gemc import ir
from tests.fusion.helpers import compiled, eager_step, entries_of, fresh_seed, params_of
from tests.fusion.test_codegen import compiled_case

PRENORM = "tests/fusion/models.py:build_prenorm"
BF16 = {"atol": 2e-2, "rtol": 2e-2}


def test_runner_writes_requested_dtype_and_returns_input_dtype_grads() -> None:
    """A lone LayerNorm asked for bf16 output from fp32 inputs: eager's ``layer_norm(x)``
    rounded to bf16, and the fp32 inputs' gradients from a bf16 output gradient."""
    found = compiled_case("norm_alone")
    entry, placeholders = found["entry"], found["placeholders"]
    shape = (3, 7, 40)
    binding = {**entry["binding"], "shapes": [list(shape)]}
    run = make_runner(generated(entry["structure"])[0], binding)
    gen = torch.Generator().manual_seed(fresh_seed())
    x = torch.randn(shape, generator=gen, requires_grad=True)
    w = torch.randn(shape[-1], generator=gen, requires_grad=True)
    b = torch.randn(shape[-1], generator=gen, requires_grad=True)
    by_name = dict(zip(placeholders, (x, w, b)))
    (got,) = run(*(by_name[n] for n in binding["inputs"]), out_dtypes=[torch.bfloat16])
    (plain,) = run(*(by_name[n] for n in binding["inputs"]))
    expected = F.layer_norm(x, (shape[-1],), w, b, 1e-5)
    assert got.dtype == torch.bfloat16 and plain.dtype == torch.float32
    torch.testing.assert_close(got, expected.to(torch.bfloat16), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(plain, expected, atol=1e-5, rtol=1e-5)
    g = torch.randn(shape, generator=gen).to(torch.bfloat16)
    ref = torch.autograd.grad(expected.to(torch.bfloat16), (x, w, b), g)
    out = torch.autograd.grad(got, (x, w, b), g)
    for name, o, r in zip("xwb", out, ref):
        assert o.dtype == torch.float32, name
        torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def _record(runner: GraphRunner) -> tuple[dict[str, torch.dtype], dict[str, torch.dtype]]:
    """Dtypes of every fused unit's outputs, and of what every GEMM unit received as x."""
    outs: dict[str, torch.dtype] = {}
    gemm_x: dict[str, torch.dtype] = {}
    for unit in runner.units:
        if "run" not in unit:
            continue
        entry = unit["entry"]

        def run(*inputs: torch.Tensor, _run: Any = unit["run"], _entry: Any = entry,
                **kw: Any) -> tuple[torch.Tensor, ...]:
            if _entry["kind"] == "gemm_epilogue":
                ix = _entry["structure"]["ops"][0]["args"][0][1]
                gemm_x[_entry["binding"]["inputs"][ix]] = inputs[ix].dtype
            result = _run(*inputs, **kw)
            outs.update({n: t.dtype for n, t in zip(_entry["binding"]["outputs"], result)})
            return result

        unit["run"] = run
    return outs, gemm_x


def _layer_norm(gm: torch.fx.GraphModule, region: str) -> str:
    return next(n.name for n in gm.graph.nodes if n.target is torch.ops.aten.layer_norm.default
                and n.meta.get(ir.REGION) == region)


def test_norm_feeding_only_a_gemm_writes_the_autocast_dtype() -> None:
    gm, ctx, spec = compiled(PRENORM)
    entries = entries_of(gm, ctx)
    norm, norm0 = _layer_norm(gm, "norm"), _layer_norm(gm, "norm0")
    groups = {n: e for e in entries for n in e["nodes"]}
    assert groups[norm]["nodes"] == [norm] and groups[norm]["kind"] == "norm"  # alone
    assert groups[norm0]["nodes"] == [norm0] and groups[norm0]["kind"] == "norm"
    head = next(n for n in gm.graph.nodes if n.meta.get(ir.REGION) == "head"
                and n.target is torch.ops.aten.linear.default)
    y = head.args[0].name  # the last GEMM group's output, read only by the plain head linear
    # mix's output, norm's input
    h = next(n for n in gm.graph.nodes if n.name == norm).args[0].name

    model = spec.model
    batch = spec.make_batch(fresh_seed(), "cpu")
    ref, expected = eager_step(model, batch, torch.bfloat16)

    runner = GraphRunner(gm, entries, params_of(model))
    outs, gemm_x = _record(runner)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = runner(*batch)
    # narrowed: read only as a GEMM's x (a fused group's, a plain linear's)
    assert outs[norm] == gemm_x[norm] == torch.bfloat16
    assert outs[y] == torch.bfloat16
    # kept: norm0's output is also the fc2 GEMM's residual operand, h is norm's input
    assert outs[norm0] == gemm_x[norm0] == torch.float32
    assert outs[h] == torch.float32
    # Triton's interpreter stores fp32 into bf16 by truncation (a GPU rounds to nearest
    # even, as eager's cast does): here a narrowed value may sit one bf16 ulp off eager's
    torch.testing.assert_close(loss, ref, **BF16)
    loss.backward()
    for k, p in model.named_parameters():
        assert p.grad.dtype == p.dtype, k
        torch.testing.assert_close(p.grad, expected[k], atol=5e-2, rtol=5e-2, msg=k)

    # no autocast: eager's dtypes everywhere
    model.zero_grad()
    outs.clear()
    runner(*batch)
    assert set(outs.values()) == {torch.float32}


def test_narrowing_can_be_turned_off() -> None:
    gm, ctx, spec = compiled(PRENORM)
    runner = GraphRunner(gm, entries_of(gm, ctx), params_of(spec.model), narrow=False)
    outs, _ = _record(runner)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        runner(*spec.make_batch(0, "cpu"))
    assert outs[_layer_norm(gm, "norm")] == torch.float32
