"""gemc's kernels as custom ops, and the rewritten graph through torch.compile (Inductor).

The ops' fake implementations and autograd registrations are checked with
``torch.library.opcheck`` on real plan entries (the GEM example's tiny preset), and their
values against the kernels' own autograd functions; then the whole rewritten graph,
compiled by Inductor, against eager: loss, every dense gradient and the tables the fused
optimizer updated in the backward.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch
from gemc.backends.triton import ops as gemc_ops
from gemc.backends.triton.codegen import generated
from gemc.backends.triton.codegen.host import make_runner
from gemc.backends.triton.embedding_bag_reference import rowwise_adagrad_step_, touched_rows
from gemc.backends.triton.graph_runner import GraphRunner
from gemc.backends.triton.inductor_graph import (
    CHOICE_ENV,
    build,
    default_choice,
    measure_groups,
    runner_for,
)
from gemc.backends.triton.jagged import jagged_to_padded, padded_to_jagged
from gemc.backends.triton.jagged_attention import jagged_attention

from tests.fusion.helpers import compiled, eager_step, entries_of, params_of

# The built-graph tests check a host path (a graph built from GEM's CPU batch, the group
# measurement through Inductor's CPU code): GEM's batch draws from a CPU generator inside the
# model's own code, which the GPU run's device context cannot move (the first GPU run,
# thirtieth session, failed so, not in a kernel). They run on the CPU run only, skipped with
# this reason on the GPU run.
_HOST_PATH_ONLY = pytest.mark.skipif(
    os.environ.get("GEMC_TEST_DEVICE", "cpu") != "cpu",
    reason="a host path test (GEM's CPU batch, Inductor's CPU code): the CPU run checks it")

GEM = "examples/gem/model.py:build"
ARGS = {"preset": "tiny", "batch_size": 4}
STATIC = ("test_schema", "test_autograd_registration", "test_faketensor",
          "test_aot_dispatch_static")


@functools.cache
def _gem() -> tuple[Any, list[dict[str, Any]], Any]:
    gm, ctx, spec = compiled(GEM, ARGS)
    return gm, entries_of(gm, ctx), spec


def _inputs(gm: Any, entry: dict[str, Any], seed: int) -> list[torch.Tensor]:
    """Random inputs at a group's captured input shapes (floats require grad)."""
    g = torch.Generator().manual_seed(seed)
    nodes = {n.name: n for n in gm.graph.nodes}
    out = []
    for name in entry["binding"]["inputs"]:
        val = nodes[name].meta["val"]
        if val.dtype.is_floating_point:
            out.append(torch.randn(val.shape, generator=g, dtype=val.dtype).requires_grad_())
        else:
            out.append(torch.randint(0, 2, val.shape, generator=g).to(val.dtype))
    return out


@pytest.mark.parametrize("kind", ["gemm_epilogue", "norm"])
def test_fused_group_op_matches_its_autograd_function_and_passes_opcheck(kind):
    gm, entries, _ = _gem()
    entry = next(e for e in entries if e["kind"] == kind)
    code = entry.get("code") or generated(entry["structure"])[0]
    run = make_runner(code, entry["binding"])
    key = gemc_ops.register_group(entry, run.impl)
    inputs = _inputs(gm, entry, 0)
    torch.library.opcheck(torch.ops.gemc.fused_group.default, (key, inputs, ""),
                          test_utils=STATIC)
    expected = run(*inputs)
    n_out = len(entry["binding"]["outputs"])
    got = torch.ops.gemc.fused_group(key, inputs, "")[:n_out]
    for e, o in zip(expected, got):
        torch.testing.assert_close(o, e)
    weights = [torch.randn_like(e) for e in expected]
    floats = [t for t in inputs if t.requires_grad]
    ref = torch.autograd.grad(expected, floats, weights)
    grads = torch.autograd.grad(got, floats, weights)
    for r, g in zip(ref, grads):
        torch.testing.assert_close(g, r)


