"""Multi-process training on CPU (gloo) against the single-process reference.

One launch per world size runs several plans back to back (process start-up dominates on
a small machine). Every plan shards the six tables of ``tests/runner/models.py``
differently, so each sharding type is exercised by every launch that includes it:

=========  ================================================  ===========================
world      tables t0..t5                                      dense regions / optimizer
=========  ================================================  ===========================
2  "a"     table_wise@1, row_wise, column_wise,              all ddp; row-wise Adagrad
           data_parallel, row_wise (reversed ranks),
           column_wise (reversed ranks)
2  "b"     column_wise, data_parallel, row_wise,             top fsdp with its LayerNorm
           table_wise@0, table_row_wise, grid 2x1            (top.2) ddp inside it, bottom
                                                             ddp, root fsdp (owns nothing:
                                                             not wrapped); lazy Adam
2  resume  plan "b": 3 steps with checkpoints every 2,       must equal "b" steps 4..6
           then --resume to 6 (in-process)                  exactly
2  reshard plan "a" 3 steps, checkpoint; resumed under plan  steps 4..6 must match the
           "b" (other shardings, FSDP) to 6; then resumed    reference: DCP reshards the
           on one process (no process group) to 8           tables and dense state
2  gem     GEM tiny (10 tables: bags, the history's         regions alternately ddp and
           nn.Embedding, the position table): the five       fsdp; row-wise Adagrad;
           sharding kinds in turn                            5 steps
4  "c"     row_wise, column_wise (dims 2,2,1,1), grid 2x2,   top hsdp (2 hosts x 2),
           table_wise@3, table_row_wise@{2,3},               bottom fsdp, root ddp;
           data_parallel                                     row-wise Adagrad
=========  ================================================  ===========================

Each trains 6 steps (GEM 3); the mean-over-ranks loss of every step must match
``reference.reference_losses`` (one process, the W batches of a step averaged) to rtol 1e-4.
Why 6 (8 before, GEM 5): each step costs ~0.5 s a scenario (the owners' fused update runs
interpreted, one program per looked-up id); what a step past the first compares (an
update, each optimizer's state, the exchange's steady count) steps 2..6 compare (GEM 2..3).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from gemc.backends.torch.optimizers import resolve_optimizers
from gemc.backends.torch.reference import ReferenceTrainer, reference_losses
from gemc.backends.torch.runner import RunOptions, run

from gemc.api import load_model
from gemc.plan import write_plan
from tests.runner.harness import MODEL, REPO, run_scenarios, variant

STEPS = 6
RESUME_AT = STEPS // 2  # the resumed scenarios stop here (a checkpoint at 2 and at the stop)
CHECKPOINT_EVERY = 2
ADAM = {"embedding": {"kind": "adam", "lr": 0.01}}
GEM = f"{REPO / 'examples' / 'gem' / 'model.py'}:build"
GEM_ARGS = {"preset": "tiny", "batch_size": 8}
GEM_STEPS = 3  # every sharding kind and both dense strategies; kernels interpreted


def _gem_plan() -> dict | None:
    """GEM tiny for 2 ranks, every sharding kind and both dense strategies in turn."""
    from gemc.api import compile as gemc_compile

    if not (REPO / "examples" / "gem" / "model.py").is_file():
        return None
    base = gemc_compile(GEM, GEM_ARGS, topology="h200:1x2")
    kinds = ["table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise"]
    tables = {}
    for i, t in enumerate(base["tables"]):
        kind = kinds[i % len(kinds)]
        tables[t["fqn"]] = (kind, [i % 2] if kind == "table_wise" else [0, 1])
    regions = {reg["name"]: ("fsdp" if i % 2 else "ddp") for i, reg in enumerate(base["regions"])}
    return variant(base, tables, regions)


def _plans(world: int, base: dict) -> dict[str, dict]:
    r = list(range(world))
    if world == 2:
        return {
            "a": variant(
                base,
                {
                    "t0.weight": ("table_wise", [1]),
                    "t1.weight": ("row_wise", r),
                    "t2.weight": ("column_wise", r),
                    "t3.weight": ("data_parallel", r),
                    "t4.weight": ("row_wise", [1, 0]),
                    "t5.weight": ("column_wise", [1, 0]),
                },
                {"": "ddp", "bottom": "ddp", "top": "ddp"},
                optimizer={"embedding": {"kind": "rowwise_adagrad", "lr": 0.05}},
            ),
            "b": variant(
                base,
                {
                    "t0.weight": ("column_wise", r),
                    "t1.weight": ("data_parallel", r),
                    "t2.weight": ("row_wise", r),
                    "t3.weight": ("table_wise", [0]),
                    "t4.weight": ("table_row_wise", r),
                    "t5.weight": ("grid", r, [2, 1]),
                },
                {"": "fsdp", "bottom": "ddp", "top": "fsdp", "top.2": "ddp"},
                optimizer=ADAM,
            ),
        }
    return {
        "c": variant(
            base,
            {
                "t0.weight": ("row_wise", r),
                "t1.weight": ("column_wise", r),
                "t2.weight": ("grid", r, [2, 2]),
                "t3.weight": ("table_wise", [3]),
                "t4.weight": ("table_row_wise", [2, 3]),
                "t5.weight": ("data_parallel", r),
            },
            {"": "ddp", "bottom": "fsdp", "top": "hsdp"},
            optimizer={"embedding": {"kind": "rowwise_adagrad", "lr": 0.05}},
        ),
    }


def _reference(plan: dict, world: int, args: dict | None = None) -> list[float]:
    dense_cfg, emb_cfg = resolve_optimizers(plan.get("optimizer"))
    return reference_losses(
        load_model(MODEL, args or {}), steps=STEPS, world_size=world, dense_cfg=dense_cfg,
        emb_cfg=emb_cfg
    )


PER_TABLE_EXCHANGE = 4  # all_to_all_single: sizes, ids, pooled rows, their gradients
HOST_REDUCE = 2  # an exchange whose row shards sum inside hosts: stage A, its gradients


def _reduces(plan: dict, fqn: str) -> bool:
    """Whether the table's row shards sum inside hosts first (backends/torch/host_reduce)."""
    from gemc.backends.torch.embedding import Shard
    from gemc.backends.torch.host_reduce import host_groups
    from gemc.backends.torch.runner import gpus_per_host

    table = next(t for t in plan["tables"] if t["fqn"] == fqn)
    return host_groups([Shard.from_plan(s) for s in table["shards"]], gpus_per_host(plan),
                       plan["mesh"]["world_size"]) is not None


