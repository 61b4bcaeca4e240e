"""The GEM example end to end: every kernel the compiler lists, in place, against eager.

The tiny preset at batch 4 (one empty history, one empty bag per table at least) compiled
through the kernel passes; the graph runs with the fused groups, both jagged attentions and
the batched embedding lookup substituted. Loss and dense gradients must match eager; the
tables, updated inside the backward by the fused row-wise Adagrad, must match an eager
Adagrad step on the eager gradients. Then the plan: ``gemc.compile`` lists every kernel,
self-contained, and writes the sources to the dump directory.
"""

from __future__ import annotations

import hashlib
import json

import torch
from gemc.backends.triton.codegen import generated
from gemc.backends.triton.embedding_bag_reference import rowwise_adagrad_step_, touched_rows
from gemc.backends.triton.graph_runner import GraphRunner

from gemc.plan import load_plan, write_plan
from tests.fusion.helpers import compiled, eager_step, entries_of, fresh_seed, params_of

GEM = "examples/gem/model.py:build"
ARGS = {"preset": "tiny", "batch_size": 4}


def test_gem_tiny_with_all_kernels_matches_eager():
    gm, ctx, spec = compiled(GEM, ARGS)
    entries = entries_of(gm, ctx)
    kinds = {e["kind"] for e in entries}
    assert {"jagged_attention", "batched_embedding_bag", "gemm_epilogue", "norm"} <= kinds
    assert sum(e["kind"] == "jagged_attention" for e in entries) == 2
    model = spec.model
    batch = spec.make_batch(fresh_seed() % 1000, "cpu")
    ref, grads = eager_step(model, batch)
    runner = GraphRunner(gm, entries, params_of(model))
    loss = runner(*batch)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    # the sequence blocks ran on the real tokens only: every group inside the packed region
    # was launched at room for them (the history's ids plus one slot per empty row), not at
    # B * L
    region = next(e for e in entries if e["kind"] == "packed_tokens")
    tokens = batch[-3].numel() + (batch[-2].numel() - 1)
    inside = [u for u in runner.units if "structure" in u["entry"]
              and set(u["entry"]["nodes"]) <= set(region["nodes"])]
    assert len(inside) >= 8 and all(list(u["packed_runs"]) == [tokens] for u in inside)
    loss.backward()
    emb = next(e for e in entries if e["kind"] == "batched_embedding_bag")
    tables = {t["fqn"]: t for t in emb["tables"]}
    assert len(tables) == len(model.bags)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder" and "gemc.param" not in n.meta]
    inputs = dict(zip(names, batch))
    opt = emb["optimizer"]
    for k, p in model.named_parameters():
        if k not in tables:
            torch.testing.assert_close(p.grad, grads[k], atol=2e-5, rtol=1e-4, msg=k)
            continue
        assert p.grad is None
        ids = inputs[tables[k]["ids"]]
        weight = p.detach().clone()
        rows = touched_rows(ids, torch.tensor([0, ids.numel()]), 1)[0]
        rowwise_adagrad_step_(weight, grads[k], torch.zeros(weight.shape[0]), rows, opt["lr"],
                              opt["eps"], opt["weight_decay"])
        torch.testing.assert_close(runner.table_weights(k), weight, atol=1e-6, rtol=1e-5, msg=k)


def test_runner_releases_values_after_their_last_reader():
    """The environment holds a value only until its last reader: same loss, a fraction of
    the values alive at once (the rest live on only where autograd saved them)."""
    gm, ctx, spec = compiled(GEM, ARGS)
    entries = entries_of(gm, ctx)
    batch = spec.make_batch(fresh_seed() % 1000, "cpu")
    params = params_of(spec.model)
    keep = GraphRunner(gm, entries, params, release=False)
    drop = GraphRunner(gm, entries, params)
    with torch.no_grad():
        expected, got = keep(*batch), drop(*batch)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert keep.peak_live > 200
    assert drop.peak_live < keep.peak_live / 2, (drop.peak_live, keep.peak_live)


def test_every_layer_norm_runs_as_a_generated_norm_kernel():
    """Also the LayerNorms whose residual add went to the preceding GEMM's epilogue (alone
    in their group), priced no slower than the ATen op they replace."""
    gm, ctx, _ = compiled(GEM, ARGS)
    group_of = {n: e for e in entries_of(gm, ctx) if e["kind"] != "packed_tokens"
                for n in e["nodes"]}
    norms = [n.name for n in gm.graph.nodes if n.target is torch.ops.aten.layer_norm.default]
    assert len(norms) >= 4 * 2  # four per InterFormer block, two blocks at least
    assert all(group_of[n]["kind"] == "norm" for n in norms), \
        [(n, group_of.get(n, {}).get("kind")) for n in norms]
    alone = [group_of[n] for n in norms if group_of[n]["nodes"] == [n]]
    assert alone
    for e in alone:
        assert 0 < e["predicted"]["after_ms"] <= e["predicted"]["before_ms"], e["name"]


