"""MLIR through torch-mlir: files written by a compile parse back, and the linalg modules,
run on the CPU by MLIR's ExecutionEngine, give what eager PyTorch gives.

Fusion groups are being built by another pass; until they exist, hand-chosen node sets of
the tiny GEM preset stand in for them (set as ``gemc.group`` on the nodes, exactly what
the fusion pass will write).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gemc.backends.mlir import export
from gemc.backends.mlir.extract import extract_subgraph
from gemc.backends.mlir.lower import LINALG, parse_module, parsing_context
from gemc.backends.mlir.refcheck import compare, random_inputs

from gemc import ir
from tests.mlir.tiny import tiny, tiny_dump

GROUPS = {
    "mlp": ("linear", "gelu", "linear_1"),
    "ln_mlp": ("flatten", "layer_norm", "linear_3", "gelu_1", "linear_4"),
    "attn_out": (
        "scaled_dot_product_attention",
        "transpose_5",
        "reshape",
        "linear_14",
        "add_7",
        "layer_norm_5",
    ),
    "loss": (
        "select_1",
        "binary_cross_entropy_with_logits",
        "select_2",
        "binary_cross_entropy_with_logits_1",
        "add_16",
    ),
    "positions": ("index", "sub_1", "embedding_1", "add_5"),
    "bag": ("embedding_bag", "getitem"),  # embedding_bag does not lower: named, no crash
}
FLOAT_ONLY = ("mlp", "ln_mlp", "attn_out", "loss")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, dict]:
    """The tiny graph with the hand-chosen groups, exported as a compile would."""
    gm = tiny().gm
    by_name = {n.name: n for n in gm.graph.nodes}
    try:
        for gid, names in GROUPS.items():
            for name in names:
                by_name[name].meta[ir.GROUP] = gid
        out = tmp_path_factory.mktemp("mlir-export")
        index = export.export_to_dump(gm, out)
    finally:
        for n in gm.graph.nodes:
            n.meta.pop(ir.GROUP, None)
    return out / "mlir", index


def _body(path: Path) -> str:
    return path.read_text()


def test_compile_writes_mlir_that_parses_back():
    dump = tiny_dump()
    mdir = dump / "mlir"
    assert (dump / "plan.json").is_file(), "compile --dump-dir must copy the plan for gemc report"
    index = json.loads((mdir / "index.json").read_text())
    files = sorted(p.name for p in mdir.glob("*.mlir"))
    assert {"graph.raw.mlir", "graph.torch.mlir", "graph.linalg.mlir"} <= set(files)
    ctx = parsing_context()
    for name in files:
        text = _body(mdir / name)
        assert text.startswith("// gemc: "), name
        module = parse_module(text, ctx)
        assert "func.func @main" in str(module), name
    assert index["graph"]["reached"] == LINALG
    linalg = _body(mdir / "graph.linalg.mlir")
    assert "linalg." in linalg and "torch.aten" not in linalg
    # Ops that do not lower are named with a reason; the graph's files say they were cut.
    listed = (mdir / "unsupported.txt").read_text()
    for u in index["unsupported"]:
        assert u["op"] in listed and u["reason"]
    cut = {n for u in index["unsupported"] for n in u["nodes"]}
    assert set(index["graph"]["cut"]) == cut
    if cut:
        assert "// gemc: cut" in linalg


def test_unsupported_ops_are_named_with_stage_and_reason(exported):
    mdir, index = exported
    by_op = {u["op"]: u for u in index["unsupported"]}
    # torch-mlir has no op for a data-dependent repeat_interleave: it stays a torch.operator.
    repeat = by_op["aten.repeat_interleave.self_Tensor"]
    assert repeat["stage"] == "torch" and "failed to legalize" in repeat["reason"]
    assert 'torch.operator "torch.aten.repeat_interleave.self_Tensor"' in _body(
        mdir / "graph.raw.mlir"
    )
    groups = {g["name"]: g for g in index["groups"]}
    assert groups["group_bag"]["reached"] != LINALG and groups["group_bag"]["error"]
    assert "group_bag" in (mdir / "unsupported.txt").read_text()


@pytest.mark.parametrize("gid", [g for g in GROUPS if g != "bag"])
def test_group_matches_eager(exported, gid):
    mdir, index = exported
    t = tiny()
    group = {g["name"]: g for g in index["groups"]}[f"group_{gid}"]
    assert group["reached"] == LINALG, group["error"]
    assert group["files"] == {
        "torch": f"group_{gid}.torch.mlir",
        "linalg": f"group_{gid}.linalg.mlir",
    }
    text = _body(mdir / group["files"]["linalg"])
    parse_module(text)
    sub = extract_subgraph(t.gm, t.nodes(*GROUPS[gid]))
    assert [n.name for n in sub.inputs] == group["args"]
    assert [n.name for n in sub.outputs] == group["results"]
    # The values that flow into the group in a real step: outputs must be the step's.
    real = compare(
        sub,
        [t.values[a] for a in group["args"]],
        [t.values[r] for r in group["results"]],
        linalg_text=text,
    )
    real.assert_close()
    if gid in FLOAT_ONLY:  # and fresh random inputs, eager run of the same subgraph
        for seed in (1, 2):
            compare(sub, random_inputs(sub, seed), linalg_text=text).assert_close()


def test_whole_graph_linalg_matches_a_real_step(exported):
    """Everything torch-mlir lowers (the graph minus the cut ops), run by LLVM on a real
    batch, against the eager step: every value crossing the cut and the loss itself."""
    mdir, index = exported
    t = tiny()
    graph = index["graph"]
    text = _body(mdir / graph["files"][LINALG])
    from gemc.backends.mlir.refbackend import compile_reference

    got = compile_reference(text)(*[t.values[a] for a in graph["args"]])
    assert len(got) == len(graph["results"]) and "add_16" in graph["results"]
    for name, value in zip(graph["results"], got):
        torch.testing.assert_close(value, t.values[name], rtol=1e-4, atol=1e-4, msg=name)


def test_without_torch_mlir_a_note_not_a_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(export, "available", lambda: False)
    status = export.dump_mlir(tiny().gm, tmp_path)
    assert "not installed" in status
    assert "torch-mlir is not installed" in (tmp_path / "mlir" / "unavailable.txt").read_text()
    assert not list((tmp_path / "mlir").glob("*.mlir"))


def test_an_export_bug_leaves_a_traceback_not_a_failed_compile(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(export, "export_to_dump", broken)
    status = export.dump_mlir(tiny().gm, tmp_path)
    assert "export failed" in status
    assert "RuntimeError: boom" in (tmp_path / "mlir" / "error.txt").read_text()


def test_compiled_fusion_groups_match_a_real_step():
    """The fusion groups the compile made (when the pipeline has a fusion pass): each kind of
    group that reached linalg, fed the values that flow into it in a real step."""
    from gemc.backends.mlir.refbackend import compile_reference

    mdir = tiny_dump() / "mlir"
    index = json.loads((mdir / "index.json").read_text())
    t = tiny()
    checked, kinds = 0, set()
    for group in index["groups"]:
        names = group["args"] + group["results"]
        if group["reached"] != LINALG or not all(n in t.values for n in names):
            continue  # not lowered (named in unsupported.txt), or nodes the pipeline rewrote
        ops = tuple(str(t.node(n).target) for n in group["results"])
        if ops in kinds:  # one of each kind keeps the test fast
            continue
        kinds.add(ops)
        got = compile_reference((mdir / group["files"][LINALG]).read_text())(
            *[t.values[a] for a in group["args"]]
        )
        for name, value in zip(group["results"], got):
            torch.testing.assert_close(
                value, t.values[name], rtol=1e-4, atol=1e-4, msg=f"{group['name']}: {name}"
            )
        checked += 1
    if index["groups"]:
        assert checked, "no compiled fusion group could be checked"