def test_a_groups_backward_with_an_unused_output_keeps_no_tensor():
    """A group of two outputs whose first has no gradient: the gradients are the autograd
    function's, and the launcher keeps no tensor of the call (under CUDA graphs one kept from a graph's first run outlives the run in the
    graph's memory pool, which the CUDA-graph trees refuse)."""
    gm, entries, _ = _gem()
    entry = next(e for e in entries if len(e.get("binding", {}).get("outputs", [])) >= 2)
    code = entry.get("code") or generated(entry["structure"])[0]
    run = make_runner(code, entry["binding"])
    key = gemc_ops.register_group(entry, run.impl)
    inputs = _inputs(gm, entry, 0)
    floats = [t for t in inputs if t.requires_grad]
    expected = run(*inputs)
    got = torch.ops.gemc.fused_group(key, inputs, "")[:len(expected)]
    weight = torch.randn_like(expected[-1])
    ref = torch.autograd.grad(expected[-1], floats, weight, allow_unused=True)
    grads = torch.autograd.grad(got[-1], floats, weight, allow_unused=True)
    for r, g in zip(ref, grads):
        if r is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, r)
    kept = [name for name, value in vars(run.impl).items()
            if isinstance(value, torch.Tensor) or isinstance(value, dict) and any(
                isinstance(x, torch.Tensor) for x in value.values())]
    assert not kept, kept


def test_jagged_attention_op_matches_the_kernel_and_passes_opcheck():
    b, h, length, d = 3, 2, 8, 16
    g = torch.Generator().manual_seed(1)
    offsets = torch.tensor([0, 5, 5, 12])  # row 1 empty, row 2 longer than L: clamped
    q, k, v = (torch.randn(b, h, length, d, generator=g).requires_grad_() for _ in range(3))
    args = (q, k, v, offsets, 1, length, d ** -0.5)
    torch.library.opcheck(torch.ops.gemc.jagged_attention.default, args, test_utils=STATIC)
    out, _ = torch.ops.gemc.jagged_attention(*args)
    # the reference: the kernel over the values + offsets, as the interpreter runs it
    lengths = (offsets[1:] - offsets[:-1]).clamp(min=1, max=length)
    attn = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    total = int(attn[-1])
    qj, kj, vj = (padded_to_jagged(x.transpose(1, 2), attn, total) for x in (q, k, v))
    ref = jagged_to_padded(jagged_attention(qj, kj, vj, attn, length, scale=d ** -0.5), attn,
                           length)
    torch.testing.assert_close(out, ref)
    w = torch.randn_like(ref)
    torch.testing.assert_close(torch.autograd.grad(out, (q, k, v), w),
                               torch.autograd.grad(ref, (q, k, v), w))


def _silu_padded_reference(q, k, v, lengths, bias, norm, causal):
    """HSTU's attention as a model writes it on ``[B, L, H, D]``: every score, then masked."""
    length = q.shape[1]
    s = torch.einsum("bnhd,bmhd->bhnm", q, k) + bias
    pos = torch.arange(length)
    keep = (pos[None, :] < lengths[:, None])
    visible = keep[:, None, :, None] & keep[:, None, None, :]
    if causal:
        visible = visible & (pos[:, None] >= pos[None, :])
    return torch.einsum("bhnm,bmhd->bnhd", torch.nn.functional.silu(s) / norm * visible, v)


@pytest.mark.parametrize("causal", [True, False])
def test_padded_silu_attention_op_equals_the_padded_formula_with_its_bias_gradient(causal):
    b, h, length, d = 4, 2, 8, 16
    g = torch.Generator().manual_seed(3)
    offsets = torch.tensor([0, 5, 5, 13, 20])  # an empty row, a full one, one past L (clamped)
    lengths = (offsets[1:] - offsets[:-1]).clamp(max=length)
    q, k, v = (torch.randn(b, length, h, d, generator=g).requires_grad_() for _ in range(3))
    bias = (0.1 * torch.randn(b, 1, length, length, generator=g)).requires_grad_()
    args = (q, k, v, offsets, bias, length + 2, 0.5, causal)
    torch.library.opcheck(torch.ops.gemc.padded_silu_attention.default, args,
                          test_utils=STATIC)
    out = torch.ops.gemc.padded_silu_attention(*args)
    ref = _silu_padded_reference(0.5 * q, k, v, lengths, bias, length + 2, causal)
    keep = (torch.arange(length)[None, :] < lengths[:, None])[:, :, None, None]
    torch.testing.assert_close(out, ref * keep)  # padding query rows: zero
    w = torch.randn_like(ref) * keep  # nothing reads a padding query row
    got = torch.autograd.grad(out, (q, k, v, bias), w)
    want = torch.autograd.grad(ref, (q, k, v, bias), w)
    for gg, ww in zip(got, want):
        torch.testing.assert_close(gg, ww)