def _check_exchange(meta: dict, plan: dict, on_call: dict[str, str] | None = None) -> None:
    """Step 1 looks every routed table up on its own; from step 2 the tables the model calls
    with batch entries share one exchange, the others (``on_call``) keep their own. An
    exchange with row shards on several GPUs of a host (on several hosts) sums them there
    first: one more all-to-all and its backward (the tables here are all fp32)."""
    on_call = on_call or {}
    routed = sorted(t["fqn"] for t in plan["tables"] if t["sharding"] != "data_parallel")
    assert meta["embedding_exchange"] == {
        "batched": sorted(set(routed) - set(on_call)), "on_call": on_call}
    steps = meta["all_to_all_per_step"]
    assert steps[0] == sum(PER_TABLE_EXCHANGE + HOST_REDUCE * _reduces(plan, f)
                           for f in routed)
    batched = [f for f in routed if f not in on_call]
    later = (PER_TABLE_EXCHANGE * (1 + len(on_call))
             + HOST_REDUCE * (any(_reduces(plan, f) for f in batched)
                              + sum(_reduces(plan, f) for f in on_call)))
    assert set(steps[1:]) == {later}, steps
    warned = [w for w in meta["warnings"] if "looked up when the model calls them" in w]
    assert len(warned) == (1 if on_call else 0), meta["warnings"]
    assert all(f"'{fqn}' ({why})" in warned[0] for fqn, why in on_call.items())


