"""Single-process checks of the runner's pieces: init, optimizers, hooks, errors, files."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from gemc.backends.torch import checkpoint as ckpt
from gemc.backends.torch import init, precision
from gemc.backends.torch import kernels as kernel_registry
from gemc.backends.torch.dense import TensorParallelNotSupported
from gemc.backends.torch.reference import reference_losses
from gemc.backends.torch.runner import RunOptions, run
from gemc.backends.torch.sparse_optim import EmbeddingOptimConfig, RowState
from torch import nn

from gemc.errors import GemcError, GemcUserError, PlanError
from tests.runner.harness import MODEL, variant


def test_table_slices_equal_the_whole_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any shard is the same slice of what one process draws, across block boundaries."""
    monkeypatch.setattr(init, "BLOCK_ROWS", 7)
    rows, dim = 30, 6
    whole = init.fill_table_slice_(
        torch.empty(rows, dim), fqn="t.weight", rows=rows, dim=dim, row_offset=0, col_offset=0,
        seed=3, padding_idx=12,
    )
    assert torch.all(whole[12] == 0) and whole.std() > 0.5
    for r0, nr, c0, nc in [(0, 30, 0, 6), (5, 11, 0, 6), (13, 17, 2, 3), (28, 2, 5, 1), (6, 1, 0, 6)]:
        part = init.fill_table_slice_(
            torch.empty(nr, nc), fqn="t.weight", rows=rows, dim=dim, row_offset=r0,
            col_offset=c0, seed=3, padding_idx=12,
        )
        torch.testing.assert_close(part, whole[r0 : r0 + nr, c0 : c0 + nc], rtol=0, atol=0)
    other = init.fill_table_slice_(
        torch.empty(rows, dim), fqn="u.weight", rows=rows, dim=dim, row_offset=0, col_offset=0,
        seed=3,
    )
    assert not torch.equal(other, whole)


def test_derive_seed_is_stable() -> None:
    assert init.derive_seed(0, "module", "top.0") == init.derive_seed(0, "module", "top.0")
    assert init.derive_seed(0, "a") != init.derive_seed(1, "a")
    assert 0 <= init.derive_seed(5, "x") < 2**63


def test_dense_init_depends_on_names_not_on_global_rng() -> None:
    def build() -> nn.Module:
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))

    a, b = build(), build()
    for m in (a, b):
        m.to_empty(device="cpu")
    torch.manual_seed(1)
    init.reset_dense_(a, seed=7)
    torch.manual_seed(2)
    init.reset_dense_(b, seed=7)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na


def test_module_without_reset_parameters_takes_the_author_values() -> None:
    """Nothing is refused, nothing left as to_empty garbage: a module without
    reset_parameters, and a tensor a reset_parameters leaves unwritten, take the values of
    the author's build; everything reset_parameters writes keeps its seeded value."""

    class Raw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.arange(3.0))
            self.register_buffer("steps", torch.tensor([5, 6]))

    class Scaled(nn.Linear):  # reset_parameters (nn.Linear's) does not write ``gain``
        def __init__(self) -> None:
            super().__init__(2, 2)
            self.gain = nn.Parameter(torch.full((2,), 2.0))
            self.register_buffer("keep", torch.tensor([True, False]))

    def build() -> nn.Module:
        return nn.Sequential(Scaled(), Raw())

    with torch.device("meta"):
        model = build()
    model.to_empty(device="cpu")
    calls = []

    def author() -> nn.Module:
        calls.append(1)
        return build()

    report = init.init_dense_(model, seed=7, author_build=author)
    assert calls == [1]  # built once
    torch.testing.assert_close(model[1].w.data, torch.arange(3.0))
    assert model[1].steps.tolist() == [5, 6]
    torch.testing.assert_close(model[0].gain.data, torch.full((2,), 2.0))
    assert model[0].keep.tolist() == [True, False]
    with torch.random.fork_rng():  # nn.Linear's own reset under the seed of the name "0"
        torch.manual_seed(init.derive_seed(7, "module", "0"))
        expected = nn.Linear(2, 2)
    torch.testing.assert_close(model[0].weight.data, expected.weight.data)
    assert report.per_module == {"0": "reset_parameters + author's __init__", "1": "author's __init__"}
    assert sorted(report.author_tensors) == ["0.gain", "0.keep", "1.steps", "1.w"]
    assert report.numel["reset_parameters"] == 6 and report.numel["author's __init__"] == 9


