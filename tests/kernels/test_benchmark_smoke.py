"""benchmarks/kernels.py runs end to end at --smoke sizes and writes a well-formed report."""

from __future__ import annotations

import json

from tests.benchmark_module import load_benchmark


def test_benchmark_smoke_writes_json(tmp_path):
    bench = load_benchmark("kernels")
    out = tmp_path / "kernels.json"
    bench.main(["--smoke", "--no-compile", "--cases", "attention,query,embedding,jagged",
                "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["preset"] == "smoke"
    rows = report["results"]
    assert not [r for r in rows if r["error"]], [r for r in rows if r["error"]]
    variants = {(r["case"], r["mode"], r["variant"]) for r in rows}
    assert ("softmax attention causal", "fwd+bwd", "triton jagged") in variants
    assert ("embedding step", "fwd+bwd+opt", "eager EmbeddingBag + AdamW") in variants
    assert ("history queries over dense keys", "fwd+bwd", "triton jagged queries") in variants
    assert ("jagged_to_padded", "fwd+bwd", "eager index_put") in variants
    # The Triton results agree with eager at the benchmark's own size.
    checked = [r for r in rows if r["max_abs_err"] is not None]
    assert checked and all(r["max_abs_err"] < 0.05 for r in checked)
    assert all(r["ms"] > 0 for r in rows)
    assert [t["required_speedup"] for t in report["targets"]] == [2.0, 3.0]


def _smoke_rows(tmp_path, case: str) -> tuple[dict, list[dict]]:
    """The report of ``--smoke --cases <case>`` and its rows, none of which failed."""
    out = tmp_path / f"{case}.json"
    load_benchmark("kernels").main(["--smoke", "--no-compile", "--cases", case, "--out",
                                    str(out)])
    report = json.loads(out.read_text())
    rows = report["results"]
    assert not [r for r in rows if r["error"]], [r for r in rows if r["error"]]
    return report, rows


def test_zoo_attention_case_times_every_model_with_a_history(tmp_path):
    """``--cases zoo`` at the zoo's tiny shapes: per model with a history, gemc's kernel and
    the padded baselines timed and checked against eager; the summary names every model."""
    report, rows = _smoke_rows(tmp_path, "zoo")
    cases = {r["case"] for r in rows}
    assert cases == {"hstu: silu attention causal", "sasrec_bst: softmax attention",
                     "mmoe: softmax attention causal",
                     "transact: softmax attention, additive key mask"}
    variants = {(r["case"], r["variant"]) for r in rows if r["mode"] == "fwd+bwd"}
    assert ("hstu: silu attention causal", "sdpa padded (softmax, masked)") in variants
    checked = [r for r in rows if r["max_abs_err"] is not None]
    assert len(checked) == 10 and all(r["max_abs_err"] < 0.05 for r in checked)
    # TransAct's attention as its packed region runs it (representatives), timed and checked
    assert ("transact: softmax attention, additive key mask",
            "triton packed region (representatives)") in variants
    zoo = report["zoo"]
    assert set(zoo) == {"hstu", "sasrec_bst", "mmoe", "transact", "din", "dlrm_dcnv2",
                        "wukong"}
    for model in ("hstu", "sasrec_bst", "mmoe", "transact"):
        assert zoo[model]["gemc_ms"] > 0 and zoo[model]["vs_sdpa_masked"] > 0
    assert zoo["hstu"]["vs_padded_silu_eager"] > 0
    # the figure is the form the compiled model runs: TransAct's region, its guarded op kept
    assert zoo["transact"]["gemc_variant"] == "triton packed region (representatives)"
    assert zoo["transact"]["guarded_op_ms"] > 0
    assert zoo["hstu"]["gemc_variant"] == "triton jagged" and "guarded_op_ms" not in zoo["hstu"]
    # TransAct's window masks latest actions: the guard compacted its keys on every call
    paths = zoo["transact"]["guard_paths"]
    assert paths["calls"] > 0 and paths["fallback"] == 0
    assert 0 < zoo["transact"]["mean_kept_keys"] < zoo["transact"]["seq_len"]


def test_narrow_shards_case_checks_every_width_against_pytorch(tmp_path):
    """``--cases narrow`` at smoke sizes under the interpreter: every width's forward and
    fused row-wise Adagrad step were checked against PyTorch (the case raises on a
    mismatch) and timed next to ``nn.EmbeddingBag``; the summary has each width's time per
    column against the 128-wide shard (1.0 at 128 itself) and both GB/s figures."""
    report, rows = _smoke_rows(tmp_path, "narrow")
    assert {r["case"] for r in rows} == {f"narrow shard {w} wide, pooling {p}"
                                         for w in (8, 16, 32, 64, 128) for p in (5, 2)}
    narrow = report["narrow"]
    assert set(narrow) == {"pooling 5", "pooling 2"}
    for per_mode in narrow.values():
        assert set(per_mode) == {"gemc triton fwd", "gemc triton fwd+bwd+opt",
                                 "eager EmbeddingBag fwd", "eager EmbeddingBag fwd+bwd",
                                 "eager EmbeddingBag + Adagrad fwd+bwd+opt"}
        for cells in per_mode.values():
            assert cells["128"]["per_column_vs_128"] == 1.0
            assert all(c["ms"] > 0 and c["rows_gbps"] > 0 and c["per_column_vs_128"] > 0
                       for c in cells.values())
            # an 8-wide fp32 row is exactly one sector: the two byte counts agree
            assert abs(cells["8"]["rows_gbps"] - cells["8"]["sectors_gbps"]) < 1e-9


def test_narrow_group_case_times_one_kernel_against_a_kernel_a_shard(tmp_path):
    """``--cases narrow_group`` at smoke sizes: 1, 2, 4 and 8 shards in one batched kernel
    and in one kernel each, both timed (their outputs checked equal first: the case raises
    otherwise), and the summary has both times per shard count."""
    report, rows = _smoke_rows(tmp_path, "narrow_group")
    assert {(r["case"], r["variant"]) for r in rows} == {
        (f"{k} narrow shards 16 wide, pooling 5", v) for k in (1, 2, 4, 8)
        for v in ("gemc triton, one kernel", "gemc triton, a kernel a shard")}
    group = report["narrow_group"]
    assert set(group) == {"1", "2", "4", "8"}
    assert all(c["one_kernel_ms"] > 0 and c["kernel_per_shard_ms"] > 0 and not c["errors"]
               for c in group.values())


def test_narrow_split_case_times_the_two_phase_update_against_one_pass(tmp_path):
    """``--cases narrow_split`` at smoke sizes: column shards 16, 32 and 64 of a 128-wide
    row and the whole row, each stepped in one pass and in two phases (the whole row's
    two checked equal to its one pass first: the case raises otherwise)."""
    report, rows = _smoke_rows(tmp_path, "narrow_split")
    assert {(r["case"], r["variant"]) for r in rows} == {
        (f"column shard {w} of 128 wide, pooling 5", v) for w in (16, 32, 64, 128)
        for v in ("gemc triton, one pass", "gemc triton, two phases")}
    split = report["narrow_split"]
    assert set(split) == {"16", "32", "64", "128"}
    assert all(c["one_pass_ms"] > 0 and c["two_phase_ms"] > 0 and not c["errors"]
               for c in split.values())


def test_narrow_check_catches_a_wrong_update():
    """The benchmark's own check fails on a kernel that is off: a shard whose learning rate
    differs from the reference's by 1% is caught."""
    import pytest
    import torch

    bench = load_benchmark("kernels")
    from gemc.backends.triton import BatchedEmbeddingBag

    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(50, 8, mode="sum", sparse=True)
    ids, offsets = torch.randint(0, 50, (12,)), torch.arange(0, 13, 3)
    grad = torch.randn(4, 8)
    good = BatchedEmbeddingBag([(50, 8)], lr=0.01, eps=1e-8)
    bench._narrow_check(good, bag, ids, offsets, grad, 0.01, 1e-8)
    bad = BatchedEmbeddingBag([(50, 8)], lr=0.0101, eps=1e-8)
    with pytest.raises(AssertionError):
        bench._narrow_check(bad, bag, ids, offsets, grad, 0.01, 1e-8)


def test_sector_bytes():
    bench = load_benchmark("kernels")
    assert bench.sector_bytes(8) == 32.0 and bench.sector_bytes(128) == 512.0
    assert bench.sector_bytes(8, element_bytes=2) == 32.0  # a 16-byte row moves a sector
    assert bench.sector_bytes(12) == 64.0  # 48-byte rows straddle two sectors each