@pytest.mark.parametrize("causal", [True, False])
def test_silu_attention_on_packed_values_equals_the_padded_op(causal):
    """The packed region's op: the ``[T, H, D]`` values of the same rows (an empty row, a
    full one, two spare slots past ``offsets[-1]``) give the padded op's real rows, forward
    and backward (the bias's gradient too); spare slots come out zero, their gradient
    zero."""
    b, h, length, d = 4, 2, 8, 16
    g = torch.Generator().manual_seed(5)
    offsets = torch.tensor([0, 5, 5, 13, 16])
    total = int(offsets[-1]) + 2  # spare slots, as a region's bounded layout has
    q, k, v = (torch.randn(total, h, d, generator=g).requires_grad_() for _ in range(3))
    bias = (0.1 * torch.randn(b, 1, length, length, generator=g)).requires_grad_()
    args = (q, k, v, offsets, bias, length + 2, 0.5, causal)
    torch.library.opcheck(torch.ops.gemc.jagged_silu_attention_values.default, args,
                          test_utils=STATIC)
    out = torch.ops.gemc.jagged_silu_attention_values(*args)
    real = int(offsets[-1])
    padded = [jagged_to_padded(x[:real], offsets, length).detach().requires_grad_()
              for x in (q, k, v)]
    ref_padded = torch.ops.gemc.padded_silu_attention(*padded, offsets, bias, length + 2,
                                                      0.5, causal)
    ref = padded_to_jagged(ref_padded, offsets, real)
    torch.testing.assert_close(out[:real], ref)
    assert not out[real:].any()
    w = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, bias), w)
    want = torch.autograd.grad(ref_padded, (*padded, bias),
                               jagged_to_padded(w[:real], offsets, length))
    for gg, ww in zip(got[:3], want[:3]):
        torch.testing.assert_close(gg[:real], padded_to_jagged(ww, offsets, real))
        assert not gg[real:].any()
    torch.testing.assert_close(got[3], want[3])


def test_padded_silu_attention_traces_into_one_graph_without_a_host_read():
    """The point of the op: Dynamo sees one node, so the graph has no break."""
    b, h, length, d = 2, 2, 8, 16
    q, k, v = (torch.randn(b, length, h, d).requires_grad_() for _ in range(3))
    offsets = torch.tensor([0, 3, 9])
    counts: list[int] = []

    def backend(gm, _inputs):
        op = torch.ops.gemc.padded_silu_attention
        counts.append(sum(n.target in (op, op.default) for n in gm.graph.nodes))
        return gm

    def f(q, k, v, offsets):
        return torch.ops.gemc.padded_silu_attention(q, k, v, offsets, None, length, 1.0,
                                                    True).sum()

    torch._dynamo.reset()
    torch.compile(f, backend=backend, fullgraph=True)(q, k, v, offsets).backward()
    assert counts == [1]


def test_choice_defaults_to_inductor_unless_a_win_was_measured(monkeypatch):
    group = {"name": "norm_1", "kind": "norm"}
    monkeypatch.delenv(CHOICE_ENV, raising=False)
    assert default_choice(group) == "inductor"
    assert default_choice(group, {"norm_1": {"choice": "gemc", "gemc_ms": 1.0,
                                             "inductor_ms": 2.0}}) == "gemc"
    assert default_choice({"name": "a", "kind": "jagged_attention"}) == "gemc"
    assert default_choice({"name": "e", "kind": "batched_embedding_bag"}) == "gemc"
    monkeypatch.setenv(CHOICE_ENV, "gemc")
    assert default_choice(group) == "gemc"


@_HOST_PATH_ONLY
@pytest.mark.parametrize("packed", [True, False])
def test_built_graph_calls_the_ops_it_chose_and_equals_the_interpreter(monkeypatch, packed):
    """Without compiling: the emitted graph is the plan's graph (same loss as the
    interpreter, with the packed token region or without it: then the attentions take
    padded values), with one fused-group call per group measured as a gemc win, and the
    other groups' ATen nodes in place."""
    monkeypatch.delenv(CHOICE_ENV, raising=False)
    gm, entries, spec = _gem()
    entries = [e for e in entries if e["kind"] != "batched_embedding_bag"]
    groups = [e for e in entries if "structure" in e]
    measured = {groups[0]["name"]: {"choice": "gemc"}, groups[1]["name"]: {"choice": "gemc"}}
    batch = spec.make_batch(5, "cpu")
    runner, left = runner_for(gm, entries, params_of(spec.model), packed=packed)
    region = [e["name"] for e in entries if e["kind"] == "packed_tokens"]
    assert left == ([] if packed else region)
    built = build(runner, measured=measured)
    assert {n for n, c in built.choices.items() if c == "gemc"} == {
        *measured, *(e["name"] for e in entries if e["kind"] in (
            "jagged_attention", "key_padding_attention", "transposed_linear"))}
    code = built.module.code
    assert code.count("_call_group(") == 2
    if packed:  # both attentions read the region's values in place; tokens enter by gathers
        assert code.count("_p_attention(") == 2
        assert "_p_source(" in code and "_p_gather(" in code
    else:
        assert code.count("_call_attention(") == 2 and "_p_" not in code
    expected = GraphRunner(gm, [e for e in entries if packed or e["name"] not in region],
                           params_of(spec.model))
    with torch.no_grad():
        torch.testing.assert_close(built.module(*batch), expected(*batch))