def _close(got: list[float], ref: list[float], rtol: float = 1e-4) -> None:
    assert len(got) == len(ref)
    bad = [
        (i + 1, g, r) for i, (g, r) in enumerate(zip(got, ref)) if abs(g - r) > rtol * abs(r)
    ]
    assert not bad, f"steps (step, distributed, reference) off by more than rtol {rtol}: {bad}"


def _check_reshard(phases: list, plan_one_rank: dict, ck: Path) -> None:
    """Plan "a" for 3 steps, plan "b" (other shardings and dense strategies) resumed to 6,
    then one process resumed to 8: the 2-rank checkpoint (ShardedTensor tables, FSDP
    DTensors) read into whole tables. With "a"'s optimizer settings throughout."""
    optimizer = {"embedding": {"kind": "rowwise_adagrad", "lr": 0.05}}
    dense_cfg, emb_cfg = resolve_optimizers(optimizer)
    trainer = ReferenceTrainer(load_model(MODEL, {}), world_size=2, dense_cfg=dense_cfg,
                               emb_cfg=emb_cfg)
    ref = [trainer.step(s) for s in range(STEPS)]
    assert [s for s, _ in phases[1]] == list(range(RESUME_AT + 1, STEPS + 1))
    _close([loss for _, loss in phases[0] + phases[1]], ref)
    one = variant(plan_one_rank, optimizer=optimizer)
    rest = run(one, RunOptions(steps=STEPS + 2, device="cpu", progress=False, checkpoint_dir=str(ck),
                               resume=True))
    assert rest.report["resumed_from"].endswith(f"step-{STEPS:08d}")
    trainer.world_size = 1  # on one rank, step s trains on make_batch(s)
    _close([loss for _, loss in rest.losses], [trainer.step(s) for s in (STEPS, STEPS + 1)])


