"""group-embeddings: golden dump, what is grouped, and the batched lookup with its fused
optimizer against eager PyTorch followed by the same optimizer step."""

from __future__ import annotations

import pytest
import torch
from gemc.backends.triton.embedding_bag_reference import (
    lazy_adam_step_,
    rowwise_adagrad_step_,
    touched_rows,
)
from gemc.backends.triton.graph_runner import GraphRunner
from gemc.passes.group_embeddings import GroupEmbeddings

from gemc import ir
from gemc.api import load_model, pass_context
from gemc.capture import capture
from gemc.pass_manager import PassManager
from gemc.pipeline import annotation_passes
from gemc.plan_builder import kernel_entries
from tests.conftest import check_golden
from tests.fusion import models
from tests.fusion.helpers import dump_after, eager_step, fresh_seed, params_of

BAGS = "tests/fusion/models.py:build_bags"


def test_group_embeddings_golden_dump():
    check_golden("group_embeddings.txt", dump_after(BAGS, "group-embeddings"))


def _compiled(entry: str, **options):
    spec = load_model(entry, {}, device="cpu")
    captured = capture(spec, entrypoint=entry)
    ctx = pass_context(entry, {}, captured, None)
    gm = PassManager([*annotation_passes(), GroupEmbeddings(**options)]).run(captured.gm, ctx)
    return gm, kernel_entries(gm, ctx), spec


def test_every_table_joins_one_group():
    _, entries, _ = _compiled(BAGS)
    assert len(entries) == 1
    entry = entries[0]
    assert entry["kind"] == "batched_embedding_bag" and entry["batch"] == models.BAGS
    assert [(t["fqn"], t["pooling"], t["include_last_offset"]) for t in entry["tables"]] == [
        ("a.weight", "sum", True), ("b.weight", "mean", True), ("c.weight", "sum", False)]
    assert sorted(entry["replaces"]) == ["a", "b", "c"]


def test_padding_index_is_not_grouped():
    gm, entries, _ = _compiled("tests/fusion/models.py:build_padded_bag")
    assert entries == [] and not any(ir.GROUP in n.meta for n in gm.graph.nodes)


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_batched_lookup_and_fused_update_match_eager(optimizer: str):
    lr = 0.05
    gm, entries, spec = _compiled(BAGS, optimizer=optimizer, lr=lr)
    model = spec.model
    batch = models.bag_batch(torch.Generator().manual_seed(fresh_seed()))
    ref, grads = eager_step(model, batch)
    runner = GraphRunner(gm, entries, params_of(model))
    loss = runner(*batch)
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-5)
    loss.backward()
    for k, p in model.named_parameters():
        if k.startswith("top."):
            torch.testing.assert_close(p.grad, grads[k], atol=1e-6, rtol=1e-5, msg=k)
        else:
            assert p.grad is None, f"{k}: the fused optimizer must not make a dense gradient"
    ids = {"a": batch[0], "b": batch[2], "c": batch[4]}
    for name, table_ids in ids.items():
        fqn = f"{name}.weight"
        weight = dict(model.named_parameters())[fqn].detach().clone()
        offsets = torch.tensor([0, table_ids.numel()])
        rows = touched_rows(table_ids, offsets, 1)[0]
        if optimizer == "rowwise_adagrad":
            rowwise_adagrad_step_(weight, grads[fqn], torch.zeros(weight.shape[0]), rows, lr,
                                  1e-8)
        else:
            lazy_adam_step_(weight, grads[fqn], torch.zeros_like(weight), torch.zeros_like(weight),
                            rows, 1, lr, 1e-8, (0.9, 0.999))
        torch.testing.assert_close(runner.table_weights(fqn), weight, atol=1e-6, rtol=1e-5,
                                   msg=fqn)