def test_a_model_whose_resets_write_everything_is_never_rebuilt() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.BatchNorm1d(3))
    model.to_empty(device="cpu")

    def author() -> nn.Module:
        raise AssertionError("the author's build is not needed")

    report = init.init_dense_(model, seed=1, author_build=author)
    assert report.author_tensors == []
    assert all(torch.isfinite(t).all() for t in model.state_dict().values())


def test_author_values_needed_but_no_build_given_is_an_error() -> None:
    with torch.device("meta"):
        model = nn.Module()
        model.w = nn.Parameter(torch.zeros(3))
    model.to_empty(device="cpu")
    with pytest.raises(GemcError, match="author's build"):
        init.init_dense_(model, seed=0)


def test_rowwise_adagrad_and_lazy_adam_formulas() -> None:
    """The update rules of the fused Triton kernel (its eager reference, restated)."""
    w0 = torch.randn(5, 3)
    rows = torch.tensor([1, 3])
    g = torch.randn(2, 3)
    cfg = EmbeddingOptimConfig(kind="rowwise_adagrad", lr=0.1, eps=1e-8)
    w = w0.clone()
    RowState(w, cfg.kind).apply(w, rows, g, cfg, 1, 3)
    acc = g.pow(2).mean(1)
    expect = w0.clone()
    expect[rows] -= 0.1 * g / (acc.sqrt()[:, None] + 1e-8)
    torch.testing.assert_close(w, expect)

    cfg = EmbeddingOptimConfig(kind="adam", lr=0.01)
    w = w0.clone()
    state = RowState(w, cfg.kind)
    state.apply(w, rows, g, cfg, 1, 3)
    m = 0.1 * g
    v = 0.001 * g * g
    step_size = 0.01 * (1 - 0.999) ** 0.5 / (1 - 0.9)
    expect = w0.clone()
    expect[rows] -= step_size * m / (v.sqrt() + 1e-8)
    torch.testing.assert_close(w, expect)
    untouched = [0, 2, 4]
    assert torch.equal(w[untouched], w0[untouched])
    assert torch.all(state.tensors["exp_avg"][untouched] == 0)


def test_runner_on_one_process_equals_the_reference(base_plans) -> None:
    """World size 1 in module mode: the runner is the reference, bit for bit."""
    plan = variant(base_plans[1])  # fp32, no kernels
    got = run(plan, RunOptions(steps=5, device="cpu", progress=False)).losses
    from gemc.api import load_model

    ref = reference_losses(load_model(MODEL, {}), steps=5, world_size=1)
    assert [loss for _, loss in got] == ref