@pytest.mark.skipif(not os.environ.get("GEMC_SLOW_TESTS"),
                    reason="set GEMC_SLOW_TESTS=1 (Inductor's C++ compile of GEM's whole "
                    "training graph: ~60 s on a 2-core machine)")
def test_gem_tiny_compiled_by_inductor_around_gemc_ops_matches_eager(monkeypatch):
    """The GEM example's rewritten graph through torch.compile, with every group as a gemc
    op (the path a measured win takes) and the batched embedding's fused optimizer: loss,
    dense gradients and the updated tables equal eager's."""
    monkeypatch.setenv(CHOICE_ENV, "gemc")
    gm, entries, spec = _gem()
    model = spec.model
    batch = spec.make_batch(7, "cpu")
    ref, grads = eager_step(model, batch)
    runner, _ = runner_for(gm, entries, params_of(model))
    built = build(runner)
    assert "embedding_bag" in built.module.code and "_p_source(" in built.module.code
    fn = torch.compile(built.module, dynamic=False)
    loss = fn(*batch)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    loss.backward()
    emb = next(e for e in entries if e["kind"] == "batched_embedding_bag")
    tables = {t["fqn"]: t for t in emb["tables"]}
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"
             and "gemc.param" not in n.meta]
    inputs = dict(zip(names, batch))
    opt = emb["optimizer"]
    for k, p in model.named_parameters():
        if k not in tables:
            torch.testing.assert_close(p.grad, grads[k], atol=2e-5, rtol=1e-4, msg=k)
            continue
        ids = inputs[tables[k]["ids"]]
        weight = p.detach().clone()
        rows = touched_rows(ids, torch.tensor([0, ids.numel()]), 1)[0]
        rowwise_adagrad_step_(weight, grads[k], torch.zeros(weight.shape[0]), rows, opt["lr"],
                              opt["eps"], opt["weight_decay"])
        torch.testing.assert_close(runner.table_weights(k), weight, atol=1e-6, rtol=1e-5,
                                   msg=k)