@pytest.mark.parametrize("world", [2, 4])
def test_loss_trajectory_matches_single_process(world, base_plans, plan_dir: Path) -> None:
    plans = _plans(world, base_plans[world])
    scenarios = []
    for name, plan in plans.items():
        path = plan_dir / f"w{world}-{name}.json"
        write_plan(path, plan)
        scenarios.append({"name": name, "plan": str(path), "phases": [{"steps": STEPS}]})
    gem = _gem_plan() if world == 2 else None
    if gem is not None:
        write_plan(plan_dir / "w2-gem.json", gem)
        scenarios.append(
            {"name": "gem", "plan": str(plan_dir / "w2-gem.json"), "phases": [{"steps": GEM_STEPS}]}
        )
    if world == 2:
        ck = plan_dir / "w2-resume-ckpt"
        scenarios.append(
            {
                "name": "resume",
                "plan": str(plan_dir / "w2-b.json"),
                "phases": [
                    {"steps": RESUME_AT, "checkpoint_dir": str(ck),
                     "checkpoint_every": CHECKPOINT_EVERY},
                    {"steps": STEPS, "checkpoint_dir": str(ck), "resume": True},
                ],
            }
        )
        # plan "b"'s layout with plan "a"'s optimizers (a checkpoint keeps its optimizer)
        write_plan(plan_dir / "w2-b-adagrad.json", {**plans["b"], "optimizer": plans["a"]["optimizer"]})
        rk = plan_dir / "w2-reshard-ckpt"
        scenarios.append(
            {
                "name": "reshard",
                "plan": str(plan_dir / "w2-a.json"),
                "phases": [
                    {"steps": RESUME_AT, "checkpoint_dir": str(rk)},
                    {"steps": STEPS, "checkpoint_dir": str(rk), "resume": True,
                     "plan": str(plan_dir / "w2-b-adagrad.json")},
                ],
            }
        )
    r2 = [0, 1]
    computed = None
    if world == 2:  # t0's ids made in the model: looked up on its own, and still right
        from gemc.api import compile as gemc_compile

        a = plans["a"]
        computed = variant(
            gemc_compile(MODEL, {"computed_ids": True}, topology="h200:1x2"),
            {t["fqn"]: (t["sharding"], sorted({s["rank"] for s in t["shards"]}))
             for t in a["tables"]},
            {r["name"]: r["strategy"] for r in a["regions"]}, optimizer=a["optimizer"])
        computed["tables"] = a["tables"]
        write_plan(plan_dir / "w2-computed.json", computed)
        scenarios.append({"name": "computed", "plan": str(plan_dir / "w2-computed.json"),
                          "phases": [{"steps": STEPS}]})
    graph = None
    if world == 2:  # graph mode: the generated kernels on both ranks, tables sharded
        graph = variant(
            base_plans[2],
            {"t0.weight": ("table_wise", [1]), "t1.weight": ("row_wise", r2),
             "t2.weight": ("column_wise", r2), "t3.weight": ("data_parallel", r2),
             "t4.weight": ("grid", r2, [2, 1]), "t5.weight": ("data_parallel", r2)},
            {"": "ddp", "bottom": "ddp", "top": "ddp"},
            optimizer=plans["a"]["optimizer"], kernels=True)
        assert {k["kind"] for k in graph["kernels"]} >= {"gemm_epilogue", "norm"}
        write_plan(plan_dir / "w2-graph.json", graph)
        scenarios.append({"name": "graph", "plan": str(plan_dir / "w2-graph.json"),
                          "phases": [{"steps": STEPS}]})
    results = run_scenarios(world, scenarios, plan_dir / f"w{world}-results.json")
    for name, plan in plans.items():
        got = [loss for _, loss in results[name][0]]
        _close(got, _reference(plan, world))
        _check_exchange(results["_meta"][name][0], plan)
    if graph is not None:
        _close([loss for _, loss in results["graph"][0]], _reference(graph, world))
        meta = results["_meta"]["graph"][0]
        _check_exchange(meta, graph, {"t4.weight": "its ids and offsets are computed in the model"})
        fused = [k["name"] for k in graph["kernels"] if k["kind"] == "batched_embedding_bag"]
        assert all(any(f"kernel(s) {', '.join(fused)}" in w for w in meta["warnings"])
                   for _ in fused[:1]), meta["warnings"]
    if computed is not None:
        _close([loss for _, loss in results["computed"][0]],
               _reference(computed, world, {"computed_ids": True}))
        _check_exchange(results["_meta"]["computed"][0], computed,
                        {"t0.weight": "its ids are computed in the model"})
    if gem is not None:
        ref = reference_losses(
            load_model(GEM, GEM_ARGS), steps=GEM_STEPS, world_size=2
        )
        _close([loss for _, loss in results["gem"][0]], ref)
    if world == 2:
        # a checkpoint of one plan resumes under another sharding, and on another world size
        _check_reshard(results["reshard"], base_plans[1], plan_dir / "w2-reshard-ckpt")
        first, resumed = results["resume"]
        assert [s for s, _ in first] == list(range(1, RESUME_AT + 1))
        assert [s for s, _ in resumed] == list(range(RESUME_AT + 1, STEPS + 1))
        uninterrupted = dict((s, loss) for s, loss in results["b"][0])
        assert [loss for _, loss in first] == [uninterrupted[s] for s in range(1, RESUME_AT + 1)]
        # resuming is exact: same state, same batches, same reduction order
        assert [loss for _, loss in resumed] == [uninterrupted[s]
                                                 for s in range(RESUME_AT + 1, STEPS + 1)]


