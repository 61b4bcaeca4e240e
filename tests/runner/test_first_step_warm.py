"""The warm-up of gemc's own kernels ahead of the first step (gemc.backends.triton.warm):
the launches it derives from the compiled graph's gemc ops, the region guard and the sparse
optimizer are the launches the first step makes; a failure warns and training goes on; a
worker compiles a launch into Triton's cache for the H200's target without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from gemc.backends.triton import warm as W

from tests.hopper_target import HOPPER_DRIVER

REPO = Path(__file__).resolve().parents[2]


def test_signature_specialises_ints_and_pointers_as_triton_does() -> None:
    launch = W.Launch("gemc.m", "k", (W.Arg(torch.bfloat16, True), W.Arg(torch.float32, False),
                                      1, 16, 17, 2**31, 0.5, None), (("B", 64),))
    _, args, kw = W.signature(launch)
    assert args[0] == ("ptr", "torch.bfloat16", True) and args[1][2] is False
    assert [a[2] for a in args[2:5]] == ["one", "d16", ""]
    assert args[5][1] == "i64" and args[6] == "fp32" and args[7] is None
    assert kw == (("B", ("int", "i32", "d16")),)
    assert W.signature(launch, skip=("B",))[2] == ()
    # the two specialisations of a size the graph does not fix
    for v in (48, 50):
        got = {W._specialise(x)[2] for x in W.int_variants(v)}
        assert got == {"d16", ""}
    assert W.int_variants(1) == [1]
    # an unaligned view's descriptor says so
    base = torch.empty(64, dtype=torch.bfloat16, device="meta")
    assert W.Arg.of(base[8:]).aligned and not W.Arg.of(base[1:]).aligned


ZOO = {"mmoe": "examples/zoo/mmoe.py:build", "dlrm": "examples/dlrm/model.py:build",
       "gem": "examples/gem/model.py:build", "hstu": "examples/zoo/hstu.py:build",
       "sasrec_bst": "examples/zoo/sasrec_bst.py:build",
       "dlrm_dcnv2": "examples/zoo/dlrm_dcnv2.py:build"}
"""Tiny presets whose first step launches gemc's kernels, between them every op the zoo's
graphs hold: key-lengths and packed-values attention, HSTU's silu attention with its
relative bias, segment sums and gathers by row, the batched lookup (its gradient a slice
of a concatenation's in DLRM-DCNv2), the region guard and the sparse optimizer."""

FIRST_STEP_BATCH = {"dlrm_dcnv2": 4, "gem": 8, "dlrm": 16}
"""The batch of the presets whose tiny batch costs most of the test: their first step runs
the batched lookup's fused update interpreted, one program per looked-up id (DLRM-DCNv2's
214 ids a sample at B=16 took 8.8 s of its 11 s step, GEM at B=32 and DLRM at B=32 most of
theirs). Every gemc op of the graph still launches, at the batch both the derivation and
the step see; the same kernels, constexprs and dtypes, a quarter of the ids."""


@pytest.mark.parametrize("model", sorted(ZOO))
def test_derived_launches_are_the_first_steps_launches(model: str, monkeypatch) -> None:
    """Every gemc kernel launch of the first step (recorded at the launch) has a derived
    warm-up launch of the same kernel, constexprs, dtypes, alignments and integer
    specialisations; nothing derived at the values the graph fixes is never launched (a
    variant, derived at a value it does not fix, may not be); every gemc op of the graph
    was derived."""
    from gemc.backends.torch import runner

    from gemc.api import compile as gemc_compile

    args = {"preset": "tiny", "seed": 0}
    if model in FIRST_STEP_BATCH:
        args["batch_size"] = FIRST_STEP_BATCH[model]
    plan = gemc_compile(str(REPO / ZOO[model]), args, topology="h200:1x1", planner="default")
    made: list[W.WarmUp] = []
    real_warm = runner.warm_kernels
    monkeypatch.setattr(runner, "warm_kernels", lambda d: made.append(real_warm(d)) or made[-1])
    monkeypatch.chdir(REPO)
    with W.record_launches() as launched:
        res = runner.run(plan, runner.RunOptions(steps=1, device="cpu", cache_dir="none",
                                                 progress=False))
    (warm,) = made
    derived = {W.signature(x, W.config_keys(x)) for x in warm.launches.values()}
    fixed = {W.signature(x, W.config_keys(x)) for x in warm.launches.values() if not x.variant}
    real = {W.signature(x, W.config_keys(x)) for x in launched}
    assert real, "the first step launched none of gemc's kernels"
    assert real - derived == set(), "launches the warm-up did not derive"
    assert fixed - real == set(), "derived launches the step never made"
    report = res.report["first_step"]["kernel_warmup"]
    assert report["workers"] == 0 and not report["failures"]
    assert report["ops_not_derived"] == {}
    assert sum(r["variants"] for r in report["kernels"].values()) == len(derived)


def test_a_failing_derivation_or_compile_warns_and_names_the_kernel() -> None:
    warm = W.WarmUp(workers=0)

    def broken() -> None:
        raise RuntimeError("no shape")

    with pytest.warns(UserWarning, match="deriving the launches of gemc::x .*no shape"):
        assert warm.derive("gemc::x", broken) == []
    res = W.compile_launch(W.Launch("gemc.backends.triton.warm", "nothing_here", (), ()))
    assert res["error"] and res["kernel"] == "warm.nothing_here"

    class Done:
        def result(self) -> dict:
            return res

    with pytest.warns(UserWarning, match="compiling warm.nothing_here failed in the worker"):
        warm._done(Done())  # type: ignore[arg-type]
    assert len(warm.report()["failures"]) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        W.WarmUp(workers=0).start().close()  # no pool: nothing to start or stop


_HOPPER = HOPPER_DRIVER + textwrap.dedent("""
    import sys
    from gemc.backends.triton import warm as W
    from gemc.backends.triton.key_padding_attention import ADDITIVE_MASKED_GAP
    mask = torch.empty((8, 64), dtype=torch.uint8, device="meta")
    out = torch.empty(8, dtype=torch.int32, device="meta")
    launch = W.Launch("gemc.backends.triton.key_padding_attention", "_prefix_kernel",
                      (W.Arg.of(mask), 64, 1, 64, W.Arg.of(out), W.Arg.of(out)),
                      (("ADDITIVE", False), ("BLOCK_L", 64), ("GAP", ADDITIVE_MASKED_GAP)))
    res = W.compile_launch(launch)
    print(res)
    sys.exit(1 if res["error"] else 0)
""")


def test_a_worker_compiles_a_launch_into_tritons_cache_for_hopper(tmp_path: Path) -> None:
    """Triton compiles for GPUTarget("cuda", 90, 32) without a GPU (ptxas ships with the
    wheel): the warm-up's compile path writes the cache entry a launch would read."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _HOPPER], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = [p.name for p in tmp_path.rglob("*") if p.is_file()]
    assert any(f.endswith(".cubin") for f in files), files
    assert any(f == "_prefix_kernel.json" for f in files), files


# ---- each gemc op's derivation against its launches, forward and backward ------------------


def _launches_of(fn, inputs, dynamic=(), rerun=()):
    """(derived, recorded): the launches ``warm_graph`` derives from the Dynamo graph of
    ``fn(*inputs)`` (``dynamic``: (input, dim) pairs made symbolic), and those its forward
    and backward make, run on ``inputs`` and on each of ``rerun`` (other inputs)."""
    from gemc.backends.triton import ops

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    for i, dim in dynamic:
        torch._dynamo.mark_dynamic(inputs[i], dim)
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    recorded = []
    for args in (inputs, *rerun):
        with W.record_launches() as launched:
            compiled(*args).float().sum().backward()
        recorded += launched
    warm = W.WarmUp(workers=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a derivation that fails would only warn
        assert ops.warm_graph(graphs[0], warm) == {}
    return list(warm.launches.values()), recorded


def _same(derived, recorded) -> None:
    real = {W.signature(x, W.config_keys(x)) for x in recorded}
    got = {W.signature(x, W.config_keys(x)) for x in derived}
    assert real and real - got == set(), "launches the warm-up did not derive"
    assert got - real == set(), "derived launches never made"


def _silu_inputs(batch=2, length=8, heads=2, dim=16):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, length, heads, dim, generator=g, dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))
    offsets = torch.tensor([0, 5, 13], dtype=torch.int64)
    bias = (0.1 * torch.randn(length, length, generator=g)).requires_grad_()
    return q, k, v, offsets, bias


@pytest.mark.parametrize("with_bias", [True, False])
def test_padded_silu_attention_derives_its_launches(with_bias: bool) -> None:
    from gemc.backends.triton import ops  # noqa: F401 (registers the ops)

    q, k, v, offsets, bias = _silu_inputs()

    def fn(q, k, v, offsets, bias):
        return torch.ops.gemc.padded_silu_attention(q, k, v, offsets, bias, 8, 0.25, True)

    _same(*_launches_of(fn, [q, k, v, offsets, bias if with_bias else None]))


def test_query_attention_and_its_prefix_lengths_derive_their_launches() -> None:
    from gemc.backends.triton import jagged_query_attention as jqa
    from gemc.backends.triton import ops  # noqa: F401

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 8, 16, generator=g).requires_grad_()
    k, v = (torch.randn(2, 2, 4, 16, generator=g).requires_grad_() for _ in range(2))
    keep = torch.arange(8)[None, :] < torch.tensor([[5], [8]])

    def fn(q, k, v, keep):
        lengths = torch.ops.gemc.query_prefix_lengths(keep)
        return torch.ops.gemc.jagged_query_attention(q, k, v, lengths, 0.25)[0]

    before = jqa.STATS.as_dict()
    derived, recorded = _launches_of(fn, [q, k, v, keep])
    _same(derived, recorded)
    assert {x.kernel for x in derived} >= {"key_padding_attention._prefix_kernel",
                                           "varlen_key_attention._dq_kernel"}
    # the derivation ran the counting host code on meta tensors: the counts are the runs'
    assert jqa.STATS.as_dict()["calls"] == before["calls"] + 1


def test_small_table_gather_derives_its_backward() -> None:
    from gemc.backends.triton import small_table_gather  # noqa: F401 (registers the op)

    weight = torch.randn(12, 2).requires_grad_()
    index = torch.randint(-12, 12, (4, 64), generator=torch.Generator().manual_seed(0))
    derived, recorded = _launches_of(
        lambda w, i: torch.ops.gemc.gather_rows(w, i), [weight, index])
    _same(derived, recorded)
    assert [x.kernel for x in derived] == ["small_table_gather._row_sums_kernel"]


def test_a_dynamic_size_is_warmed_at_both_specialisations() -> None:
    """A token count Dynamo made symbolic: the launches derived at its hint and at its other
    specialisation are those the op makes at a count of each kind (the row logsumexp's
    stride is the count)."""
    from gemc.backends.triton import ops  # noqa: F401

    def values(total, seed=0):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(total, 2, 16, generator=g).requires_grad_() for _ in range(3))
        return [q, k, v, torch.tensor([0, 5, total], dtype=torch.int64)]

    def fn(q, k, v, offsets):
        return torch.ops.gemc.jagged_attention_values(q, k, v, offsets, 32, 0.25, True)[0]

    inputs = values(32)
    assert W.int_variants(32) == [32, 33]
    derived, recorded = _launches_of(fn, inputs, dynamic=[(0, 0), (1, 0), (2, 0)],
                                     rerun=[values(33, 1)])
    _same(derived, recorded)
    labels = {x.variant for x in derived}
    assert "" in labels and any(lab.startswith("dynamic size ") for lab in labels), labels
    # without the variants, the count's other specialisation would compile at its launch
    base = {W.signature(x) for x in derived if not x.variant}
    assert {W.signature(x) for x in recorded} - base


def test_a_failing_op_derivation_is_one_warning_naming_the_op(monkeypatch) -> None:
    from gemc.backends.triton import ops

    def broken(*args):
        raise RuntimeError("no launch here")

    monkeypatch.setitem(ops.WARM, "segment_sum", broken)
    x = torch.randn(6, 4)
    offsets = torch.tensor([0, 2, 6])
    graphs = []
    torch._dynamo.reset()
    torch.compile(lambda x, o, r: torch.ops.gemc.segment_sum(x, o, r),
                  backend=lambda gm, _: graphs.append(gm) or gm.forward,
                  fullgraph=True)(x, offsets, torch.tensor([0, 0, 1, 1, 1, 1]))
    warm = W.WarmUp(workers=0)
    with pytest.warns(UserWarning) as caught:
        assert ops.warm_graph(graphs[0], warm) == {}
    msgs = [str(w.message) for w in caught if "gemc warm-up" in str(w.message)]
    assert len(msgs) == 1 and "gemc::segment_sum" in msgs[0] and "no launch here" in msgs[0]


def test_host_code_with_an_aten_fallback_derives_its_kernel_on_meta_as_on_a_gpu(monkeypatch) -> None:
    """On a GPU (not interpreted) the masked row update and the segment sums chose their
    ATen fallback for anything not CUDA, meta included, so the warm-up derived nothing for
    them and they compiled at their first launch (MMoE's dense-gradient tables on the
    H200). With the interpreter off, meta tensors now reach the kernel's launch (recorded,
    not run) while CPU tensors still take the fallback."""
    from gemc.backends.triton import masked_row_update as mru
    from gemc.backends.triton import runtime
    from gemc.backends.triton import segment_sum as ss

    monkeypatch.setattr(runtime, "INTERPRETED", False)  # the GPU's branch
    weight = torch.empty(100, 32, device="meta")
    state = {"sum": torch.empty(100, device="meta")}
    x = torch.empty(50, 16, dtype=torch.bfloat16, device="meta")
    offsets = torch.empty(5, dtype=torch.int64, device="meta")
    with W.dry_launches() as seen:
        mru.masked_row_update_(weight, torch.empty_like(weight), state,
                               optimizer="rowwise_adagrad", lr=0.1, eps=1e-8,
                               betas=(0.9, 0.999), weight_decay=0.0, step_size=0.0)
        ss.segment_sum_rows(x, offsets)
    assert [(s.module, s.name) for s in seen] == [
        ("gemc.backends.triton.masked_row_update", "_masked_row_update_kernel"),
        ("gemc.backends.triton.segment_sum", "_segment_sum_kernel")]
    # a CPU tensor on that branch takes the fallback: no launch, the update done by ATen
    w = torch.zeros(4, 2)
    g = torch.ones(4, 2)
    s = {"sum": torch.zeros(4)}
    with W.record_launches() as launched:
        mru.masked_row_update_(w, g, s, optimizer="rowwise_adagrad", lr=0.1, eps=1e-8,
                               betas=(0.9, 0.999), weight_decay=0.0, step_size=0.0)
    assert launched == [] and bool((w != 0).all())