@_HOST_PATH_ONLY
def test_measured_choices_reach_the_built_graph(monkeypatch):
    """The measurement runs each group both ways (forward and backward, here through the
    interpreter and Inductor's CPU code), keeps the faster, and the graph built from the
    record calls gemc's op exactly where gemc won. The timer is scripted: CPU times of
    interpreted Triton say nothing about a GPU."""
    monkeypatch.delenv(CHOICE_ENV, raising=False)
    gm, entries, spec = _gem()
    entries = [e for e in entries if e["kind"] != "batched_embedding_bag"]
    runner, _ = runner_for(gm, entries, params_of(spec.model))
    names = [e["name"] for e in entries if e["kind"] in ("gemm_epilogue", "norm")][:2]
    script = {names[0]: [1.0, 2.0], names[1]: [2.0, 2.0]}  # gemc wins; a tie: Inductor
    calls: list[str] = []

    def timer(fn, device, repeats):
        fn()  # both paths really run, forward and backward
        name = names[min(len(calls) // 2, 1)]
        calls.append(name)
        return script[name][(len(calls) - 1) % 2]

    measured = measure_groups(runner, names=names, timer=timer)
    assert calls == [names[0], names[0], names[1], names[1]]
    assert measured[names[0]] == {"kind": measured[names[0]]["kind"], "gemc_ms": 1.0,
                                  "inductor_ms": 2.0, "choice": "gemc"}
    assert measured[names[1]]["choice"] == "inductor"
    built = build(runner, measured=measured)
    assert built.choices[names[0]] == "gemc" and built.choices[names[1]] == "inductor"
    assert built.module.code.count("_call_group(") == 1


def test_packed_region_ops_pass_opcheck_and_add_gradients_up_in_fp32():
    """The gather into a region's tokens and the sum over a row's tokens: fakes and
    autograd checked, values against index_select / a per-row sum, and the gathered
    operand's gradient is each row's token gradients added up."""
    g = torch.Generator().manual_seed(2)
    offsets = torch.tensor([0, 3, 3, 7])  # attention offsets; slots 7, 8 are spare
    row = torch.tensor([0, 0, 0, 2, 2, 2, 2, 0, 0])  # a spare slot reads row 0
    row_out = torch.tensor([0, 0, 0, 2, 2, 2, 2, 3, 3])  # and scatters to row B (dropped)
    src = torch.randn(3, 4, generator=g, requires_grad=True)
    for args in ((src, row, offsets), (src, row, None)):
        torch.library.opcheck(torch.ops.gemc.gather_tokens.default, args, test_utils=STATIC)
    picked = torch.ops.gemc.gather_tokens(src, row, offsets)
    torch.testing.assert_close(picked, src.index_select(0, row))
    w = torch.randn(9, 4, generator=g)
    (grad,) = torch.autograd.grad(picked, src, w)
    torch.testing.assert_close(grad, torch.stack([w[:3].sum(0), torch.zeros(4),
                                                  w[3:7].sum(0)]))
    tokens = torch.randn(9, 4, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.gemc.segment_sum.default, (tokens, offsets, row_out),
                          test_utils=STATIC)
    sums = torch.ops.gemc.segment_sum(tokens, offsets, row_out)
    torch.testing.assert_close(sums, torch.stack([tokens[:3].sum(0), torch.zeros(4),
                                                  tokens[3:7].sum(0)]))
    (gt,) = torch.autograd.grad(sums, tokens, torch.ones(3, 4))
    torch.testing.assert_close(gt, torch.cat([torch.ones(7, 4), torch.zeros(2, 4)]))


@pytest.mark.parametrize("causal", [False, True])
def test_values_attention_op_passes_opcheck_and_is_sdpa_within_each_sequence(causal):
    """``gemc::jagged_attention_values`` (a packed region's attention, causal for a guarded
    causal self-attention): per sequence of the ``[T, H, D]`` values, SDPA forward and
    backward; the spare slots past ``offsets[-1]`` get no gradient."""
    g = torch.Generator().manual_seed(4)
    offsets = torch.tensor([0, 3, 3, 7])  # slots 7, 8 are spare
    q, k, v = (torch.randn(9, 2, 4, generator=g, requires_grad=True) for _ in range(3))
    torch.library.opcheck(torch.ops.gemc.jagged_attention_values.default,
                          (q, k, v, offsets, 4, 0.5, causal), test_utils=STATIC)
    out, _ = torch.ops.gemc.jagged_attention_values(q, k, v, offsets, 4, 0.5, causal)
    w = torch.randn(9, 2, 4, generator=g)
    grads = torch.autograd.grad((out[:7] * w[:7]).sum(), (q, k, v))
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(x[a:b].transpose(0, 1) for x in (qr, kr, vr)), scale=0.5, is_causal=causal
    ).transpose(0, 1) for a, b in ((0, 3), (3, 7))])
    torch.testing.assert_close(out[:7], ref, atol=1e-5, rtol=1e-5)
    expected = torch.autograd.grad((ref * w[:7]).sum(), (qr, kr, vr))
    for got, want in zip(grads, expected):  # want: zero on the spare slots, never read
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        assert not want[7:].any()


def _attention_op_case(name: str, g: torch.Generator) -> tuple[tuple, tuple]:
    """An attention op's differentiable inputs ``(q, k, v)`` and the rest of its
    arguments: its lengths (or offsets) first, then its constants (each op's backward takes
    ``(q, k, v, lengths, out, lse, grad, *constants)``)."""
    def qkv(*shapes):
        return tuple(torch.randn(*s, generator=g, requires_grad=True) for s in shapes)

    if name == "jagged_attention_values":  # packed [T, H, D] values, offsets, max_len
        return qkv(*[(12, 2, 4)] * 3), (torch.tensor([0, 5, 12]), 7, 0.5, False)
    if name == "jagged_attention":  # padded [B, H, L, D], offsets clamped to 1..L
        return qkv(*[(2, 2, 6, 4)] * 3), (torch.tensor([0, 4, 10]), 1, 6, 0.5)
    if name == "jagged_query_attention":  # padded queries over 3 dense keys
        return qkv((2, 2, 6, 4), (2, 2, 3, 4), (2, 2, 3, 4)), (torch.tensor([4, 6]), 0.5)
    # key_lengths_attention: 3 dense queries over padded keys
    return qkv((2, 2, 3, 4), (2, 2, 6, 4), (2, 2, 6, 4)), (torch.tensor([4, 6]), 0.5)