def test_graph_mode_runs_the_plans_kernels(base_plans, tmp_path) -> None:
    """The compiler's kernels (fused GEMM epilogues, one batched embedding bag with the
    optimizer in its backward) on one rank, Triton interpreted: same losses as eager, and a
    checkpoint taken in graph mode resumes exactly."""
    from gemc.api import load_model

    plan = variant(base_plans[1], kernels=True)
    kinds = sorted({k["kind"] for k in plan["kernels"]})
    assert "batched_embedding_bag" in kinds and "gemm_epilogue" in kinds
    ck = str(tmp_path / "ck")
    first = run(plan, RunOptions(steps=2, device="cpu", progress=False, checkpoint_dir=ck))
    assert first.report["kernels_applied"] and first.report["execution"].startswith("graph")
    graph = first.report["graph_executor"]
    assert graph["executor"] == "inductor" and graph["kernel_choices"]
    # auto (the default) takes no CUDA graphs off a CUDA device, and says why
    assert graph["compile_mode"] is None
    assert graph["compile_mode_reason"] == "auto: CUDA graphs need a CUDA device"
    assert graph["host_s"]["build"] > 0  # building the rewritten graph, before torch.compile
    # generated groups without a measured win are Inductor's; the embedding lookup gemc's
    assert all(c == ("gemc" if "embedding" in n else "inductor")
               for n, c in graph["kernel_choices"].items() if "transposed" not in n)
    assert first.report["first_step_s"] > 0
    # what the first step is made of: torch's compile (Dynamo traced the rewritten graph)
    # inside it, the rest outside
    acc = first.report["first_step"]
    assert acc["first_step_s"] == first.report["first_step_s"]
    assert acc["torch_timers"]["bytecode_tracing"]["calls"] >= 1
    assert 0 < acc["torch_compile_s"] < acc["first_step_s"]
    assert acc["compile_workers"].startswith("not started")  # the CPU compiles no Triton
    assert acc["outside_torch_compile_s"] == pytest.approx(
        acc["first_step_s"] - acc["torch_compile_s"], abs=1e-3)
    # ... and by phase: the forward frame compiles in the forward, the backward's lazily in
    # the backward; each phase's parts never exceed its wall time
    phases = acc["phases"]
    assert list(phases) == ["batch", "forward", "backward", "optimizers", "loss_read"]
    assert phases["forward"]["torch_compile_s"] > 0 and phases["backward"]["torch_compile_s"] > 0
    for p in phases.values():
        assert p["torch_compile_s"] + p["gemc_triton_compile_s"] <= p["wall_s"] + 2e-3
    assert sum(p["torch_compile_s"] for p in phases.values()) == pytest.approx(
        acc["torch_compile_s"], abs=5e-3)
    resumed = run(plan, RunOptions(steps=3, device="cpu", progress=False, checkpoint_dir=ck,
                                   resume=True))
    assert resumed.report["first_step"] is None  # a resumed run's first step is not one
    got = [loss for _, loss in first.losses + resumed.losses]
    ref = reference_losses(load_model(MODEL, {}), steps=3, world_size=1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=0)


def test_graph_mode_interpreter_fallback_is_loud_and_reads_losses_in_blocks(base_plans) -> None:
    """``--graph-executor interpreter`` still trains the plan (with a warning naming the
    unfused path), and losses read every 2 steps (no host sync in between) are the
    reference's."""
    from gemc.api import load_model

    plan = variant(base_plans[1], kernels=True)
    with pytest.warns(UserWarning, match="op-by-op interpreter"):
        got = run(plan, RunOptions(steps=3, device="cpu", progress=False, loss_every=2,
                                   graph_executor="interpreter"))
    assert [s for s, _ in got.losses] == [1, 2, 3]
    assert got.report["graph_executor"]["executor"] == "interpreter"
    ref = reference_losses(load_model(MODEL, {}), steps=3, world_size=1)
    torch.testing.assert_close([loss for _, loss in got.losses], ref, rtol=1e-5, atol=0)


def test_kernels_on_several_ranks_need_ddp_regions() -> None:
    from gemc.backends.torch.graph_mode import check_graph_mode

    gemm = {"name": "g0", "kind": "gemm_epilogue"}
    regions = [{"name": "", "strategy": "ddp"}, {"name": "top", "strategy": "fsdp"},
               {"name": "bottom", "strategy": "hsdp"}]
    with pytest.raises(PlanError, match="top, bottom are not ddp") as exc:
        check_graph_mode([gemm], world_size=2, regions=regions)
    assert "--no-kernels" in exc.value.fix
    check_graph_mode([gemm], world_size=2, regions=regions[:1])
    check_graph_mode([gemm], world_size=1, regions=regions)  # one rank


def test_skip_kernels_leaves_out_names_and_kinds_and_refuses_typos() -> None:
    from gemc.backends.torch.runner import kept_kernels

    plan = {"kernels": [{"name": "g0", "kind": "gemm_epilogue"},
                        {"name": "g1", "kind": "gemm_epilogue"},
                        {"name": "kp0", "kind": "key_padding_attention"}]}
    assert [k["name"] for k in kept_kernels(plan, ())] == ["g0", "g1", "kp0"]
    assert [k["name"] for k in kept_kernels(plan, ("key_padding_attention",))] == ["g0", "g1"]
    assert [k["name"] for k in kept_kernels(plan, ("g1", "kp0"))] == ["g0"]
    with pytest.raises(GemcUserError, match="--skip-kernels g2") as exc:
        kept_kernels(plan, ("g2",))
    assert "gemm_epilogue, key_padding_attention, kp0" in exc.value.fix