def _replica_plans(base: dict) -> dict[str, dict]:
    """Four data-parallel tables on 2 ranks beside a table-wise and a row-wise one: t4 has a
    padding row (and a bag of padding only), t5 is never looked up by rank 1's batches
    (``idle_t5_on_odd``), t3 is an unpooled lookup."""
    r = [0, 1]
    tables = {"t0.weight": ("table_wise", [1]), "t1.weight": ("data_parallel", r),
              "t2.weight": ("row_wise", r), "t3.weight": ("data_parallel", r),
              "t4.weight": ("data_parallel", r), "t5.weight": ("data_parallel", r)}
    regions = {"": "ddp", "bottom": "ddp", "top": "ddp"}
    adagrad = variant(base, tables, regions,
                      optimizer={"embedding": {"kind": "rowwise_adagrad", "lr": 0.05}})
    bf16 = copy.deepcopy(adagrad)
    for t in bf16["tables"]:
        if t["sharding"] == "data_parallel":
            t["precision"], t["precision_reason"] = "bf16", "set by the test"
    # t0 and t2 (sum bags of width 8, t2 with per-sample weights and offsets without the
    # last) share one storage, lookup and update (replica_groups); t1, t3, t4 stay alone
    grouped = {**tables, "t0.weight": ("data_parallel", r), "t2.weight": ("data_parallel", r),
               "t5.weight": ("row_wise", r)}
    return {"adagrad": adagrad, "adam": variant(base, tables, regions, optimizer=ADAM),
            "bf16": bf16, "grouped": variant(base, grouped, regions, optimizer=ADAM),
            # graph mode: the group looked up ahead of the compiled graph (replica_ahead)
            "grouped-graph": variant(base, grouped, regions, optimizer=ADAM, kernels=True)}


def test_replicas_train_as_the_reference_with_one_all_reduce(plan_dir: Path) -> None:
    """Every data-parallel table is reduced in ONE all-reduce a step (the embedding
    optimizer's only collective here: no column shards), with the single-process
    reference's arithmetic (fp32, row-wise Adagrad and lazy Adam, a padding row, a table
    one rank never touches), bf16 replicas near fp32's, two replicas in one group (one
    storage, lookup and update; in graph mode looked up ahead of the compiled graph), and
    a resume of the grouped plan exact."""
    from gemc.api import compile as gemc_compile

    args = {"idle_t5_on_odd": True}
    base = gemc_compile(MODEL, args, topology="h200:1x2")
    plans = _replica_plans(base)
    scenarios = []
    for name, plan in plans.items():
        write_plan(plan_dir / f"w2-dp-{name}.json", plan)
        scenarios.append({"name": name, "plan": str(plan_dir / f"w2-dp-{name}.json"),
                          "phases": [{"steps": STEPS}]})
    ck = plan_dir / "w2-dp-resume-ckpt"
    scenarios.append({"name": "resume", "plan": str(plan_dir / "w2-dp-grouped.json"), "phases": [
        {"steps": RESUME_AT, "checkpoint_dir": str(ck), "checkpoint_every": CHECKPOINT_EVERY},
        {"steps": STEPS, "checkpoint_dir": str(ck), "resume": True}]})
    results = run_scenarios(2, scenarios, plan_dir / "w2-dp-results.json")
    for name in ("adagrad", "adam", "grouped", "grouped-graph"):
        _close([loss for _, loss in results[name][0]], _reference(plans[name], 2, args))
    for name in plans:
        assert results["_meta"][name][0]["embedding_all_reduce_per_step"] == [1] * STEPS, name
    batch = results["_meta"]["grouped"][0]["replica_batch"]
    assert batch["groups"] == {"replica-group-0": ["t0.weight", "t2.weight"]}
    assert batch["batched_lookup"] == ["t0.weight", "t2.weight"]
    assert set(batch["not_grouped"]) == {"t1.weight", "t3.weight", "t4.weight"}
    graph = results["_meta"]["grouped-graph"][0]["replica_batch"]
    assert graph["groups"] == batch["groups"]
    assert graph["graph_ahead"] == {"ahead": ["t0.weight", "t2.weight"], "in_graph": {},
                                    "in_graph_steps": {}}
    fp32 = [loss for _, loss in results["adagrad"][0]]
    bf16 = [loss for _, loss in results["bf16"][0]]
    off = max(abs(a - b) / abs(b) for a, b in zip(bf16, fp32))
    assert 0 < off < 0.01, f"bf16 replicas off fp32's by {off:.3%}"
    first, resumed = results["resume"]
    assert [loss for _, loss in first + resumed] == [loss for _, loss in results["grouped"][0]]