def test_plan_lists_self_contained_kernels_and_dumps_sources(tmp_path):
    from gemc.api import compile as gemc_compile

    dump = tmp_path / "dump"
    plan = gemc_compile(GEM, {"preset": "tiny"}, topology="h200:1x8", dump_dir=dump)
    path = tmp_path / "plan.json"
    write_plan(path, plan)
    assert load_plan(path) == plan
    kernels = plan["kernels"]
    kinds = {k["kind"] for k in kernels}
    assert {"jagged_attention", "batched_embedding_bag", "gemm_epilogue", "norm"} <= kinds
    codes = {k["sha256"]: k["code"] for k in kernels if "code" in k}
    for k in kernels:
        assert k["nodes"] and k["predicted"]["before_ms"] > 0 and k["predicted"]["after_ms"] > 0
        if "structure" not in k:
            assert k["library"].startswith("gemc.backends.triton.")
            continue
        source = codes[k["sha256"]]  # embedded once per distinct source
        assert hashlib.sha256(source.encode()).hexdigest() == k["sha256"]
        assert generated(k["structure"]) == (source, k["sha256"])  # regenerable
        assert (dump / k["file"]).read_text() == source
    manifest = json.loads((dump / "manifest.json").read_text())
    fuse = next(p for p in manifest["passes"] if p["name"] == "fuse")
    assert fuse["kernels"] == sum(k["kind"] != "packed_tokens" for k in kernels)
    from gemc.explain import explain

    text = explain(plan)  # one line per kind, the packed region with its span and fill
    assert f"kernels    {len(kernels)}" in text
    assert "packed_tokens" in text and "nodes at fill" in text and "jagged_attention" in text
    region = next(k for k in kernels if k["kind"] == "packed_tokens")  # both blocks inside
    assert {k["name"] for k in kernels if k["kind"] == "jagged_attention"} <= {
        k["name"] for k in kernels if set(k["nodes"]) <= set(region["nodes"])}


def test_region_times_are_priced_with_the_plans_kernels():
    """A gemc island (the attentions) costs its after_ms (inside the packed region times
    the fill; the jagged attention is already priced on the real tokens); a generated group runs as Inductor's code, so its GEMM costs its own
    time and its memory-bound nodes their share of Inductor's fused kernels, below their
    op-by-op time; a transposed linear keeps the GEMM alone. The plan's regions sum these."""
    from gemc.cost_model.inductor_fusion import FUSIBLE_KINDS
    from gemc.passes.pack_jagged_tokens import PACKED

    from gemc import ir
    from gemc.graph_summary import kernel_adjusted_ms
    from gemc.kernel_kinds import inductor_compiled_kinds

    gm, ctx, _ = compiled(GEM, ARGS)
    ms = kernel_adjusted_ms(gm)
    entries = entries_of(gm, ctx)
    region = next(e for e in entries if e["kind"] == "packed_tokens")
    by_name = {n.name: n for n in gm.graph.nodes}
    checked = set()
    for e in entries:
        if e["kind"] in ("packed_tokens", "batched_embedding_bag"):
            continue
        if e["kind"] == "transposed_linear":
            node = by_name[e["nodes"][0]]
            assert ms[node] == node.meta["gemc.predicted_ms"] < e["predicted"]["before_ms"]
            continue
        inside = set(e["nodes"]) <= set(region["nodes"])
        if e["kind"] in inductor_compiled_kinds():
            for name in e["nodes"]:
                node = by_name[name]
                own = float(node.meta.get("gemc.predicted_ms") or 0.0)
                if ir.kind_of(node) is ir.OpKind.GEMM:
                    scale = region["fill"] if inside else 1.0
                    torch.testing.assert_close(ms[node], own * scale, msg=name)
                elif ir.kind_of(node) in FUSIBLE_KINDS:
                    assert ms[node] <= own + 1e-9, name
            continue
        scale = region["fill"] if inside and e["kind"] != "jagged_attention" else 1.0
        got = sum(ms[by_name[n]] for n in e["nodes"])
        torch.testing.assert_close(got, e["predicted"]["after_ms"] * scale, rtol=1e-3,
                                   atol=1e-6, msg=e["name"])  # before/after: 6 decimals
        checked.add(inside)
    assert checked
    loose = next(n for n in gm.graph.nodes if "gemc.group" not in n.meta and PACKED not in n.meta
                 and n.meta.get("gemc.predicted_ms") and ir.kind_of(n) is ir.OpKind.GEMM)
    assert ms[loose] == loose.meta["gemc.predicted_ms"]