def test_unknown_kernel_kind_is_refused() -> None:
    from gemc.backends.torch.graph_mode import check_graph_mode

    with pytest.raises(PlanError, match="kind 'mystery'"):
        check_graph_mode([{"name": "m", "kind": "mystery"}], world_size=1)


def test_world_size_mismatch_is_a_named_error(base_plans, monkeypatch, capsys) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(PlanError, match="world size mismatch.*compiled for 2 ranks.*has 3") as exc:
        run(base_plans[2], RunOptions(steps=1, device="cpu", progress=False))
    assert "--nproc_per_node=2" in exc.value.fix


def test_world_size_mismatch_from_the_command_line(base_plans, plan_dir, monkeypatch, capsys):
    from gemc.backends.torch.cli import main

    from gemc.plan import write_plan

    path = plan_dir / "two.json"
    write_plan(path, base_plans[2])
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert main([str(path), "--steps", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gemc: error: world size mismatch")
    assert "fix:" in err and "where:" in err


def test_fingerprint_mismatch_is_refused(base_plans, tmp_path) -> None:
    """A plan compiled for other model arguments (hidden=16) must not run on hidden=32."""
    from gemc.api import compile as gemc_compile

    toy = str(Path(__file__).resolve().parents[1] / "models" / "toy.py") + ":build"
    plan = gemc_compile(toy, {}, topology="h200:1x1")
    plan["model"]["args"] = {"hidden": 32}
    with pytest.raises(PlanError, match="compiled for a different model"):
        run(plan, RunOptions(steps=1, device="cpu", progress=False))
    tampered = copy.deepcopy(base_plans[1])
    tampered["model"]["fingerprint"] = "sha256:" + "0" * 64
    with pytest.raises(PlanError, match="model.fingerprint|different model"):
        run(tampered, RunOptions(steps=1, device="cpu", progress=False))


def test_tensor_parallel_is_a_loud_error(base_plans) -> None:
    plan = copy.deepcopy(base_plans[1])
    next(r for r in plan["regions"] if r["name"] == "top")["strategy"] = "tp"
    with pytest.raises(TensorParallelNotSupported, match="tensor parallel not yet supported"):
        run(plan, RunOptions(steps=1, device="cpu", progress=False))


def test_precision_sites() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    plan = precision.resolve(
        [{"target": "*", "dtype": "bf16"}, {"target": "1", "dtype": "fp32", "sqnr_db": 40}], model
    )
    assert plan.global_dtype == torch.bfloat16 and plan.per_module == {"1": torch.float32}
    precision.install(model, plan, "cpu")
    with plan.autocast("cpu"):
        seen: dict[str, torch.dtype] = {}

        def record(name: str):  # noqa: ANN202
            def hook(_m, _a, out) -> None:  # noqa: ANN001
                seen[name] = out.dtype

            return hook

        model[0].register_forward_hook(record("0"))
        model[1].register_forward_hook(record("1"))
        model(torch.randn(3, 2))
    assert seen == {"0": torch.bfloat16, "1": torch.float32}
    with pytest.raises(PlanError, match="precision 'int4' is not supported"):
        precision.resolve([{"target": "*", "dtype": "int4"}], model)
    with pytest.raises(PlanError, match="module 'nope'"):
        precision.resolve([{"target": "nope", "dtype": "bf16"}], model)
    with pytest.raises(PlanError, match="names no target"):
        precision.resolve([{"node": "linear_3", "dtype": "bf16"}], model)


def test_kernel_entries_are_applied_or_refused(tmp_path) -> None:
    ctx = kernel_registry.KernelContext("cpu", 0, 1, tmp_path, {})
    model = nn.Linear(2, 2)
    with pytest.raises(PlanError, match="kind 'fused_mlp'.*cannot execute"):
        kernel_registry.apply(model, [{"name": "k0", "kind": "fused_mlp"}], ctx)
    calls = []
    kernel_registry.register("test_kind", lambda m, e, c: calls.append(e["name"]))
    src = tmp_path / "k.py"
    src.write_text("# kernel\n")
    import hashlib

    good = {"name": "k1", "kind": "test_kind", "source": "k.py",
            "sha256": hashlib.sha256(src.read_bytes()).hexdigest()}
    assert kernel_registry.apply(model, [good], ctx) == ["k1"] and calls == ["k1"]
    with pytest.raises(PlanError, match="changed since the plan was compiled"):
        kernel_registry.apply(model, [{**good, "sha256": "0" * 64}], ctx)
    with pytest.raises(PlanError, match="does not exist"):
        kernel_registry.apply(model, [{**good, "source": "missing.py"}], ctx)


def test_find_latest_trusts_only_complete_checkpoints(tmp_path) -> None:
    def complete(name: str) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_text("x")

    assert ckpt.find_latest(tmp_path) is None
    complete("step-00000004")
    complete("step-00000008")
    (tmp_path / "step-00000012.tmp").mkdir()  # an interrupted save
    (tmp_path / "step-00000016").mkdir()  # no .metadata: never finished
    (tmp_path / "latest").write_text("step-00000016\n")  # pointer to an incomplete one
    assert ckpt.find_latest(tmp_path) == (8, tmp_path / "step-00000008")
    (tmp_path / "latest").write_text("step-00000004\n")
    assert ckpt.find_latest(tmp_path) == (4, tmp_path / "step-00000004")
    os.remove(tmp_path / "latest")
    assert ckpt.find_latest(tmp_path)[0] == 8


def test_resume_with_another_embedding_optimizer_is_refused(base_plans, tmp_path) -> None:
    plan = variant(base_plans[1])
    ck = str(tmp_path / "ck")
    run(plan, RunOptions(steps=1, device="cpu", progress=False, checkpoint_dir=ck))
    with pytest.raises(GemcUserError, match="holds rowwise_adagrad state.*uses adam") as exc:
        run(plan, RunOptions(steps=2, device="cpu", progress=False, checkpoint_dir=ck,
                             resume=True, embedding_optimizer="adam"))
    assert "--embedding-optimizer rowwise_adagrad" in exc.value.fix


def test_gemc_cli_wiring_round_trips_the_flags() -> None:
    """``add_run_parser`` on gemc's subparsers; the flags a self-launch passes on are the
    flags it was given."""
    import argparse

    from gemc.backends.torch.cli import add_run_parser, argv_of

    parser = argparse.ArgumentParser(prog="gemc")
    add_run_parser(parser.add_subparsers(dest="command", required=True))
    flags = ["run", "p.json", "--steps", "7", "--checkpoint-dir", "ck", "--checkpoint-every",
             "3", "--resume", "--device", "cpu", "--embedding-optimizer", "adam", "--lr",
             "0.002", "--precision", "bf16", "--fp8-linears", "1024", "--no-kernels", "--quiet",
             "--kernel-module", "m",
             "--graph-executor", "interpreter", "--compile-mode", "reduce-overhead",
             "--measure-kernels", "--autotune", "--kernel-choices", "c.json", "--loss-every", "5",
             "--divergence", "stop", "--reference-losses", "ref.json", "--cache-dir", "none"]
    args = parser.parse_args(flags)
    again = parser.parse_args(["run", *argv_of(args)])
    assert vars(again) == vars(args)
    assert args.autotune and not parser.parse_args(["run", "p.json"]).autotune


def test_prefetch_reasons_name_why_a_table_is_looked_up_on_call() -> None:
    from gemc.backends.torch.table_prefetch import ABSENT, NOT_IN_BATCH, why_not_prefetched

    assert why_not_prefetched([1, 2, ABSENT, 1], [1, 2, ABSENT, 1]) is None
    assert why_not_prefetched([1, 2, 3, 1], [1, 4, 3, 1]) == "ranks called it differently"
    assert why_not_prefetched([1, 2, ABSENT, 2], [1, 2, ABSENT, 2]) == "called 2 times in a step"
    assert why_not_prefetched([1, 2, ABSENT, 0], [1, 2, ABSENT, 0]) == "called 0 times in a step"
    both = [NOT_IN_BATCH, 2, NOT_IN_BATCH, 1]
    assert why_not_prefetched(both, both) == "its ids and per-sample weights are computed in the model"


def test_recording_finds_arguments_by_identity_not_value() -> None:
    from gemc.backends.torch.table_prefetch import ABSENT, NOT_IN_BATCH, Recording

    ids, offsets = torch.tensor([1, 2]), torch.tensor([0, 2])
    rec = Recording((torch.zeros(1), ids, offsets))
    rec.note(ids, offsets, None)
    assert rec.positions == (1, 2, ABSENT) and rec.calls == 1
    rec.note(ids.clone(), offsets, None)  # equal values, another tensor: computed
    assert rec.positions == (NOT_IN_BATCH, 2, ABSENT) and rec.calls == 2


def test_prefetched_table_called_with_other_tensors_is_an_error() -> None:
    from gemc.backends.torch.table_prefetch import Prefetched

    ids, offsets = torch.tensor([1, 2]), torch.tensor([0, 2])
    out = torch.ones(1, 4)
    pre = Prefetched((ids, offsets, None), out)
    assert pre.take("t0.weight", ids, offsets, None) is out
    with pytest.raises(GemcUserError, match="t0.weight.*other tensors") as err:
        pre.take("t0.weight", ids.clone(), offsets, None)
    assert err.value.where == "model forward, call of t0" and "batch's own tensors" in err.value.fix


class _TiedTable(nn.Module):
    """A table whose weight the model also reads directly (an output projection)."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode="sum", include_last_offset=True)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return (self.bag(ids, offsets) @ self.bag.weight.t()).sum()


def test_graph_mode_on_several_ranks_refuses_a_table_read_outside_its_lookup() -> None:
    from gemc.backends.torch.embedding import shard_tables
    from gemc.backends.torch.graph_mode import GraphExecutor
    from gemc.backends.torch.sparse_optim import EmbeddingOptimizer

    from gemc.capture import capture
    from gemc.sharding import make_shards
    from gemc.spec import ModelSpec

    model = _TiedTable()
    example = (torch.zeros(3, dtype=torch.long), torch.tensor([0, 1, 3]))
    captured = capture(ModelSpec(model=model, example_inputs=example, make_batch=None))
    table = {"fqn": "bag.weight", "rows": 10, "dim": 4, "sharding": "row_wise",
             "shards": make_shards("row_wise", [0, 1], 10, 4)}
    tables = shard_tables(model, [table], rank=0, world_size=2, seed=0)
    emb_opt = EmbeddingOptimizer(tables, EmbeddingOptimConfig(), world_size=2)
    with pytest.raises(PlanError, match="reads table 'bag.weight' in node") as err:
        GraphExecutor(captured.gm, captured.param_fqns, model, [], tables=tables,
                      emb_opt=emb_opt, device=torch.device("cpu"), world_size=2)
    assert "--no-kernels" in err.value.fix


def test_kernel_choices_come_from_a_file_or_a_run_report(tmp_path) -> None:
    """``--kernel-choices``: a JSON object of per-kernel records, or a run report whose
    ``graph_executor.measured`` holds them; anything else is a user error naming the file."""
    import json

    from gemc.backends.torch.kernel_choices import read_choices as _kernel_choices

    record = {"norm_1": {"choice": "gemc", "gemc_ms": 0.1, "inductor_ms": 0.2}}
    plain = tmp_path / "choices.json"
    plain.write_text(json.dumps(record))
    report = tmp_path / "plan.run.json"
    report.write_text(json.dumps({"graph_executor": {"measured": record}, "steps": {}}))
    assert _kernel_choices(str(plain)) == record == _kernel_choices(str(report))
    assert _kernel_choices(None) is None
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(GemcUserError, match="is not a JSON object"):
        _kernel_choices(str(bad))
    with pytest.raises(GemcUserError, match="missing.json"):
        _kernel_choices(str(tmp_path / "missing.json"))


def test_module_mode_under_torch_compile_trains_like_the_reference(base_plans) -> None:
    """A plan without graph kernels still runs compiled when asked (on CUDA by default):
    the whole model through torch.compile, the sharded tables' lookups eager, the same
    losses as the reference; the report says so. CPU default (auto) stays eager."""
    from gemc.api import load_model

    plan = variant(base_plans[1])  # fp32, no kernels
    got = run(plan, RunOptions(steps=3, device="cpu", progress=False, compile_modules="on"))
    assert "under torch.compile" in got.report["execution"]
    ref = reference_losses(load_model(MODEL, {}), steps=3, world_size=1)
    torch.testing.assert_close([loss for _, loss in got.losses], ref, rtol=1e-5, atol=1e-6)
    auto = run(plan, RunOptions(steps=1, device="cpu", progress=False))
    assert "torch.compile" not in auto.report["execution"]
