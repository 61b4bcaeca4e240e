"""Feature-interaction, multi-task and sparse-feature models written by others in their own
idioms (tests/models/probes_d), through gemc as written: compiled at h200:1x1 and 1x8,
then 3 steps against the eager reference on one rank (graph mode: the plan's kernels,
Triton interpreted) and on two gloo ranks. What each probe found:

* ``nn.Embedding(max_norm=1.0)`` (embedding_idioms ``max_norm``): its forward renorms the
  looked-up rows in place (``embedding_renorm_``). gemc compiled it as a table, with a
  wrong warning ("also read outside its lookups") and a data_parallel placement, then the
  runner refused it ("leave max_norm out") on any number of ranks. Now: one GPU keeps it
  the model's dense nn.Embedding and trains it exactly (graph mode too, the renorm in the
  graph); on several ranks each replica would renorm only its batch's rows, so the compile
  refuses it by name (the table, the author's line, a differentiable fix).
* ``scale_grad_by_freq=True`` (``freq``): compiled as a table, then refused by the runner.
  Now it stays a dense nn.Embedding, which DDP trains exactly as eager (each rank's
  gradient scaled by its own batch's counts, then averaged), on one rank and two.
* pytorch-fm's ``x + x.new_tensor(self.offsets)`` (a NumPy array) and PNN's ``x[:, row]``
  over Python index lists (torchfm): torch.export lifts such tensors to graph inputs; graph
  mode passed them none ("forward() missing 2 required positional arguments"), and the
  index lists had no values at all (captured on meta). Now the capture keeps every lifted
  constant's value (recovering a meta one from an export with fake CPU state), graph mode
  feeds them, and a positional meta device in the graph (``aten.to.device(t, meta)``) runs
  on the run's device.
* pytorch-fm's FFM initialises its tables with ``nn.init.xavier_uniform_`` on ``.data``,
  DeepCTR-Torch with ``normal_(std=1e-4)`` (its DNN weights too): the runner, and the
  reference it is checked against, drew every table N(0, 1) and reset every nn.Linear, so
  gemc trained from other weights than eager (FFM's first loss 1.68 instead of ~0.69),
  unseen by any loss comparison. Now tables are drawn from the build's recipe
  (gemc.init_recipes) and an author-initialised dense weight keeps the author's value.
  RecBole's ``_init_weights`` redraws an ``nn.Embedding(padding_idx=0)``'s padding row,
  which eager then returns at padding ids: the row is kept drawn, and a sharded
  ``nn.Embedding`` (whose exchange drops padding ids) puts it back at those positions.
* A DLRM port's index lists as plain tensor attributes (``self.li = torch.tensor(...)``
  in ``__init__``, not buffers): left on meta by the meta build and ``to_empty``, the
  forward gathered garbage (module mode) and graph mode had no value. Now they take the
  author's build's values, and graph mode reads them from the materialized model.
* Frozen and pretrained tables (frozen.py): ``requires_grad_(False)`` and
  ``from_pretrained(vectors, freeze=True)`` were sharded and trained anyway (the tables'
  optimizers update every looked-up row), and ``from_pretrained``'s vectors were replaced
  by an N(0, 1) fill. Now a frozen table stays the model's dense module (a warning says
  so) and a table built from given values (``_weight=``, ``from_pretrained``) starts from
  them, each shard its slice, taken from the author's build.
* Matched eager as written (pinned here on two ranks, some re-sharded by hand): a
  hand-written KeyedJaggedTensor split by ``torch.split(values, lengths.sum(...).tolist())``
  with one table shared by two features (row-wise), TorchRec's ``Batch`` dataclass with
  the KJT registered as a pytree, ``padding_idx`` in the middle of a table (row-wise, the
  padding row in rank 1's shard), mixed dims, ``ids % buckets`` hashing, a 2-D
  ``EmbeddingBag`` with per-sample weights, DCN-Mix, FuxiCTR's FiBiNET / CIN / FinalMLP
  PLE with ``w * BCE + w * MSE``, MMoE with learned-uncertainty loss weights over dict
  features and labels and an ``EmbeddingBag(mode="mean", padding_idx=0)`` (whose MSE
  loss's ``aten.broadcast_tensors`` was an op of unknown kind: now a view), DLRM's interaction with ``li``/``lj`` built in forward or
  by ``torch.tril_indices``.
* Not fixed: a graph mode constant the meta build lost and no attribute holds (a tensor
  built from a meta tensor's values) is refused by name; ``padding_idx`` rows are zeroed
  only where no part-write follows the author's whole-table fill (a write to another
  row after it would keep the padding row zeroed).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from gemc.backends.torch.reference import reference_losses
from gemc.backends.torch.runner import RunOptions, run

from gemc.api import compile as gemc_compile
from gemc.api import load_model
from gemc.capture import capture
from gemc.errors import UnsupportedOpError
from gemc.plan import write_plan
from tests.runner.harness import REPO, run_scenarios, variant

PROBES = REPO / "tests" / "models" / "probes_d"
IDIOMS = f"{PROBES / 'embedding_idioms.py'}:build"
MAX_NORM = (IDIOMS, {"variant": "max_norm"})
FREQ = (IDIOMS, {"variant": "freq"})
PAD = (IDIOMS, {"variant": "pad_middle"})
PSW = (IDIOMS, {"variant": "psw2d"})
KJT = (f"{PROBES / 'torchrec_kjt.py'}:build", {"split": "tolist"})
KJT_BATCH = (f"{PROBES / 'torchrec_kjt.py'}:build", {"split": "fixed", "batch": "object"})
DCN = (f"{PROBES / 'dcn_mix.py'}:build", {"structure": "parallel"})
FIBINET = (f"{PROBES / 'fuxictr.py'}:build", {"arch": "fibinet"})
CIN = (f"{PROBES / 'fuxictr.py'}:build", {"arch": "cin"})
FINALMLP = (f"{PROBES / 'fuxictr.py'}:build", {"arch": "finalmlp"})
PLE = (f"{PROBES / 'ple_reg.py'}:build", {})
OPNN = (f"{PROBES / 'torchfm.py'}:build", {"arch": "opnn"})
FFM = (f"{PROBES / 'torchfm.py'}:build", {"arch": "ffm"})
DLRM_ATTR = (f"{PROBES / 'dlrm_interaction.py'}:build", {"index": "attribute"})
FROZEN = f"{PROBES / 'frozen.py'}:build"
MMOE = (f"{PROBES / 'mmoe_uncertainty.py'}:build", {})
DEEPFM = (f"{REPO / 'tests' / 'models' / 'probes_b' / 'deepctr.py'}:build", {"arch": "deepfm"})
STEPS = 3


def _close(got: list[float], ref: list[float]) -> None:
    assert len(got) == len(ref) == STEPS
    assert got == pytest.approx(ref, rel=1e-4), (got, ref)


def _tables(plan: dict) -> list[str]:
    """The reference's tables: the plan's (a weight gemc keeps dense is dense there too)."""
    return [t["fqn"].removesuffix(".weight") for t in plan["tables"]]


def _one_rank(case: tuple[str, dict], plan: dict, kernels: bool) -> None:
    plan = variant(plan, kernels=kernels)
    res = run(plan, RunOptions(steps=STEPS, device="cpu", progress=False))
    _close([loss for _, loss in res.losses],
           reference_losses(load_model(*case), steps=STEPS, world_size=1,
                            table_modules=_tables(plan)))


def test_max_norm_trains_dense_on_one_gpu_and_is_refused_on_several() -> None:
    plan = gemc_compile(*MAX_NORM, topology="h200:1x1")
    assert plan["tables"] == []
    kept = [w for w in plan["warnings"] if "max_norm=1.0" in w and "stays the model's dense" in w]
    assert len(kept) == 3, plan["warnings"]
    assert not any("read outside its lookups" in w for w in plan["warnings"])
    model = load_model(*MAX_NORM).model  # the renorm matters: N(0, 1) rows of dim 4
    assert model.emb["user"].max_norm == 1.0
    _one_rank(MAX_NORM, plan, kernels=True)
    with pytest.raises(UnsupportedOpError, match="max_norm=1.0.*on 8 ranks") as info:
        gemc_compile(*MAX_NORM, topology="h200:1x8")
    assert "embedding_idioms.py:" in info.value.where, info.value.where
    assert "F.normalize" in info.value.fix


def test_scale_grad_by_freq_stays_a_dense_embedding() -> None:
    for topology in ("h200:1x8", "h200:1x1"):
        plan = gemc_compile(*FREQ, topology=topology)
        assert "tags.weight" not in {t["fqn"] for t in plan["tables"]}
        assert len(plan["tables"]) == 3  # the other fields are still tables
        assert any("'tags.weight' uses scale_grad_by_freq" in w for w in plan["warnings"])
    _one_rank(FREQ, plan, kernels=True)


def test_constants_built_from_python_data_reach_graph_mode() -> None:
    assert any(v.is_meta for v in capture(load_model(*OPNN)).constants.values())
    captured = capture(load_model(*OPNN), constant_values=True)  # as graph mode captures
    values = {name: v.tolist() for name, v in captured.constants.items()}
    assert sorted(values.values()) == [[0, 0, 0, 1, 1, 2], [0, 12, 21, 28], [0, 12, 21, 28],
                                       [1, 2, 3, 2, 3, 3]], values
    plan = gemc_compile(*OPNN, topology="h200:1x8")
    assert {t["fqn"] for t in plan["tables"]} == {"embedding.embedding.weight",
                                                   "linear.fc.weight"}
    _one_rank(OPNN, gemc_compile(*OPNN, topology="h200:1x1"), kernels=True)


def test_a_plain_tensor_attribute_gets_the_authors_values() -> None:
    """DLRM ports' ``self.li = torch.tensor([...])`` in ``__init__`` (no register_buffer),
    read as ``Z[:, self.li, self.lj]``: built on meta, ``to_empty`` left it there and the
    runner's forward gathered garbage ("all elements of input should be between 0 and 1"
    in the BCE, after the sigmoid); graph mode had no value for the lifted attribute."""
    from gemc.backends.torch.init import plain_tensors
    from gemc.backends.torch.materialize import materialize_

    spec = load_model(*DLRM_ATTR)
    assert {n: t.is_meta for n, t in plain_tensors(spec.model).items()} == \
        {"li": True, "lj": True}
    _one_rank(DLRM_ATTR, gemc_compile(*DLRM_ATTR, topology="h200:1x1"), kernels=True)
    run_model = load_model(*DLRM_ATTR).model
    materialize_(run_model, torch.device("cpu"), 0, ["emb_l.0", "emb_l.1", "emb_l.2"],
                 origin=spec.origin)
    assert run_model.li.tolist() == [1, 2, 2, 3, 3, 3] and run_model.lj.tolist() == \
        [0, 0, 1, 0, 1, 2]


def test_frozen_and_pretrained_tables_start_and_stay_as_eager() -> None:
    """``requires_grad_(False)`` on a table and ``from_pretrained(vectors, freeze=True)``:
    the runner trained both (its tables' optimizers update every looked-up row) and drew
    the pretrained vectors N(0, 1). Now a frozen table stays the model's dense module and
    a table built from given values takes them from the author's build."""
    from gemc.backends.torch.reference import ReferenceTrainer

    plan = gemc_compile(FROZEN, {"freeze": "requires_grad"}, topology="h200:1x8")
    assert "tags.weight" not in {t["fqn"] for t in plan["tables"]}
    assert any("'tags.weight' is frozen" in w for w in plan["warnings"]), plan["warnings"]
    _one_rank((FROZEN, {"freeze": "requires_grad"}),
              gemc_compile(FROZEN, {"freeze": "requires_grad"}, topology="h200:1x1"),
              kernels=False)
    vectors = torch.randn(30, 4, generator=torch.Generator().manual_seed(5)) * 0.1
    spec = load_model(FROZEN, {"freeze": "from_pretrained"})
    assert spec.init_recipes["content.weight"].kind == "given"
    trainer = ReferenceTrainer(spec, table_modules=["item", "tags"])
    trainer.step(0)
    assert torch.equal(spec.model.content.weight.detach(), vectors)
    trainable = load_model(FROZEN, {"freeze": "trainable"})
    ReferenceTrainer(trainable)  # a table: drawn from the given values, shard by shard
    assert torch.equal(trainable.model.content.weight.detach(), vectors)


def test_mse_loss_is_priced_as_known_ops() -> None:
    """``nn.MSELoss`` decomposes through ``aten.broadcast_tensors``, which was an op of
    unknown kind (a warning on every multi-task model with a regression head)."""
    plan = gemc_compile(*MMOE, topology="h200:1x1")
    assert not [w for w in plan["warnings"] if "unknown kind" in w], plan["warnings"]


def test_a_meta_device_argument_runs_on_the_run_device() -> None:
    from gemc.backends.triton.graph_runner import on_run_device

    cpu = torch.device("cpu")
    args, kwargs = on_run_device((1, torch.device("meta"), torch.int64), {"device": None}, cpu)
    assert args == (1, cpu, torch.int64) and kwargs == {"device": cpu}


def test_the_authors_initialisation_is_where_training_starts() -> None:
    """pytorch-fm's FFM calls ``nn.init.xavier_uniform_`` on its tables' ``.data``;
    DeepCTR-Torch ``nn.init.normal_(std=1e-4)`` on its tables and DNN weights. The runner
    (and its reference) drew every table N(0, 1) and reset every nn.Linear with
    ``reset_parameters()``: FFM's first loss was 1.68 where the author's model starts
    near 0.69."""
    from gemc.backends.torch.init import fill_table_slice_
    from gemc.backends.torch.reference import ReferenceTrainer

    ffm = load_model(*FFM)
    recipe = ffm.init_recipes["ffm.embeddings.0.weight"]
    bound = math.sqrt(6 / (33 + 4))  # xavier over a 33 x 4 table
    assert (recipe.kind, recipe.a, recipe.b, recipe.by_author) == \
        ("uniform", pytest.approx(-bound), pytest.approx(bound), True)
    assert ffm.init_recipes["linear.fc.weight"].kind == "normal"  # nn.Embedding's own
    ReferenceTrainer(ffm)
    table = ffm.model.ffm.embeddings[0].weight.detach()
    assert table.abs().max() <= bound and table.std() > bound / 2, table.std()
    # the precision probe folds and resets tables: it takes no author's value for them
    plan = gemc_compile(*FFM, topology="h200:1x1")
    assert not [w for w in plan["warnings"] if "no precision probe" in w], plan["warnings"]
    rows = fill_table_slice_(torch.empty(10, 4), fqn="ffm.embeddings.0.weight", rows=33,
                             dim=4, row_offset=20, col_offset=0, seed=0, recipe=recipe)
    assert torch.equal(rows, table[20:30])  # a shard draws its slice of the same table

    # RecBole's _init_weights redraws a padding_idx=0 table's padding row too: eager looks
    # it up as drawn (an nn.Embedding's forward), gemc zeroed it
    init_pad = load_model(IDIOMS, {"variant": "init_pad"})
    assert not init_pad.init_recipes["tags.weight"].zeroes_padding_row()
    assert load_model(*PAD).init_recipes["emb.user.weight"].zeroes_padding_row()
    ReferenceTrainer(init_pad)
    assert init_pad.model.tags.weight[0].abs().min() > 0

    deepfm = load_model(*DEEPFM)
    trainer = ReferenceTrainer(deepfm)
    model = deepfm.model.model
    assert model.embedding_dict["user_id"].weight.std() < 1e-3
    assert model.dnn.linears[0].weight.std() < 1e-3  # not kaiming's ~0.14
    assert model.dnn.linears[0].bias.abs().max() > 1e-2  # the bias keeps its reset
    assert trainer.init_report.per_module["model.dnn.linears.0"] == \
        "reset_parameters + author's __init__"


# (name, case, every table's sharding by hand, or None for the plan's); module mode (graph
# mode on two ranks compiles each graph once a rank: too slow here, one rank runs it above)
TWO_RANKS = (
    ("freq", FREQ, None),
    ("pad_row_wise", PAD, "row_wise"),
    ("psw_column_wise", PSW, "column_wise"),
    ("kjt_shared_row_wise", KJT, "row_wise"),
    ("kjt_batch_object", KJT_BATCH, None),
    ("dcn_mix", DCN, None),
    ("fibinet", FIBINET, None),
    ("cin", CIN, None),
    ("finalmlp", FINALMLP, None),
    ("ple_bce_mse", PLE, None),
    ("ffm_row_wise", FFM, "row_wise"),
    ("dlrm_attribute", DLRM_ATTR, None),
    ("pretrained_row_wise", (FROZEN, {"freeze": "trainable"}), "row_wise"),
    ("mmoe_uncertainty", MMOE, None),
    ("init_pad_row_wise", (IDIOMS, {"variant": "init_pad"}), "row_wise"),
)


def test_two_gloo_ranks_match_eager(tmp_path: Path) -> None:
    scenarios, plans = [], {}
    for name, case, sharding in TWO_RANKS:
        plan = gemc_compile(*case, topology="h200:1x2")
        tables = None if sharding is None else {t["fqn"]: (sharding, [0, 1])
                                                for t in plan["tables"]}
        plan = variant(plan, tables=tables)
        write_plan(tmp_path / f"{name}.json", plan)
        plans[name] = plan
        scenarios.append({"name": name, "plan": str(tmp_path / f"{name}.json"),
                          "phases": [{"steps": STEPS}]})
    results = run_scenarios(2, scenarios, tmp_path / "results.json")
    for name, case, _ in TWO_RANKS:
        ref = reference_losses(load_model(*case), steps=STEPS, world_size=2,
                               table_modules=_tables(plans[name]))
        _close([loss for _, loss in results[name][0]], ref)