@pytest.mark.parametrize("name", ["jagged_attention_values", "jagged_attention",
                                  "jagged_query_attention", "key_lengths_attention"])
def test_attention_backward_zero_fills_no_logsumexp_gradient(name):
    """An attention op's logsumexp is for its backward alone: it takes no gradient, and
    eager autograd passes the backward ``None`` for it instead of a zero-filled tensor (an
    ``aten.zeros`` launch a backward on the GPU); the gradients are the backward op's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(6)
    (q, k, v), (lengths, *constants) = _attention_op_case(name, g)
    out, lse = getattr(torch.ops.gemc, name)(q, k, v, lengths, *constants)
    assert out.requires_grad and not lse.requires_grad
    w = torch.randn(out.shape, generator=g)
    with Ops() as seen:
        grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    assert not [n for n in seen.names if n.startswith(("zeros", "fill", "zero_"))], seen.names
    want = getattr(torch.ops.gemc, f"{name}_backward")(
        q.detach(), k.detach(), v.detach(), lengths, out.detach(), lse, w, *constants)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("name", ["jagged_attention_values", "jagged_attention",
                                  "jagged_query_attention", "key_lengths_attention"])
def test_attention_backward_without_an_output_gradient_gives_none(name):
    """Gradients not materialised, an attention op's backward may get no gradient for its
    output either (a function downstream that gives none for it, as this one does for its
    first input): it gives ``q, k, v`` none, where it would launch its kernels on ``None``."""
    class SecondOnly(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):  # type: ignore[override]
            ctx.set_materialize_grads(False)
            return a.clone(), b.clone()

        @staticmethod
        def backward(ctx, ga, gb):  # type: ignore[override]
            return None, gb

    g = torch.Generator().manual_seed(7)
    (q, k, v), (lengths, *constants) = _attention_op_case(name, g)
    out, _ = getattr(torch.ops.gemc, name)(q, k, v, lengths, *constants)
    other = torch.randn(3, generator=g, requires_grad=True)
    _, y = SecondOnly.apply(out, other)
    grads = torch.autograd.grad(y.sum(), (q, k, v, other), allow_unused=True)
    assert grads[:3] == (None, None, None)
    torch.testing.assert_close(grads[3], torch.ones(3))


def test_key_bias_values_attention_op_passes_opcheck_and_is_sdpa_with_that_bias():
    """``gemc::jagged_attention_values`` with a ``key_bias`` (a region with padding
    representatives' attention): per sequence of the ``[T, H, D]`` values, SDPA with the per-key bias by
    position (``-inf`` a key no query sees), forward and backward."""
    g = torch.Generator().manual_seed(5)
    offsets = torch.tensor([0, 3, 3, 7])  # slots 7, 8 are spare
    q, k, v = (torch.randn(9, 2, 4, generator=g, requires_grad=True) for _ in range(3))
    bias = torch.randn(3, 4, generator=g)
    bias[0, 1] = bias[2, 3] = float("-inf")
    torch.library.opcheck(torch.ops.gemc.jagged_attention_values.default,
                          (q, k, v, offsets, 4, 0.5, False, bias), test_utils=STATIC)
    out, _ = torch.ops.gemc.jagged_attention_values(q, k, v, offsets, 4, 0.5, False, bias)
    w = torch.randn(9, 2, 4, generator=g)
    grads = torch.autograd.grad((out[:7] * w[:7]).sum(), (q, k, v))
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(x[a:e].transpose(0, 1) for x in (qr, kr, vr)), scale=0.5,
        attn_mask=bias[row, :e - a][None, None, :]).transpose(0, 1)
        for row, (a, e) in ((0, (0, 3)), (2, (3, 7)))])
    torch.testing.assert_close(out[:7], ref, atol=1e-5, rtol=1e-5)
    expected = torch.autograd.grad((ref * w[:7]).sum(), (qr, kr, vr))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("op", ["softmax", "silu"])
def test_values_backward_reads_a_head_major_gradient_in_place(op):
    """A packed region's attention output leaves as a ``[1, H, T, D]`` view of its ``[T, H,
    D]`` rows, so its gradient arrives head-major: the backward op reads it with its
    strides (no copy of it, which cost 0.053 ms of TransAct's region attention on an
    H100) and gives the gradients of the same gradient made contiguous."""
    g = torch.Generator().manual_seed(8)
    offsets = torch.tensor([0, 3, 3, 7])
    q, k, v = (torch.randn(9, 2, 16, generator=g) for _ in range(3))
    head_major = torch.randn(1, 2, 9, 16, generator=g)[0].transpose(0, 1)  # [T, H, D] view
    assert not head_major.is_contiguous() and head_major.stride(-1) == 1
    if op == "softmax":
        out, lse = torch.ops.gemc.jagged_attention_values(q, k, v, offsets, 4, 0.5, False)
        backward = torch.ops.gemc.jagged_attention_values_backward
        args = lambda grad: (q, k, v, offsets, out, lse, grad, 4, 0.5, False)  # noqa: E731
    else:
        bias = 0.1 * torch.randn(3, 1, 4, 4, generator=g)
        backward = torch.ops.gemc.jagged_silu_attention_values_backward
        args = lambda grad: (q, k, v, offsets, bias, grad, 4, 0.5, True, False)  # noqa: E731
    want = backward(*args(head_major.contiguous()))
    with torch.profiler.profile(record_shapes=True) as prof:
        got = backward(*args(head_major))
    copied = [e.input_shapes for e in prof.events() if e.name in ("aten::clone", "aten::contiguous")
              and e.input_shapes and list(e.input_shapes[0]) == list(head_major.shape)]
    assert not copied, f"the gradient was copied: {copied}"
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_key_bias_values_attention_across_blocks_with_large_and_masked_entries():
    """The per-key bias as one ``[BLOCK_N]`` load (``_bias_tile``'s ``KEY_BIAS``): rows
    longer than a block (full and ragged blocks, a partial query block whose rows past the
    end read the bias too), entries of +40 and ``-inf``: SDPA with that bias per
    sequence, forward and backward, and nothing non-finite anywhere."""
    g = torch.Generator().manual_seed(6)
    lengths = [37, 0, 70, 5]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    total, L = int(offsets[-1]) + 3, max(lengths)
    q, k, v = (torch.randn(total, 2, 8, generator=g, requires_grad=True) for _ in range(3))
    bias = 3 * torch.randn(len(lengths), L, generator=g)
    bias[0, 5] = bias[2, 40] = 40.0
    bias[0, ::3] = bias[2, 1::4] = float("-inf")
    out, _ = torch.ops.gemc.jagged_attention_values(q, k, v, offsets, L, 0.3, False, bias)
    w = torch.randn(total, 2, 8, generator=g)
    n = int(offsets[-1])
    grads = torch.autograd.grad((out[:n] * w[:n]).sum(), (q, k, v))
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(x[a:e].transpose(0, 1) for x in (qr, kr, vr)), scale=0.3,
        attn_mask=bias[row, :e - a][None, None, :]).transpose(0, 1)
        for row, (a, e) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist()))
        if e > a])
    torch.testing.assert_close(out[:n], ref, atol=1e-5, rtol=1e-5)
    expected = torch.autograd.grad((ref * w[:n]).sum(), (qr, kr, vr))
    for got, want in zip(grads, expected):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_embedding_bag_op_looks_up_and_its_backward_is_the_fused_optimizer_step():
    """``gemc::embedding_bag`` answers as the module does (fake and schema checked), and
    its backward, ``gemc::embedding_bag_update``, moves the weights exactly as the module's
    own fused backward does on the same gradient."""
    from gemc.backends.triton.embedding_bag import BatchedEmbeddingBag

    def module() -> BatchedEmbeddingBag:
        torch.manual_seed(3)
        m = BatchedEmbeddingBag([(10, 4), (6, 4)], pooling="sum", optimizer="rowwise_adagrad",
                                lr=0.1, eps=1e-8, weight_decay=0.0)
        m.reset_parameters()
        return m

    ops_module, twin = module(), module()
    gemc_ops.register_table("test_bags", ops_module)
    ids = torch.tensor([1, 3, 3, 0, 5, 2])
    offsets = torch.tensor([0, 2, 3, 5, 6])  # 2 tables x batch 2
    args = ("test_bags", ops_module.weights, ops_module.momentum1, ops_module.momentum2, ids,
            offsets, None, ops_module._anchor)
    torch.library.opcheck(torch.ops.gemc.embedding_bag.default, args,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))
    out = torch.ops.gemc.embedding_bag(*args)
    ref = twin(ids, offsets)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(ops_module.weights, twin.weights)
    torch.testing.assert_close(ops_module.momentum1, twin.momentum1)
    assert not torch.equal(ops_module.weights, module().weights)  # the step did move them


def test_a_registered_tables_lookup_makes_and_keeps_no_tensor():
    """``register_table`` makes the module's launch layout ahead of any graph, so a lookup
    through ``gemc::embedding_bag`` keeps no tensor it made (under CUDA graphs, one made in
    a graph's first run and kept is refused: TransAct's layout, five tensors)."""
    from gemc.backends.triton.embedding_bag import BatchedEmbeddingBag

    m = BatchedEmbeddingBag([(10, 4), (6, 4)], pooling="sum", optimizer="rowwise_adagrad",
                            lr=0.1, eps=1e-8, weight_decay=0.0)
    m.reset_parameters()
    assert not m._layouts
    gemc_ops.register_table("test_bags_layout", m)
    kept = {k: [id(t) for t in vars(v).values() if isinstance(t, torch.Tensor)]
            for k, v in m._layouts.items()}
    assert kept and all(len(ids) == 5 for ids in kept.values())
    ids, offsets = torch.tensor([1, 3, 0, 5]), torch.tensor([0, 2, 3, 3, 4])
    torch.ops.gemc.embedding_bag("test_bags_layout", m.weights, m.momentum1, m.momentum2,
                                 ids, offsets, None, m._anchor)
    assert {k: [id(t) for t in vars(v).values() if isinstance(t, torch.Tensor)]
            for k, v in m._layouts.items()} == kept


def test_bag_inputs_op_lays_out_the_batched_lookup_as_the_interpreter_does():
    """``gemc::bag_inputs``: one opaque op for the flat ids, offsets and mean-pooling
    weights of many tables (start offsets or with the last offset; sum and mean tables),
    equal to the interpreter's layout; its fake gives the same shapes."""
    ids = [torch.tensor([1, 3, 3]), torch.tensor([0, 5, 2, 2], dtype=torch.int32)]
    offsets = [torch.tensor([0, 2]), torch.tensor([0, 1, 4])]  # starts; with the last
    include_last, mean = [False, True], [True, False]
    args = (ids, offsets, include_last, mean)
    torch.library.opcheck(torch.ops.gemc.bag_inputs.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    flat_ids, flat_offsets, psw = torch.ops.gemc.bag_inputs(*args)
    assert flat_ids.tolist() == [1, 3, 3, 0, 5, 2, 2]
    assert flat_offsets.tolist() == [0, 2, 3, 4, 7]  # table 2 shifted by table 1's 3 ids
    want = GraphRunner._bag_layout([torch.tensor([0, 2, 3]), torch.tensor([0, 1, 4])],
                                   [3, 4], mean)[1]
    torch.testing.assert_close(psw, want)
    torch.testing.assert_close(psw, torch.tensor([0.5, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0]))
    assert torch.ops.gemc.bag_inputs(ids, offsets, include_last, [False, False])[2].numel() == 0


def test_bag_layout_under_a_cuda_graph_capture_fills_what_the_copy_gives(monkeypatch):
    """Under a CUDA graph capture the batched lookup's per-table starts and mean flags are
    filled on the device, one fill per value (a pageable host copy cannot be captured:
    TransAct's ``reduce-overhead`` step failed on it); the layout equals the copy's, empty
    lists and bools included."""
    from gemc.backends.triton import graph_runner, runtime

    for values, dtype in (([0, 3, 7], torch.int64), ([True, False], torch.bool),
                          ([], torch.int64)):
        got = runtime.filled_values(values, dtype, torch.device("cpu"))
        assert got.dtype == dtype and got.tolist() == values
    offs = [torch.tensor([0, 2, 3]), torch.tensor([0, 1, 4]), torch.tensor([0, 0, 2])]
    nnz, mean = [3, 4, 2], [True, False, True]
    want = GraphRunner._bag_layout(offs, nnz, mean)
    monkeypatch.setattr(graph_runner, "host_values", runtime.filled_values)
    got = GraphRunner._bag_layout(offs, nnz, mean)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
